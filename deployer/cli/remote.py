"""`ddeploy hosts|push|plan|status|rollback|log|lock`: thin shims over deployer.engine + fleet.

Every remote command selects hosts with --host NAME (repeatable), --group G or --all, runs on them
in parallel (--parallel N, --fail-fast), prints `[host]` progress and a summary table on stderr,
and with --json one result per host on stdout. Exit status is non-zero when any host failed.
"""

from __future__ import annotations

import sys
from typing import Callable

import click

from .. import engine
from ..errors import ConnectError, UsageError
from ..fleet import HostResult, raise_if_failed, run_fleet, summary_table
from ..output import emit_json, say, table
from ..patchset import load_patch_set
from . import cli


def host_selection(fn):
    """--host/--group/--all plus --parallel/--fail-fast/--json/--accept-new-host-keys."""
    opts = [click.option("--host", "-H", "names", multiple=True, help="Host name (repeatable)."),
            click.option("--group", "-g", "groups", multiple=True, help="All hosts of a group (repeatable)."),
            click.option("--all", "all_hosts", is_flag=True, help="Every inventory host (not `local`)."),
            click.option("--parallel", "-j", type=click.IntRange(1, 256), default=8, show_default=True,
                         help="Hosts worked on at once."),
            click.option("--fail-fast", is_flag=True, help="Start no new host after a failure."),
            click.option("--json", "as_json", is_flag=True, help="Per-host results as JSON on stdout."),
            click.option("--accept-new-host-keys", is_flag=True,
                         help="Record unknown SSH host keys in known_hosts (changed keys are still refused).")]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _hosts(ctx: click.Context, names, groups, all_hosts):
    if not (names or groups or all_hosts):
        raise UsageError("choose hosts with --host NAME, --group G or --all (see `ddeploy hosts`)")
    if all_hosts and (names or groups):
        raise UsageError("--all already selects every host; drop --host/--group (or drop --all)")
    return ctx.obj.inventory.select(names, groups, all_hosts)


def _options(accept_new_host_keys: bool, **kw) -> engine.Options:
    return engine.Options(accept_new_host_keys=accept_new_host_keys, command=" ".join(["ddeploy", *sys.argv[1:]]), **kw)


def _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, op,
           report=lambda results: click.echo(summary_table(results), err=True)) -> list[HostResult]:
    """Run op on the selected hosts, then finish (report, --json, exit status)."""
    results = run_fleet(_hosts(ctx, names, groups, all_hosts), op, parallel=parallel, fail_fast=fail_fast)
    finish(results, as_json, report)
    return results


def finish(results: list[HostResult], as_json: bool, report: Callable[[list[HostResult]], None]) -> None:
    """The end of every fleet command: report on stderr, one result per host as JSON on stdout with
    --json, non-zero exit when any host failed."""
    report(results)
    if as_json:
        emit_json([r.to_json() for r in results])
    raise_if_failed(results)


def _push_args(fn):
    fn = click.option("--version", "-V", "version", default="latest", show_default=True,
                      help="Patch set: a released version, `latest`, or a patch-set directory.")(fn)
    fn = click.option("--3way", "three_way", is_flag=True, help="Fall back to a 3-way merge when a patch does not apply.")(fn)
    return fn


@cli.command()
@host_selection
@_push_args
@click.option("--dry-run", "-n", is_flag=True, help="Show the plan; write nothing on any host.")
@click.option("--force", is_flag=True, help="Save hand edits on the host (recoverably), then go on.")
@click.option("--build", "build_after", is_flag=True,
              help="After a successful apply that changed kernel sources, build the kernels (ddeploy build).")
@click.pass_context
def push(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys, version, three_way,
         dry_run, force, build_after):
    """Apply a patch set to the hosts' SGLang checkouts (atomically, recorded in git on the host)."""
    ps = load_patch_set(version)  # verified (checksums, path safety) before any host is touched
    opts = _options(accept_new_host_keys, dry_run=dry_run, three_way=three_way, force=force)
    op = lambda h, say: engine.push_host(h, ps, opts, say)  # noqa: E731
    if build_after and not dry_run:  # kernel build concern (deployer/build.py)
        from ..build import BuildOptions, push_then_build

        push_op, bopts = op, BuildOptions(accept_new_host_keys=accept_new_host_keys)
        op = lambda h, say: push_then_build(h, push_op, bopts, say)  # noqa: E731
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, op)


