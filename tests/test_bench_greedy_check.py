"""`ddeploy bench --compare`'s greedy check on an OpenSSH test host, with the SGLang stand-ins of
tests/standin_sglang: a tree whose completions equal the baseline's passes; one that answers a
single token differently (`STANDIN_DIVERGE`, as a tree that verifies with a wrong mask would)
fails the command with exit 12 naming the prompt and the token, prints the table, saves the
result, and leaves the original launch serving and recorded.

The real server's failing greedy check (a tree mask shifted on purpose) is the overlay's engine
tests' control; here a stand-in makes the deploy tool's side of it cheap to prove."""

from __future__ import annotations

import json

import pytest

from processes import alive, free_port
from test_bench_interrupt import _healthy_config, _launch_args, _stand_in_pids, launches_dir, marks  # noqa: F401
from test_launch_lifecycle import _record

pytestmark = pytest.mark.sshd

BENCH = ("--requests", "4", "--concurrency", "2", "--input-len", "8", "--output-len", "16")


@pytest.mark.parametrize("diverging", ["", "ddtree"], ids=["equal", "ddtree-diverges"])
def test_the_greedy_check_compares_every_probe_token_and_a_failure_keeps_the_launch(hosts, cli, marks, diverging):
    launch_dir = launches_dir(hosts, "h1")
    port = free_port()
    args = [*_launch_args("h1", marks, "", port), "--set", f"env.STANDIN_DIVERGE={diverging}"]
    r = cli(*args, inventory=hosts.inventory_dir)
    assert r.code == 0, r.stderr
    pid = _record(launch_dir)["units"][0]["pid"]

    r = cli("bench", "--host", "h1", "--compare", "linear", "--yes", *BENCH, inventory=hosts.inventory_dir)
    stored = json.loads(cli("status", "--host", "h1", "--json", inventory=hosts.inventory_dir).stdout)
    greedy = stored[0]["data"]["bench"]["greedy"]
    if not diverging:
        assert r.code == 0, r.stderr
        assert "ddtree equals linear token for token" in r.stdout
        assert greedy["equal"] is True and greedy["difference"] is None
    else:
        assert r.code == 12, r.stderr
        assert "greedy check failed: ddtree's completion of probe prompt 0" in r.stderr
        assert "differs from linear's at output token 3" in r.stderr
        assert "greedy check: FAILED on probe prompt 0 at output token 3" in r.stdout  # the table too
        assert greedy["equal"] is False
        assert stored[0]["data"]["bench"]["configs"][0]["greedy_equal"] is False
        difference = greedy["difference"]
        assert difference["prompt"] == 0 and difference["position"] == 3
        assert int(difference["got"]) == (int(difference["baseline"]) + 1) % 1000
    # either way the original launch serves again, recorded, and nothing else runs
    record = _record(launch_dir)
    assert record["state"] == "running" and record["topology"] == "tp8", record
    restarted = record["units"][0]["pid"]
    assert alive(restarted) and _healthy_config(f"http://127.0.0.1:{port}") == "ddtree"
    assert [p for p in _stand_in_pids(marks) if alive(p)] == [restarted], (pid, restarted)
