"""The host's launch record (launch.json in the launch directory) and the launch lock beside it.

The record names the last launch: its id, topology, state and units (pid, start time, log). Every
operation that starts, stops or waits on servers (launch, stop, wait, bench) holds the launch lock
(fcntl.flock on launch.lock, dropped by the kernel when the agent ends) for its whole work, and
writes the record by compare-and-swap on the launch id: an operation whose launch was replaced
meanwhile (a baseline restored, a new launch) never overwrites the newer record.
"""

import json
import os
import time

from .common import Fail, hostname, now, progress

LAUNCH_RECORD = "launch.json"
LAUNCH_LOCK = "launch.lock"
LOCK_WAIT = 5.0  # seconds a second operation waits for the lock before naming its holder


def new_launch_id() -> str:
    """Unique per start on this host: time, pid, and a random suffix."""
    return "%s-%d-%s" % (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), os.getpid(), os.urandom(3).hex())


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


def write_launch(base: str, record: dict, replaces=None) -> None:
    """Write the record atomically. Compare-and-swap: the record on disk must be the one this
    operation read (`replaces`: its launch id, or None when it starts a new launch over whatever
    was there); a record replaced meanwhile is never overwritten."""
    if replaces is not None:
        current = read_launch(base) or {}
        if current.get("id") != replaces:
            raise Fail(
                "StateError",
                "the launch record in %s changed under this operation (now %s); left as it is"
                % (base, current.get("id") or "none"),
            )
    path = os.path.join(base, LAUNCH_RECORD)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2)
    os.replace(tmp, path)


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


# --- the launch lock ------------------------------------------------------------------------------


_HELD = {}  # launch directory -> the open fd whose flock this process holds


def _holder(base: str) -> dict:
    try:
        with open(os.path.join(base, LAUNCH_LOCK + ".json")) as fh:
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


def hold_launch_lock(base: str, req: dict, wait: float = LOCK_WAIT) -> None:
    """Hold the launch directory's lock until this agent ends: wait up to `wait` s for another
    operation to finish, then fail naming it. Only "would block" means held."""
    import errno
    import fcntl

    if base in _HELD:
        return
    os.makedirs(base, exist_ok=True)
    fd = os.open(os.path.join(base, LAUNCH_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.time() + wait
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise Fail(
                    "LockError",
                    "cannot lock %s: %s; keep the launch directory on a filesystem with flock support"
                    % (os.path.join(base, LAUNCH_LOCK), exc.strerror),
                ) from None
        who = describe_holder(_holder(base))
        if time.time() >= deadline:
            os.close(fd)
            busy = "the launches in %s are busy: %s holds their lock; try again when it ends" % (base, who)
            raise Fail("LockError", busy)
        if not said:
            progress("waiting for %s to finish with %s" % (who, base))
            said = True
        time.sleep(0.2)
    _HELD[base] = fd
    owner = {"command": req.get("command", req.get("op")), "pid": os.getpid(), "by": req.get("by", "?"),
             "host": hostname(), "at": now()}  # fmt: skip
    tmp = os.path.join(base, "%s.json.%d.tmp" % (LAUNCH_LOCK, os.getpid()))
    with open(tmp, "w") as fh:
        json.dump(owner, fh)
    os.replace(tmp, os.path.join(base, LAUNCH_LOCK + ".json"))
