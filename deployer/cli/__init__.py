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


_gc_paused = [False]


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI, turning DeployError into `ddeploy: error: ...` + exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # answered before Click is even imported
        print(f"ddeploy, version {__version__}")
        sys.exit(ExitCode.OK)
    if argv is None:  # a process of its own: pause the cyclic GC while the command imports
        import gc

        gc.disable()  # what start-up allocates (~400k objects) is almost never garbage; see resume_gc
        _gc_paused[0] = True
    code = run(args)
    if argv is None:  # the process ends now: leave what it built to the OS (collecting it takes ~60 ms)
        gc.freeze()
    sys.exit(code)


def resume_gc() -> None:
    """Collect as usual from here on (a command calls this once its imports are done, before the
    part that runs as long as its hosts take). Until then the GC is paused: scanning the modules
    and models being imported again and again cost ~30 ms of every command's start."""
    if not _gc_paused[0]:  # an in-process caller (tests): its GC is not ours to change
        return
    import gc

    _gc_paused[0] = False
    gc.freeze()  # what was imported stays; later collections skip it
    gc.enable()


def run(args: list[str]) -> int:
    """The command's exit status; every DeployError is printed as one line."""
    import click

    from .app import cli
    from .context import AppContext

    try:
        rv = cli.main(args=args, prog_name="ddeploy", standalone_mode=False, obj=AppContext(argv=tuple(args)))
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
