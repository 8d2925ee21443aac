"""`ddeploy rollout` over the three OpenSSH test hosts, each serving the SGLang stand-in of
tests/standin_sglang (a real server takes a minute to start, and a rollout starts one per unit
and per put-back; the real server's launch, bench and greedy probes are proven in
tests/test_serving.py). A release's behaviour comes from the checkout it is launched from, as a
real release's would: the stand-in answers one greedy token off when the release ships
`python/sglang/standin_diverge` (the role of the overlay's mask-shift hook on a real engine).

The rollout file turns off the kernel build and the overlay's tests (these test checkouts carry
generated patch sets without kernels or tests; `push --build` and `test --remote` have their own
tests, and the rollout calls the same functions).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import alive, free_port, wait_until
from sshd_hosts import STUB, make_patch_set
from test_bench_interrupt import CLI, ROOT, STAND_IN, _launch_args, _marked, _stand_in_pids, launches_dir, read_record

pytestmark = pytest.mark.sshd

NAMES = ("h1", "h2", "h3")
QUICK = """\
steps: {build: false, tests: false}
drain_timeout_s: 5
deadlines: {build_s: 120, launch_s: 60, gates_s: 60}
measure: {requests: 2, concurrency: 1, input_len: 4, output_len: 8, repeats: 2, probes: 2, probe_tokens: 8}
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    """0.3.0: a release whose greedy completions differ (the stand-in reads the marker file)."""
    root = tmp_path_factory.mktemp("broken")
    concerns = [("builder", {STUB: "VERSION = 3\n"}), ("diverge", {"python/sglang/standin_diverge": "1\n"})]
    return make_patch_set(root / "0.3.0", "0.3.0", concerns)


@pytest.fixture
def serving(hosts, cli, patch_sets, tmp_path):
    """Every host on 0.1.0, serving the stand-in (its own port); afterwards every launch stopped
    and no stand-in left. Yields (marks dir, rollout file, {host: pid})."""
    from deployer.locations import cache_dir

    shutil.rmtree(cache_dir() / "rollouts", ignore_errors=True)  # no earlier test's rollout in the way
    inv = hosts.inventory_dir
    marks = tmp_path / "marks"
    marks.mkdir()
    spec = tmp_path / "rollout.yaml"
    spec.write_text(QUICK)
    r = cli("push", "--all", "--version", str(patch_sets["v1"]), inventory=inv)
    assert r.code == 0, r.stderr
    pids = {}
    for name in NAMES:
        r = cli(*launch_args(hosts, name, marks), inventory=inv)
        assert r.code == 0, r.stderr
        pids[name] = read_record(launches_dir(hosts, name))["units"][0]["pid"]
    yield marks, spec, pids
    for name in NAMES:
        cli("stop", "--host", name, "--grace", "2", inventory=inv)
    for pid in _stand_in_pids(marks):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def launch_args(hosts, name: str, marks: Path, *extra: str) -> list[str]:
    """The stand-in's launch; the release's own python/ on its path too, after the stand-in's
    (whose benchmark client must be found first), so a release's marker files reach the server."""
    path = f"{STAND_IN}:{hosts.host(name).checkout / 'python'}"
    return [*_launch_args(name, marks, "", free_port()), "--set", f"env.PYTHONPATH={path}", *extra]


def applied(cli, hosts) -> dict[str, str | None]:
    out = json.loads(cli("status", "--all", "--json", inventory=hosts.inventory_dir).stdout)
    return {r["host"]: (r["data"].get("applied") or {}).get("version") for r in out if r["host"] in NAMES}


def events(stderr: str) -> list[dict]:
    line = next(ln for ln in stderr.splitlines() if "events in " in ln)
    return [json.loads(x) for x in Path(line.split("events in ", 1)[1].strip()).read_text().splitlines()]


