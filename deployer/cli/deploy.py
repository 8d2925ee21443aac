"""`ddeploy hosts|push|plan|status|rollback|log|lock`: thin shims over deployer.ops.deploy.

Every remote command selects hosts with --host NAME (repeatable), --group G or --all, runs on them
in parallel (--parallel N, --fail-fast), prints `[host]` progress and a summary table on stderr,
and with --json one result per host on stdout. Exit status is non-zero when any host failed.
"""

from __future__ import annotations

import click

from ..errors import UsageError
from .app import cli
from .context import AppContext, chosen_set, fleet_options, overlay_option, selection
from .fleet import run
from .output import emit_json, say, table


def _deploy_options(ctx: click.Context, **kw):
    from ..ops.deploy import Options

    app: AppContext = ctx.obj
    return Options(accept_new_host_keys=selection(ctx).accept_new_host_keys, command=app.command, **kw)


def _push_args(fn):
    fn = click.option(
        "--version",
        "-V",
        "version",
        default=None,
        help="Patch set: a released version, `latest` (the default), or a patch-set directory.",
    )(fn)
    fn = overlay_option(fn)
    fn = click.option(
        "--3way", "three_way", is_flag=True, help="Fall back to a 3-way merge when a patch does not apply."
    )(fn)
    fn = click.option("--diff", "diff", is_flag=True, help="With the plan: the unified diff push would make per host.")(
        fn
    )
    return fn


@cli.command()
@fleet_options
@_push_args
@click.option("--dry-run", "-n", is_flag=True, help="Show the plan; write nothing on any host.")
@click.option("--force", is_flag=True, help="Save hand edits on the host (recoverably), then go on.")
@click.option(
    "--build",
    "build_after",
    is_flag=True,
    help="After a successful apply that changed kernel sources, build the kernels (ddeploy build).",
)
@click.pass_context
def push(ctx, version, overlay, three_way, diff, dry_run, force, build_after):
    """Apply a patch set to the hosts' SGLang checkouts (atomically, recorded in git on the host)."""
    if diff and not dry_run:
        raise UsageError("--diff shows what push would change; add --dry-run (or use `ddeploy plan --diff`)")
    hosts = selection(ctx).hosts(ctx.obj)
    with _early_agents(ctx, hosts) as early:
        sets = _sets_for(hosts, version, overlay)  # verified (checksums, path safety) before anything runs on a host
        early.start("plan" if dry_run else "push-build" if build_after else "push")
        from ..ops.deploy import push_host

        opts = _deploy_options(ctx, dry_run=dry_run, three_way=three_way, force=force, diff=diff, early=early)
        set_of = _reply_set(sets)
        op = lambda h, say: push_host(h, sets[h.name], opts, say)  # noqa: E731
        describe = lambda res: _views().describe_push(res, set_of(res))  # noqa: E731
        if build_after and not dry_run:
            from ..ops.kernel_build import BuildOptions, push_then_build

            bopts = BuildOptions(accept_new_host_keys=opts.accept_new_host_keys, command=opts.command)
            op = lambda h, say: push_then_build(h, sets[h.name], opts, bopts, say)  # noqa: E731
            describe = lambda res: _views().describe_push_build(res, set_of(res))  # noqa: E731
        report = _plan_report(ctx, describe) if diff else None
        run(ctx.obj, selection(ctx), op, describe, report=report, hosts=hosts)


@cli.command()
@fleet_options
@_push_args
@click.pass_context
def plan(ctx, version, overlay, three_way, diff):
    """What `push` would do per host (patches, files, conflicts, drift); writes nothing."""
    hosts = selection(ctx).hosts(ctx.obj)
    with _early_agents(ctx, hosts) as early:
        sets = _sets_for(hosts, version, overlay)
        early.start("plan")
        from ..ops.deploy import plan_host

        opts = _deploy_options(ctx, dry_run=True, three_way=three_way, diff=diff, early=early)
        set_of = _reply_set(sets)
        op = lambda h, say: plan_host(h, sets[h.name], opts, say)  # noqa: E731
        describe = lambda res: _views().describe_push(res, set_of(res))  # noqa: E731
        run(ctx.obj, selection(ctx), op, describe, report=_plan_report(ctx, describe) if diff else None, hosts=hosts)


