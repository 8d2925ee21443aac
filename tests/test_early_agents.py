"""EarlyAgents on real sshd hosts: connections opened while the client prepares its request, the
agent started only on `start`, the early agent used by the first call, failures reported where
the session is taken, and nothing left running when the client gives up; the agent's bundle sent
once per host and version, later calls naming its hash."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from deployer.errors import ConnectError, StateError
from deployer.inventory import Inventory
from deployer.transport.agent_client import agent_session
from deployer.transport.early_agents import EarlyAgents
from deployer.transport.protocol import StatusReply
from processes import logging_python, running, starts, wait_until

pytestmark = pytest.mark.sshd


def test_nothing_runs_on_a_host_before_start(hosts, tmp_path):
    h1, log = logging_python(tmp_path, Inventory.load(hosts.inventory_dir).get("h1"))
    with EarlyAgents([h1]) as early:
        session = early.take(h1)  # connected; no agent was started (start was never called)
        assert session is not None and starts(log) == []
        session.conn.close()
    with EarlyAgents([h1]):
        time.sleep(0.5)  # the handshake happens; the client then gives up (a bad patch set)
    assert starts(log) == []


def test_the_first_call_uses_the_agent_started_early(hosts, tmp_path, monkeypatch):
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "0")  # this process's own connections
    h1, log = logging_python(tmp_path, Inventory.load(hosts.inventory_dir).get("h1"))
    with EarlyAgents([h1]) as early:
        early.start("status")
        assert wait_until(lambda: starts(log) == ["status"])  # running before the request exists
        with agent_session(h1, early=early) as agent:
            reply = agent.call("status", {}, StatusReply)
            assert reply.facts.head == hosts.base_commit
            assert starts(log) == ["status"]  # no second agent for that call
            agent.call("status", {}, StatusReply)
            assert starts(log) == ["status", "status"]  # later calls start their own
    assert wait_until(lambda: running(log) == [])


def test_an_agent_never_asked_ends_and_touches_nothing(hosts, tmp_path):
    h1, log = logging_python(tmp_path, Inventory.load(hosts.inventory_dir).get("h1"))
    before = hosts.hosts[0].git("for-each-ref"), hosts.hosts[0].git("status", "--porcelain")
    with EarlyAgents([h1]) as early:
        early.start("push")
        assert wait_until(lambda: starts(log) == ["push"])
    assert wait_until(lambda: running(log) == [])  # it read no request and ended
    assert (hosts.hosts[0].git("for-each-ref"), hosts.hosts[0].git("status", "--porcelain")) == before
    assert not (hosts.hosts[0].checkout / ".git" / "ddeploy").exists()


def test_a_failed_early_connect_is_raised_where_the_session_is_taken(hosts):
    inv = Inventory.load(hosts.inventory_dir)
    hosts.hosts[2].stop()
    h1, h3 = inv.get("h1"), inv.get("h3")
    with EarlyAgents([h1, h3]) as early:
        early.start("status")
        with pytest.raises(ConnectError, match=r"^\[h3\] .*unreachable \(connection refused\)"):
            with agent_session(h3, early=early):
                pass
        with agent_session(h1, early=early) as agent:
            assert agent.call("status", {}, StatusReply).facts.head == hosts.base_commit


def test_local_hosts_and_hosts_not_opened_early_connect_as_usual(hosts):
    inv = Inventory.load(hosts.inventory_dir)
    with EarlyAgents([inv.get("local")]) as early:
        assert early.take(inv.get("local")) is None
        early.start("status")
        with agent_session(inv.get("h2"), early=early) as agent:  # not opened early: its own connect
            assert agent.call("status", {}, StatusReply).facts.head == hosts.base_commit


def test_push_starts_the_agent_only_for_a_verified_set(hosts, cli, patch_sets, tmp_path, monkeypatch):
    """The CLI connects first, starts the agent once the set is verified, and uses it for the
    push; a tampered set never gets an agent started on any host. One agent per command."""
    import shutil

    import yaml

    # A client that never shipped to h1: an earlier test's note that it did would (rightly) cost a
    # second call when the reset host answers NeedShip.
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "0")  # per command: its own connection

    inventory = tmp_path / "inventory"
    inventory.mkdir()
    h1, log = logging_python(tmp_path, Inventory.load(hosts.inventory_dir).get("h1"))
    doc = yaml.safe_load((hosts.inventory_dir / "h1.yaml").read_text())
    (inventory / "h1.yaml").write_text(yaml.safe_dump({**doc, "python": h1.python}))
    tampered = tmp_path / "tampered"
    shutil.copytree(patch_sets["v1"], tampered)
    patch = tampered / "0002-wiring.patch"
    patch.write_text(patch.read_text().replace("# ddtree 0.1.0", "# evil 0.1.0"))

    r = cli("push", "--host", "h1", "--version", str(tampered), inventory=inventory)
    assert r.code == 4 and "sha256" in r.stderr
    time.sleep(0.5)
    assert starts(log) == [] and not (hosts.hosts[0].checkout / ".git" / "ddeploy").exists()

    r = cli("push", "--host", "h1", "--version", str(patch_sets["v1"]), inventory=inventory)
    assert r.code == 0 and "applied ddtree 0.1.0" in r.stderr, r.stderr
    assert starts(log) == ["push"]  # one agent, started before the request, did the push
    r = cli("push", "--host", "h1", "--version", str(patch_sets["v1"]), "--dry-run", inventory=inventory)
    assert r.code == 0 and starts(log) == ["push", "plan"]
    r = cli("status", "--host", "h1", inventory=inventory)  # status and rollback start theirs early too
    assert r.code == 0 and "ddtree 0.1.0" in r.stderr and starts(log) == ["push", "plan", "status"]
    r = cli("rollback", "--host", "h1", inventory=inventory)
    assert r.code == 0 and starts(log) == ["push", "plan", "status", "rollback"], r.stderr
    assert hosts.hosts[0].git("rev-parse", "HEAD") == hosts.base_commit


def metered(monkeypatch) -> dict:
    """Bytes the client writes on each SSH channel (the remote command's stdin), in order."""
    import paramiko

    sent: dict[paramiko.Channel, int] = {}  # by the channel itself: ids start again on each connection
    real = paramiko.Channel.sendall

    def sendall(chan, data):
        sent[chan] = sent.get(chan, 0) + len(data)
        return real(chan, data)

    monkeypatch.setattr(paramiko.Channel, "sendall", sendall)
    return sent


def test_the_agent_crosses_once_per_version_and_later_calls_name_its_hash(hosts, tmp_path, monkeypatch):
    """The first call to a host sends the bundle and the host keeps it under its hash; later calls
    (new connections) send only the request. A host whose copy is damaged answers NeedAgent and gets
    the bundle again on the same connection; a changed agent is a new hash, sent once again."""
    from deployer.transport import agent_bundle, agent_client

    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path / "client-cache"))
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "0")  # metered: this process's own connections
    sent = metered(monkeypatch)
    h1, log = logging_python(tmp_path, Inventory.load(hosts.inventory_dir).get("h1"))
    wrapper = h1.python  # the host keeps its agents in a cache of this test's own
    Path(wrapper).write_text(Path(wrapper).read_text().replace("exec ", f"XDG_CACHE_HOME={tmp_path}/host exec ", 1))
    kept_dir = tmp_path / "host" / "ddeploy" / "agent"

    def status() -> list[int]:
        before = len(sent)
        with agent_session(h1) as agent:
            assert agent.call("status", {}, StatusReply).facts.head == hosts.base_commit
        return list(sent.values())[before:]

    [first] = status()
    [entry] = kept_dir.iterdir()
    assert first > 50_000 and entry.name.startswith(agent_client.agent_digest() + "-")
    assert status() == status() and max(status()) < 2_000  # the request and the bundle's hash only
    entry.write_bytes(entry.read_bytes()[:-100])  # a cut-off copy: never run
    damaged = status()
    assert len(damaged) == 2 and damaged[0] < 2_000 < 50_000 < damaged[1], damaged  # NeedAgent, then sent
    assert max(status()) < 2_000 and [e.name for e in kept_dir.iterdir()] == [entry.name]

    changed = agent_client.agent_bundle().replace(b"does not exist on this host", b"is not on this host")
    digest = hashlib.sha256(changed).hexdigest()
    for module in (agent_bundle, agent_client):  # the bundle's module, and the session's names for it
        monkeypatch.setattr(module, "agent_bundle", lambda: changed)
        monkeypatch.setattr(module, "agent_digest", lambda: digest)
    monkeypatch.setattr(agent_bundle, "_bundle_head", lambda: b"%d\n" % len(changed) + changed)
    with agent_session(h1.model_copy(update={"checkout": "/nonexistent"})) as agent:
        with pytest.raises(StateError, match="is not on this host"):  # the changed agent ran
            agent.call("status", {}, StatusReply)
    assert list(sent.values())[-1] > 50_000 and len(list(kept_dir.iterdir())) == 2
    assert max(status()) < 2_000 and len(starts(log)) == 9