def test_dry_run_prints_the_plan_and_touches_nothing(hosts, cli, serving, patch_sets):
    marks, spec, pids = serving
    r = cli("rollout", str(patch_sets["v2"]), "--all", "-f", str(spec), "--batch", "2", "--dry-run",
            inventory=hosts.inventory_dir)  # fmt: skip
    assert r.code == 0, r.stderr
    assert "rollout of ddtree 0.2.0 over 3 unit(s), canary first" in r.stderr
    assert "canary   h1    0.1.0        tp8" in r.stderr and "batch 1  h2    0.1.0        tp8" in r.stderr
    assert "dry run: nothing was touched" in r.stderr
    assert applied(cli, hosts) == dict.fromkeys(NAMES, "0.1.0")
    assert {n: read_record(launches_dir(hosts, n))["units"][0]["pid"] for n in NAMES} == pids


def test_every_unit_passes_its_gates_and_ends_on_the_new_release(hosts, cli, serving, patch_sets):
    marks, spec, pids = serving
    r = cli("rollout", str(patch_sets["v2"]), "--all", "-f", str(spec), "--batch", "2", inventory=hosts.inventory_dir)
    assert r.code == 0, r.stderr
    assert "every unit serves" in r.stderr
    assert applied(cli, hosts) == dict.fromkeys(NAMES, "0.2.0")
    for name in NAMES:
        record = read_record(launches_dir(hosts, name))
        assert record["state"] == "running" and record["topology"] == "tp8"
        assert record["units"][0]["pid"] != pids[name] and alive(record["units"][0]["pid"])
    log = events(r.stderr)
    assert [e["units"] for e in log if e["event"] == "batch"] == [["h1"], ["h2", "h3"]]
    gates = [(e["unit"], e["gate"], e["verdict"]) for e in log if e["event"] == "gate"]
    for name in NAMES:
        assert (name, "greedy", "pass") in gates and (name, "health", "pass") in gates
    assert all(v in ("pass", "n/a") for _, g, v in gates if g not in ("throughput", "itl_p99")), gates
    assert [e["state"] for e in log if e["event"] == "rollout"] == ["done"]
    # every sample the gates compared is in the log: each unit's reference and candidate
    for kind in ("reference", "candidate"):
        samples = {e["unit"]: e["measurement"] for e in log if e["event"] == kind}
        assert sorted(samples) == list(NAMES)
        assert all(len(m["runs"]) == 2 and len(m["probes"]) == 2 for m in samples.values())


def test_a_release_that_breaks_greedy_equality_halts_at_the_canary(hosts, cli, serving, broken):
    marks, spec, pids = serving
    r = cli("rollout", str(broken), "--all", "-f", str(spec), inventory=hosts.inventory_dir)
    assert r.code == 1, r.stderr
    assert "gate greedy: fail: probe 0 differs at token 3" in r.stderr
    assert "failed; the failed units serve their previous release" in r.stderr
    assert applied(cli, hosts) == dict.fromkeys(NAMES, "0.1.0")
    canary = read_record(launches_dir(hosts, "h1"))
    assert canary["state"] == "running" and alive(canary["units"][0]["pid"]) and canary["units"][0]["pid"] != pids["h1"]
    for name in ("h2", "h3"):  # never touched: the same server since the fixture
        assert read_record(launches_dir(hosts, name))["units"][0]["pid"] == pids[name]
    log = events(r.stderr)
    assert [e["unit"] for e in log if e["event"] == "unit" and e["step"] == "start"] == ["h1"]
    assert [(e["unit"], e["ok"]) for e in log if e["event"] == "put-back"] == [("h1", True)]
    # the failed rollout holds the fleet until the operator says otherwise
    again = cli("rollout", str(broken), "--all", "-f", str(spec), "--dry-run", inventory=hosts.inventory_dir)
    assert again.code == 0  # a dry run only reads
    again = cli("rollout", str(broken), "--all", "-f", str(spec), inventory=hosts.inventory_dir)
    assert again.code == 7 and "failed; look at its events" in again.stderr and "--after-failure" in again.stderr


