"""What every part of the agent uses: the error it reports (Fail), progress lines on stderr,
timestamps, the git identity and refs, running a tool."""

import contextlib
import os
import subprocess
import sys
import time


STATE_REF = "refs/ddeploy/state"


PRE_REF = "refs/ddeploy/pre-deploy"


ZERO = "0" * 40


IDENTITY = {
    "GIT_AUTHOR_NAME": "ddeploy",
    "GIT_AUTHOR_EMAIL": "ddeploy@localhost",
    "GIT_COMMITTER_NAME": "ddeploy",
    "GIT_COMMITTER_EMAIL": "ddeploy@localhost",
}


# Patch commits are reproducible: the same set on the same base gives the same commits everywhere.
FIXED_DATES = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000"}


_quiet = [False]


class Fail(Exception):
    """An error reported to the client; kind names a deployer.errors class."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def progress(msg: str) -> None:
    if _quiet[0]:
        return
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        _quiet[0] = True  # the client went away; keep working silently


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def hostname() -> str:
    return os.uname().nodename  # what socket.gethostname() returns (uname(2)), without importing socket


def run_tool(argv: list, env=None, cwd=None):
    """(rc, stdout, stderr) of a command; rc 127 when it does not exist."""
    try:
        p = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=dict(os.environ, **(env or {}))
        )
    except OSError as exc:
        return 127, "", "%s: %s" % (argv[0], exc.strerror)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def last_text_line(*texts, default="no output") -> str:
    for text in texts:
        lines = text.strip().splitlines()
        if lines:
            return lines[-1]
    return default


@contextlib.contextmanager
def silenced():
    """No progress lines inside the with block (a step the caller reports in one line of its own)."""
    was, _quiet[0] = _quiet[0], True
    try:
        yield
    finally:
        _quiet[0] = was


def test_pause(req: dict, where: str) -> None:
    """Test hook (DDEPLOY_TEST_AGENT_PAUSE="WHERE:SECONDS" on the client): a window at `where` in
    which a test acts beside this process (another push, a kill)."""
    at, _, secs = str(req.get("options", {}).get("pause") or "").rpartition(":")
    if at == where and float(secs or 0):
        progress("pausing %.1fs %s (test hook)" % (float(secs), where.replace("_", " ")))
        time.sleep(float(secs))
