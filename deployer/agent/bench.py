"""`ddeploy bench` on the host: SGLang's own benchmark client against the serving launch, and with
`compare` the baseline too, the whole exchange run here so the host, not the link, decides how
it ends.

    measure     `python -m sglang.benchmark.serving` (0.5.23's name; `sglang.bench_serving` is
                its deprecated alias) with the unit's env file sourced (the same SGLang as the
                server): `warmup` runs at the first concurrency (discarded), then `repeats` runs
                in a row per concurrency; then the greedy probes: fixed prompts through
                /generate one at a time, their tokens and the server's verify counts.
    compare     the launch is stopped, the baseline's units (rendered by the client) start beside
                it, are waited for, measured and stopped, and the launch is started again from its
                own scripts and waited for, whatever happened in between: a failed baseline, a
                client that went away (Ctrl-C, a cut link). A failed restore is reported with the
                first cause and what the host serves now.
    bench-save  the result as the `bench` section of the host's state record (status shows it).

The operation holds the launch lock throughout; each client run has a time limit (`timeout`),
and the whole measurement a deadline (`deadline` s from the operation's start: client runs, greedy
probes, the baseline's start; the restore is not bounded by it). Runs end with the operation's
client (their process group is killed).
"""

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error

from .client import gone, pause
from .common import Fail, now, progress
from .launch import start_launch, stop_launch
from .launch_record import alive_units, hold_launch_lock, live_units, read_launch
from .repo import Repo
from .serving import http_json, log_tail, serving_summary, verify_calls, wait_serving
from .state import update_section
from .units import signal_group, unit_files, write_files

# SGLang's benchmark client as 0.5.23 names it; `python -m sglang.bench_serving` prints a
# deprecation warning and runs this.
BENCH_MODULE = "sglang.benchmark.serving"


def bench_argv(req: dict, unit: dict, concurrency: int, out_file: str) -> list:
    p = req["params"]
    env_file = os.path.join(os.path.dirname(unit["log"]), unit["name"] + ".env")
    client = [
        req["python"], "-m", BENCH_MODULE,
        "--backend", "sglang",
        "--base-url", unit["url"],
        "--dataset-name", "random-ids",
        "--num-prompts", str(int(p["requests"])),
        "--random-input-len", str(int(p["input_len"])),
        "--random-output-len", str(int(p["output_len"])),
        "--random-range-ratio", "1.0",
        "--max-concurrency", str(int(concurrency)),
        "--temperature", repr(float(p["temperature"])),
        "--seed", str(int(p.get("seed", 1))),
        "--flush-cache",
        "--disable-tqdm",
        "--output-file", out_file,
    ]  # fmt: skip
    # The unit's own environment (its PYTHONPATH: the SGLang it serves), then the client.
    return ["bash", "-c", 'source "$1" && shift && exec "$@"', "ddeploy-bench", env_file] + client


def supervise(proc, limit: float) -> str:
    """Wait for the client process; stop its process group when it runs past `limit` s or this
    operation's client goes away. "done", "timeout" or "gone"."""
    deadline = time.time() + limit
    while proc.poll() is None:
        if gone() or time.time() > deadline:
            why = "gone" if gone() else "timeout"
            signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            return why
        pause(0.2)
    return "done"


def remaining(req: dict) -> float:
    """Seconds left before the benchmark's deadline."""
    return req["deadline_at"] - time.time()


def past_deadline(req: dict, during: str) -> Fail:
    return Fail(
        "RemoteCommandError",
        "the benchmark ran past its deadline (%.0f s, --timeout) during %s and was stopped; raise --timeout or lower "
        "--requests" % (float(req["deadline"]), during),
    )


def run_client(req: dict, unit: dict, concurrency: int, which: str) -> dict:
    """One run of the client (`which`: "run 2 of 3", "warm-up run 1 of 1"); its JSON result."""
    limit = float(req.get("timeout") or 3600)
    budget = remaining(req)
    with tempfile.TemporaryDirectory(prefix="ddeploy-bench-") as tmp:
        out_file = os.path.join(tmp, "result.jsonl")
        log = os.path.join(os.path.dirname(unit["log"]), "bench.log")
        with open(log, "a") as fh:
            fh.write("=== ddeploy bench concurrency %d, %s at %s ===\n" % (concurrency, which, now()))
            fh.flush()
            proc = subprocess.Popen(  # its own process group: stopped whole at a timeout
                bench_argv(req, unit, concurrency, out_file),
                stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, start_new_session=True,
            )  # fmt: skip
            ended = supervise(proc, min(limit, budget))
        where = "concurrency %d (%s)" % (concurrency, which)
        if ended == "timeout" and budget < limit:
            raise past_deadline(req, "%s at %s (log %s)" % (BENCH_MODULE, where, log))
        if ended == "gone":
            raise Fail("StateError", "the client went away during the benchmark; its run on the host was stopped")
        if ended == "timeout":
            raise Fail(
                "RemoteCommandError",
                "%s ran past the run timeout (%.0f s) at %s and was stopped; raise --run-timeout or "
                "lower --requests (log %s)" % (BENCH_MODULE, limit, where, log),
            )
        check_client(req, unit, proc.returncode, out_file, log)
        with open(out_file) as fh:
            return json.loads(fh.read().strip().splitlines()[-1])


