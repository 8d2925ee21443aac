"""The root `ddeploy` group; each command group lives in its own module and registers here."""

from __future__ import annotations

import click

from .. import __version__
from .context import AppContext


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddeploy")
@click.option(
    "--inventory",
    "-i",
    "inventory_dir",
    type=click.Path(file_okay=False),
    envvar="DDEPLOY_HOSTS_DIR",
    help="Directory of host YAML files (default: $DDEPLOY_HOSTS_DIR, else ./hosts, else "
    "~/.config/ddeploy/hosts, else the project checkout's hosts/).",
)
@click.pass_context
def cli(ctx: click.Context, inventory_dir: str | None) -> None:
    """Ship DDTree speculative-decoding patch sets onto SGLang checkouts on GPU hosts."""
    ctx.ensure_object(AppContext).inventory_dir = inventory_dir


def _register() -> None:
    from . import deploy, kernels, launch, patches, render, rollout, tests  # noqa: F401  (each adds its commands)


_register()
