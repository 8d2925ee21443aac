"""What a launched server really serves: `launch --wait`, `wait`, and the checks bench makes.

The agent polls the units on the host itself (their URLs are in the launch record), so no port is
forwarded: every unit of the last launch answers /health; /server_info, summarised, per unit. A
unit that exits (or never gets healthy: then, if this command started it, the launch is stopped)
fails the call with its log's last lines, and the record says so. A client that goes away while
a wait runs ends it: a launch this command started is stopped, one it found is left as it is.
"""

import json
import time
import urllib.error
import urllib.request

from .client import pause
from .common import Fail, now, progress
from .launch_record import alive_units, hold_launch_lock, read_launch, write_launch
from .repo import Repo
from .units import stop_groups


TAIL_LINES = 15


def server_request(url: str, payload=None):
    """A request to a unit's own server; only http:// URLs (the client builds them from render
    values), never file: or another scheme."""
    if not url.startswith("http://"):
        raise Fail("UsageError", "not a server URL: %r" % url)
    data = None if payload is None else json.dumps(payload).encode()
    return urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # noqa: S310


def http_json(url: str, payload=None, timeout: float = 30.0):
    """GET (or POST `payload`) a JSON endpoint of a local server."""
    with urllib.request.urlopen(server_request(url, payload), timeout=timeout) as resp:  # noqa: S310 (http only)
        return json.loads(resp.read() or b"null")


VERIFY_COUNTER = "sglang:spec_verify_calls_total"


def verify_calls(url: str):
    """SGLang's counter of verify steps over finished requests (/metrics, --enable-metrics), or
    None when the server exports no metrics."""
    try:
        with urllib.request.urlopen(server_request(url + "/metrics"), timeout=30) as resp:  # noqa: S310 (http only)
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
        with urllib.request.urlopen(server_request(url + "/health"), timeout=30) as resp:  # noqa: S310 (http only)
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


def fail_launch(record: dict, unit: dict, why: str, stop: bool) -> None:
    """The launch failed at `unit`: with `stop` (this command started it), stop every unit of it
    first; record the failure, show the unit's log tail, raise one line."""
    if stop:
        stop_groups(record["units"], 10.0)
        why += " (the launch is stopped)"
    lines = log_tail(unit["log"]) if unit.get("log") else []
    for line in lines:
        progress("%s | %s" % (unit["name"], line))
    record.update(state="failed", failure="%s %s" % (unit["name"], why), failed_at=now())
    write_launch(record, replaces=record.get("id"))
    last = lines[-1].strip() if lines else "(empty log)"
    where = " (log %s)" % unit["log"] if unit.get("log") else ""
    raise Fail("RemoteCommandError", "%s %s: %s%s" % (unit["name"], why, last, where))


def abandon(record: dict, started_here: bool) -> None:
    """The client went away during a wait: stop what this command started (recorded as stopped);
    a launch it found running is left as it is."""
    if started_here:
        stop_groups(record["units"], 10.0)
        record.update(state="stopped", stopped_at=now(), failure="its client went away before it served")
        write_launch(record, replaces=record.get("id"))
    raise Fail("StateError", "the client went away while %s was starting" % record["topology"])


def wait_serving(record: dict, timeout: float, started_here: bool = False, interruptible: bool = True):
    """Block until every unit answers /health; its summary per unit. A unit that exits fails at
    once; so does the timeout, and (`interruptible`) the client going away. `started_here` (launch
    --wait, a bench baseline): the command started these units, so a failure stops them all; a
    launch it found running is left as it is."""
    deadline = time.time() + timeout
    pending = list(record["units"])
    served = []
    started = time.time()
    while pending:
        for unit in list(pending):
            if not alive_units({"units": [unit]}):
                fail_launch(record, unit, "exited before it served", stop=started_here)
            if not unit.get("url"):  # a node rank > 0: no HTTP server; rank 0's health covers it
                pending.remove(unit)
                continue
            if healthy(unit["url"]):
                info = http_json(unit["url"] + "/server_info")
                served.append(dict(serving_summary(info), unit=unit["name"], url=unit["url"]))
                pending.remove(unit)
                progress("%s: healthy after %.0f s" % (unit["name"], time.time() - started))
        if pending and time.time() > deadline:
            fail_launch(record, pending[0], "not healthy after %.0f s" % timeout, stop=started_here)
        if not pending:
            break
        if not interruptible:
            time.sleep(1.0)
        elif pause(1.0):  # woken early: the client has gone
            abandon(record, started_here)
    record.update(state="running", serving=served)
    write_launch(record, replaces=record.get("id"))
    return served


def running_launch(name: str) -> dict:
    """The host's last launch record while a unit of it runs (the caller holds the launch lock);
    else StateError naming what to run first."""
    record = read_launch()
    if record is None or not alive_units(record):
        what = "nothing was launched" if record is None else "the last launch (%s) is not running" % record["topology"]
        raise Fail(
            "StateError",
            "%s on %s; run `ddeploy launch --host %s --topology TOPOLOGY --wait` first" % (what, name, name),
        )
    return record


def op_wait(repo: Repo, req: dict) -> dict:
    """The last launch, once every unit is healthy (launch --wait, bench)."""
    hold_launch_lock(req)
    record = running_launch(req["target"]["name"])
    started_here = bool(req.get("started_here"))
    serving = wait_serving(record, float(req.get("timeout", 900)), started_here)
    return {"ok": True, "record": record, "serving": serving}
