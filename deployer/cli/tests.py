"""`ddeploy test`: the overlay's tests, on hosts with --remote (deployer.ops.overlay_tests), else
locally against the overlay."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UsageError
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
@click.pass_context
def test_cmd(ctx, remote, expr, version, report_dir, overlay):
    """Run the overlay's unit tests (test/srt/ddtree) on hosts, or locally.

    With --remote --overlay, the overlay's working copy is pushed first as a dev snapshot (a no-op
    when unchanged) and its tests run on the hosts."""
    from ..inventory import local_host
    from ..ops.overlay_tests import TestOptions, test_host, test_local
    from ..patchset import load_patch_set

    sel = selection(ctx)
    if not remote and sel.given:
        raise UsageError("--host/--group/--all select hosts for --remote; add --remote (or drop them to test locally)")
    if overlay is not None and version is not None:
        raise UsageError("--overlay tests a dev snapshot of the overlay; drop --version (or drop --overlay)")
    opts = TestOptions(
        expr=expr,
        requested=load_patch_set(version) if version else None,
        snapshot=chosen_set(None, overlay) if remote and overlay is not None else None,
        overlay=Path(overlay) if overlay else None,
        report_dir=report_dir,
        accept_new_host_keys=sel.accept_new_host_keys,
        command=ctx.obj.command,
    )
    if remote:
        run(ctx.obj, sel, lambda h, say: test_host(h, opts, say), _views().describe_test, report=_views().test_table)
    else:
        run(
            ctx.obj,
            sel,
            lambda h, say: test_local(opts, say),
            _views().describe_test,
            report=_views().test_table,
            hosts=[local_host()],
        )


def _views():
    """The renderers, imported when a command runs (not for --help or --version)."""
    from . import views

    return views
