"""The head start (deployer/transport/head_start.py) on real sshd hosts, through the console
entry point as users run it: a repeated command connects and starts the agent's bootstrap from
the last run's hint before its inventory is read, uses it only for the host it was made for,
never when the inventory changed or the hint is not trusted, and a bad patch set still changes
nothing on the host."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployer.transport import head_start
from deployer.transport.head_start import HINT_FILE, HeadStart, host_record
from processes import alive, wait_until

CONSOLE = [sys.executable, "-c", "from deployer.cli import main; main()"]


class Console:
    """`ddeploy` as a process of its own (so main() may take a head start), with a cache of its
    own, against a one-host inventory whose python logs each start: its pid, the op (the agent's
    argv is `python -S -c BOOTSTRAP OP`) and $MARK (from the host's `env`)."""

    def __init__(self, tmp_path: Path, fleet, session_cache: Path, mark: str = "one", host: str = "h1"):
        self.tmp, self.fleet = tmp_path, fleet
        self.cache = tmp_path / "cache"
        self.cache.mkdir()
        if (session_cache / "base").exists():
            (self.cache / "base").symlink_to(session_cache / "base")
        self.log = tmp_path / "python.log"
        python = tmp_path / "python"
        python.write_text(f'#!/bin/sh\necho "$$ $4 $MARK" >> {self.log}\nexec {sys.executable} "$@"\n')
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        self.inventory = tmp_path / "inventory"
        self.inventory.mkdir()
        self.doc = yaml.safe_load((fleet.inventory_dir / f"{host}.yaml").read_text())
        self.doc["name"] = "h1"  # the tests' one host, whichever fleet host it is
        self.doc["python"] = str(python)
        self.set_mark(mark)

    def set_mark(self, mark: str) -> None:
        self.doc["env"] = {"MARK": mark}
        (self.inventory / "h1.yaml").write_text(yaml.safe_dump(self.doc, sort_keys=False))

    def __call__(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*CONSOLE, "-i", str(self.inventory), *args],
            capture_output=True,
            text=True,
            cwd=self.tmp,
            env={**os.environ, "DDEPLOY_CACHE_DIR": str(self.cache), **env},
            timeout=120,
        )

    def starts(self) -> list[tuple[str, str]]:
        """(op, MARK) of every agent started so far; the log is emptied."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        self.log.write_text("")
        self._pids = [int(line.split()[0]) for line in lines]
        return [tuple(line.split()[1:3]) for line in lines]

    def none_running(self) -> bool:
        """No process from the last `starts()` is still alive."""
        return not [p for p in self._pids if alive(p)]

    @property
    def hints(self) -> Path:
        return self.cache / HINT_FILE


@pytest.fixture
def console(tmp_path, hosts, _isolated_cache):
    return Console(tmp_path, hosts, _isolated_cache)


def _push(console, set_dir):
    return console("push", "--version", str(set_dir), "--host", "h1")


def _rewrite_hint(console, change) -> None:
    doc = json.loads(console.hints.read_text())
    for entry in doc["entries"].values():
        change(entry)
    console.hints.write_text(json.dumps(doc))


@pytest.mark.sshd
def test_a_repeated_push_starts_its_agent_once_from_the_head_start(console, patch_sets):
    first = _push(console, patch_sets["v1"])
    assert first.returncode == 0, first.stderr
    assert console.starts() == [("push", "one")]
    mode = console.hints.stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    (entry,) = json.loads(console.hints.read_text())["entries"].values()
    assert entry["op"] == "push" and [h["name"] for h in entry["hosts"]] == ["h1"]
    assert entry["hosts"][0]["env"] == {"MARK": "one"}
    before = console.hints.read_bytes()

    again = _push(console, patch_sets["v1"])
    assert again.returncode == 0, again.stderr
    assert "already applied" in again.stderr
    assert console.starts() == [("push", "one")]  # the head start's bootstrap ran the agent
    assert console.hints.read_bytes() == before  # nothing changed: not rewritten


@pytest.mark.sshd
def test_a_bad_patch_set_after_a_head_start_changes_nothing(console, patch_sets, hosts, tmp_path):
    import shutil

    bad = tmp_path / "set"
    shutil.copytree(patch_sets["v1"], bad)
    assert _push(console, bad).returncode == 0
    console.starts()
    head = hosts.hosts[0].git("rev-parse", "HEAD")
    patch = sorted(bad.glob("*.patch"))[0]
    patch.write_text(patch.read_text() + "\n")  # its checksum no longer matches

    res = _push(console, bad)
    assert res.returncode == 4, res.stderr  # ExitCode.PATCH_SET
    assert res.stderr.count("\n") == 1 and "ddeploy: error:" in res.stderr
    # The hint matched, so the bootstrap may have started before the set was found bad (the
    # client may also have failed first); it was never given its program and ended without
    # touching the checkout.
    assert console.starts() in ([], [("push", "one")])
    assert wait_until(console.none_running)
    assert hosts.hosts[0].git("rev-parse", "HEAD") == head


@pytest.mark.sshd
def test_a_hint_that_does_not_match_the_host_is_not_used(console, patch_sets):
    assert _push(console, patch_sets["v1"]).returncode == 0
    console.starts()
    _rewrite_hint(console, lambda e: e["hosts"][0]["env"].update(MARK="stale"))  # the files still match

    res = _push(console, patch_sets["v1"])
    assert res.returncode == 0, res.stderr
    assert "already applied" in res.stderr
    started = console.starts()
    # The stale record was connected and its bootstrap started, then closed unused: the agent
    # that did the work is the one started with the inventory's own settings.
    assert sorted(started) == [("push", "one"), ("push", "stale")]
    assert wait_until(console.none_running)
    (entry,) = json.loads(console.hints.read_text())["entries"].values()
    assert entry["hosts"][0]["env"] == {"MARK": "one"}  # the hint is right again


@pytest.mark.sshd
def test_an_edited_inventory_gets_no_head_start(console, patch_sets):
    assert _push(console, patch_sets["v1"]).returncode == 0
    console.starts()
    console.set_mark("two")

    res = _push(console, patch_sets["v1"])
    assert res.returncode == 0, res.stderr
    assert console.starts() == [("push", "two")]  # nothing was started from the old record


@pytest.mark.sshd
@pytest.mark.parametrize("spoil", ["group-writable", "garbage", "other command"])
def test_an_untrusted_or_unusable_hint_is_ignored(console, patch_sets, spoil):
    assert _push(console, patch_sets["v1"]).returncode == 0
    console.starts()
    _rewrite_hint(console, lambda e: e["hosts"][0]["env"].update(MARK="stale"))
    if spoil == "group-writable":
        console.hints.chmod(0o664)
    elif spoil == "garbage":
        console.hints.write_text("{not json")
    res = console("plan", "--version", str(patch_sets["v1"]), "--host", "h1") if spoil == "other command" else None
    res = res or _push(console, patch_sets["v1"])
    assert res.returncode == 0, res.stderr
    assert console.starts() == [("plan" if spoil == "other command" else "push", "one")]


@pytest.mark.sshd
def test_head_start_off(console, patch_sets):
    res = console("push", "--version", str(patch_sets["v1"]), "--host", "h1", DDEPLOY_HEAD_START="0")
    assert res.returncode == 0, res.stderr
    assert not console.hints.exists()


@pytest.mark.sshd
def test_an_unreachable_host_fails_as_without_a_head_start(console, patch_sets, hosts):
    assert _push(console, patch_sets["v1"]).returncode == 0
    hosts.hosts[0].stop()
    try:
        with_head = _push(console, patch_sets["v1"])
        without = console("push", "--version", str(patch_sets["v1"]), "--host", "h1", DDEPLOY_HEAD_START="0")
    finally:
        hosts.hosts[0].start()
    assert with_head.returncode == without.returncode == 5  # ExitCode.CONNECT
    line = [ln for ln in with_head.stderr.splitlines() if ln.startswith("h1 ")]
    assert line == [ln for ln in without.stderr.splitlines() if ln.startswith("h1 ")]


@pytest.mark.sshd
def test_status_gets_a_head_start_too(console, patch_sets):
    assert _push(console, patch_sets["v1"]).returncode == 0
    for _ in range(2):
        status = console("status", "--host", "h1", "--json")
        assert status.returncode == 0, status.stderr
    assert [r["host"] for r in json.loads(status.stdout)] == ["h1"]
    ops = [op for op, _ in console.starts()]
    assert ops == ["push", "status", "status"]
    entries = json.loads(console.hints.read_text())["entries"]
    assert sorted(e["op"] for e in entries.values()) == ["push", "status"]


# ------------------------------------------------------------------ the hint file, without hosts
class _Host:
    """What host_record reads of an inventory.Host."""

    def __init__(self, name="b300", env=None):
        from deployer.inventory import SSHSpec

        self.name, self.ssh, self.source, self.env = name, SSHSpec(host=name), f"/inv/{name}.yaml", env or {}
        self.python, self.is_local = "python3", False


def _head(tmp_path, monkeypatch, argv=("push", "--host", "b300")):
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    inventory = tmp_path / "inv"
    inventory.mkdir(exist_ok=True)
    (inventory / "b300.yaml").write_text("name: b300\n")
    head = HeadStart.begin(list(argv))
    head.inventory_dir = inventory
    return head, inventory


def test_remember_then_match(tmp_path, monkeypatch):
    head, inventory = _head(tmp_path, monkeypatch)
    head.remember("push", [_Host()])
    key, entry = head_start._matching_entry(["push", "--host", "b300"])
    assert entry is not None and entry["op"] == "push" and entry["hosts"] == [host_record(_Host())]
    assert head_start._matching_entry(["push", "--host", "b30"])[1] is None  # another command line
    monkeypatch.setenv("DDEPLOY_SSH_CONFIG", "/elsewhere")
    assert head_start._matching_entry(["push", "--host", "b300"])[1] is None  # another environment
    monkeypatch.delenv("DDEPLOY_SSH_CONFIG")
    (inventory / "extra.yml").write_text("name: x\n")
    assert head_start._matching_entry(["push", "--host", "b300"])[1] is None  # a file was added
    (inventory / "extra.yml").unlink()
    (inventory / "_draft.yaml").write_text("not read by Inventory.load\n")
    assert head_start._matching_entry(["push", "--host", "b300"])[1] is not None


def test_the_hint_file_keeps_the_newest_commands(tmp_path, monkeypatch):
    for i in range(head_start.MAX_ENTRIES + 3):
        head, _ = _head(tmp_path, monkeypatch, argv=("status", "--host", f"h{i}"))
        head.remember("status", [_Host(f"h{i}")])
    entries = json.loads((tmp_path / "cache" / HINT_FILE).read_text())["entries"]
    assert len(entries) == head_start.MAX_ENTRIES
    assert head_start._matching_entry(["status", "--host", "h0"])[1] is None  # the oldest went first
    assert head_start._matching_entry(["status", "--host", f"h{head_start.MAX_ENTRIES + 2}"])[1] is not None


def test_only_fleet_commands_look_for_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    assert HeadStart.begin(["render", "--host", "b300"]) is None
    assert HeadStart.begin(["status", "--host", "b300"]) is not None


def test_local_hosts_are_not_recorded(tmp_path, monkeypatch):
    head, _ = _head(tmp_path, monkeypatch)
    local = _Host("local")
    local.is_local = True
    head.remember("push", [local, _Host()])
    (entry,) = json.loads((tmp_path / "cache" / HINT_FILE).read_text())["entries"].values()
    assert [h["name"] for h in entry["hosts"]] == ["b300"]


def test_the_record_holds_every_ssh_setting():
    from deployer.inventory import SSHSpec

    assert set(SSHSpec.model_fields) == set(head_start.SSH_FIELDS)  # a new setting must be compared too


@pytest.mark.sshd
def test_a_host_behind_a_proxyjump_gets_a_head_start(tmp_path, hosts, _isolated_cache, patch_sets):
    console = Console(tmp_path, hosts, _isolated_cache, host="h2")
    console.doc["ssh"]["host"] = "h2-via-h1"  # the fleet's ssh_config: h2 through h1
    console.set_mark("one")
    for _ in range(2):
        res = _push(console, patch_sets["v1"])
        assert res.returncode == 0, res.stderr
    assert "already applied" in res.stderr
    assert console.starts() == [("push", "one"), ("push", "one")]  # one agent per run
    assert hosts.hosts[1].git("log", "-1", "--format=%s").startswith("ddtree")
    # The head start did go through the jump host: a record it cannot use still shows up there.
    _rewrite_hint(console, lambda e: e["hosts"][0]["env"].update(MARK="stale"))
    assert _push(console, patch_sets["v1"]).returncode == 0
    assert sorted(console.starts()) == [("push", "one"), ("push", "stale")]


@pytest.mark.sshd
def test_a_bootstrap_started_for_another_op_is_abandoned(console, patch_sets):
    assert _push(console, patch_sets["v1"]).returncode == 0
    console.starts()
    _rewrite_hint(console, lambda e: e.update(op="plan"))  # the settings match; the op does not
    res = _push(console, patch_sets["v1"])
    assert res.returncode == 0, res.stderr
    assert "already applied" in res.stderr
    # The bootstrap started for `plan` was closed unused; the one for push did the work.
    assert sorted(console.starts()) == [("plan", "one"), ("push", "one")]
    assert wait_until(console.none_running)
