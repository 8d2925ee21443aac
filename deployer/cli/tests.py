"""`ddeploy test`: the overlay's tests, on hosts with --remote (deployer.ops.overlay_tests), else
locally against the overlay."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from ..errors import DeployError, UsageError
from .output import say
from .app import cli
from .context import chosen_set, fleet_options, overlay_option, selection
from .fleet import run


@cli.command("test")
@fleet_options
@click.option("--remote", is_flag=True, help="Run on the selected hosts (else locally against the overlay).")
@click.option("-k", "expr", help="Only tests matching this pytest -k expression.")
@click.option("--version", "-V", "version", help="Refuse hosts where another patch set than this one is applied.")
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where JUnit reports land (default: <cache>/test-reports/<host>/).",
)
@overlay_option
@click.option("--watch", is_flag=True, help="With --remote --overlay: run again on every change of the overlay.")
@click.pass_context
def test_cmd(ctx, remote, expr, version, report_dir, overlay, watch):
    """Run the overlay's unit tests (test/srt/ddtree) on hosts, or locally.

    With --remote --overlay, the overlay's working copy is pushed first as a dev snapshot (a no-op
    when unchanged) and its tests run on the hosts; --watch repeats that after every save."""
    from ..ops.overlay_tests import TestOptions
    from ..patchset import load_patch_set

    sel = selection(ctx)
    if not remote and sel.given:
        raise UsageError("--host/--group/--all select hosts for --remote; add --remote (or drop them to test locally)")
    if overlay is not None and version is not None:
        raise UsageError("--overlay tests a dev snapshot of the overlay; drop --version (or drop --overlay)")
    if watch and not (remote and overlay is not None):
        raise UsageError("--watch repeats `test --remote --overlay` on every change; add --remote and --overlay")
    opts = TestOptions(
        expr=expr,
        requested=load_patch_set(version) if version else None,
        overlay=Path(overlay) if overlay else None,
        report_dir=report_dir,
        accept_new_host_keys=sel.accept_new_host_keys,
        command=ctx.obj.command,
    )
    if watch:
        _watch(ctx.obj, sel, opts, overlay)
    else:
        _test_once(ctx.obj, sel, opts, remote, overlay)


def _test_once(app, sel, opts, remote: bool, overlay: str | None) -> None:
    from ..inventory import local_host
    from ..ops.overlay_tests import test_host, test_local

    views = _views()
    if remote:
        hosts = sel.hosts(app)
        with _early_agents(app, sel, hosts) as early:
            snapshot = chosen_set(None, overlay) if overlay is not None else None  # exported beside the connects
            early.start("test")
            opts = replace(opts, snapshot=snapshot, early=early)
            op = lambda h, say: test_host(h, opts, say)  # noqa: E731
            run(app, sel, op, views.describe_test, report=views.test_table, hosts=hosts)
    else:
        local = [local_host()]
        run(app, sel, lambda h, say: test_local(opts, say), views.describe_test, report=views.test_table, hosts=local)


def _watch(app, sel, opts, overlay: str) -> None:
    """Test, then again after every change of the overlay; a failed round is reported, not fatal;
    Ctrl-C stops (exit 0)."""
    from ..locations import active_overlay_dir
    from ..patchset.snapshot import overlay_digest, wait_for_change

    path = Path(overlay) if overlay else active_overlay_dir()
    try:
        while True:
            digest = overlay_digest(path)
            try:
                _test_once(app, sel, opts, True, str(path))
            except DeployError as exc:
                click.echo(f"ddeploy: error: {exc}", err=True)
            say(f"watching {path} for changes (Ctrl-C stops)")
            wait_for_change(path, digest)
    except KeyboardInterrupt:
        say("stopped watching")


def _early_agents(app, sel, hosts):
    """Connect to the first hosts while the dev snapshot is exported (deployer/transport/agent_client.py,
    EarlyAgents); the agent starts once it is verified."""
    from ..transport.early_agents import EarlyAgents

    return EarlyAgents(hosts[: sel.parallel], accept_new_host_keys=sel.accept_new_host_keys, command=app.command)


def _views():
    """The renderers, imported when a command runs (not for --help or --version)."""
    from . import views

    return views
