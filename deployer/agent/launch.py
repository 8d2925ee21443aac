"""`ddeploy launch | logs | stop`: detached server processes and their record (launch.json in the
launch directory). Starting and stopping hold the launch lock; a start that fails stops what it
started (every unit) before it reports, so nothing runs unrecorded or half-launched."""

import os
import subprocess
import sys
import time

from .common import Fail, now, progress
from .launch_record import LAUNCH_RECORD, alive_units, hold_launch_lock, new_launch_id, read_launch, write_launch
from .repo import Repo
from .serving import fail_launch, wait_serving
from .units import start_unit, stop_groups, unit_files, write_files


def refuse_if_running(base: str, host: str):
    """The last record, refused while any of its units still runs."""
    previous = read_launch(base)
    running = alive_units(previous)
    if running:
        raise Fail(
            "StateError",
            "topology %s is still running (pid %s); run `ddeploy stop --host %s` first"
            % (previous["topology"], ", ".join(str(u["pid"]) for u in running), host),
        )
    return previous


def start_launch(base: str, topology: str, remote: str, units: list, keep: dict, settle: float) -> dict:
    """Start each unit detached, recording each as it starts (so `stop` finds whatever runs);
    after `settle` s every unit must still run. Any failure stops them all (fail_launch)."""
    record = dict(keep, id=new_launch_id(), topology=topology, dir=remote, state="running", started_at=now(), units=[])
    write_launch(base, record)
    for unit in units:
        try:
            started = start_unit(remote, unit)
        except Fail as exc:
            log = os.path.join(remote, unit["name"] + ".log")
            fail_launch(base, record, {"name": unit["name"], "log": log}, str(exc), stop=True)
        record["units"].append(started)
        write_launch(base, record, replaces=record["id"])
        progress("started %s (pid %d), log %s" % (started["name"], started["pid"], started["log"]))
    time.sleep(settle)  # a script that fails at once (bad python, bad flag) shows it here
    alive = alive_units(record)
    dead = [u for u in record["units"] if u not in alive]
    if dead:
        fail_launch(base, record, dead[0], "exited right after start", stop=True)
    return record


def op_launch(repo: Repo, req: dict) -> dict:
    """Write the host's units (or, with `restart`, start a recorded launch's scripts again), start
    each detached, record pids; refuse while a recorded launch runs. `wait`: seconds to wait for
    every unit to serve (serving.wait_serving), 0 for none."""
    base = req["base"]
    hold_launch_lock(base, req)
    refuse_if_running(base, req["target"]["name"])
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
    record = start_launch(base, topology, remote, units, keep, float(req.get("settle", 1.0)))
    out = {"ok": True, "record": record}
    if req.get("wait"):
        out["serving"] = wait_serving(base, record, float(req["wait"]), started_here=True)
    return out


def op_logs(repo: Repo, req: dict) -> dict:
    """The last launch's logs on stderr (streamed by the client); --follow ends when the server exits."""
    base = req["base"]
    record = read_launch(base)
    if record is None:
        raise Fail(
            "StateError",
            "nothing was launched here (no %s); run `ddeploy launch` first" % os.path.join(base, LAUNCH_RECORD),
        )
    files = [u["log"] for u in record["units"]]
    argv = ["tail", "-n", str(int(req.get("lines", 50)))]
    if req.get("follow"):
        running = alive_units(record)
        argv += ["-F"] + (["--pid=%d" % running[0]["pid"]] if running else [])
    sys.stderr.flush()
    rc = subprocess.run(argv + files, stdout=2, stderr=subprocess.DEVNULL).returncode
    return {"ok": True, "rc": rc, "files": files}


def stop_launch(base: str, record: dict, grace: float) -> dict:
    """Stop the record's running units, record it stopped; {unit name: outcome}."""
    running = alive_units(record)
    outcome = stop_groups(running, grace)
    for u in running:
        progress("%s (pid %s): %s" % (u["name"], u["pid"], outcome[u["name"]]))
    record.update(state="stopped", stopped_at=now())
    write_launch(base, record, replaces=record.get("id"))
    return outcome


def op_stop(repo: Repo, req: dict) -> dict:
    """TERM each recorded process group (verified by start time), wait up to grace, KILL the rest."""
    base, grace = req["base"], max(1.0, float(req.get("grace", 30)))
    if os.path.isdir(base):
        hold_launch_lock(base, req)
    record = read_launch(base)
    if not alive_units(record):
        if record is None:
            what = "no launch recorded in %s" % os.path.join(base, LAUNCH_RECORD)
        elif record.get("state") == "stopped":
            what = "last launch %s was stopped at %s" % (record["topology"], record.get("stopped_at", "?"))
        else:
            what = "last launch %s has exited (see `ddeploy logs --host %s`)" % (
                record["topology"],
                req["target"]["name"],
            )
        raise Fail("StateError", "nothing to stop: %s" % what)
    outcome = stop_launch(base, record, grace)
    return {"ok": True, "record": record, "outcome": outcome}
