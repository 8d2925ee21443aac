"""`ddeploy launch | logs | stop`: detached server processes and their record (the host's launch
record, launch_record.py; the launch directory holds only scripts and logs). Starting and
stopping hold the host's launch lock; a start that fails, or whose record cannot be written, stops
what it started (every unit, each unit's whole session) before it reports, so nothing runs
unrecorded or half-launched; so does a start whose client went away before hearing of it (Ctrl-C
during a multi-host launch: the host whose start was in flight goes back to what it served)."""

import os
import subprocess
import sys
import time

from .client import gone
from .common import Fail, now, progress, test_pause
from .launch_record import LAUNCH_RECORD, alive_units, hold_launch_lock, live_units, new_launch_id, read_launch
from .launch_record import record_path, write_launch
from .repo import Repo
from .serving import fail_launch, wait_serving
from .units import start_unit, stop_groups, unit_files, write_files


def refuse_if_running(host: str):
    """The last record, refused while any process of its units still runs (a server whose leader
    died but whose workers live on still holds the GPUs)."""
    previous = read_launch()
    running = live_units(previous)
    if running:
        unit = running[0]
        raise Fail(
            "StateError",
            "%s (topology %s, pid %s, scripts in %s) is still running on %s; run `ddeploy stop --host %s` first"
            % (unit["name"], previous["topology"], unit["pid"], previous.get("dir", "?"), host, host),
        )
    return previous


def record_or_undo(record: dict, replaces, host: str) -> None:
    """Write the record; when it cannot be written (a full disk, a record replaced meanwhile), stop
    every unit it names so nothing runs unrecorded, and fail naming the host."""
    try:
        write_launch(record, replaces=replaces)
    except (Fail, OSError) as exc:
        stop_groups(record["units"], 10.0)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise Fail(
            "StateError",
            "the launch record %s could not be written (%s), so the %s launch was stopped; fix that and run "
            "`ddeploy launch --host %s` again" % (record_path(), why, record["topology"], host),
        ) from None


def start_launch(topology: str, remote: str, units: list, keep: dict, req: dict) -> dict:
    """Start each unit detached, recording each as it starts (so `stop` finds whatever runs);
    after `settle` s every unit must still run. Any failure stops them all (fail_launch)."""
    host = req["target"]["name"]
    record = dict(keep, id=new_launch_id(), topology=topology, dir=remote, state="running", started_at=now(), units=[])
    record_or_undo(record, None, host)
    for unit in units:
        try:
            started = start_unit(remote, unit)
        except Fail as exc:
            log = os.path.join(remote, unit["name"] + ".log")
            fail_launch(record, {"name": unit["name"], "log": log}, str(exc), stop=True)
        record["units"].append(started)
        test_pause(req, "launch_unit_started")
        record_or_undo(record, record["id"], host)
        progress("started %s (pid %d), log %s" % (started["name"], started["pid"], started["log"]))
    time.sleep(float(req.get("settle", 1.0)))  # a script that fails at once (bad python, bad flag) shows it here
    alive = alive_units(record)
    dead = [u for u in record["units"] if u not in alive]
    if dead:
        fail_launch(record, dead[0], "exited right after start", stop=True)
    return record


def undo_unreported(record: dict) -> None:
    """The client went away (Ctrl-C, a cut link) before it heard that this launch started: it
    cannot stop it or tell anyone, so the host goes back to what it served before, recorded."""
    stop_groups(record["units"], 10.0)
    record.update(state="stopped", stopped_at=now(), failure="its client went away before the launch was reported")
    write_launch(record, replaces=record["id"])
    raise Fail("StateError", "the client went away while %s was starting; it was stopped" % record["topology"])


def op_launch(repo: Repo, req: dict) -> dict:
    """Write the host's units (or, with `restart`, start a recorded launch's scripts again), start
    each detached, record pids; refuse while a recorded launch runs. `wait`: seconds to wait for
    every unit to serve (serving.wait_serving), 0 for none."""
    base = req["base"]
    hold_launch_lock(req)
    refuse_if_running(req["target"]["name"])
    again = req.get("restart")
    if again:
        remote, units, topology = again["dir"], again["units"], again["topology"]
        missing = [u["script_file"] for u in units if not os.path.isfile(os.path.join(remote, u["script_file"]))]
        if missing:
            raise Fail("StateError", "cannot start %s again: %s is gone from %s" % (topology, missing[0], remote))
        keep = {k: again.get(k) for k in ("variant", "sets")}
    else:
        topology, units = req["topology"], req["units"]
        remote = os.path.join(base, topology + ("-" + req["variant"] if req.get("variant") else ""))
        for unit in units:
            write_files(remote, unit_files(unit))
        keep = {"variant": req.get("variant"), "sets": req.get("sets") or []}
    record = start_launch(topology, remote, units, keep, req)
    if not req.get("wait") and gone():
        undo_unreported(record)
    out = {"ok": True, "record": record}
    if req.get("wait"):
        out["serving"] = wait_serving(record, float(req["wait"]), started_here=True)
    return out


def op_logs(repo: Repo, req: dict) -> dict:
    """The last launch's logs on stderr (streamed by the client); --follow ends when the server exits."""
    # No lock: `--follow` runs as long as the server; an older agent's record is read where it is.
    legacy = os.path.join(req["base"], LAUNCH_RECORD) if req.get("base") else ""
    record = read_launch() or (read_launch(legacy) if legacy and os.path.isfile(legacy) else None)
    if record is None:
        raise Fail(
            "StateError",
            "nothing was launched here (no %s); run `ddeploy launch` first" % record_path(),
        )
    files = [u["log"] for u in record["units"]]
    argv = ["tail", "-n", str(int(req.get("lines", 50)))]
    if req.get("follow"):
        running = alive_units(record)
        argv += ["-F"] + (["--pid=%d" % running[0]["pid"]] if running else [])
    sys.stderr.flush()
    rc = subprocess.run(argv + files, stdout=2, stderr=subprocess.DEVNULL).returncode
    return {"ok": True, "rc": rc, "files": files}


def stop_launch(record: dict, grace: float) -> dict:
    """Stop the record's units (every process of each unit's session), record it stopped; {unit
    name: outcome}."""
    running = live_units(record)
    outcome = stop_groups(running, grace)
    for u in running:
        progress("%s (pid %s): %s" % (u["name"], u["pid"], outcome[u["name"]]))
    record.update(state="stopped", stopped_at=now())
    write_launch(record, replaces=record.get("id"))
    return outcome


def op_stop(repo: Repo, req: dict) -> dict:
    """TERM every process of each recorded unit's session (the leader verified by start time, or
    gone), wait up to grace, KILL the rest."""
    grace = max(1.0, float(req.get("grace", 30)))
    hold_launch_lock(req)
    record = read_launch()
    if not live_units(record):
        if record is None:
            what = "no launch recorded in %s" % record_path()
        elif record.get("state") == "stopped":
            what = "last launch %s was stopped at %s" % (record["topology"], record.get("stopped_at", "?"))
        else:
            what = "last launch %s has exited (see `ddeploy logs --host %s`)" % (
                record["topology"],
                req["target"]["name"],
            )
        raise Fail("StateError", "nothing to stop: %s" % what)
    outcome = stop_launch(record, grace)
    return {"ok": True, "record": record, "outcome": outcome}
