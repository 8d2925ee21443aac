"""The overlay developer's loop on a real sshd host: edit the overlay, `test --remote --overlay`
ships it as a dev snapshot and runs its tests there, a second run pushes nothing, and a release
pushed afterwards replaces the snapshot."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import yaml

from deployer.patchset.export import export_patch_set
from patchset_fixtures import SMALL_CONCERNS, make_overlay, patches_root  # noqa: F401

pytestmark = pytest.mark.sshd

PROBE = "python/ddtree_probe/__init__.py"
# The host's run leaves the module's MARK where the test can read it: proof of the bytes it ran.
PROBE_TEST = """from pathlib import Path

import ddtree_probe


def test_probe_runs_from_the_patched_checkout():
    checkout = Path.cwd().resolve()
    assert Path(ddtree_probe.__file__).resolve().is_relative_to(checkout / "python")
    (checkout / ".git" / "ddeploy" / "probe-mark").write_text(ddtree_probe.MARK)
"""


def state_of(host) -> dict:
    return json.loads(host.git("cat-file", "blob", "refs/ddeploy/state:state.json"))


def mark_overlay(tmp_path, mark: str):
    concerns = {**SMALL_CONCERNS, "concerns": [c for c in SMALL_CONCERNS["concerns"] if c["id"] != "retrieve"]}
    overlay = make_overlay(tmp_path / "overlay", concerns=concerns)
    (overlay / PROBE).write_text(f'MARK = "{mark}"\n')
    (overlay / "test/srt/ddtree/test_probe.py").write_text(PROBE_TEST)
    return overlay


@pytest.fixture
def k1(cli, python_hosts):
    yield python_hosts.hosts[0]
    cli("rollback", "--host", "k1", "--force", inventory=python_hosts.inventory_dir)  # pristine again


def test_edit_test_remote_again_then_a_release_replaces_the_snapshot(cli, python_hosts, k1, patches_root, tmp_path):
    overlay = mark_overlay(tmp_path, "released")
    export_patch_set(overlay, patches_root, version="0.3.0", date="2026-11-29")
    (overlay / PROBE).write_text('MARK = "edited"\n')  # the developer's edit, not released

    def dev_test():
        args = ("test", "--remote", "--host", "k1", "--overlay", str(overlay), "-k", "probe")
        return cli(*args, "--report-dir", str(tmp_path / "reports"), "--json", inventory=python_hosts.inventory_dir)

    first = dev_test()
    assert first.code == 0, first.stderr
    applied = state_of(k1)["applied"]
    version = applied["version"]
    assert version.startswith("0.3.0+dev.") and applied["dev"] is True
    assert f"[k1] shipping ddtree dev snapshot {version} (2 patches)" in first.stderr
    assert (k1.checkout / ".git/ddeploy/probe-mark").read_text() == "edited"  # the host ran the edit
    assert (k1.checkout / PROBE).read_text() == 'MARK = "edited"\n'
    [report] = (tmp_path / "reports" / "k1").glob("*.xml")
    suite = ET.parse(report).getroot().find("testsuite")  # noqa: S314 - our own pytest's report
    assert (suite.get("tests"), suite.get("failures")) == ("1", "0")
    assert json.loads(first.stdout)[0]["changed"] is True and state_of(k1)["tests"]["version"] == version

    (k1.checkout / ".git/ddeploy/probe-mark").unlink()
    second = dev_test()
    assert second.code == 0, second.stderr
    assert f"ddtree {version} is already applied; nothing to do" in second.stderr and "shipping" not in second.stderr
    assert state_of(k1)["applied"]["at"] == applied["at"] and json.loads(second.stdout)[0]["changed"] is False
    assert (k1.checkout / ".git/ddeploy/probe-mark").read_text() == "edited"  # the tests ran again

    status = cli("status", "--host", "k1", inventory=python_hosts.inventory_dir)
    assert f"ddtree dev snapshot {version}" in status.stderr
    log = cli("log", "--host", "k1", inventory=python_hosts.inventory_dir)
    assert f"push ddtree {version} (dev snapshot)" in log.stderr

    release = cli("push", "--host", "k1", "--version", "0.3.0", inventory=python_hosts.inventory_dir)
    assert release.code == 0, release.stderr
    assert f"applied ddtree 0.3.0 over {version}" in release.stderr
    applied = state_of(k1)["applied"]
    assert (applied["version"], applied["dev"]) == ("0.3.0", False)
    assert (k1.checkout / PROBE).read_text() == 'MARK = "released"\n' and k1.git("status", "--porcelain") == ""
    assert sorted(d.name for d in patches_root.iterdir()) == ["0.3.0"]  # the snapshot never became a release


def test_a_second_edit_is_a_new_snapshot_replacing_the_first(cli, python_hosts, k1, patches_root, tmp_path):
    overlay = mark_overlay(tmp_path, "one")
    push = ("push", "--host", "k1", "--overlay", str(overlay), "--json")
    r = cli(*push, inventory=python_hosts.inventory_dir)
    assert r.code == 0, r.stderr
    one = state_of(k1)["applied"]["version"]
    assert one.startswith("0.0.0+dev.")  # nothing released under this patches root
    (overlay / PROBE).write_text('MARK = "two"\n')
    plan = cli(
        "plan", "--host", "k1", "--overlay", str(overlay), "--diff", "--json", inventory=python_hosts.inventory_dir
    )
    assert plan.code == 0, plan.stderr
    diff = json.loads(plan.stdout)[0]["data"]["diff"]
    assert diff["files"] == [PROBE] and '-MARK = "one"\n+MARK = "two"\n' in diff["text"]
    r = cli(*push, inventory=python_hosts.inventory_dir)
    assert r.code == 0, r.stderr
    two = state_of(k1)["applied"]["version"]
    assert two != one and f"applied ddtree dev snapshot {two} over {one}" in r.stderr
    assert (k1.checkout / PROBE).read_text() == 'MARK = "two"\n'
    assert yaml.safe_load(k1.git("cat-file", "blob", "refs/ddeploy/state:state.json"))["last"]["dev"] is True


def test_the_host_keeps_only_the_newest_dev_snapshots_patches(cli, python_hosts, k1, patches_root, tmp_path):
    overlay = mark_overlay(tmp_path, "m0")
    sets = k1.checkout / ".git/ddeploy/sets"
    released = sorted(d.name for d in sets.iterdir() if "+dev." not in d.name) if sets.is_dir() else []
    shipped = []
    for i in range(5):
        (overlay / PROBE).write_text(f'MARK = "m{i}"\n')
        r = cli("push", "--host", "k1", "--overlay", str(overlay), inventory=python_hosts.inventory_dir)
        assert r.code == 0, r.stderr
        shipped.append(state_of(k1)["applied"]["version"])
    kept = sorted(d.name for d in sets.iterdir() if "+dev." in d.name)
    assert len(kept) == 3 and all(any(v in d for d in kept) for v in shipped[-3:]), kept
    assert sorted(d.name for d in sets.iterdir() if "+dev." not in d.name) == released
    # Rollback to an older snapshot does not need its patch files: it returns to the recorded commit.
    r = cli("rollback", "--host", "k1", "--to", shipped[0], inventory=python_hosts.inventory_dir)
    assert r.code == 0, r.stderr
    assert (k1.checkout / PROBE).read_text() == 'MARK = "m0"\n'


def test_watch_runs_again_after_each_save_until_ctrl_c(cli, python_hosts, k1, patches_root, tmp_path, monkeypatch):
    import deployer.patchset.snapshot as snapshot

    overlay = mark_overlay(tmp_path, "first")
    saves = iter(['MARK = "second"\n', KeyboardInterrupt])

    def developer(_seconds: float) -> None:  # what happens while ddeploy polls: a save, then Ctrl-C
        step = next(saves)
        if step is KeyboardInterrupt:
            raise KeyboardInterrupt
        (overlay / PROBE).write_text(step)

    monkeypatch.setattr(snapshot, "sleep", developer)  # only the overlay poll's sleep
    args = ("test", "--remote", "--host", "k1", "--overlay", str(overlay), "-k", "probe", "--watch")
    r = cli(*args, "--report-dir", str(tmp_path / "reports"), inventory=python_hosts.inventory_dir)
    assert r.code == 0, r.stderr
    assert r.stderr.count("[k1] shipping ddtree dev snapshot") == 2 and r.stderr.count("[k1] 1 passed") == 2
    assert r.stderr.count(f"watching {overlay} for changes (Ctrl-C stops)") == 2 and "stopped watching" in r.stderr
    assert (k1.checkout / ".git/ddeploy/probe-mark").read_text() == "second"  # the second round ran the save
    assert len(list((tmp_path / "reports" / "k1").glob("*.xml"))) == 2


def test_watch_needs_remote_and_overlay(cli, tmp_path):
    r = cli("test", "--remote", "--host", "k1", "--watch")
    assert r.code == 2 and "--watch repeats `test --remote --overlay` on every change" in r.stderr


def logged_inventory(python_hosts, tmp_path):
    """k1 with a `python` that logs each agent's op (argv `-S -c BOOTSTRAP OP DIGEST`), then runs the real one."""
    inventory, log = tmp_path / "inventory", tmp_path / "agents.log"
    inventory.mkdir()
    doc = yaml.safe_load((python_hosts.inventory_dir / "k1.yaml").read_text())
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = -S ] && echo "$4" >> {log}\nexec {doc["python"]} "$@"\n')
    wrapper.chmod(0o755)
    (inventory / "k1.yaml").write_text(yaml.safe_dump({**doc, "python": str(wrapper)}))
    return inventory, log