def test_a_failure_in_the_second_batch_puts_that_batch_back(hosts, cli, serving, patch_sets, tmp_path):
    marks, spec, pids = serving
    # h3's server answers /health_generate with 503 once restarted (STANDIN_UNHEALTHY in its
    # environment from the start, read by the stand-in at each start: only the new launch is judged)
    inv = hosts.inventory_dir
    cli("stop", "--host", "h3", "--grace", "2", inventory=inv)
    assert cli(*launch_args(hosts, "h3", marks, "--set", "env.STANDIN_UNHEALTHY=ddtree"), inventory=inv).code == 0
    r = cli("rollout", str(patch_sets["v2"]), "--all", "-f", str(spec), "--batch", "2", inventory=inv)
    assert r.code == 1, r.stderr
    assert "[h3] gate health: fail" in r.stderr
    assert applied(cli, hosts) == {"h1": "0.2.0", "h2": "0.1.0", "h3": "0.1.0"}
    log = events(r.stderr)
    assert {e["unit"]: e["result"] for e in log if e["event"] == "unit-done"} == {
        "h1": "pass",
        "h2": "rolled-back",
        "h3": "rolled-back",
    }
    for name in NAMES:
        assert read_record(launches_dir(hosts, name))["state"] == "running"


def test_a_second_rollout_over_the_same_hosts_is_refused(hosts, cli, serving, patch_sets):
    from deployer.locations import cache_dir

    marks, spec, pids = serving
    lock = cache_dir() / "rollouts" / "hosts" / "h2.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"20261207T000000Z-beef (pid 1)")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = cli("rollout", str(patch_sets["v2"]), "--all", "-f", str(spec), inventory=hosts.inventory_dir)
    finally:
        os.close(fd)
    assert r.code == 7, r.stderr
    assert "host h2 is in rollout 20261207T000000Z-beef (pid 1), running on this machine now" in r.stderr
    assert applied(cli, hosts) == dict.fromkeys(NAMES, "0.1.0")


