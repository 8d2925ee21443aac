"""The checkout's lock: fcntl.flock on .git/ddeploy/deploy.lock, held for the whole operation and
released by the kernel when the agent ends or dies (nothing stale to break); the holder's record
deploy.lock.json beside it, for messages."""

import json
import os
import time

from .common import Fail, hostname, progress
from .repo import Repo


def lock_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock")


def holder_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock.json")


_HELD = {}  # lock file path -> the open fd whose flock this process holds


def _open_lock(repo: Repo) -> int:
    os.makedirs(repo.ddir, exist_ok=True)
    return os.open(lock_path(repo), os.O_RDWR | os.O_CREAT, 0o644)


def _lock_is_held(repo: Repo) -> bool:
    """Whether some process holds the flock (this one included, through another open file)."""
    import fcntl

    if not os.path.exists(lock_path(repo)):
        return False
    fd = _open_lock(repo)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own shared lock
    return False


def _read_holder(repo: Repo) -> dict:
    try:
        with open(holder_path(repo)) as fh:
            owner = json.load(fh)
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _holder_soon(repo: Repo) -> dict:
    """The record of a holder that may have taken the lock an instant ago (it writes it next)."""
    for _ in range(20):
        owner = _read_holder(repo)
        if owner:
            return owner
        time.sleep(0.05)
    return {}


def read_lock(repo: Repo):
    """The holder's record, with `alive`: whether the lock is held now. A record whose lock is not
    held was left by a process that died; the next command replaces it (nothing to break)."""
    owner, held = _read_holder(repo), _lock_is_held(repo)
    if not owner and not held:
        return None
    owner["alive"] = held
    return owner


def describe_owner(owner) -> str:
    age = time.time() - float(owner.get("time", time.time()))
    return "%s (pid %s on %s) running `%s` for %.0fs" % (
        owner.get("by", "?"),
        owner.get("pid", "?"),
        owner.get("host", "?"),
        owner.get("command", "?"),
        age,
    )


def acquire(repo: Repo, req: dict) -> None:
    """Take the checkout's lock for the rest of this process (or until release): fcntl.flock on
    .git/ddeploy/deploy.lock, which the kernel drops when the process dies, so there is never a
    stale lock to break. The holder's record beside it only says who holds it."""
    import fcntl

    fd = _open_lock(repo)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        owner = _holder_soon(repo)
        who = "by %s" % describe_owner(owner) if owner else "(its holder is still starting)"
        raise Fail(
            "LockError",
            "checkout %s is locked %s; wait for it to finish (the lock goes when that process ends)" % (repo.path, who),
        ) from None
    _HELD[lock_path(repo)] = fd
    left = _read_holder(repo)
    if left:
        progress(
            "the previous holder (pid %s, `%s`) ended without releasing the lock"
            % (left.get("pid", "?"), left.get("command", "?"))
        )
    owner = {
        "by": req.get("by", "?"),
        "user": req.get("by", "?").split("@")[0],
        "host": hostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "command": req.get("command", req.get("op")),
    }
    tmp = "%s.%d.tmp" % (holder_path(repo), os.getpid())
    with open(tmp, "w") as fh:
        json.dump(owner, fh)
    os.replace(tmp, holder_path(repo))


def release(repo: Repo) -> None:
    """Drop the record, then the flock (the lock file stays: unlinking it would let two processes
    lock two different files of the same name)."""
    fd = _HELD.pop(lock_path(repo), None)
    if fd is None:
        return
    try:
        os.unlink(holder_path(repo))
    except OSError:
        pass
    os.close(fd)
