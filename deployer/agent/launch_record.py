"""The host's launch record and launch lock, in the agent's own place on the host: the launches
directory of its cache (`$DDEPLOY_CACHE_DIR`, else `$XDG_CACHE_HOME/ddeploy`, else
`~/.cache/ddeploy`, then `launches/`), whatever launch directory a launch used. The launch
directory holds only scripts, env files and logs: exclusion belongs to the host and its GPUs, so
`--set launch_dir=` cannot start a second server beside the first, and `status`/`stop`/`logs`
find a launch without the `--set` it was started with.

The record names the last launch: its id, topology, state, scripts dir and units (pid, start time,
log). Every operation that starts, stops or waits on servers (launch, stop, wait, bench) holds the
launch lock (fcntl.flock on launch.lock, dropped by the kernel when the agent ends) for its whole
work, and writes the record by compare-and-swap on the launch id: an operation whose launch was
replaced meanwhile (a baseline restored, a new launch) never overwrites the newer record. A record
left by an older agent in a launch directory (`<launch_dir>/launch.json`) is adopted once, under
the lock, when nothing is recorded here yet.
"""

import json
import os
import time

from .common import Fail, hostname, now, progress

LAUNCH_RECORD = "launch.json"
LAUNCH_LOCK = "launch.lock"
LOCK_WAIT = 5.0  # seconds a second operation waits for the lock before naming its holder


def launches_dir() -> str:
    """Where this host keeps its launch lock and record (the same rule as the client's cache)."""
    cache = os.environ.get("DDEPLOY_CACHE_DIR")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(xdg, "ddeploy")
    return os.path.join(cache, "launches")


def record_path() -> str:
    return os.path.join(launches_dir(), LAUNCH_RECORD)


def new_launch_id() -> str:
    """Unique per start on this host: time, pid, and a random suffix."""
    return "%s-%d-%s" % (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), os.getpid(), os.urandom(3).hex())


def read_launch(path: str = ""):
    """The last launch record (`path`: another record file), None when nothing was launched;
    unreadable is an error, not 'nothing'."""
    path = path or record_path()
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


def write_launch(record: dict, replaces=None) -> None:
    """Write the record atomically. Compare-and-swap: the record on disk must be the one this
    operation read (`replaces`: its launch id, or None when it starts a new launch over whatever
    was there); a record replaced meanwhile is never overwritten."""
    if replaces is not None:
        current = read_launch() or {}
        if current.get("id") != replaces:
            raise Fail(
                "StateError",
                "the launch record %s changed under this operation (now %s); left as it is"
                % (record_path(), current.get("id") or "none"),
            )
    path = record_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2)
    os.replace(tmp, path)


def _stat(pid: int):
    """The fields of /proc/PID/stat after the command name (which may hold spaces): [state, ppid,
    pgrp, session, ...], None when the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int):
    """Field 22 of /proc/PID/stat, None when gone or a zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def alive_units(record) -> list:
    """The recorded units whose leader still runs with the recorded start time (a reused pid is not
    ours): the units that can serve."""
    return [u for u in (record or {}).get("units", []) if start_time(int(u["pid"])) == str(u["starttime"])]


def session_members(sid: int) -> list:
    """The live processes of session `sid` (the unit's server and the workers it forked)."""
    members = []
    for name in os.listdir("/proc"):
        fields = _stat(int(name)) if name.isdigit() else None
        if fields and fields[0] != "Z" and fields[3] == str(sid):
            members.append(int(name))
    return members


def unit_pids(unit: dict) -> list:
    """The live processes of a recorded unit: its leader's session, also after the leader died (a
    scheduler that outlives it keeps its GPU memory). A pid cannot be reused while a session of
    that id has members, so once the leader is gone the remaining members are ours; a leader pid
    that runs with another start time was reused after our session ended."""
    pid = int(unit["pid"])
    fields = _stat(pid)
    if fields is not None and fields[19] != str(unit["starttime"]):
        return []
    return session_members(pid)


def live_units(record) -> list:
    """The recorded units with any process left (leader or not): what holds the host's GPUs."""
    return [u for u in (record or {}).get("units", []) if unit_pids(u)]


# --- the launch lock ------------------------------------------------------------------------------


_HELD = {}  # the lock file -> the open fd whose flock this process holds


def _holder(path: str) -> dict:
    try:
        with open(path + ".json") as fh:
            owner = json.load(fh)
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def describe_holder(owner: dict) -> str:
    return "`%s` (pid %s, by %s, since %s)" % (
        owner.get("command", "?"),
        owner.get("pid", "?"),
        owner.get("by", "?"),
        owner.get("at", "?"),
    )


def hold_launch_lock(req: dict, wait: float = LOCK_WAIT) -> None:
    """Hold the host's launch lock until this agent ends: wait up to `wait` s for another operation
    to finish, then fail naming it. Only "would block" means held. Then adopt a record an older
    agent left in the request's launch directory."""
    path = os.path.join(launches_dir(), LAUNCH_LOCK)
    if path not in _HELD:
        _HELD[path] = _take_lock(path, wait)
        _write_holder(path, req)
    if req.get("base"):
        adopt_legacy(req["base"])


def _take_lock(path: str, wait: float) -> int:
    import errno
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.time() + wait
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise Fail(
                    "LockError",
                    "cannot lock %s: %s; keep the agent's cache (DDEPLOY_CACHE_DIR) on a filesystem with flock "
                    "support" % (path, exc.strerror),
                ) from None
        who = describe_holder(_holder(path))
        if time.time() >= deadline:
            os.close(fd)
            busy = "the launches on this host are busy: %s holds their lock; try again when it ends" % who
            raise Fail("LockError", busy)
        if not said:
            progress("waiting for %s to finish with this host's launches" % who)
            said = True
        time.sleep(0.2)


def _write_holder(path: str, req: dict) -> None:
    owner = {"command": req.get("command", req.get("op")), "pid": os.getpid(), "by": req.get("by", "?"),
             "host": hostname(), "at": now()}  # fmt: skip
    tmp = "%s.json.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(owner, fh)
    os.replace(tmp, path + ".json")


def adopt_legacy(base: str) -> None:
    """A record an older agent kept in the launch directory becomes this host's record (once,
    under the lock, when none is kept here): its servers stay findable by status, stop and logs."""
    old = os.path.join(base, LAUNCH_RECORD)
    if not os.path.isfile(old) or os.path.exists(record_path()):
        return
    record = read_launch(old)
    if isinstance(record, dict) and record.get("units") is not None:
        write_launch(record)
        os.replace(old, old + ".adopted")
        progress("adopted the launch record %s (now %s)" % (old, record_path()))