def test_a_dev_round_is_one_agent_call_that_pushes_then_tests(cli, python_hosts, k1, tmp_path):
    """Each `test --remote --overlay` starts one agent on the host: it pushes the snapshot and runs
    its tests in the same call (no second process, login shell or round trip for the tests)."""
    overlay = mark_overlay(tmp_path, "one")
    inventory, log = logged_inventory(python_hosts, tmp_path)
    pycache = k1.checkout / ".git/ddeploy/pycache"
    compiled = []  # per round: {the test module's .pyc: its mtime}
    for n in (1, 2):
        mark = f"round {n} of {tmp_path.name}"  # a snapshot never shipped before (no NeedShip call)
        (overlay / PROBE).write_text(f'MARK = "{mark}"\n')
        r = cli("test", "--remote", "--host", "k1", "--overlay", str(overlay), "-k", "probe", inventory=inventory)
        assert r.code == 0 and "1 passed" in r.stderr, r.stderr
        assert (k1.checkout / ".git/ddeploy/probe-mark").read_text() == mark
        assert log.read_text().split() == ["test"] * n
        compiled.append({p: p.stat().st_mtime_ns for p in pycache.rglob("test_probe.*.pyc")})
    assert compiled[0] and compiled[1] == compiled[0]  # unchanged by the round: its bytecode was kept