def check_client(req: dict, unit: dict, rc: int, out_file: str, log: str) -> None:
    """The server survived the run and the client wrote its result, else one line saying why."""
    name = req["target"]["name"]
    if not alive_units({"units": [unit]}):
        raise Fail(
            "RemoteCommandError",
            "%s died during the benchmark: %s (server log %s); `ddeploy logs --host %s` shows why, "
            "`ddeploy launch --host %s --topology %s --wait` starts it again"
            % (
                unit["name"],
                (log_tail(unit["log"], 1) or ["(empty log)"])[0].strip(),
                unit["log"],
                name,
                name,
                req.get("topology", "TOPOLOGY"),
            ),
        )
    if rc == 0 and os.path.exists(out_file):
        return
    lines = log_tail(log, 200)
    missing = [line for line in lines if "No module named" in line]
    if missing:
        raise Fail(
            "RemoteCommandError",
            "SGLang's benchmark client does not run with %s: %s; install the sglang wheel's "
            "requirements into that environment (log %s)" % (req["python"], missing[-1].strip(), log),
        )
    last = next((line for line in reversed(lines) if line.strip()), "no output")
    raise Fail("RemoteCommandError", "%s exited with %d: %s (log %s)" % (BENCH_MODULE, rc, last.strip(), log))


def greedy_probes(req: dict, unit: dict) -> list:
    """Each fixed prompt alone through /generate at temperature 0: tokens and verify counts."""
    out = []
    for prompt in req["probes"]["prompts"]:
        if gone():
            raise Fail("StateError", "the client went away during the greedy probes")
        left = remaining(req)
        if left <= 0:
            raise past_deadline(req, "the greedy probes of %s" % unit["name"])
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": int(req["probes"]["output_len"]),
                "ignore_eos": True,
            },
        }
        try:
            reply = http_json(unit["url"] + "/generate", body, timeout=min(600.0, left))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if remaining(req) <= 0:
                raise past_deadline(req, "the greedy probes of %s" % unit["name"]) from None
            alive = alive_units({"units": [unit]})
            why = "died during the greedy probes" if not alive else "failed a greedy probe (%s)" % exc
            raise Fail(
                "RemoteCommandError",
                "%s %s (server log %s); `ddeploy logs --host %s` shows why"
                % (unit["name"], why, unit["log"], req["target"]["name"]),
            ) from None
        meta = reply.get("meta_info") or {}
        out.append(
            {
                "output_ids": reply.get("output_ids") or [],
                "verify_count": meta.get("spec_verify_ct"),
                "completion_tokens": meta.get("completion_tokens"),
            }
        )
    return out


def run_row(result: dict, concurrency: int, before, after) -> dict:
    """One concurrency's numbers from the client's JSON result and the server's verify counter."""
    return {
        "concurrency": concurrency,
        "completed": result.get("completed"),
        "duration_s": result.get("duration"),
        "output_tokens": result.get("total_output_tokens"),
        "output_tokens_per_s": result.get("output_throughput"),
        "ttft_ms_median": result.get("median_ttft_ms"),
        "ttft_ms_p99": result.get("p99_ttft_ms"),
        "itl_ms_median": result.get("median_itl_ms"),
        "itl_ms_p99": result.get("p99_itl_ms"),
        # SGLang's own counter, reset by --flush-cache before the run.
        "accept_length": result.get("accept_length"),
        # The server's verify steps over the run's requests (and the client's warm-up one).
        # None: no metrics, or no speculation (nothing was verified).
        "verify_count": None if before is None or after is None else (after - before) or None,
    }


def warm_up(req: dict, unit: dict) -> int:
    """The warm-up: `warmup` client runs at the first concurrency, their results discarded."""
    count = int(req["params"].get("warmup") or 0)
    concurrency = req["params"]["concurrency"][0]
    for i in range(count):
        which = "warm-up run %d of %d" % (i + 1, count)
        progress("%s: %s, concurrency %d, %s (not counted)" % (unit["name"], BENCH_MODULE, concurrency, which))
        run_client(req, unit, concurrency, which)
    return count


def measured_runs(req: dict, unit: dict) -> list:
    """The client `repeats` times in a row per concurrency: each run's numbers."""
    repeats = int(req["params"].get("repeats") or 1)
    runs = []
    for concurrency in req["params"]["concurrency"]:
        for i in range(repeats):
            which = "run %d of %d" % (i + 1, repeats)
            shown = ", " + which if repeats > 1 else ""
            progress("%s: %s, concurrency %d%s" % (unit["name"], BENCH_MODULE, concurrency, shown))
            before = verify_calls(unit["url"])
            result = run_client(req, unit, concurrency, which)
            runs.append(run_row(result, concurrency, before, verify_calls(unit["url"])))
    return runs


