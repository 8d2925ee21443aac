"""The host's state record (refs/ddeploy/state) and the checkout lock: one implementation, the
agent's, exercised on real sshd hosts through the CLI and on the checkouts directly."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from deployer.agent.common import Fail, STATE_REF
from deployer.agent.lock import acquire, read_lock, release
from deployer.agent.repo import Repo
from deployer.agent.state import update_section

pytestmark = pytest.mark.sshd


def test_sections_are_recorded_as_a_commit_chain_beside_the_engines_own(hosts, ddeploy, patch_sets):
    h1 = hosts.hosts[0]
    assert ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"])).code == 0
    repo = Repo(str(h1.checkout))
    update_section(repo, "builds", lambda old: {"sm_120": {"ok": True}}, "build sm_120")
    update_section(repo, "tests", lambda old: {"ok": False, "passed": 1}, "test run")
    state = json.loads(h1.git("cat-file", "blob", f"{STATE_REF}:state.json"))
    assert state["builds"] == {"sm_120": {"ok": True}} and state["tests"]["passed"] == 1
    assert state["applied"]["version"] == "0.1.0"  # the engine's sections are kept
    log = ddeploy("log", "--host", "h1", "--json")
    messages = [e["message"] for e in json.loads(log.stdout)[0]["data"]["entries"]]
    assert messages[:2] == ["test run", "build sm_120"] and messages[2].startswith("push ddtree 0.1.0")
    assert h1.git("rev-parse", f"{STATE_REF}~1^{{tree}}") != h1.git("rev-parse", f"{STATE_REF}^{{tree}}")
    assert h1.git("status", "--porcelain") == ""  # the work tree is untouched


def _holder_record(h, pid: int, command: str) -> None:
    """A holder's record as a killed holder leaves it (nobody holds the flock)."""
    record = h.checkout / ".git" / "ddeploy" / "deploy.lock.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(
        json.dumps(
            {
                "by": "alice@laptop",
                "host": socket.gethostname(),
                "pid": pid,
                "time": time.time() - 5,
                "command": command,
            }
        )
    )


@pytest.mark.parametrize("args", [("push",), ("rollback",)])
def test_a_live_lock_refuses_and_names_its_holder(hosts, ddeploy, patch_sets, args):
    h2 = hosts.hosts[1]
    repo = Repo(str(h2.checkout))
    acquire(repo, {"by": "alice@laptop", "command": "ddeploy build --host h2"})  # this process holds it
    try:
        extra = ("--version", str(patch_sets["v1"])) if args == ("push",) else ()
        r = ddeploy(*args, "--host", "h2", *extra)
        assert r.code == 7, r.stderr
        assert "is locked by alice@laptop" in r.stderr and "running `ddeploy build --host h2`" in r.stderr
        assert h2.git("rev-parse", "HEAD") == hosts.base_commit
        r = ddeploy("lock", "release", "--host", "h2", "--yes")  # a live holder's lock is the kernel's
        assert r.code == 7 and "still running" in r.stderr and f"kill {os.getpid()}" in r.stderr, r.stderr
    finally:
        release(repo)
    assert read_lock(repo) is None


def test_a_record_left_by_a_killed_command_is_replaced_by_the_next_one(hosts, ddeploy, patch_sets):
    h3 = hosts.hosts[2]
    _holder_record(h3, 999_999_999, "ddeploy build --host h3")  # nobody holds the flock
    status = ddeploy("lock", "status", "--host", "h3", "--json")
    assert json.loads(status.stdout)[0]["data"]["lock"]["alive"] is False and "(stale" in status.stderr
    r = ddeploy("push", "--host", "h3", "--version", str(patch_sets["v1"]))
    assert r.code == 0, r.stderr
    assert "the previous holder (pid 999999999, `ddeploy build --host h3`) ended without releasing" in r.stderr
    assert not (h3.checkout / ".git" / "ddeploy" / "deploy.lock.json").exists()


def test_the_lock_records_the_real_command_line(hosts, ddeploy, patch_sets):
    """In-process callers (these tests) record their own argv, not the test runner's."""
    h1 = hosts.hosts[0]
    repo = Repo(str(h1.checkout))
    req = {"by": "t@x", "command": "ddeploy push --host h1 --version 0.1.0"}
    acquire(repo, req)
    try:
        assert read_lock(repo)["command"] == req["command"]
        with pytest.raises(Fail, match="running `ddeploy push --host h1 --version 0.1.0`"):
            acquire(repo, req)
    finally:
        release(repo)
    assert read_lock(repo) is None
