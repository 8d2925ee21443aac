"""`ddeploy launch|logs|stop`: detached server processes and their record (launch.json beside
the checkout), each stopped exactly (pid and start time)."""

import json
import os
import signal
import subprocess
import sys
import time

from .common import Fail, now, progress
from .repo import Repo


LAUNCH_RECORD = "launch.json"


def read_launch(base: str):
    """The last launch record, None when nothing was launched; unreadable is an error, not 'nothing'."""
    path = os.path.join(base, LAUNCH_RECORD)
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Fail(
            "StateError",
            "cannot read the launch record %s (%s); fix its permissions or run as its owner" % (path, exc.strerror),
        ) from None
    try:
        return json.loads(text)
    except ValueError:
        raise Fail("StateError", "%s is not valid JSON; remove it after checking nothing runs" % path) from None


def write_launch(base: str, record: dict) -> None:
    path = os.path.join(base, LAUNCH_RECORD)
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh, indent=2)
    os.rename(path + ".tmp", path)


def start_time(pid: int):
    """Field 22 of /proc/PID/stat (the command name in field 2 may hold spaces), None when gone or a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def alive_units(record) -> list:
    """The recorded units whose pid still runs with the recorded start time (a reused pid is not ours)."""
    return [u for u in (record or {}).get("units", []) if start_time(int(u["pid"])) == str(u["starttime"])]


def start_unit(remote: str, unit: dict) -> dict:
    log = os.path.join(remote, unit["name"] + ".log")
    with open(log, "a") as fh:
        fh.write("=== ddeploy launch %s at %s ===\n" % (unit["script_file"], now()))
        fh.flush()
        # Its own session (setsid): it leads its own process group, and stop signals exactly that group.
        proc = subprocess.Popen(
            ["nohup", "bash", "./" + unit["script_file"]],
            cwd=remote,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started = start_time(proc.pid)
    if started is None:
        raise Fail("RemoteCommandError", "%s did not start (exited at once); see %s" % (unit["script_file"], log))
    return {
        "name": unit["name"],
        "script_file": unit["script_file"],
        "pid": proc.pid,
        "starttime": started,
        "log": log,
        "url": unit.get("url"),
    }


def write_units(remote: str, units: list) -> None:
    os.makedirs(remote, exist_ok=True)
    for unit in units:
        for fname, text, mode in ((unit["script_file"], unit["script"], 0o755), (unit["env_file"], unit["env"], 0o600)):
            path = os.path.join(remote, fname)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(path + ".tmp", mode)
            os.rename(path + ".tmp", path)


def op_launch(repo: Repo, req: dict) -> dict:
    """Write the host's units (or, with `restart`, start a recorded launch's scripts again), start
    each detached, record pids; refuse while a recorded launch runs. `wait`: seconds to wait for
    every unit to serve (serving.wait_serving), 0 for none."""
    base = req["base"]
    previous = read_launch(base)
    running = alive_units(previous)
    if running:
        raise Fail(
            "StateError",
            "topology %s is still running (pid %s); run `ddeploy stop --host %s` first"
            % (previous["topology"], ", ".join(str(u["pid"]) for u in running), req["target"]["name"]),
        )
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
        write_units(remote, units)
        keep = {"variant": req.get("variant"), "sets": req.get("sets") or []}
    record = dict(keep, topology=topology, dir=remote, state="running", started_at=now(), units=[])
    try:
        for unit in units:
            s = start_unit(remote, unit)
            record["units"].append(s)
            progress("started %s (pid %d), log %s" % (s["name"], s["pid"], s["log"]))
    finally:  # whatever started is recorded, so `stop` can find it even if a later unit failed
        write_launch(base, record)
    time.sleep(float(req.get("settle", 1.0)))  # a script that fails at once (bad python, bad flag) shows it here
    alive = alive_units(record)
    dead = [u for u in record["units"] if u not in alive]
    if dead:
        from .serving import fail_unit

        fail_unit(base, record, dead[0], "exited right after start")
    out = {"ok": True, "record": record}
    if req.get("wait"):
        from .serving import wait_serving

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


def op_stop(repo: Repo, req: dict) -> dict:
    """TERM each recorded process group (verified by start time), wait up to grace, KILL the rest."""
    base, grace = req["base"], max(1.0, float(req.get("grace", 30)))
    record = read_launch(base)
    running = alive_units(record)
    if not running:
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
    outcome = stop_groups(running, grace)
    for u in running:
        progress("%s (pid %s): %s" % (u["name"], u["pid"], outcome[u["name"]]))
    record["state"] = "stopped"
    record["stopped_at"] = now()
    write_launch(base, record)
    return {"ok": True, "record": record, "outcome": outcome}


def group_alive(unit: dict) -> bool:
    """Whether the unit's process group still has a live member. The group is the recorded one only
    while its leader is (start time checked); after that the group id cannot be reused while any
    member lives, so a remaining member is ours. The leader is reaped first if this process
    started it (a zombie still counts as a member)."""
    pid = int(unit["pid"])
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_groups(units: list, grace: float) -> dict:
    """TERM each unit's process group, wait up to `grace` s for every member (the server's workers
    too) to exit, KILL what is left; {unit name: "terminated" | "killed"}."""
    for u in units:
        signal_group(int(u["pid"]), signal.SIGTERM)
    deadline = time.time() + grace
    while any(group_alive(u) for u in units) and time.time() < deadline:
        time.sleep(0.1)
    outcome = {}
    for u in units:
        outcome[u["name"]] = "terminated"
        if group_alive(u):
            signal_group(int(u["pid"]), signal.SIGKILL)
            outcome[u["name"]] = "killed"
    for _ in range(50):  # KILL cannot be ignored; the kernel needs a moment to take them down
        if not any(group_alive(u) for u in units):
            break
        time.sleep(0.1)
    return outcome


def signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
