"""The entry point: one operation per run, its reply as one JSON object on stdout."""

import json
import os
import signal
import sys
from importlib import import_module

from .client import watch
from .common import Fail
from .repo import Repo


# Each operation's module, imported only when that operation runs: a push never loads the
# kernel build's importlib.metadata or the server checks' urllib.
OPS = {
    "push": ("push", "op_push"),
    "push-build": ("push_build", "op_push_build"),
    "rollback": ("rollback", "op_rollback"),
    "status": ("status", "op_status"),
    "state": ("status", "op_state"),
    "plan": ("plan", "op_plan"),
    "log": ("history", "op_log"),
    "lock-status": ("lock_commands", "op_lock_status"),
    "lock-release": ("lock_commands", "op_lock_release"),
    "build": ("build", "op_build"),
    "sources": ("build", "op_sources"),
    "test": ("overlay_tests", "op_test"),
    "launch": ("launch", "op_launch"),
    "logs": ("launch", "op_logs"),
    "stop": ("launch", "op_stop"),
    "wait": ("serving", "op_wait"),
    "drain": ("serving_checks", "op_drain"),
    "health": ("serving_checks", "op_health"),
    "router": ("router", "op_router"),
    "bench": ("bench", "op_bench"),
    "bench-save": ("bench", "op_bench_save"),
}


def operation(op: str):
    module, name = OPS[op]
    return getattr(import_module("." + module, __package__), name)


# Work on launches beside the checkout, not in it: the checkout need not exist.
NO_CHECKOUT = ("launch", "logs", "stop", "wait", "drain", "health", "router", "bench")


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
        result = operation(op)(Repo(req["checkout"]), req)
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
