"""Host state record (refs/ddeploy/state) and the checkout lock, on a real sshd host."""

from __future__ import annotations

import json

import pytest

from deployer.connection import open_connection
from deployer.errors import LockError, StateError
from deployer.inventory import Inventory
from deployer.lock import acquire_lock, held_lock, read_lock, release_lock
from deployer.state import STATE_REF, read_state, state_history, update_state

pytestmark = pytest.mark.sshd


def test_sections_are_recorded_as_a_commit_chain(hosts):
    host = Inventory.load(hosts.inventory_dir).get("h1")
    with open_connection(host) as conn:
        assert read_state(conn, host)["applied"] is None
        update_state(conn, host, "builds", {"sm_120": {"ok": True}}, message="build sm_120")
        update_state(conn, host, "tests", {"ok": False, "passed": 1}, message="test run")
        state = read_state(conn, host)
        assert state["builds"] == {"sm_120": {"ok": True}} and state["tests"]["passed"] == 1
        assert [e["message"] for e in state_history(conn, host)] == ["test run", "build sm_120"]
        with pytest.raises(StateError, match="belongs to the deploy engine"):
            update_state(conn, host, "applied", {}, message="x")
    h1 = hosts.hosts[0]
    assert json.loads(h1.git("cat-file", "blob", f"{STATE_REF}:state.json"))["tests"]["ok"] is False
    assert h1.git("rev-parse", f"{STATE_REF}~1^{{tree}}") != h1.git("rev-parse", f"{STATE_REF}^{{tree}}")
    assert h1.git("status", "--porcelain") == ""  # the work tree is untouched


def test_lock_is_exclusive_and_names_its_holder(hosts):
    host = Inventory.load(hosts.inventory_dir).get("h2")
    with open_connection(host) as conn:
        with held_lock(conn, host, "build sm_103"):
            assert read_lock(conn, host)["command"] == "build sm_103"
            with pytest.raises(LockError, match=r"\[h2\] checkout .* is locked by .*running `build sm_103`"):
                acquire_lock(conn, host, "push")
        assert read_lock(conn, host) is None
        assert release_lock(conn, host) is False
