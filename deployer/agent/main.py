"""The entry point: one operation per run, its reply as one JSON object on stdout."""

import json
import os
import signal
import sys

from .bench import op_bench, op_bench_save
from .build import op_build, op_sources
from .client import watch
from .common import Fail
from .history import op_log
from .launch import op_launch, op_logs, op_stop
from .lock_commands import op_lock_release, op_lock_status
from .overlay_tests import op_test
from .plan import op_plan
from .push import op_push
from .push_build import op_push_build
from .repo import Repo
from .rollback import op_rollback
from .serving import op_wait
from .status import op_state, op_status


OPS = {
    "push": op_push,
    "push-build": op_push_build,
    "rollback": op_rollback,
    "status": op_status,
    "plan": op_plan,
    "log": op_log,
    "lock-status": op_lock_status,
    "lock-release": op_lock_release,
    "build": op_build,
    "sources": op_sources,
    "test": op_test,
    "state": op_state,
    "launch": op_launch,
    "logs": op_logs,
    "stop": op_stop,
    "wait": op_wait,
    "bench": op_bench,
    "bench-save": op_bench_save,
}


# Work on launches beside the checkout, not in it: the checkout need not exist.
NO_CHECKOUT = ("launch", "logs", "stop", "wait", "bench")


# Interactive: they end with the client (a cut connection stops `logs --follow`).
ATTACHED = ("logs",)


def detach() -> None:
    """A cut connection must not kill a transaction halfway: ignore hangups, leave the session."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        os.setsid()
    except OSError:
        pass


def main(argv: list, request=None) -> int:
    """argv: [program, OP]; request: the JSON text (from the client's program), else read on stdin."""
    try:
        if request is None:  # one line; the client holds stdin open after it until the call ends
            request = sys.stdin.buffer.readline().decode()
            watch(sys.stdin.fileno())
        req = json.loads(request)
        op = argv[1] if len(argv) > 1 else req.get("op")
        if op not in ATTACHED:
            detach()
        if op not in OPS:
            raise Fail("UsageError", "unknown agent operation %r" % op)
        if op not in NO_CHECKOUT and not os.path.isdir(req["checkout"]):
            raise Fail(
                "StateError",
                "checkout %s does not exist on this host; create it (clone SGLang "
                "0.5.23) or fix `checkout` in the inventory" % req["checkout"],
            )
        result = OPS[op](Repo(req["checkout"]), req)
    except Fail as exc:
        result = {"ok": False, "error": {"kind": exc.kind, "message": str(exc)}}
    except Exception as exc:  # noqa: BLE001 - reported as data, never a traceback on the wire
        result = {
            "ok": False,
            "error": {"kind": "RemoteCommandError", "message": "agent failed: %s: %s" % (type(exc).__name__, exc)},
        }
    try:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    return 0
