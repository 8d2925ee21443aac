"""The `ddeploy` command line: thin Click shims over the library.

Each command group lives in its own module under deployer/cli/; this module holds the root
group and the single boundary that maps DeployError to a one-line message and an exit code.
Only deployer/cli/ renders (tables, progress, colours); nothing outside it imports it.
"""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..errors import DeployError, ExitCode
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
    from . import deploy, kernels, launch, patches, render, tests  # noqa: F401  (each module adds its commands)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI, turning DeployError into `ddeploy: error: ...` + exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rv = cli.main(args=args, prog_name="ddeploy", standalone_mode=False, obj=AppContext(argv=tuple(args)))
    except click.exceptions.Abort:
        click.echo("ddeploy: aborted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except DeployError as exc:
        click.echo(f"ddeploy: error: {exc}", err=True)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        click.echo("ddeploy: interrupted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    sys.exit(rv if isinstance(rv, int) else ExitCode.OK)
