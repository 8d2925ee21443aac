"""`ddeploy rollout VERSION`: a fleet from its release to VERSION, canary first, behind gates
(deployer/rollout/). The plan is printed before anything is touched; --dry-run stops there."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import click

from ..errors import DeployError, ExitCode, StateError, UsageError
from .app import cli
from .context import AppContext, chosen_set
from .output import emit_json, say


class RolloutFailed(DeployError):
    exit_code = ExitCode.FAILURE


class RolloutPaused(DeployError):
    exit_code = ExitCode.STATE


@cli.command()
@click.argument("version", required=False)
@click.option("--host", "-H", "names", multiple=True, help="Host name (repeatable).")
@click.option("--group", "-g", "groups", multiple=True, help="All hosts of a group (repeatable).")
@click.option("--all", "all_hosts", is_flag=True, help="Every host of the inventory.")
@click.option("--file", "-f", "spec_file", type=click.Path(dir_okay=False, path_type=Path), help="Rollout file.")
@click.option("--batch", help='Batch sizes after the canary, e.g. "1,5,20%" (the last repeats).')
@click.option("--max-fail", help="Units that may fail (each put back) before the rollout aborts: N or N%.")
@click.option("--min-available", type=click.IntRange(min=0), help="Units that must keep serving during a batch.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), help="Seconds to wait for running requests.")
@click.option("--canary", help="Host whose unit goes first (default: the first selected).")
@click.option("--dry-run", is_flag=True, help="Print the plan; touch nothing.")
@click.option("--resume", is_flag=True, help="Go on with the last rollout (paused, interrupted or cut off).")
@click.option("--after-failure", is_flag=True, help="Start although the last rollout over these hosts failed.")
@click.option("--json", "as_json", is_flag=True, help="Also print the result as JSON on stdout.")
@click.pass_obj
def rollout(app: AppContext, version, names, groups, all_hosts, spec_file, batch, max_fail, min_available,
            drain_timeout, canary, dry_run, resume, after_failure, as_json) -> None:  # fmt: skip
    """Move hosts to a release unit by unit, canary first, behind gates; put back what fails."""
    from ..rollout import journal
    from ..rollout.plan import describe

    with ExitStack() as stack:
        if resume:
            if version or names or groups or all_hosts or spec_file or batch or max_fail or canary or dry_run:
                raise UsageError("--resume goes on with the last rollout as planned; drop the other arguments")
            rollout_id, plan, spec, ps, past = _resumed(app)
            journal.hold_hosts(stack, [h.name for u in plan.units for h in u.hosts], rollout_id)
        else:
            if not version:
                raise UsageError("name the release to roll out (e.g. `ddeploy rollout 0.2.19 --group prod`)")
            if not (names or groups or all_hosts):
                raise UsageError("choose hosts with --host NAME, --group G or --all (see `ddeploy hosts`)")
            from ..rollout.spec import load_spec

            overrides = {"batch": batch, "max_fail": max_fail, "min_available": min_available}
            spec = load_spec(spec_file, {**overrides, "drain_timeout_s": drain_timeout})
            ps = chosen_set(version, None)  # verified before any host is contacted
            hosts = app.inventory.select(names, groups, all_hosts)
            rollout_id, past = journal.new_id(), None
            if not dry_run:  # held before the hosts are read, so the plan is this rollout's own
                journal.hold_hosts(stack, [h.name for h in hosts], rollout_id)
                if not after_failure:
                    _refuse_after_failure({h.name for h in hosts})
            plan = _planned(app, hosts, ps, spec, canary)
        click.echo(describe(plan, spec), err=True)
        if dry_run:
            say("dry run: nothing was touched")
            return
        log = journal.Journal(rollout_id)
        if past is None:
            log.write("plan", plan=plan.to_data(), spec=spec.model_dump(), source=_source(version, ps))
        else:
            log.write("resume")
        say(f"rollout {rollout_id}: events in {log.path}")
        from ..rollout.runner import Rollout, summary

        runner = Rollout(plan, spec, ps, log, lambda text, who: say(text, who), past)
        state = runner.run()
    rows = summary(plan, runner.finished)
    from .output import table

    click.echo(table([[r["unit"], r["result"]] for r in rows], ["unit", "result"]), err=True)
    if as_json:
        emit_json({"id": rollout_id, "state": state, "units": rows, "events": str(log.path)})
    if state == "failed":
        stuck = [r["unit"] for r in rows if r["result"] == "put-back-failed"]
        if stuck:
            raise RolloutFailed(
                f"rollout {rollout_id} failed and {', '.join(stuck)} could not be put back (see {log.path}): "
                f"bring each back by hand (`ddeploy rollback --host H --to V`, `ddeploy launch --host H ... --wait`)"
            )
        raise RolloutFailed(
            f"rollout {rollout_id} failed; the failed units serve their previous release (see {log.path})"
        )
    if state == "paused":
        raise RolloutPaused(f"rollout {rollout_id} paused on an inconclusive gate; `ddeploy rollout --resume` goes on")
    if state == "interrupted":
        raise KeyboardInterrupt
    say(f"rollout {rollout_id} done: every unit serves {ps.name} {ps.version}")


def _planned(app: AppContext, hosts, ps, spec, canary):
    from ..rollout.observe import observe
    from ..rollout.plan import make_plan, make_units

    serving, versions = observe(hosts, app.command)
    return make_plan(ps.version, make_units(hosts, serving, versions, app.inventory), spec, canary)


def _source(version: str, ps) -> dict[str, str]:
    return {"argument": version, "name": ps.name, "version": ps.version, "fingerprint": ps.fingerprint()}


def _resumed(app: AppContext):
    """The last rollout's plan, spec and patch set, and what its log says was done."""
    from ..patchset import load_patch_set
    from ..rollout import journal
    from ..rollout.plan import Plan, Serving, Unit
    from ..rollout.spec import RolloutSpec

    last = journal.latest()
    if last is None:
        raise StateError("no rollout to resume on this machine")
    past = journal.replay(last)
    if past.over:
        raise StateError(f"rollout {last} is {past.state}; there is nothing to resume (start a new one)")
    ps = load_patch_set(past.source["argument"])
    if ps.fingerprint() != past.source["fingerprint"]:
        raise StateError(
            f"rollout {last} rolled out {past.source['name']} {past.source['version']}, and "
            f"{past.source['argument']} now names different patches; start a new rollout"
        )
    units = []
    for u in past.plan["units"]:
        s = u["serving"]
        serving = None if s is None else Serving(s["topology"], tuple(s["sets"]), s["nnodes"])
        units.append(Unit(tuple(app.inventory.get(n) for n in u["hosts"]), serving, tuple(u["versions"])))
    plan = Plan(
        past.plan["version"],
        tuple(units),
        tuple(tuple(b) for b in past.plan["batches"]),
        past.plan["max_failures"],
        past.plan["min_available"],
    )
    return last, plan, RolloutSpec.model_validate(past.spec), ps, past


def _refuse_after_failure(hosts: set[str]) -> None:
    """A failed rollout holds its hosts until the operator says otherwise (--after-failure)."""
    from ..rollout import journal

    failed = journal.last_failed(hosts)
    if failed is not None:
        rollout_id, held = failed
        raise StateError(
            f"the last rollout over {', '.join(sorted(held))} ({rollout_id}) failed; look at its events "
            f"({journal.rollouts_dir() / rollout_id / 'events.jsonl'}), then start again with --after-failure"
        )
