"""What protects a host: hand edits, the lock, a cut connection, a killed deploy, bad patch sets."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sshd_hosts import STUB, VERSION_PY, rewritten_set

pytestmark = pytest.mark.sshd


def snapshot(h) -> dict:
    return {
        "refs": h.git("for-each-ref", "--format=%(objectname) %(refname)"),
        "head": h.git("rev-parse", "HEAD"),
        "status": h.git("status", "--porcelain", "--untracked-files=all"),
    }


def cli_process(hosts, *args, pause: str) -> subprocess.Popen:
    """The real CLI as a separate process, with the agent's test pause hook set."""
    env = {**os.environ, "DDEPLOY_TEST_AGENT_PAUSE": pause}
    return subprocess.Popen(
        [sys.executable, "-c", "from deployer.cli import main; main()", "-i", str(hosts.inventory_dir), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def holder(h) -> Path:
    """The lock holder's record (the lock itself is an flock on deploy.lock beside it)."""
    return h.checkout / ".git" / "ddeploy" / "deploy.lock.json"


def test_hand_edit_blocks_push_and_rollback_until_forced_and_is_recoverable(hosts, ddeploy, patch_sets):
    h1 = hosts.hosts[0]
    assert ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"])).code == 0
    (h1.checkout / VERSION_PY).write_text("hand edit\n")
    before = snapshot(h1)
    for args in (("push", "--version", str(patch_sets["v2"])), ("rollback",)):
        r = ddeploy(*args, "--host", "h1")
        assert r.code == 7, r.stderr
        assert f"hand edits in {VERSION_PY}" in r.stderr and "--force" in r.stderr
        assert snapshot(h1) == before and (h1.checkout / VERSION_PY).read_text() == "hand edit\n"
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v2"]), "--force", "--json")
    assert r.code == 0, r.stderr
    saved = json.loads(r.stdout)[0]["data"]["saved"]
    assert saved.startswith("refs/ddeploy/saved/") and saved in r.stderr
    assert (h1.checkout / STUB).read_text() == "VERSION = 2\n"
    assert h1.git("status", "--porcelain") == ""
    # Recoverable: the saved commit holds the edit on top of the v1 head it was made on.
    assert h1.git("show", f"{saved}:{VERSION_PY}") == "hand edit"
    assert h1.git("diff", "--name-only", f"{saved}~1", saved) == VERSION_PY
    (h1.checkout / STUB).write_text("another edit\n")
    r = ddeploy("rollback", "--host", "h1", "--force", "--json")
    assert r.code == 0, r.stderr
    saved2 = json.loads(r.stdout)[0]["data"]["saved"]
    assert h1.git("show", f"{saved2}:{STUB}") == "another edit"
    assert h1.git("rev-parse", "HEAD^{tree}") == hosts.base_tree


def test_hand_edit_before_the_first_push_blocks_it(hosts, ddeploy, patch_sets):
    h2 = hosts.hosts[1]
    (h2.checkout / STUB).write_text("my own stub\n")  # untracked file where the set adds one
    r = ddeploy("push", "--host", "h2", "--version", str(patch_sets["v1"]))
    assert r.code == 7 and STUB in r.stderr
    assert h2.git("rev-parse", "HEAD") == hosts.base_commit
    assert h2.git("for-each-ref", "refs/ddeploy") == ""


def test_racing_pushes_one_wins_the_other_names_the_holder(hosts, ddeploy, patch_sets):
    h1 = hosts.hosts[0]
    first = cli_process(hosts, "push", "--host", "h1", "--version", str(patch_sets["v1"]), pause="4")
    try:
        wait_for(lambda: holder(h1).exists(), what="the first push to take the lock")
        r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v2"]))
        assert r.code == 7, r.stderr
        assert "is locked by" in r.stderr and "running `ddeploy" in r.stderr and "push --host h1" in r.stderr
        assert h1.git("rev-parse", "HEAD") == hosts.base_commit  # the loser changed nothing
    finally:
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert (h1.checkout / STUB).read_text() == "VERSION = 1\n"
    assert h1.git("rev-parse", "HEAD~2") == hosts.base_commit and h1.git("status", "--porcelain") == ""
    assert not holder(h1).exists()


def _tree_is_old_or_new(h, base_tree: str) -> str:
    tree = h.git("rev-parse", "HEAD^{tree}")
    clean = h.git("status", "--porcelain", "--untracked-files=all") == ""
    assert clean, "work tree half switched"
    return "old" if tree == base_tree else "new"


def test_connection_cut_mid_push_leaves_old_or_new_and_the_next_push_completes(hosts, ddeploy, patch_sets):
    h1 = hosts.hosts[0]
    push = cli_process(hosts, "push", "--host", "h1", "--version", str(patch_sets["v1"]), pause="4")
    wait_for(lambda: holder(h1).exists(), what="the push to start on the host")
    h1.stop()
    _out, err = push.communicate(timeout=60)
    assert push.returncode == 5, err
    assert "[h1]" in err and "connection lost" in err
    assert _tree_is_old_or_new(h1, hosts.base_tree) == "old"  # cut before the switch
    wait_for(lambda: not holder(h1).exists(), what="the host to finish the transaction on its own")
    assert _tree_is_old_or_new(h1, hosts.base_tree) == "new"
    h1.start()
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 0 and "already applied" in r.stderr
    assert json.loads(h1.git("cat-file", "blob", "refs/ddeploy/state:state.json"))["applied"]["version"] == "0.1.0"


def test_agent_killed_mid_push_is_reported_as_died_not_as_a_lost_connection(hosts, ddeploy, patch_sets):
    h1 = hosts.hosts[0]
    push = cli_process(hosts, "push", "--host", "h1", "--version", str(patch_sets["v1"]), pause="30")
    wait_for(lambda: holder(h1).exists(), what="the push to start on the host")
    os.kill(json.loads(holder(h1).read_text())["pid"], signal.SIGKILL)
    _out, err = push.communicate(timeout=60)
    assert push.returncode == 6, err
    died = "the agent process on h1 died (killed by SIGKILL) during `push`; `ddeploy status --host h1` shows what it"
    died += " left"
    assert re.search(r"^\[h1\] FAILED in [\d.]+s: " + re.escape(died) + "$", err, re.M), err
    assert "connection lost" not in err
    assert _tree_is_old_or_new(h1, hosts.base_tree) == "old"  # killed before the switch
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 0 and "ended without releasing the lock" in r.stderr, r.stderr
    assert (h1.checkout / VERSION_PY).read_text().endswith("# ddtree 0.1.0\n")


def test_after_a_holder_is_killed_exactly_one_of_several_racing_pushes_proceeds(hosts, ddeploy, patch_sets):
    """The race a directory-plus-pid lock loses: several runs find the same dead holder at once.
    With flock the kernel dropped the dead holder's lock; exactly one racer takes it."""
    h3 = hosts.hosts[2]
    first = cli_process(hosts, "push", "--host", "h3", "--version", str(patch_sets["v1"]), pause="30")
    wait_for(holder(h3).exists, what="the first push to take the lock")
    os.kill(json.loads(holder(h3).read_text())["pid"], signal.SIGKILL)
    first.communicate(timeout=60)
    assert holder(h3).exists()  # the dead holder's record stays; its lock does not
    racers = [
        cli_process(hosts, "push", "--host", "h3", "--version", str(patch_sets["v1"]), pause="12") for _ in range(4)
    ]
    results = [(p.communicate(timeout=120)[1], p.returncode)[::-1] for p in racers]
    winners = [err for code, err in results if code == 0]
    losers = [err for code, err in results if code != 0]
    assert len(winners) == 1, [code for code, _ in results]
    assert "ended without releasing the lock" in winners[0]
    assert all(("is locked by" in err and "push --host h3" in err) for err in losers), losers
    assert (h3.checkout / VERSION_PY).read_text().endswith("# ddtree 0.1.0\n")
    assert not holder(h3).exists()


def test_deploy_killed_mid_switch_is_completed_by_the_next_push(hosts, ddeploy, patch_sets):
    h2 = hosts.hosts[1]
    # bytecode the host's tests left for a file the set rewrites: stale once the switch completes
    source = h2.checkout / VERSION_PY
    stale = h2.checkout / ".git/ddeploy/pycache" / str(source.parent).lstrip("/") / "version.cpython-311.pyc"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"stale")
    push = cli_process(hosts, "push", "--host", "h2", "--version", str(patch_sets["v1"]), pause="mid_switch:30")
    wait_for(lambda: (h2.checkout / STUB).exists(), what="the switch to begin")
    owner = json.loads(holder(h2).read_text())
    os.kill(owner["pid"], signal.SIGKILL)  # the agent dies with the work tree half switched
    push.communicate(timeout=60)
    journal = json.loads((h2.checkout / ".git" / "ddeploy" / "journal.json").read_text())
    assert journal["command"].startswith("ddeploy -i ") and journal["command"].endswith(
        f"push --host h2 --version {patch_sets['v1']}"
    )  # the real command line, not the interpreter's argv
    status = ddeploy("status", "--host", "h2", "--json")
    assert json.loads(status.stdout)[0]["data"]["interrupted"] is True
    assert "(stale)" in status.stderr
    r = ddeploy("push", "--host", "h2", "--version", str(patch_sets["v1"]))
    assert r.code == 0, r.stderr
    assert "ended without releasing the lock" in r.stderr and "completing an interrupted push" in r.stderr
    assert (h2.checkout / VERSION_PY).read_text().endswith("# ddtree 0.1.0\n")
    assert h2.git("status", "--porcelain", "--untracked-files=all") == ""
    assert h2.git("rev-parse", "HEAD~2") == hosts.base_commit
    assert not stale.exists()  # the completed switch dropped the bytecode of what it covers


def test_lock_status_and_release(hosts, ddeploy, monkeypatch):
    h3 = hosts.hosts[2]
    holder(h3).parent.mkdir(parents=True)
    holder(h3).write_text(
        json.dumps(
            {
                "by": "alice@laptop",
                "pid": 999999,
                "host": "elsewhere",
                "time": time.time() - 600,
                "command": "ddeploy push",
            }
        )
    )
    r = ddeploy("lock", "status", "--host", "h3")
    assert r.code == 0
    assert re.search(r"held by alice@laptop pid 999999 running `ddeploy push` for 6\d\ds", r.stderr)
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    r = ddeploy("lock", "release", "--host", "h3")  # asks first; "n" -> aborted, lock kept
    assert r.code == 130 and "Release the deploy lock on h3?" in r.stderr and holder(h3).exists()
    r = ddeploy("lock", "release", "--host", "h3", "--yes")
    assert r.code == 0 and "released the lock of" in r.stderr
    assert not holder(h3).exists()


def test_tampered_or_escaping_patch_sets_are_refused_before_any_host(hosts, ddeploy, patch_sets, tmp_path):
    import shutil

    before = [snapshot(h) for h in hosts.hosts]
    tampered = tmp_path / "tampered"
    shutil.copytree(patch_sets["v1"], tampered)
    patch = tampered / "0002-wiring.patch"
    patch.write_text(patch.read_text().replace("# ddtree 0.1.0", "import os; os.system('x')"))
    r = ddeploy("push", "--all", "--version", str(tampered))
    assert r.code == 4 and "0002-wiring.patch" in r.stderr and "sha256" in r.stderr

    escaping = rewritten_set(
        patch_sets["v1"], tmp_path / "escaping", "0002-wiring.patch", "python/sglang/version.py", "../../outside.py"
    )
    r = ddeploy("push", "--all", "--version", str(escaping))
    assert r.code == 4 and "escapes the checkout" in r.stderr
    assert [snapshot(h) for h in hosts.hosts] == before
    assert not any((h.checkout / ".git" / "ddeploy").exists() for h in hosts.hosts)
    assert "[h1]" not in r.stderr  # no host was contacted


def test_patch_set_altered_on_the_host_is_shipped_again(hosts, ddeploy, patch_sets):
    h1 = hosts.hosts[0]
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 0 and "shipping ddtree 0.1.0" in r.stderr
    assert ddeploy("rollback", "--host", "h1").code == 0
    [shipped] = (h1.checkout / ".git" / "ddeploy" / "sets").glob("ddtree-0.1.0-*")
    wiring = shipped / "0002-wiring.patch"
    wiring.write_text(wiring.read_text().replace("# ddtree 0.1.0", "# evil 0.1.0"))
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 0 and "shipping ddtree 0.1.0" in r.stderr, r.stderr
    assert (h1.checkout / VERSION_PY).read_text().endswith("# ddtree 0.1.0\n")
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert "shipping" not in r.stderr and "already applied" in r.stderr  # one round trip when nothing to do


def test_a_first_push_is_one_agent_call_and_a_lost_set_is_shipped_again(hosts, ddeploy, patch_sets, monkeypatch):
    from deployer.locations import cache_dir
    from deployer.transport.agent_client import AgentSession

    calls: list[str] = []
    real_call = AgentSession.call

    def counting(self, op, *args, **kw):
        calls.append(op)
        return real_call(self, op, *args, **kw)

    monkeypatch.setattr(AgentSession, "call", counting)
    shutil.rmtree(cache_dir() / "shipped", ignore_errors=True)  # this client never shipped it
    h1 = hosts.hosts[0]
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 0 and "shipping ddtree 0.1.0" in r.stderr and calls == ["push"], (calls, r.stderr)
    assert ddeploy("rollback", "--host", "h1").code == 0
    shutil.rmtree(h1.checkout / ".git" / "ddeploy" / "sets")  # the host lost it; the client's note is stale
    calls.clear()
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 0 and "shipping ddtree 0.1.0" in r.stderr and calls == ["push", "push"], (calls, r.stderr)
    assert (h1.checkout / VERSION_PY).read_text().endswith("# ddtree 0.1.0\n")
