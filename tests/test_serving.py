"""`ddeploy launch --wait` and `ddeploy bench` against real SGLang servers on CPU: the `local`
host and an OpenSSH test host, both serving the `cpu-tiny` profile (the overlay's CPU engine
harness, tiny models) from a checkout the newest release was pushed onto.

The local run is the users' configuration class scaled down: a DeepSeek-V3-architecture target
(MLA + MoE) at TP 2 whose draft a tree must beat linear DFlash on. The test host runs the Llama
models at TP 1 (a cheaper start) for the failure paths: a crash at start, a start that outlives
--wait-timeout, a server that dies during the run, a host whose python cannot run SGLang's
benchmark client. A failing greedy check is `test_bench_greedy_check.py`'s (the stand-in
server), and a tree that verifies with a corrupted mask is the overlay engine tests' control.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from host_env import variant_inventory
from processes import alive, free_port

pytestmark = pytest.mark.slow

SMALL = ("--requests", "8", "--concurrency", "4", "--input-len", "16", "--output-len", "32")
LLAMA_TP1 = ("--set", "cpu_model_arch=llama", "--set", "tp_size=1")


# launch dir -> where the agent keeps that host's launch record (its cache's launches/)
_RECORDS: dict[Path, Path] = {}


def _record(launch_dir: Path) -> dict:
    return json.loads((_RECORDS[launch_dir] / "launch.json").read_text())


def _pid(launch_dir: Path) -> int:
    return _record(launch_dir)["units"][0]["pid"]


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.fixture
def local_launch_dir(cli, _isolated_cache):
    """The local host's launch dir; whatever a test left running there is stopped after it."""
    launch_dir = _isolated_cache / "local" / "ddeploy-launch"
    _RECORDS[launch_dir] = _isolated_cache / "launches"
    yield launch_dir
    if (_RECORDS[launch_dir] / "launch.json").exists():
        cli("stop", "--host", "local", "--grace", "5")