@cli.command()
@host_selection
@_push_args
@click.pass_context
def plan(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys, version, three_way):
    """What `push` would do per host (patches, files, conflicts, drift); writes nothing."""
    ps = load_patch_set(version)
    opts = _options(accept_new_host_keys, dry_run=True, three_way=three_way)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, lambda h, say: engine.plan_host(h, ps, opts, say))


@cli.command()
@host_selection
@click.pass_context
def status(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys):
    """Per host: reachable, applied version, drift, lock holder, kernel builds, last remote test."""
    opts = _options(accept_new_host_keys)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, lambda h, say: engine.status_host(h, opts, say),
           report=lambda results: click.echo(status_table(results), err=True))


def status_table(results: list[HostResult]) -> str:
    rows = []
    for r in results:
        d = r.data
        if r.ok:
            rows.append([r.host, "yes", d["applied"], d["drift"], d["lock"], d["builds"], d["tests"]])
        elif isinstance(r.error, ConnectError):
            rows.append([r.host, f"no: {r.summary}"[:70], "?", "?", "?", "?", "?"])
        else:  # reachable, but the checkout cannot be read (missing, not git, ...)
            rows.append([r.host, "yes", f"error: {r.summary}"[:70], "?", "?", "?", "?"])
    return table(rows, ["host", "reachable", "applied", "drift", "lock", "builds", "tests"])


@cli.command()
@host_selection
@click.option("--to", "to", metavar="V", help="Return to a previously applied version instead of the pre-deploy state.")
@click.option("--force", is_flag=True, help="Save hand edits on the host (recoverably), then roll back.")
@click.pass_context
def rollback(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys, to, force):
    """Return the checkouts exactly to the state before the applied version (or to version V)."""
    opts = _options(accept_new_host_keys, to=to, force=force)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, lambda h, say: engine.rollback_host(h, opts, say))


@cli.command()
@host_selection
@click.pass_context
def log(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys):
    """History of what was applied and rolled back (newest first)."""
    opts = _options(accept_new_host_keys)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, lambda h, say: engine.log_host(h, opts, say),
           report=history_tables)


def history_tables(results: list[HostResult]) -> None:
    for r in results:
        if r.ok:
            rows = [[e["date"], e["commit"][:12], e["message"]] for e in r.data["entries"]]
            say(f"history of {r.host}:\n" + (table(rows, ["date", "record", "what"]) if rows else "(nothing yet)"))


@cli.group()
def lock() -> None:
    """Inspect or release a checkout's deploy lock (e.g. one left by a killed deploy)."""


@lock.command("status")
@host_selection
@click.pass_context
def lock_status(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys):
    """Who holds each host's lock, and for how long."""
    opts = _options(accept_new_host_keys)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json,
           lambda h, say: engine.lock_status_host(h, opts, say))


@lock.command("release")
@host_selection
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def lock_release(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys, yes):
    """Remove a stale lock (asks first unless --yes)."""
    hosts = _hosts(ctx, names, groups, all_hosts)
    if not yes:
        click.confirm(f"Release the deploy lock on {', '.join(h.name for h in hosts)}? Only do this when no "
                      f"deploy is running there", abort=True, err=True)
    opts = _options(accept_new_host_keys)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json,
           lambda h, say: engine.lock_release_host(h, opts, say))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Hosts as JSON on stdout.")
@click.pass_context
def hosts(ctx, as_json):
    """List the inventory's hosts (and the built-in `local`)."""
    inv = ctx.obj.inventory
    if as_json:
        emit_json([{**h.model_dump(mode="json"), "source": h.source} for h in inv.hosts.values()])
        return
    rows = [[h.name, _target(h), f"{h.gpu.count}x {h.gpu.model}", h.gpu.arch, h.interconnect, h.checkout,
             ",".join(h.groups)] for h in inv.hosts.values()]
    say(table(rows, ["host", "target", "gpus", "arch", "link", "checkout", "groups"]))


def _target(h) -> str:
    if h.is_local:
        return "(this machine)"
    s = h.ssh
    target = f"{s.user + '@' if s.user else ''}{s.host}{':' + str(s.port) if s.port else ''}"
    return target + (f" via {s.jump}" if s.jump else "")