def measure(req: dict, record: dict) -> dict:
    """The warm-up, then the measured runs against the record's (single) unit, then the greedy
    probes."""
    unit = record["units"][0]
    warmup = warm_up(req, unit)
    runs = measured_runs(req, unit)
    probes = greedy_probes(req, unit) if req.get("probes") else None
    info = http_json(unit["url"] + "/server_info")
    return {
        "record": record,
        "serving": serving_summary(info),
        "server_args": {k: v for k, v in info.items() if k != "internal_states"},
        "warmup": warmup,
        "runs": runs,
        "probes": probes,
    }


def serving_launch(req: dict) -> dict:
    """The launch the client asked to measure: running, and the one it rendered for."""
    record = read_launch()
    name = req["target"]["name"]
    if record is None or not alive_units(record):
        raise Fail(
            "StateError",
            "nothing is serving on %s; run `ddeploy launch --host %s --topology TOPOLOGY --wait` first" % (name, name),
        )
    expected = req.get("launch_id")
    if expected and record.get("id") != expected:
        raise Fail("StateError", "the launch on %s changed since the benchmark read it; run the bench again" % name)
    return record


def measure_baseline(base: str, req: dict, record: dict) -> dict:
    """Stop the launch, start its baseline, wait for it and measure it. The caller restores."""
    compare = req["compare"]
    stop_launch(record, 30.0)
    topology = record["topology"]
    remote = os.path.join(base, "%s-%s" % (topology, compare["variant"]))
    for unit in compare["units"]:
        write_files(remote, unit_files(unit))
    progress("launching the %s baseline of %s" % (compare["variant"], topology))
    keep = {"variant": compare["variant"], "sets": compare.get("sets") or []}
    baseline = start_launch(topology, remote, compare["units"], keep, req)
    wait_serving(baseline, max(1.0, min(float(req.get("wait_timeout", 900)), remaining(req))), started_here=True)
    progress("measuring the %s baseline (%s)" % (compare["variant"], topology))
    return measure(req, baseline)


def restore(req: dict, original: dict, cause) -> dict:
    """Stop whatever the baseline left running, start the original launch again from its scripts
    and wait for it; even with the client gone. A failure names `cause` (what went wrong first)
    and what the host serves now."""
    current = read_launch()
    if current and current.get("id") != original.get("id") and live_units(current):
        stop_launch(current, 30.0)
    progress("starting %s again" % original["topology"])
    keep = {k: original.get(k) for k in ("variant", "sets")}
    try:
        again = start_launch(original["topology"], original["dir"], original["units"], keep, dict(req, settle=1.0))
        wait_serving(again, float(req.get("wait_timeout", 900)), started_here=False, interruptible=False)
        return again
    except Fail as exc:
        first = "; what failed first: %s" % cause if cause else ""
        now_serving = describe_serving(req["target"]["name"], original["topology"])
        raise Fail(
            "RemoteCommandError",
            "restoring %s failed: %s%s; the host now serves %s" % (original["topology"], exc, first, now_serving),
        ) from None


def describe_serving(host: str, topology: str) -> str:
    record = read_launch()
    running = live_units(record)
    if not running:
        return "nothing (`ddeploy launch --host %s --topology %s --wait` starts it)" % (host, topology)
    return "%s, recorded, pid %s (`ddeploy status` / `ddeploy stop` find it)" % (
        record["topology"] + ("-" + record["variant"] if record.get("variant") else ""),
        ", ".join(str(u["pid"]) for u in running),
    )


def op_bench(repo: Repo, req: dict) -> dict:
    """Measure the serving launch; with `compare`, its baseline too, and serve the launch again."""
    req["deadline_at"] = time.time() + float(req.get("deadline") or 1e9)
    hold_launch_lock(req)
    record = serving_launch(req)
    if len(record["units"]) != 1:
        count = len(record["units"])
        raise Fail("UsageError", "bench drives one server; %s runs %d units" % (record["topology"], count))
    measured = [measure(req, record)]
    if not req.get("compare"):
        return {"ok": True, "measured": measured}
    original = json.loads(json.dumps(record))  # the scripts to start again, as they were
    cause = None
    try:
        measured.append(measure_baseline(req["base"], req, record))
    except Exception as exc:  # noqa: BLE001 - raised again once the launch serves again
        cause = exc
    restored = restore(req, original, cause)
    if cause is not None:
        raise cause
    return {"ok": True, "measured": measured, "restored": restored}


def op_bench_save(repo: Repo, req: dict) -> dict:
    """The last benchmark as the state record's `bench` section; its history beside the launches."""
    result = req["result"]
    history = os.path.join(req["base"], "bench.jsonl")
    os.makedirs(req["base"], exist_ok=True)
    with open(history, "a") as fh:
        fh.write(json.dumps(result) + "\n")
    last = {k: v for k, v in result.items() if k != "server_args"}  # those stay in the history
    update_section(repo, "bench", lambda old: last, "ddeploy bench %s" % result.get("topology", ""))
    return {"ok": True, "history": history}