def test_local_cpu_tiny_serves_ddtree_and_beats_linear_dflash(cli, local_launch_dir):
    launch_dir = local_launch_dir
    port = ("--set", f"port={free_port()}")
    assert cli("push", "--host", "local").code == 0

    r = cli("launch", "--host", "local", "-t", "cpu-tiny", "--wait", *port)
    assert r.code == 0, r.stderr
    assert (
        "local-cpu-tiny serves cpu-tiny: DFLASH + DDTree (budget 14, top-K 2, verify width 15), "
        "attention torch_native, TP 2"
    ) in r.stderr
    record = _record(launch_dir)
    assert record["state"] == "running" and record["serving"][0]["config"] == "ddtree"
    first_pid = _pid(launch_dir)

    # --compare restarts the server: refused without --yes, the server untouched.
    r = cli("bench", "--host", "local", "--compare", "linear", *SMALL)
    assert r.code == 2 and "pass --yes" in r.stderr, r.stderr
    r = cli("bench", "--host", "local", "--topology", "tp8", *SMALL)
    assert r.code == 7 and "serves topology cpu-tiny, not tp8" in r.stderr, r.stderr
    assert alive(first_pid) and _pid(launch_dir) == first_pid

    r = cli("bench", "--host", "local", "-t", "cpu-tiny", "--compare", "linear", "--yes", "--json", *SMALL)
    assert r.code == 0, r.stderr
    result = json.loads(r.stdout)
    ddtree, linear = result["configs"]
    assert (ddtree["config"], linear["config"]) == ("ddtree", "linear")
    assert (ddtree["verify_width"], linear["verify_width"]) == (15, 4)
    # The alternating models: the tree accepts the whole block, linear DFlash about two tokens.
    assert ddtree["accept_length"] > 3.0 and linear["accept_length"] < 2.1, result
    assert ddtree["probe_accept_length"] > 3.0 and linear["probe_accept_length"] < 2.1
    # The server's verify steps for the run (and the client's warm-up request): about half.
    assert 0 < ddtree["verify_count"] < 0.6 * linear["verify_count"]
    for row in (ddtree, linear):
        assert row["completed"] == 8 and row["output_tokens"] == 8 * 32
        assert row["output_tokens_per_s"] > 0 and row["ttft_ms_median"] > 0 and row["itl_ms_median"] > 0
        assert row["greedy_equal"] is True
    assert result["greedy"] == {"checked": True, "equal": True, "prompts": 8, "difference": None}
    assert ddtree["speedup"] == pytest.approx(ddtree["output_tokens_per_s"] / linear["output_tokens_per_s"])
    # The defaults: 1 warm-up run, then 3 runs per config whose medians the rows are.
    assert result["params"]["warmup"] == 1 and result["params"]["repeats"] == 3
    for row in (ddtree, linear):
        assert row["warmup_runs"] == 1 and row["repeats"] == 3 and len(row["runs"]) == 3
        assert row["output_tokens_per_s_min"] <= row["output_tokens_per_s"] <= row["output_tokens_per_s_max"]
    assert ddtree["speedup_interval"]["runs"] == [3, 3] and linear["speedup_interval"] is None
    assert result["applied"].startswith("ddtree ") and result["serving"][0]["tp_size"] == 2

    # What was serving before serves again: the DDTree launch from its own script, a new process.
    record = _record(launch_dir)
    assert record["topology"] == "cpu-tiny" and record["variant"] is None and record["state"] == "running"
    assert record["serving"][0]["config"] == "ddtree" and not alive(first_pid)
    assert (launch_dir / "cpu-tiny-linear" / "local-cpu-tiny.sh").is_file()
    history = [json.loads(line) for line in (launch_dir / "bench.jsonl").read_text().splitlines()]
    assert history[-1]["configs"] == result["configs"] and "ddtree" in history[-1]["server_args"]

    r = cli("status", "--host", "local", "--json")
    assert r.code == 0, r.stderr
    stored = json.loads(r.stdout)[0]["data"]["bench"]
    assert stored["configs"] == result["configs"] and stored["at"] == result["at"]
    assert "server_args" not in stored
    r = cli("status", "--host", "local")
    assert "cpu-tiny: ddtree" in r.stderr and "greedy equal" in r.stderr

    served_pid = _pid(launch_dir)
    assert cli("stop", "--host", "local").code == 0
    assert not alive(served_pid)


def test_local_crash_at_start_is_reported_and_the_launch_stopped(cli, local_launch_dir):
    assert cli("push", "--host", "local").code == 0
    r = cli("launch", "--host", "locl", "-t", "cpu-tiny", "--wait")
    assert r.code == 3 and "locl" in r.stderr
    r = cli("launch", "--host", "local", "-t", "cpu-tiny", "--wait", "--set", "tree_budget=-1")
    assert r.code == 9 and "[local] tree_budget must be 0 (DDTree off) or positive" in r.stderr, r.stderr
    r = cli("launch", "--host", "local", "-t", "cpu-tiny", "--wait", *LLAMA_TP1, "--set", "extra_args=--no-such-flag")
    assert r.code == 6, r.stderr
    assert "[local] local-cpu-tiny exited" in r.stderr and "unrecognized arguments: --no-such-flag" in r.stderr
    assert "[local] local-cpu-tiny | " in r.stderr  # the log's tail
    record = _record(local_launch_dir)
    assert record["state"] == "failed" and not alive(record["units"][0]["pid"])


@pytest.fixture
def cpu_host(hosts, cli, tmp_path):
    """h1 marked as a CPU engine host, the newest release pushed, a clean launch dir."""
    inventory = variant_inventory(hosts, tmp_path / "inventory", "h1", cpu_engine=True)
    h1 = hosts.host("h1")
    launch_dir = h1.checkout.parent / "ddeploy-launch"
    shutil.rmtree(launch_dir, ignore_errors=True)
    _RECORDS[launch_dir] = h1.cache_dir / "launches"
    r = cli("push", "--host", "h1", inventory=inventory)
    assert r.code == 0, r.stderr
    run = lambda *args, inv=inventory: cli(*args, inventory=inv)  # noqa: E731
    yield run, launch_dir, inventory
    if (_RECORDS[launch_dir] / "launch.json").exists():
        cli("stop", "--host", "h1", "--grace", "5", inventory=inventory)


