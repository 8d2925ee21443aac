"""`ddeploy launch | logs | stop`: rendered launch scripts started, tailed and stopped on hosts
(deployer.ops.launch; one connection per host per command)."""

from __future__ import annotations

import click

from .app import cli
from .context import AppContext
from .output import say
from .render import host_options, set_option


@cli.command()
@host_options
@click.option("--topology", "-t", required=True, help="Topology profile (templates/topologies.yaml).")
@set_option
@click.option("--dry-run", is_flag=True, help="Render and show what would be copied and started; touch nothing.")
@click.pass_obj
def launch(app: AppContext, hosts, group, topology, sets, dry_run) -> None:
    """Render, copy the script(s) to the host and start them detached (log + pid recorded there)."""
    from ..ops import launch as lc

    chosen = app.inventory.select(names=hosts, groups=(group,) if group else ())
    started = lc.launch(chosen, topology, sets, say, dry_run=dry_run, command=app.command)
    if dry_run:
        for name, units in started.items():
            remote = f"{lc.launch_dir(units)}/{topology}"
            for u in units:
                say(
                    f"would copy {u.script_file} + {u.env_file} to {remote}/ and start it detached, "
                    f"log {remote}/{u.name}.log",
                    name,
                )


@cli.command()
@click.option("--host", required=True, help="Host whose last launch to show.")
@click.option("-n", "lines", default=50, show_default=True, help="Lines from the end of each log.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines (Ctrl-C ends).")
@set_option
@click.pass_obj
def logs(app: AppContext, host, lines, follow, sets) -> None:
    """Tail the log(s) of the last launch on a host."""
    from ..ops import launch as lc

    lc.logs(app.inventory.get(host), sets, lines, follow, click.echo)


@cli.command()
@click.option("--host", required=True, help="Host whose launched server to stop.")
@click.option("--grace", default=30.0, show_default=True, help="Seconds between TERM and KILL.")
@set_option
@click.pass_obj
def stop(app: AppContext, host, grace, sets) -> None:
    """Stop exactly the processes the last launch started (TERM, wait, KILL)."""
    from ..ops import launch as lc

    lc.stop(app.inventory.get(host), sets, lambda m: say(m, host), grace)
