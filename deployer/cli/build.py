"""`ddeploy build` (kernels compiled in place for each host's GPU) and `ddeploy test` (the
overlay's tests, on hosts with --remote, else locally against the overlay)."""

from __future__ import annotations

from pathlib import Path

import click

from ..build import BuildOptions, build_host
from ..errors import UsageError
from ..fleet import run_fleet
from ..inventory import local_host
from ..output import table
from ..patchset import load_patch_set
from ..remote_test import TestOptions, result_rows, test_host, test_local
from . import cli
from .remote import _fleet, _hosts, finish, host_selection


@cli.command()
@host_selection
@click.option("--force", is_flag=True, help="Rebuild even when the cache already has this build.")
@click.pass_context
def build(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys, force):
    """Compile the DDTree JIT kernels on the hosts, for each host's GPU arch."""
    opts = BuildOptions(force=force, accept_new_host_keys=accept_new_host_keys)
    _fleet(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, lambda h, say: build_host(h, opts, say))


@cli.command("test")
@host_selection
@click.option("--remote", is_flag=True, help="Run on the selected hosts (else locally against the overlay).")
@click.option("-k", "expr", help="Only tests matching this pytest -k expression.")
@click.option("--version", "-V", "version", help="Refuse hosts where another patch set than this one is applied.")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where JUnit reports land (default: <cache>/test-reports/<host>/).")
@click.pass_context
def test_cmd(ctx, names, groups, all_hosts, parallel, fail_fast, as_json, accept_new_host_keys, remote, expr,
             version, report_dir):
    """Run the overlay's unit tests (test/srt/ddtree) on hosts, or locally."""
    opts = TestOptions(expr=expr, requested=load_patch_set(version) if version else None, report_dir=report_dir,
                       accept_new_host_keys=accept_new_host_keys)
    if not remote and (names or groups or all_hosts):
        raise UsageError("--host/--group/--all select hosts for --remote; add --remote (or drop them to test locally)")
    results = (run_fleet(_hosts(ctx, names, groups, all_hosts), lambda h, say: test_host(h, opts, say),
                         parallel=parallel, fail_fast=fail_fast)
               if remote else run_fleet([local_host()], lambda h, say: test_local(opts, say)))
    finish(results, as_json, results_table)


def results_table(results) -> None:
    click.echo(table(result_rows(results), ["host", "result", "passed", "failed", "skipped", "errors", "duration"]),
               err=True)

