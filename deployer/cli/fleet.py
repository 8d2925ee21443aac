"""The end of every fleet command: progress while it runs, a table on stderr, --json on stdout,
a non-zero exit when any host failed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import click

from .output import emit_json

if TYPE_CHECKING:
    from ..ops.fleet import HostResult, Operation
    from .context import AppContext, Selection

Describe = Callable[[object], str]


def run(
    app: AppContext,
    sel: Selection,
    op: Operation,
    describe: Describe,
    report: Callable[[list[HostResult]], str] | None = None,
    hosts=None,
) -> list[HostResult]:
    """Run op on the selected hosts, then finish (report, --json, exit status)."""
    from ..ops.fleet import run_fleet
    from .progress import Progress
    from .views import summary, summary_table

    hosts = sel.hosts(app) if hosts is None else hosts
    progress = Progress(len(hosts), lambda r: summary(r, describe))
    try:
        results = run_fleet(hosts, op, parallel=sel.parallel, fail_fast=sel.fail_fast, events=progress)
    finally:
        progress.close()
    finish(results, sel.as_json, report or (lambda rs: summary_table(rs, describe)))
    return results


def finish(results: list[HostResult], as_json: bool, report: Callable[[list[HostResult]], str]) -> None:
    from ..ops.fleet import raise_if_failed
    from .views import result_json

    text = report(results)
    if text:
        click.echo(text, err=True)
    if as_json:
        emit_json([result_json(r) for r in results])
    raise_if_failed(results)
