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
    head = None
    if argv is None:  # a process of its own: pause the cyclic GC while the command imports
        import gc

        gc.disable()  # what start-up allocates (~400k objects) is almost never garbage; see resume_gc
        _gc_paused[0] = True
        # Threads waiting on hosts (a connect's round trips, an agent's reply) beside one that
        # computes (imports, validation): switching the GIL every 0.5 ms instead of 5 lets each
        # take its host's answer at once (~40 ms per no-op push; docs/remote.md, Benchmark).
        sys.setswitchinterval(0.0005)
        head = _head_start(args)
    try:
        code = run(args, head)
    finally:
        if head is not None:
            head.close()
    if argv is None:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """End a console run the way sys.exit would (other threads joined, atexit hooks such as
    logging's run, output flushed) but without tearing the interpreter down: unwinding its modules
    and everything the command built cost ~40 ms of every command, for memory the OS frees anyway."""
    import atexit
    import os
    import threading

    try:
        threading._shutdown()  # what the interpreter's exit does first: threads' exit hooks, joins
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(int(code))


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


def _head_start(args: list[str]):
    """A repeated fleet command connects before Click and pydantic load (deployer/transport/
    head_start.py); DDEPLOY_HEAD_START=0 turns that off."""
    import os

    if os.environ.get("DDEPLOY_HEAD_START", "1") == "0":
        return None
    from ..transport.head_start import HeadStart

    return HeadStart.begin(args)


def run(args: list[str], head=None) -> int:
    """The command's exit status; every DeployError is printed as one line."""
    import click

    from .app import cli
    from .context import AppContext

    app = AppContext(argv=tuple(args), head_start=head)
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
