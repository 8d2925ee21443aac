"""Fleet fan-out without hosts: bounded parallelism, results as data, --fail-fast, exit codes."""

from __future__ import annotations

import io
import threading
import time

import pytest

from deployer.cli.progress import Progress
from deployer.cli.views import result_json, summary, summary_table
from deployer.errors import ConnectError, DriftError, HostsFailed
from deployer.inventory import local_host
from deployer.ops.fleet import raise_if_failed, run_fleet
from deployer.ops.outcome import Outcome


def describe(text):
    return text


def fake_hosts(n):
    return [local_host().model_copy(update={"name": f"n{i}"}) for i in range(n)]


def test_parallelism_is_bounded_and_results_keep_inventory_order():
    active, peak, lock = [0], [0], threading.Lock()

    def op(host, say):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        say("working")
        with lock:
            active[0] -= 1
        return Outcome(f"done {host.name}")

    out = io.StringIO()
    results = run_fleet(fake_hosts(7), op, parallel=3, events=Progress(7, lambda r: summary(r, describe), out))
    assert peak[0] == 3
    assert [r.host for r in results] == [f"n{i}" for i in range(7)]
    assert "[n4] working" in out.getvalue()


def test_one_failure_never_hides_the_others():
    def op(host, say):
        if host.name == "n1":
            raise ConnectError("unreachable", host=host.name)
        if host.name == "n2":
            raise ValueError("bug")
        return Outcome("fine", changed=True)

    results = run_fleet(
        fake_hosts(4), op, parallel=2, events=Progress(4, lambda r: summary(r, describe), io.StringIO())
    )
    assert [r.status for r in results] == ["ok", "failed", "failed", "ok"]
    assert result_json(results[1])["error"] == {"type": "ConnectError", "message": "[n1] unreachable", "exit_code": 5}
    assert "internal error: ValueError: bug" in results[2].message
    table = summary_table(results, describe)
    assert "n1    FAILED: unreachable" in table and "n3    ok: fine" in table
    with pytest.raises(HostsFailed, match="2 of 4 host\\(s\\) failed: n1, n2") as exc:
        raise_if_failed(results)
    assert exc.value.exit_code == 1  # mixed kinds of failure


def test_fail_fast_and_single_kind_exit_code():
    def op(host, say):
        raise DriftError("hand edits", host=host.name)

    results = run_fleet(
        fake_hosts(3), op, parallel=1, fail_fast=True, events=Progress(3, lambda r: summary(r, describe), io.StringIO())
    )
    assert [r.status for r in results] == ["failed", "skipped", "skipped"]
    with pytest.raises(HostsFailed) as exc:
        raise_if_failed(results)
    assert exc.value.exit_code == DriftError.exit_code