def test_failed_starts_are_reported_with_their_log_and_leave_nothing_running(cpu_host):
    run, launch_dir, _ = cpu_host
    r = run("bench", "--host", "h1", *SMALL)
    assert r.code == 7, r.stderr
    assert "nothing was launched on h1; run `ddeploy launch --host h1 --topology TOPOLOGY --wait` first" in r.stderr
    r = run("launch", "--host", "h1", "-t", "cpu-tinny", "--wait")
    assert r.code == 9 and "[h1] unknown topology 'cpu-tinny' (valid: " in r.stderr

    # A server that exits at start: its log's tail, a non-zero exit, the record says failed.
    r = run("launch", "--host", "h1", "-t", "cpu-tiny", "--wait", *LLAMA_TP1, "--set", "extra_args=--no-such-flag")
    assert r.code == 6, r.stderr
    assert "h1-cpu-tiny exited" in r.stderr and "h1-cpu-tiny | " in r.stderr
    assert "unrecognized arguments: --no-such-flag" in r.stderr
    record = _record(launch_dir)
    assert record["state"] == "failed" and "h1-cpu-tiny exited" in record["failure"]
    assert not alive(record["units"][0]["pid"])

    # A server not healthy within --wait-timeout is stopped, not left starting.
    r = run("launch", "--host", "h1", "-t", "cpu-tiny", "--wait", "--wait-timeout", "3", *LLAMA_TP1)
    assert r.code == 6 and "not healthy after 3 s (the launch is stopped)" in r.stderr, r.stderr
    record = _record(launch_dir)
    assert record["state"] == "failed"
    assert not alive(record["units"][0]["pid"])
    with pytest.raises(ProcessLookupError):  # the whole process group is gone
        os.killpg(record["units"][0]["pid"], 0)


def test_a_client_that_cannot_run_and_a_dying_server_fail_the_run(cpu_host, hosts, tmp_path, cli):
    run, launch_dir, _ = cpu_host
    port = ("--set", f"port={free_port()}")
    r = run("launch", "--host", "h1", "-t", "cpu-tiny", "--wait", *LLAMA_TP1, *port)
    assert r.code == 0, r.stderr
    assert "DFLASH + DDTree (budget 14, top-K 2, verify width 15), attention torch_native, TP 1" in r.stderr

    # The server, benched from an inventory whose python cannot run SGLang's client: it lacks
    # a module the client imports at start (the `datasets` requirement of the sglang wheel).
    shadow = tmp_path / "shadow" / "datasets"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'datasets'\")\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(
        f'#!/bin/bash\nexport PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{shadow.parent}"\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    edited = variant_inventory(hosts, tmp_path / "inv2", "h1", cpu_engine=True, python=str(wrapper))
    pid = _pid(launch_dir)
    r = cli("bench", "--host", "h1", *SMALL, inventory=edited)
    assert r.code == 6, r.stderr
    assert f"SGLang's benchmark client does not run with {wrapper}" in r.stderr
    assert "No module named 'datasets'" in r.stderr
    assert alive(pid)  # bench started nothing and stopped nothing

    # The server dies while SGLang's client drives it: the run fails naming the server.
    outcome = {}
    many = ("--requests", "400", "--concurrency", "1", "--input-len", "16", "--output-len", "64")
    thread = threading.Thread(target=lambda: outcome.update(r=run("bench", "--host", "h1", *many)))
    thread.start()
    bench_log = launch_dir / "cpu-tiny" / "bench.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "Starting main benchmark run" not in _text(bench_log):
        time.sleep(0.5)
    os.killpg(pid, signal.SIGKILL)
    thread.join(timeout=300)
    r = outcome["r"]
    assert r.code == 6 and "h1-cpu-tiny died during the benchmark" in r.stderr, r.stderr
    assert "`ddeploy launch --host h1 --topology cpu-tiny --wait` starts it again" in r.stderr