def _sets_for(hosts, version: str | None, overlay: str | None) -> dict:
    """{host name: its patch set}: --version or --overlay for every host, else each host's pinned
    release (`version:` in its host file), else the latest."""
    if version is not None or overlay is not None or not any(h.version for h in hosts):
        ps = chosen_set(version, overlay)
        return {h.name: ps for h in hosts}
    loaded: dict = {}
    for h in hosts:
        if (h.version or "latest") not in loaded:
            loaded[h.version or "latest"] = _pinned_set(h)
    return {h.name: loaded[h.version or "latest"] for h in hosts}


def _pinned_set(host):
    from ..errors import PatchSetError

    try:
        return chosen_set(host.version, None)
    except PatchSetError as exc:
        if not host.version:
            raise
        raise type(exc)(f"{host.source} pins {host.version}: {exc}", host=host.name) from None


def _reply_set(sets: dict):
    """A push or plan reply -> the patch set it applied (hosts may pin different releases)."""
    by_version = {ps.version: ps for ps in sets.values()}
    only = next(iter(by_version.values())) if len(by_version) == 1 else None
    return lambda res: only or by_version[getattr(res, "push", res).plan.version]


def _early_agents(ctx: click.Context, hosts):
    """Connect to the first hosts the fleet runs while this process prepares the request (the
    patch set verified, the modules the call needs imported): deployer/transport/agent_client.py,
    EarlyAgents."""
    from ..transport.early_agents import EarlyAgents

    sel, app = selection(ctx), ctx.obj
    return EarlyAgents(hosts[: sel.parallel], accept_new_host_keys=sel.accept_new_host_keys, command=app.command)


def _plan_report(ctx: click.Context, describe):
    """--diff: each host's diff on stdout (coloured on a terminal; --json carries it instead), then the table."""

    def report(results) -> str:
        if not selection(ctx).as_json:
            for text in _views().plan_diffs(results):
                click.echo(text, nl=False)
        return _views().summary_table(results, describe)

    return report


@cli.command()
@fleet_options
@click.pass_context
def status(ctx):
    """Per host: reachable, applied version, drift, lock holder, kernel builds, last remote test."""
    hosts = selection(ctx).hosts(ctx.obj)
    with _early_agents(ctx, hosts) as early:
        early.start("status")  # read-only; the newest release below is only for the checkout column
        from ..errors import PatchSetError
        from ..ops.deploy import status_host
        from ..patchset import load_patch_set

        opts = _deploy_options(ctx, early=early)
        try:
            newest = load_patch_set("latest")  # the checkout column: do the files it touches match its base?
        except PatchSetError:
            newest = None
        run(
            ctx.obj,
            selection(ctx),
            lambda h, say: status_host(h, opts, say, newest),
            _views().describe_status,
            report=_views().status_table,
            hosts=hosts,
        )


@cli.command()
@fleet_options
@click.option("--to", "to", metavar="V", help="Return to a previously applied version instead of the pre-deploy state.")
@click.option("--force", is_flag=True, help="Save hand edits on the host (recoverably), then roll back.")
@click.pass_context
def rollback(ctx, to, force):
    """Return the checkouts exactly to the state before the applied version (or to version V)."""
    hosts = selection(ctx).hosts(ctx.obj)
    with _early_agents(ctx, hosts) as early:
        early.start("rollback")  # its request is only the options: nothing to verify first
        from ..ops.deploy import rollback_host

        opts = _deploy_options(ctx, to=to, force=force, early=early)
        op = lambda h, say: rollback_host(h, opts, say)  # noqa: E731
        run(ctx.obj, selection(ctx), op, _views().describe_rollback, hosts=hosts)


@cli.command()
@fleet_options
@click.pass_context
def log(ctx):
    """History of what was applied and rolled back (newest first)."""
    from ..ops.deploy import log_host

    opts = _deploy_options(ctx)
    run(ctx.obj, selection(ctx), lambda h, say: log_host(h, opts, say), _views().describe_log, report=_histories)


def _histories(results) -> str:
    return "\n".join(f"history of {r.host}:\n{_views().history_table(r.outcome.result)}" for r in results if r.ok)