def test_ctrl_c_puts_the_unit_in_flight_back_and_resume_finishes(hosts, cli, serving, patch_sets):
    """SIGINT to the client's process group (a terminal's Ctrl-C) while h2's new server starts:
    h2 serves its previous release again, h3 is untouched; `--resume` then does h2 and h3 and
    never redoes the canary."""
    marks, spec, pids = serving
    inv = hosts.inventory_dir
    # h2's server answers /health with 503 for its first seconds from its second start on (the
    # fixture's start counts, every host's marks are in one directory): a window for the Ctrl-C
    cli("stop", "--host", "h2", "--grace", "2", inventory=inv)
    slow = launch_args(hosts, "h2", marks, "--set", "env.STANDIN_SLOW=server-ddtree-again")
    assert cli(*slow, inventory=inv).code == 0
    h3 = read_record(launches_dir(hosts, "h3"))["units"][0]["pid"]
    argv = [sys.executable, "-c", CLI, "-i", str(inv), "rollout", str(patch_sets["v2"]), "--all"]
    argv += ["-f", str(spec), "--batch", "2"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        # the fixture's three servers, h2's slow restart, the canary's new one, then h2's new one
        assert wait_until(lambda: _marked(marks, "server-ddtree-", 6), 90), "h2's new server never started"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "interrupted: putting back h2" in err
    assert applied(cli, hosts) == {"h1": "0.2.0", "h2": "0.1.0", "h3": "0.1.0"}
    assert read_record(launches_dir(hosts, "h2"))["state"] == "running"
    assert read_record(launches_dir(hosts, "h3"))["units"][0]["pid"] == h3

    r = cli("rollout", "--resume", inventory=inv)
    assert r.code == 0, r.stderr
    assert applied(cli, hosts) == dict.fromkeys(NAMES, "0.2.0")
    log = events(r.stderr)
    starts = [e["unit"] for e in log if e["event"] == "unit" and e["step"] == "start"]
    assert starts == ["h1", "h2", "h2", "h3"], starts  # h2 redone after the Ctrl-C, h1 never
    assert [e["state"] for e in log if e["event"] == "rollout"] == ["interrupted", "done"]
    again = cli("rollout", "--resume", inventory=inv)
    assert again.code == 7 and "is done; there is nothing to resume" in again.stderr


class Router:
    """A stand-in for SGLang's Model Gateway workers API (GET/POST /workers, DELETE /workers/<id>),
    in this process. Each change is logged with what served at that moment: `live` maps a worker
    URL to a function telling whether the server the test started there is still up."""

    def __init__(self, workers: list[str], live):
        import http.server
        import threading

        self.workers = {url: str(i) for i, url in enumerate(workers)}
        self.log: list[tuple[str, str, bool]] = []
        router = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def reply(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                listing = [{"id": i, "url": u} for u, i in router.workers.items()]
                self.reply(200, {"workers": listing} if self.path == "/workers" else {})

            def do_POST(self) -> None:
                url = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["url"]
                router.workers[url] = str(len(router.log) + 100)
                router.log.append(("add", url, live(url)))
                self.reply(202, {"status": "accepted"})

            def do_DELETE(self) -> None:
                wid = self.path.rsplit("/", 1)[1]
                url = next(u for u, i in router.workers.items() if i == wid)
                router.log.append(("remove", url, live(url)))
                del router.workers[url]
                self.reply(202, {"status": "accepted"})

            def log_message(self, *a) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_each_unit_leaves_its_router_before_its_drain_and_comes_back_once_it_serves(
    hosts, cli, serving, patch_sets, tmp_path
):
    """With `router:` in the host files, h1's worker is removed while its old server still
    serves, and added again only when its new server serves; a failed unit (h2: its new server
    fails /health_generate) is added back once its previous release serves again."""
    marks, spec, pids = serving
    inv = hosts.inventory_dir
    cli("stop", "--host", "h2", "--grace", "2", inventory=inv)
    assert cli(*launch_args(hosts, "h2", marks, "--set", "env.STANDIN_UNHEALTHY=ddtree"), inventory=inv).code == 0

    ports = {n: read_record(launches_dir(hosts, n))["units"][0]["url"].rsplit(":", 1)[1] for n in NAMES}
    before = {f"http://127.0.0.1:{ports[n]}": read_record(launches_dir(hosts, n))["units"][0]["pid"] for n in NAMES}
    router = Router(list(before), lambda url: url in before and alive(before[url]))
    routed = tmp_path / "inventory"
    routed.mkdir()
    for f in Path(inv).glob("*.yaml"):
        doc = f.read_text() + f"router: {{url: '{router.url}', worker_url: 'http://127.0.0.1:{{port}}'}}\n"
        (routed / f.name).write_text(doc)
    try:
        r = cli("rollout", str(patch_sets["v2"]), "--host", "h1", "--host", "h2", "-f", str(spec), inventory=routed)
    finally:
        router.server.shutdown()
    assert r.code == 1, r.stderr
    h1, h2 = (f"http://127.0.0.1:{ports[n]}" for n in ("h1", "h2"))
    # (action, worker, whether the server the fixture started there still served at that moment)
    assert router.log == [("remove", h1, True), ("add", h1, False), ("remove", h2, True), ("add", h2, False)]
    assert set(router.workers) == set(before)  # everything routed again
    assert applied(cli, hosts) == {"h1": "0.2.0", "h2": "0.1.0", "h3": "0.1.0"}
    assert "[h1] router " + router.url + ": remove " + h1 in r.stderr


def test_back_to_a_release_passed_within_the_rollback_window_skips_the_measured_gates(hosts, cli, serving, patch_sets):
    """h1: 0.1.0 -> 0.2.0 (gated), -> 0.1.0 (gated: never passed before), -> 0.2.0 again within
    the window: no reference, no measurement, only /health_generate."""
    marks, spec, pids = serving
    inv = hosts.inventory_dir
    spec.write_text(spec.read_text() + "rollback_window_h: 1\n")
    for version in ("v2", "v1"):
        r = cli("rollout", str(patch_sets[version]), "--host", "h1", "-f", str(spec), inventory=inv)
        assert r.code == 0, r.stderr
        assert [e["event"] for e in events(r.stderr)].count("reference") == 1
    r = cli("rollout", str(patch_sets["v2"]), "--host", "h1", "-f", str(spec), inventory=inv)
    assert r.code == 0, r.stderr
    assert "passed its gates on 0.2.0 in rollout " in r.stderr and "within the rollback window (1 h)" in r.stderr
    kinds = [e["event"] for e in events(r.stderr)]
    assert "reference" not in kinds and "candidate" not in kinds and "rollback-window" in kinds
    assert [(e["gate"], e["verdict"]) for e in events(r.stderr) if e["event"] == "gate"] == [("health", "pass")]
    assert applied(cli, hosts)["h1"] == "0.2.0"


def test_a_killed_client_resumed_puts_back_what_it_had_applied(hosts, cli, serving, broken):
    """The client killed (a cut link) once the canary's broken release is pushed and starting:
    `--resume` redoes h1, whose push is then a no-op, and its failed greedy gate still rolls the
    checkout back to 0.1.0: the put-back reads the host's applied release, not this process's."""
    marks, spec, pids = serving
    inv = hosts.inventory_dir
    argv = [sys.executable, "-c", CLI, "-i", str(inv), "rollout", str(broken), "--all", "-f", str(spec)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: _marked(marks, "server-ddtree-", 4), 90), "h1's new server never started"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert applied(cli, hosts)["h1"] == "0.3.0"  # cut after the push: the host keeps what it got
    r = cli("rollout", "--resume", inventory=inv)
    assert r.code == 1, r.stderr
    assert "gate greedy: fail" in r.stderr and "rolling back 0.3.0 to 0.1.0" in r.stderr
    assert applied(cli, hosts) == dict.fromkeys(NAMES, "0.1.0")
    record = read_record(launches_dir(hosts, "h1"))
    assert record["state"] == "running" and alive(record["units"][0]["pid"])


@pytest.fixture(scope="module")
def unbuildable(tmp_path_factory) -> Path:
    """0.2.1: a release with kernel sources whose build fails (its ddtree_build exits 1)."""
    root = tmp_path_factory.mktemp("unbuildable")
    build = "python/sglang/srt/speculative/ddtree_build.py"
    kernel = {build: "raise SystemExit('no build here')\n", "python/sglang/kernels/jit/ddtree_x.cuh": "// x\n"}
    concerns = [("builder", {STUB: "VERSION = 21\n"}), ("kernel", kernel)]
    return make_patch_set(root / "0.2.1", "0.2.1", concerns)


def test_a_change_that_fails_after_its_push_applied_is_rolled_back(hosts, cli, serving, unbuildable):
    """`push --build`: the push applies 0.2.1 and its kernel build then fails, so the change step
    raises with no result to say what it changed: the put-back reads the host's applied release
    and rolls it back to 0.1.0."""
    marks, spec, pids = serving
    spec.write_text(spec.read_text().replace("build: false", "build: true"))
    r = cli("rollout", str(unbuildable), "--host", "h1", "-f", str(spec), inventory=hosts.inventory_dir)
    assert r.code == 1, r.stderr
    assert "[h1] failed: " in r.stderr and "rolling back 0.2.1 to 0.1.0" in r.stderr, r.stderr
    assert applied(cli, hosts)["h1"] == "0.1.0"
    record = read_record(launches_dir(hosts, "h1"))
    assert record["state"] == "running" and alive(record["units"][0]["pid"]), r.stderr
