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
@click.option("--group", help="Host group: each member on its own, or (multi-node) ranks 0..n-1 in inventory order.")
@click.option("--topology", "-t", help="Topology profile (templates/topologies.yaml).")
@_set_option
@click.option("--output", "-o", "out_dir", type=click.Path(file_okay=False), help="Write script + env files here.")
@click.option("--explain", is_flag=True, help="Show every value and where it came from, instead of the script.")
@click.option("--all", "render_every", is_flag=True, help="Render every valid (host, topology) pair (to stdout, or into -o DIR).")
@click.pass_obj
def render(app: AppContext, hosts, group, topology, sets, out_dir, explain, render_every) -> None:
    """Render the SGLang launch script(s) for a host and topology."""
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
    elif out_dir:
        for path in rd.write_units(units, Path(out_dir)):
            say(f"wrote {path}")
    else:
        for unit in units:
            if len(units) > 1:
                click.echo(f"# ==> {unit.script_file} ({unit.host}) <==")
            click.echo(unit.script, nl=False)


def _by_host(units: list[rd.RenderedUnit]) -> dict[str, list[rd.RenderedUnit]]:
    out: dict[str, list[rd.RenderedUnit]] = {}
    for unit in units:
        out.setdefault(unit.host, []).append(unit)
    return out


@cli.command()
@click.option("--host", "hosts", multiple=True, help="Host (repeat once per node for multi-node).")
@click.option("--group", help="Host group (multi-node).")
@click.option("--topology", "-t", required=True, help="Topology profile (templates/topologies.yaml).")
@_set_option
@click.option("--dry-run", is_flag=True, help="Render and show what would be copied and started; touch nothing.")
@click.pass_obj
def launch(app: AppContext, hosts, group, topology, sets, dry_run) -> None:
    """Render, copy the script(s) to the host and start them detached (log + pid recorded there)."""
    from .. import launch as lc

    chosen = {h.name: h for h in _hosts(app, hosts, group)}
    rd.render_hosts(list(chosen.values()), topology, sets)  # a bad topology or --set fails before any host is contacted
    probed = lc.probe_hosts(list(chosen.values()), say)
    for name, units in _by_host(rd.render_hosts(list(chosen.values()), topology, sets, probed=probed)).items():
        remote = f"{lc.launch_dir(units)}/{topology}"
        if dry_run:
            for u in units:
                say(f"would copy {u.script_file} + {u.env_file} to {remote}/ and start it detached, "
                    f"log {remote}/{u.name}.log", name)
            continue
        lc.launch_host(chosen[name], units, lambda m, n=name: say(m, n))


@cli.command()
@click.option("--host", required=True, help="Host whose last launch to show.")
@click.option("-n", "lines", default=50, show_default=True, help="Lines from the end of each log.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines (Ctrl-C ends).")
@_set_option
@click.pass_obj
def logs(app: AppContext, host, lines, follow, sets) -> None:
    """Tail the log(s) of the last launch on a host."""
    from .. import launch as lc

    h = app.inventory.get(host)
    lc.logs(h, rd.launch_dir_for(h, sets), lines, follow, click.echo)


@cli.command()
@click.option("--host", required=True, help="Host whose launched server to stop.")
@click.option("--grace", default=30.0, show_default=True, help="Seconds between TERM and KILL.")
@_set_option
@click.pass_obj
def stop(app: AppContext, host, grace, sets) -> None:
    """Stop exactly the processes the last launch started (TERM, wait, KILL)."""
    from .. import launch as lc

    h = app.inventory.get(host)
    lc.stop(h, rd.launch_dir_for(h, sets), lambda m: say(m, host), grace)