@cli.group()
def lock() -> None:
    """Inspect or release a checkout's deploy lock (e.g. one left by a killed deploy)."""


@lock.command("status")
@fleet_options
@click.pass_context
def lock_status(ctx):
    """Who holds each host's lock, and for how long."""
    from ..ops.deploy import lock_status_host

    opts = _deploy_options(ctx)
    run(
        ctx.obj,
        selection(ctx),
        lambda h, say: lock_status_host(h, opts, say),
        lambda res: _views().describe_lock(res.lock),
    )


@lock.command("release")
@fleet_options
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def lock_release(ctx, yes):
    """Remove a dead holder's record (asks first unless --yes); a running holder keeps its lock."""
    from ..ops.deploy import lock_release_host

    sel = selection(ctx)
    hosts = sel.hosts(ctx.obj)
    if not yes:
        click.confirm(
            f"Release the deploy lock on {', '.join(h.name for h in hosts)}? Only do this when no "
            f"deploy is running there",
            abort=True,
            err=True,
        )
    opts = _deploy_options(ctx)
    run(ctx.obj, sel, lambda h, say: lock_release_host(h, opts, say), _views().describe_lock_release, hosts=hosts)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Hosts as JSON on stdout.")
@click.pass_obj
def hosts(app: AppContext, as_json):
    """List the inventory's hosts (and the built-in `local`)."""
    from ..inventory import Inventory, NoInventoryError

    try:
        inv = app.inventory
    except NoInventoryError:  # a new user: `local` works without one
        inv = Inventory.builtin()
        say(_no_inventory_note())
    if as_json:
        emit_json([{**h.model_dump(mode="json"), "source": h.source} for h in inv.hosts.values()])
        return
    rows = [
        [
            h.name,
            _target(h),
            f"{h.gpu.count}x {h.gpu.model}",
            h.gpu.arch,
            h.interconnect,
            h.checkout,
            ",".join(h.groups),
        ]
        for h in inv.hosts.values()
    ]
    say(table(rows, ["host", "target", "gpus", "arch", "link", "checkout", "groups"]))


@cli.command()
@click.option("--host", "-H", "names", multiple=True, help="Host name (repeatable); default: every kept connection.")
@click.option("--group", "-g", "groups", multiple=True, help="All hosts of a group (repeatable).")
@click.pass_obj
def disconnect(app: AppContext, names, groups):
    """Close the SSH connections kept open after earlier commands (as `ssh -O exit`); they close
    on their own DDEPLOY_CONTROL_PERSIST seconds (default 60) after their last command."""
    from ..transport.control import disconnect as close_kept

    chosen = app.inventory.select(names, groups, False) if names or groups else None
    closed = close_kept(chosen)
    say(f"closed the kept connection to {', '.join(closed)}" if closed else "no kept connection was open")


def _no_inventory_note() -> str:
    from ..locations import inventory_candidates

    where = ", ".join(str(c) for c in inventory_candidates())
    return (
        f"no inventory yet, so only the built-in `local` host: host files are read from -i DIR, "
        f"$DDEPLOY_HOSTS_DIR, else the first of {where} that exists; `ddeploy init` writes an example host "
        f"file into ./hosts"
    )


@cli.command()
@click.option("--force", is_flag=True, help="Overwrite an existing example file.")
@click.pass_obj
def init(app: AppContext, force):
    """Write a commented example host file to start an inventory from (-i DIR, else ./hosts)."""
    from pathlib import Path

    from ..inventory_example import write_example

    directory = Path(app.inventory_dir) if app.inventory_dir else Path.cwd() / "hosts"
    path = write_example(directory, force=force)
    say(f"wrote {path}: copy it to <name>.yaml in {directory} (one file per host), edit it, then `ddeploy hosts`")


def _target(h) -> str:
    if h.is_local:
        return "(this machine)"
    s = h.ssh
    target = f"{s.user + '@' if s.user else ''}{s.host}{':' + str(s.port) if s.port else ''}"
    return target + (f" via {s.jump}" if s.jump else "")


def _views():
    """The renderers, imported when a command runs (not for --help or --version)."""
    from . import views

    return views
