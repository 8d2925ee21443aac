"""`ddeploy render`: launch scripts per host and topology (launch, logs, stop: cli/launch.py)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UsageError
from .app import cli
from .context import AppContext
from .output import say, table

set_option = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a render value (repeatable; highest precedence).",
)


def host_options(fn):
    """--host (repeatable, node-rank order) and --group of render and launch."""
    fn = click.option(
        "--group", help="Host group: each member on its own, or (multi-node) ranks 0..n-1 in inventory order."
    )(fn)
    return click.option("--host", "hosts", multiple=True, help="Host (repeat once per node for multi-node).")(fn)


def _hosts(app: AppContext, hosts: tuple[str, ...], group: str | None):
    """Hosts in node-rank order: --host in the order given, then a --group's members."""
    return app.inventory.select(names=hosts, groups=(group,) if group else ())


@cli.command()
@host_options
@click.option("--topology", "-t", help="Topology profile (templates/topologies.yaml).")
@set_option
@click.option("--output", "-o", "out_dir", type=click.Path(file_okay=False), help="Write script + env files here.")
@click.option("--explain", is_flag=True, help="Show every value and where it came from, instead of the script.")
@click.option(
    "--all", "render_every", is_flag=True, help="Render every valid (host, topology) pair (to stdout, or into -o DIR)."
)
@click.pass_obj
def render(app: AppContext, hosts, group, topology, sets, out_dir, explain, render_every) -> None:
    """Render the SGLang launch script(s) for a host and topology."""
    from .. import render as rd

    if render_every:
        if hosts or group or topology:
            raise UsageError("--all renders every (host, topology) pair: drop --host/--group/--topology")
        units, skipped = rd.render_all(app.inventory, sets)
        for label, reason in skipped:
            say(f"skipped {label}: {reason}")
    else:
        if not topology:
            raise UsageError("render needs --topology T (or --all)")
        units = rd.render_hosts(_hosts(app, hosts, group), topology, sets)
    if explain:
        click.echo(table(rd.explain_rows(units), ["unit", "key", "value", "source"]))
        memory = rd.memory_rows(units)
        if memory:
            click.echo()
            click.echo(table(memory, ["unit", rd.memory_heading(units), "estimate", "of headroom"]))
    elif out_dir:
        for path in rd.write_units(units, Path(out_dir)):
            say(f"wrote {path}")
    else:
        for unit in units:
            if len(units) > 1:
                click.echo(f"# ==> {unit.script_file} ({unit.host}) <==")
            click.echo(unit.script, nl=False)
