"""What a launched server really serves, and how fast: `launch --wait` and `bench`.

The agent polls the units on the host itself (their URLs are in the launch record), so no port is
forwarded and a benchmark's numbers are the host's, not the SSH link's:
    wait    every unit of the last launch answers /health; /server_info, summarised, per unit.
            A unit that exits (or never gets healthy: then it is stopped) fails the call with its
            log's last lines, and the record says so.
    bench   SGLang's own client, `python -m sglang.benchmark.serving` (0.5.23's name; `sglang.
            bench_serving` is its deprecated alias), once per concurrency with the unit's env
            file sourced (the same SGLang as the server), then the greedy probes: fixed prompts
            through /generate one at a time, their tokens and the server's verify counts.
    bench-save  the result as the `bench` section of the host's state record (status shows it).
"""

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from .common import Fail, now, progress
from .launch import alive_units, read_launch, stop_groups, write_launch
from .repo import Repo
from .state import update_section


TAIL_LINES = 15
# SGLang's benchmark client as 0.5.23 names it; `python -m sglang.bench_serving` prints a
# deprecation warning and runs this.
BENCH_MODULE = "sglang.benchmark.serving"


def _request(url: str, payload=None):
    """A request to a unit's own server; only http:// URLs (the client builds them from render
    values), never file: or another scheme."""
    if not url.startswith("http://"):
        raise Fail("UsageError", "not a server URL: %r" % url)
    data = None if payload is None else json.dumps(payload).encode()
    return urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # noqa: S310


def http_json(url: str, payload=None, timeout: float = 30.0):
    """GET (or POST `payload`) a JSON endpoint of a local server."""
    with urllib.request.urlopen(_request(url, payload), timeout=timeout) as resp:  # noqa: S310 (http only)
        return json.loads(resp.read() or b"null")


VERIFY_COUNTER = "sglang:spec_verify_calls_total"


def verify_calls(url: str):
    """SGLang's counter of verify steps over finished requests (/metrics, --enable-metrics), or
    None when the server exports no metrics."""
    try:
        with urllib.request.urlopen(_request(url + "/metrics"), timeout=30) as resp:  # noqa: S310 (http only)
            text = resp.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == VERIFY_COUNTER:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return int(total) if seen else None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(_request(url + "/health"), timeout=30) as resp:  # noqa: S310 (http only)
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: str, lines: int = TAIL_LINES) -> list:
    try:
        with open(path, errors="replace") as fh:
            return fh.read().rstrip().splitlines()[-lines:]
    except OSError:
        return []


def serving_summary(info: dict) -> dict:
    """The facts a user checks after a launch, from /server_info (server args as resolved)."""
    algo = info.get("speculative_algorithm")
    budget = info.get("speculative_dflash_tree_budget")
    if not algo:
        config = "plain"
    elif algo == "DFLASH" and budget:
        config = "ddtree"
    elif algo == "DFLASH":
        config = "linear"
    else:
        config = str(algo).lower()
    return {
        "config": config,
        "model": info.get("served_model_name") or info.get("model_path"),
        "model_path": info.get("model_path"),
        "speculative_algorithm": algo,
        "verify_width": info.get("speculative_num_draft_tokens"),
        "tree_budget": budget,
        "tree_topk": info.get("speculative_dflash_tree_topk"),
        "attention_backend": info.get("attention_backend"),
        "tp_size": info.get("tp_size"),
        "ep_size": info.get("ep_size"),
        "version": info.get("version"),
    }


def fail_unit(base: str, record: dict, unit: dict, why: str) -> None:
    """Record the failure, show the unit's log tail, raise one line."""
    lines = log_tail(unit["log"])
    for line in lines:
        progress("%s | %s" % (unit["name"], line))
    record["state"] = "failed"
    record["failure"] = "%s %s" % (unit["name"], why)
    record["failed_at"] = now()
    write_launch(base, record)
    last = lines[-1].strip() if lines else "(empty log)"
    raise Fail("RemoteCommandError", "%s %s: %s (log %s)" % (unit["name"], why, last, unit["log"]))