def test_a_push_drops_the_bytecode_of_what_it_rewrites(tmp_path):
    """Python keeps a .pyc while its source's mtime (whole seconds) and size match: a one-character
    edit pushed within the second of the last test run would run the old code. A push drops the
    bytecode of the files it switches (agent/bytecode.py); shown here with the same mtime forced."""
    import os
    import subprocess
    import sys

    from deployer.agent.bytecode import drop_bytecode, pycache_dir
    from deployer.agent.repo import Repo

    checkout = tmp_path / "co"
    (checkout / ".git").mkdir(parents=True)
    repo = Repo(str(checkout))
    source = checkout / "probe_mod.py"
    env = {**os.environ, "PYTHONPYCACHEPREFIX": pycache_dir(repo)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    def run() -> str:
        argv = [sys.executable, "-c", "import probe_mod; print(probe_mod.MARK)"]
        return subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, check=True).stdout.strip()

    source.write_text('MARK = "round 1"\n')
    os.utime(source, (1_700_000_000, 1_700_000_000))
    assert run() == "round 1"
    source.write_text('MARK = "round 2"\n')  # same size, and the same second:
    os.utime(source, (1_700_000_000, 1_700_000_000))
    assert run() == "round 1"  # what Python does on its own: the old code
    drop_bytecode(repo, ["probe_mod.py", "README.md"])
    assert run() == "round 2"


def test_a_switch_drops_only_the_bytecode_of_files_whose_content_changed(tmp_path):
    """A push or rollback drops the bytecode of the files whose content it changed (agent/bytecode.py:
    contents before the switch, drop_changed after it); a file rewritten with the same content,
    or left alone, keeps its .pyc (it is still right: Python checks mtime and size)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from deployer.agent.bytecode import contents, drop_changed, pycache_dir
    from deployer.agent.repo import Repo

    checkout = tmp_path / "co"
    (checkout / ".git").mkdir(parents=True)
    repo = Repo(str(checkout))
    env = {**os.environ, "PYTHONPYCACHEPREFIX": pycache_dir(repo)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for name in ("edited", "rewritten", "left"):
        (checkout / f"{name}.py").write_text(f'MARK = "{name} 1"\n')
        os.utime(checkout / f"{name}.py", (1_700_000_000, 1_700_000_000))
    argv = [sys.executable, "-c", "import edited, rewritten, left; print(edited.MARK)"]
    assert subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True).stdout == "edited 1\n"
    mirror = Path(pycache_dir(repo)) / str(checkout).lstrip("/")  # the prefix mirrors absolute paths
    pyc = {p.name.split(".")[0]: p for p in mirror.glob("*.pyc")}
    assert sorted(pyc) == ["edited", "left", "rewritten"]

    before = contents(repo, ["edited.py", "rewritten.py", "left.py", "new.py", "notes.md"])
    (checkout / "edited.py").write_text('MARK = "edited 2"\n')  # same size, same second: Python alone
    os.utime(checkout / "edited.py", (1_700_000_000, 1_700_000_000))  # would run the old code
    (checkout / "rewritten.py").write_text('MARK = "rewritten 1"\n')  # the same content again
    (checkout / "new.py").write_text("")
    drop_changed(repo, before)
    assert not pyc["edited"].exists() and pyc["rewritten"].exists() and pyc["left"].exists()
    assert subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True).stdout == "edited 2\n"
