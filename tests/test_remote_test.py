"""`ddeploy test`: the overlay's tests run on real sshd hosts with the host's python against the
patched checkout (SGLang importable from it), reports come back, results land in host state."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from host_env import variant_inventory

pytestmark = pytest.mark.sshd

# Fast, real tests of the shipped suite (the kernel's host-compiled core against the batched
# reference); the nvcc compile test is exercised by test_build.py instead.
SELECT = "kernel and not compiles"


def push(cli, fleet, set_dir, *names) -> None:
    args = [a for n in names for a in ("--host", n)]
    r = cli("push", *args, "--version", str(set_dir), inventory=fleet.inventory_dir)
    assert r.code == 0, r.stderr


def state_of(host) -> dict:
    return json.loads(host.git("cat-file", "blob", "refs/ddeploy/state:state.json"))


def junit_totals(path) -> dict:
    suite = ET.parse(path).getroot().find("testsuite")  # noqa: S314 - our own pytest's report
    return {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}


@pytest.fixture
def fleet(cli, python_hosts, kernel_sets):
    push(cli, python_hosts, kernel_sets["good"], "k1", "k2")
    yield python_hosts
    push(cli, python_hosts, kernel_sets["good"], "k1", "k2")  # leave the good set for the next test


def test_remote_tests_pass_on_two_hosts_and_bring_back_both_reports(cli, fleet, tmp_path):
    r = cli(
        "test",
        "--remote",
        "--host",
        "k1",
        "--host",
        "k2",
        "-k",
        SELECT,
        "--report-dir",
        str(tmp_path),
        "--json",
        inventory=fleet.inventory_dir,
    )
    assert r.code == 0, r.stderr
    for host in fleet.hosts:
        [report] = (tmp_path / host.name).glob("*.xml")
        totals = junit_totals(report)
        assert totals["tests"] >= 10 and totals["failures"] == 0 and totals["errors"] == 0
        rec = state_of(host)["tests"]
        assert rec["ok"] and rec["version"] == "0.1.0" and rec["passed"] == totals["tests"] - totals["skipped"]
        assert f"[{host.name}] running test/srt/ddtree of ddtree 0.1.0" in r.stderr
        assert host.git("status", "--porcelain") == ""  # reports live in .git, the checkout stays clean
    assert "passed" in r.stderr and "[k1] " in r.stderr  # pytest's own output, streamed per host
    assert {res["host"]: res["ok"] for res in json.loads(r.stdout)} == {"k1": True, "k2": True}
    status = cli("status", "--host", "k1", inventory=fleet.inventory_dir)
    assert "ok" in status.stderr and "passed" in status.stderr


def test_a_broken_overlay_test_fails_only_its_host(cli, fleet, kernel_sets, tmp_path):
    push(cli, fleet, kernel_sets["broken_test"], "k2")
    r = cli(
        "test",
        "--remote",
        "--host",
        "k1",
        "--host",
        "k2",
        "-k",
        SELECT,
        "--report-dir",
        str(tmp_path),
        "--json",
        inventory=fleet.inventory_dir,
    )
    assert r.code == 10, r.stderr
    results = {res["host"]: res for res in json.loads(r.stdout)}
    assert results["k1"]["ok"] and not results["k2"]["ok"]
    assert "tests failed:" in results["k2"]["error"]["message"]
    [k1_report], [k2_report] = (list((tmp_path / h).glob("*.xml")) for h in ("k1", "k2"))
    assert junit_totals(k1_report)["failures"] == 0
    assert junit_totals(k2_report)["failures"] == 1
    assert "test_deliberately_broken" in k2_report.read_text()
    assert state_of(fleet.hosts[0])["tests"]["ok"] is True
    k2_state = state_of(fleet.hosts[1])["tests"]
    assert k2_state["ok"] is False and k2_state["failed"] == 1 and k2_state["version"] == "0.1.2"


def test_refuses_a_host_where_another_set_is_applied_than_requested(cli, fleet, kernel_sets):
    push(cli, fleet, kernel_sets["broken_test"], "k2")
    r = cli("test", "--remote", "--host", "k2", "--version", str(kernel_sets["good"]), inventory=fleet.inventory_dir)
    assert r.code == 7, r.stderr
    assert "ddtree 0.1.2 is applied, not the requested ddtree 0.1.0; push 0.1.0 first" in r.stderr


def test_refuses_a_host_without_a_patch_set(cli, python_hosts, tmp_path):
    from deployer.patchset.sglang_base import clone_base

    clone_base(tmp_path / "pristine")
    inv = variant_inventory(python_hosts, tmp_path / "inv", "k1", checkout=str(tmp_path / "pristine"))
    r = cli("test", "--remote", "--host", "k1", inventory=inv)
    assert r.code == 7, r.stderr
    assert "no patch set is applied to" in r.stderr and "has no overlay tests" in r.stderr


def test_without_remote_the_suite_runs_locally_against_the_overlay(cli, tmp_path):
    r = cli(
        "test",
        "-k",
        "test_mask_offsets_follow_full_mask_layout or test_core_builds_the_design_test_vector",
        "--report-dir",
        str(tmp_path),
    )
    assert r.code == 0, r.stderr
    [report] = (tmp_path / "local").glob("*.xml")
    assert junit_totals(report)["tests"] == 2 and junit_totals(report)["failures"] == 0
    assert "overlays/ddtree/test/srt/ddtree" in r.stderr


def test_a_push_during_a_remote_test_run_is_refused_and_names_it(cli, fleet, kernel_sets):
    """The tests run under the checkout's lock (made long here by the agent's test pause before
    pytest): a push to that host waits for nothing and is refused, naming the test run; the tree
    the tests run in stays the one they were asked about."""
    import time

    from test_remote_safety import cli_process

    k1 = fleet.hosts[0]
    run = cli_process(fleet, "test", "--remote", "--host", "k1", "-k", SELECT, pause="before_tests:6")
    try:
        lock = k1.checkout / ".git" / "ddeploy" / "deploy.lock.json"
        deadline = time.monotonic() + 30
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = cli("push", "--host", "k1", "--version", str(kernel_sets["broken_test"]), inventory=fleet.inventory_dir)
        assert r.code == 7 and "is locked by" in r.stderr and "test --remote --host k1" in r.stderr, r.stderr
    finally:
        out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "pausing 6.0s before tests (test hook)" in err
    assert state_of(k1)["applied"]["version"] == "0.1.0" and state_of(k1)["tests"]["ok"]