def wait_serving(base: str, record: dict, timeout: float, started_here: bool = False) -> list:
    """Block until every unit answers /health; its summary per unit. A unit that exits fails at
    once; so does the timeout. `started_here` (launch --wait): the command started these units, so
    a failure stops the rest of them too; a launch it found running is left as it is."""
    deadline = time.time() + timeout
    pending = list(record["units"])
    served = []
    started = time.time()

    def fail(unit: dict, why: str) -> None:
        if started_here:
            stop_groups(alive_units(record), 10.0)
            why += " (the launch is stopped)"
        fail_unit(base, record, unit, why)

    while pending:
        for unit in list(pending):
            if not alive_units({"units": [unit]}):
                fail(unit, "exited before it served")
            if not unit.get("url"):  # a node rank > 0: no HTTP server; rank 0's health covers it
                pending.remove(unit)
                continue
            if healthy(unit["url"]):
                info = http_json(unit["url"] + "/server_info")
                served.append(dict(serving_summary(info), unit=unit["name"], url=unit["url"]))
                pending.remove(unit)
                progress("%s: healthy after %.0f s" % (unit["name"], time.time() - started))
        if pending and time.time() > deadline:
            fail(pending[0], "not healthy after %.0f s" % timeout)
        if pending:
            time.sleep(1.0)
    record["state"] = "running"
    record["serving"] = served
    write_launch(base, record)
    return served


def op_wait(repo: Repo, req: dict) -> dict:
    """The last launch, once every unit is healthy (launch --wait, bench)."""
    base = req["base"]
    record = read_launch(base)
    name = req["target"]["name"]
    if record is None or not alive_units(record):
        what = "nothing was launched" if record is None else "the last launch (%s) is not running" % record["topology"]
        raise Fail(
            "StateError",
            "%s on %s; run `ddeploy launch --host %s --topology TOPOLOGY --wait` first" % (what, name, name),
        )
    started_here = bool(req.get("started_here"))
    serving = wait_serving(base, record, float(req.get("timeout", 900)), started_here)
    return {"ok": True, "record": record, "serving": serving}


# --- bench -------------------------------------------------------------------------------------


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


def run_client(req: dict, unit: dict, concurrency: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddeploy-bench-") as tmp:
        out_file = os.path.join(tmp, "result.jsonl")
        log = os.path.join(os.path.dirname(unit["log"]), "bench.log")
        with open(log, "a") as fh:
            fh.write("=== ddeploy bench concurrency %d at %s ===\n" % (concurrency, now()))
            fh.flush()
            rc = subprocess.run(
                bench_argv(req, unit, concurrency, out_file), stdin=subprocess.DEVNULL, stdout=fh, stderr=fh
            ).returncode
        lines = log_tail(log, 200)
        if not alive_units({"units": [unit]}):
            name = req["target"]["name"]
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
        if rc != 0 or not os.path.exists(out_file):
            missing = [line for line in lines if "No module named" in line]
            if missing:
                raise Fail(
                    "RemoteCommandError",
                    "SGLang's benchmark client does not run with %s: %s; install the sglang wheel's "
                    "requirements into that environment (log %s)" % (req["python"], missing[-1].strip(), log),
                )
            last = next((line for line in reversed(lines) if line.strip()), "no output")
            raise Fail("RemoteCommandError", "%s exited with %d: %s (log %s)" % (BENCH_MODULE, rc, last.strip(), log))
        with open(out_file) as fh:
            return json.loads(fh.read().strip().splitlines()[-1])


def greedy_probes(req: dict, unit: dict) -> list:
    """Each fixed prompt alone through /generate at temperature 0: tokens and verify counts."""
    out = []
    for prompt in req["probes"]["prompts"]:
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": int(req["probes"]["output_len"]),
                "ignore_eos": True,
            },
        }
        try:
            reply = http_json(unit["url"] + "/generate", body, timeout=600)
        except (urllib.error.URLError, OSError, ValueError) as exc:
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


def op_bench(repo: Repo, req: dict) -> dict:
    """Measure the serving launch: the client per concurrency, then the greedy probes."""
    base = req["base"]
    record = read_launch(base)
    if record is None or not alive_units(record):
        name = req["target"]["name"]
        raise Fail(
            "StateError",
            "nothing is serving on %s; run `ddeploy launch --host %s --topology TOPOLOGY --wait` first" % (name, name),
        )
    unit = record["units"][0]
    runs = []
    for concurrency in req["params"]["concurrency"]:
        progress("%s: %s, concurrency %d" % (unit["name"], BENCH_MODULE, concurrency))
        before = verify_calls(unit["url"])
        result = run_client(req, unit, concurrency)
        after = verify_calls(unit["url"])
        runs.append(
            {
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
        )
    probes = greedy_probes(req, unit) if req.get("probes") else None
    info = http_json(unit["url"] + "/server_info")
    summary = serving_summary(info)
    return {"ok": True, "serving": summary, "server_args": server_args(info), "runs": runs, "probes": probes}


def server_args(info: dict) -> dict:
    """/server_info without the live scheduler state (what the record keeps)."""
    return {k: v for k, v in info.items() if k not in ("internal_states",)}


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
