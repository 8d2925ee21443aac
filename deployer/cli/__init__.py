"""The `ddeploy` command line: thin Click shims over the library.

`app.py` holds the root group, one module per command group adds its commands, and `main` here
is the single boundary that maps DeployError to a one-line message and an exit code. Only
deployer/cli/ renders (tables, progress, colours); nothing outside it imports it. Everything a
command does not need is imported when it runs, so `--version` and `--help` start fast.
"""

from __future__ import annotations

import sys

from .. import __version__
from ..errors import DeployError, ExitCode


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI, turning DeployError into `ddeploy: error: ...` + exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # answered before Click is even imported
        print(f"ddeploy, version {__version__}")
        sys.exit(ExitCode.OK)
    sys.exit(run(args))


def run(args: list[str]) -> int:
    """The command's exit status; every DeployError is printed as one line."""
    import click

    from .app import cli
    from .context import AppContext

    app = AppContext(argv=tuple(args))
    try:
        rv = cli.main(args=args, prog_name="ddeploy", standalone_mode=False, obj=app)
    except click.exceptions.Abort:
        click.echo("ddeploy: aborted", err=True)
        return ExitCode.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except DeployError as exc:
        click.echo(f"ddeploy: error: {exc}", err=True)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("ddeploy: interrupted", err=True)
        return ExitCode.INTERRUPTED
    return rv if isinstance(rv, int) else ExitCode.OK
