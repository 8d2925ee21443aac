"""The agent's `drain` and `health` operations, through their client wrappers
(deployer/ops/serving_checks.py), on an OpenSSH test host serving the SGLang stand-in of
tests/standin_sglang: drain reads SGLang's request gauges from /metrics until they are 0 (or its
timeout passes), health reads /health_generate per unit; with nothing running both refuse. And the
stand-in's release hooks: a checkout with `python/sglang/standin_diverge` answers one token off.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from processes import free_port, wait_until
from test_bench_interrupt import STAND_IN, _launch_args, _stand_in_pids, marks  # noqa: F401

from deployer.agent.serving_checks import gauge_totals
from deployer.errors import RemoteCommandError, StateError
from deployer.inventory import Inventory
from deployer.ops.serving_checks import drain, health
from deployer.transport.agent_client import agent_session

pytestmark = pytest.mark.sshd

PROMPT = [5, 7, 11]


@pytest.fixture
def h1(hosts):
    return Inventory.load(hosts.inventory_dir).get("h1")


def serve(hosts, cli, marks, **sets: str) -> str:
    """Launch the stand-in (config ddtree) on h1 and wait until it serves; its URL."""
    port = free_port()
    args = _launch_args("h1", marks, "", port)
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    r = cli(*args, inventory=hosts.inventory_dir)
    assert r.code == 0, r.stderr
    return f"http://127.0.0.1:{port}"


def running_requests(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:  # noqa: S310 - loopback
        return gauge_totals(resp.read().decode()).get("sglang:num_running_reqs", 0)


def generate(url: str, tokens: int = 8) -> dict:
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens}}).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url + "/generate", data=body, headers=headers)  # noqa: S310 - loopback
    with urllib.request.urlopen(request, timeout=90) as resp:  # noqa: S310 - loopback
        return json.loads(resp.read())


def in_flight(url: str) -> threading.Thread:
    """A /generate that the server holds for 60 s (STANDIN_SLOW_GENERATE), from a thread; the
    server's stop at the test's end cuts it."""

    def send() -> None:
        try:
            generate(url)
        except OSError:
            pass

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    assert wait_until(lambda: running_requests(url) == 1, 10), "the request never reached the server"
    return thread


def test_drain_of_an_idle_launch_returns_drained_at_once(hosts, cli, marks, h1):
    serve(hosts, cli, marks)
    said = []
    with agent_session(h1) as agent:
        reply = drain(agent, 30.0, said.append)
    assert reply.drained is True and (reply.running, reply.queued) == (0, 0)
    assert reply.waited_s < 1.0 and said == []


def test_drain_with_a_request_in_flight_times_out_not_drained_and_says_what_it_waits_for(hosts, cli, marks, h1):
    url = serve(hosts, cli, marks, **{"env.STANDIN_SLOW_GENERATE": "ddtree"})
    in_flight(url)
    said = []
    started = time.monotonic()
    with agent_session(h1) as agent:
        reply = drain(agent, 2.0, said.append, poll=0.5)
    assert reply.drained is False and (reply.running, reply.queued) == (1, 0)
    assert 2.0 <= reply.waited_s < 4.0 and time.monotonic() - started < 15
    assert any(line.endswith(": 1 running, 0 queued; waiting up to 2 s") for line in said), said
    assert running_requests(url) == 1  # a drain only waits: the request still runs


def test_drain_of_a_server_without_metrics_fails_naming_the_unit_and_the_fix(hosts, cli, marks, h1):
    url = serve(hosts, cli, marks, enable_metrics="false")
    with agent_session(h1) as agent, pytest.raises(RemoteCommandError) as exc:
        drain(agent, 5.0, lambda line: None)
    message = str(exc.value)
    assert f"at {url}/metrics" in message and "h1-tp8" in message, message
    assert "launch with --enable-metrics, or drain it by hand" in message


@pytest.mark.parametrize("unhealthy", ["", "ddtree"], ids=["healthy", "unhealthy"])
def test_health_reports_each_units_health_generate_status(hosts, cli, marks, h1, unhealthy):
    url = serve(hosts, cli, marks, **{"env.STANDIN_UNHEALTHY": unhealthy})
    with agent_session(h1) as agent:
        (unit,) = health(agent, timeout=10.0).units
    assert (unit.name, unit.url, unit.error) == ("h1-tp8", url, None)
    assert unit.status == (503 if unhealthy else 200)


def test_drain_and_health_with_nothing_running_are_refused(hosts, cli, marks, h1):
    serve(hosts, cli, marks)
    assert cli("stop", "--host", "h1", "--grace", "2", inventory=hosts.inventory_dir).code == 0
    with agent_session(h1) as agent:
        with pytest.raises(StateError, match="the last launch .tp8. is not running on h1; run `ddeploy launch"):
            drain(agent, 5.0, lambda line: None)
        with pytest.raises(StateError, match="is not running on h1"):
            health(agent)


def test_status_shows_the_last_launch_running_then_stopped(hosts, cli, marks, h1):
    """`status` finds what a launch left (the brief: `status` and `stop` must find a launch)."""
    inv = hosts.inventory_dir

    def launch_of() -> dict:
        out = json.loads(cli("status", "--host", "h1", "--json", inventory=inv).stdout)
        return out[0]["data"]["launch"]

    serve(hosts, cli, marks)
    now = launch_of()
    assert (now["topology"], now["state"], now["units"], now["alive"]) == ("tp8", "running", 1, 1)
    table = cli("status", "--host", "h1", inventory=inv).stderr
    assert f"tp8 running (1 unit, since {now['started_at']})" in table
    assert cli("stop", "--host", "h1", "--grace", "2", inventory=inv).code == 0
    then = launch_of()
    assert (then["id"], then["state"], then["alive"]) == (now["id"], "stopped", 0)
    assert f"tp8 stopped ({then['stopped_at']})" in cli("status", "--host", "h1", inventory=inv).stderr


def test_drain_with_nothing_ever_launched_is_refused(hosts, h1):
    (hosts.host("h1").cache_dir / "launches" / "launch.json").unlink(missing_ok=True)
    with agent_session(h1) as agent, pytest.raises(StateError, match="nothing was launched on h1"):
        drain(agent, 5.0, lambda line: None)


@pytest.mark.parametrize("release", ["", "standin_diverge", "standin_accept"])
def test_a_release_in_the_checkout_changes_what_the_stand_in_generates(hosts, cli, marks, release):
    checkout = hosts.host("h1").checkout
    marker = checkout / "python" / "sglang" / (release or "no-release-file")
    if release:
        marker.write_text("2.0\n")  # the accept length for standin_accept; any text for diverge
    try:
        url = serve(hosts, cli, marks, **{"env.PYTHONPATH": f"{STAND_IN}:{checkout}/python"})
        reply = generate(url, tokens=8)
    finally:
        marker.unlink(missing_ok=True)  # the next test's `hosts` resets the checkout (git clean) anyway
    expected = [(sum(PROMPT) + i) % 1000 for i in range(8)]
    if release == "standin_diverge":
        expected[3] += 1
    assert reply["output_ids"] == expected
    assert reply["meta_info"]["spec_verify_ct"] == (4 if release == "standin_accept" else 8)


def test_the_request_gauges_sum_the_schedulers_and_skip_the_priority_breakdown():
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{dp_rank="0",model_name="m",priority=""} 2.0\n'
        'sglang:num_running_reqs{dp_rank="0",model_name="m",priority="1"} 2.0\n'
        'sglang:num_running_reqs{dp_rank="1",model_name="m",priority=""} 3.0\n'
        'sglang:num_queue_reqs{dp_rank="0",model_name="m",priority=""} 1.0\n'
        "sglang:num_queue_reqs_total 7\n"
    )
    assert gauge_totals(text) == {"sglang:num_running_reqs": 5, "sglang:num_queue_reqs": 1}
    assert gauge_totals('sglang:spec_verify_calls_total{model_name="x"} 3\n') == {}
