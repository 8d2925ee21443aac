"""`ddeploy render | launch | logs | stop`: launch scripts per host and topology."""

from __future__ import annotations

from pathlib import Path

import click

from .. import render as rd
from ..errors import UsageError
from ..output import say, table
from . import cli
from .context import AppContext

_set_option = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                           help="Override a render value (repeatable; highest precedence).")


def _hosts(app: AppContext, hosts: tuple[str, ...], group: str | None):
    """Hosts in node-rank order: --host in the order given, then a --group's members."""
    return app.inventory.select(names=hosts, groups=(group,) if group else ())


@cli.command()
@click.option("--host", "hosts", multiple=True, help="Host (repeat once per node for multi-node).")
@click.option("--group", help="Host group (multi-node: members in inventory order are ranks 0..n-1).")
@click.option("--topology", "-t", help="Topology profile (templates/topologies.yaml).")
@_set_option
@click.option("--output", "-o", "out_dir", type=click.Path(file_okay=False), help="Write script + env files here.")
@click.option("--explain", is_flag=True, help="Show every value and where it came from, instead of the script.")
@click.option("--all", "render_every", is_flag=True, help="Render every valid (host, topology) pair (needs -o).")
@click.pass_obj
def render(app: AppContext, hosts, group, topology, sets, out_dir, explain, render_every) -> None:
    """Render the SGLang launch script(s) for a host and topology."""
    if render_every:
        units, skipped = rd.render_all(app.inventory, sets)
        for label, reason in skipped:
            say(f"skipped {label}: {reason}")
    else:
        if not topology:
            raise UsageError("render needs --topology T (or --all)")
        units = rd.render_plan(_hosts(app, hosts, group), topology, sets)
    if explain:
        click.echo(table(rd.explain_rows(units), ["unit", "key", "value", "source"]))
    elif out_dir:
        for path in rd.write_units(units, Path(out_dir)):
            say(f"wrote {path}")
    else:
        for unit in units:
            if len(units) > 1:
                click.echo(f"# ==> {unit.script_file} ({unit.host}) <==")
            click.echo(unit.script, nl=False)
