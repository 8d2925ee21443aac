"""Is a launch idle, and does it generate: `drain` and `health`, the checks made around a unit's
restart (`ddeploy rollout`: drain before it stops a unit, health after it starts one).

Both run on the host, under the launch lock like `wait`, against the units of the last launch that
serve HTTP (their URLs are in the launch record). drain polls each unit's Prometheus text
(/metrics, served with --enable-metrics) until SGLang's gauges of running and queued requests
read 0 on every unit, or its timeout passes; health asks each unit's /health_generate, where
SGLang generates one token, all units at once.
"""

import http.client
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .client import pause
from .common import Fail, progress
from .launch_record import alive_units, hold_launch_lock
from .repo import Repo
from .serving import running_launch, server_request

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
SAY_EVERY = 10.0  # seconds between the progress lines of a drain that waits
# With priority scheduling SGLang exports the total under priority="" and a breakdown under
# priority="N" beside it; only the total counts.
BREAKDOWN = re.compile(r'(?:^|,)\s*priority="[^"]+"')
UNREADABLE = (urllib.error.URLError, http.client.HTTPException, OSError, ValueError)


def serving_units(req: dict) -> list:
    """The running units of the host's last launch that serve HTTP (node rank 0 of each)."""
    hold_launch_lock(req)
    record = running_launch(req["target"]["name"])
    return [u for u in alive_units(record) if u.get("url")]


def parse_sample(line: str):
    """(name, labels, value) of one Prometheus text sample; None for a comment or blank line."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    name, brace, rest = line.partition("{")
    labels = ""
    if brace:
        labels, _, rest = rest.rpartition("}")
    else:
        name, _, rest = line.partition(" ")
    return name.strip(), labels, float(rest.split()[0])


def gauge_totals(text: str) -> dict:
    """{gauge: its sum over the unit's series (one per scheduler)} for RUNNING and QUEUED; a gauge
    the text lacks is absent."""
    totals = {}
    for sample in filter(None, map(parse_sample, text.splitlines())):
        name, labels, value = sample
        if name in (RUNNING, QUEUED) and not BREAKDOWN.search(labels):
            totals[name] = totals.get(name, 0) + int(value)
    return totals


def reason(exc: Exception) -> str:
    """Why a request got no answer, in words (URLError wraps the socket's error)."""
    return str(getattr(exc, "reason", exc)) or type(exc).__name__


def no_metrics(unit: dict, why: str) -> Fail:
    what = "%s: %s at %s/metrics" % (unit["name"], why, unit["url"])
    return Fail("RemoteCommandError", what + "; launch with --enable-metrics, or drain it by hand")


def unit_load(unit: dict) -> tuple:
    """(running, queued) requests of one unit, from its /metrics."""
    request = server_request(unit["url"] + "/metrics")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310 (http only)
            totals = gauge_totals(resp.read().decode(errors="replace"))
    except UNREADABLE as exc:
        raise no_metrics(unit, "cannot read the metrics (%s)" % reason(exc)) from None
    if not totals:
        raise no_metrics(unit, "neither %s nor %s" % (RUNNING, QUEUED))
    return totals.get(RUNNING, 0), totals.get(QUEUED, 0)


def say_load(loads: dict, left: float) -> None:
    for name, (running, queued) in loads.items():
        if running or queued:
            line = "%s: %d running, %d queued; waiting up to %.0f s" % (name, running, queued, left)
            progress(line)


def wait_idle(units: list, timeout: float, poll: float) -> tuple:
    """Poll the units' loads every `poll` s until all read (0, 0) or `timeout` s pass; the last
    loads ({unit: (running, queued)}) and the seconds waited."""
    started = time.time()
    said = started - SAY_EVERY
    while True:
        loads = {u["name"]: unit_load(u) for u in units}
        waited = time.time() - started
        if all(load == (0, 0) for load in loads.values()) or waited >= timeout:
            return loads, waited
        if time.time() - said >= SAY_EVERY:
            say_load(loads, timeout - waited)
            said = time.time()
        if pause(min(poll, timeout - waited)):  # woken early: the client has gone
            raise Fail("StateError", "the client went away during the drain; nothing was changed")


def op_drain(repo: Repo, req: dict) -> dict:
    """Wait until no unit of the last launch runs or queues a request (or `timeout` s pass)."""
    units = serving_units(req)
    loads, waited = wait_idle(units, float(req["timeout"]), float(req.get("poll", 1.0)))
    running = sum(running for running, _ in loads.values())
    queued = sum(queued for _, queued in loads.values())
    return {
        "ok": True,
        "drained": running == 0 and queued == 0,
        "running": running,
        "queued": queued,
        "waited_s": round(waited, 2),
    }


def unit_health(unit: dict, timeout: float) -> dict:
    """The status of one unit's /health_generate; `error` says why none came back."""
    status, error = None, None
    request = server_request(unit["url"] + "/health_generate")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 (http only)
            status = resp.status
    except urllib.error.HTTPError as exc:  # an answer, not a failure to get one (503: unhealthy)
        status = exc.code
    except UNREADABLE as exc:
        error = reason(exc)
    return {"name": unit["name"], "url": unit["url"], "status": status, "error": error}


def op_health(repo: Repo, req: dict) -> dict:
    """Each serving unit's /health_generate, all at once, each bounded by `timeout` s."""
    units = serving_units(req)
    timeout = float(req.get("timeout", 60))
    with ThreadPoolExecutor(max(1, len(units))) as pool:
        checked = list(pool.map(lambda u: unit_health(u, timeout), units))
    return {"ok": True, "units": checked}
