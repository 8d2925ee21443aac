"""The checkout's lock: fcntl.flock on .git/ddeploy/deploy.lock, held for the whole command and
released by the kernel when the agent ends or dies (nothing stale to break); the holder's record
deploy.lock.json beside it, for messages.

Probes (status, lock status) never touch deploy.lock: a holder also keeps an exclusive flock on
the marker deploy.lock.held, and a probe asks for a shared one on the marker for an instant. A
probe on deploy.lock itself would hold it for that instant, and a push trying then would be told
"locked". Being flocks, the marker and the lock work wherever flock does (a checkout on NFS with
lockd is seen from every client, which /proc/locks is not)."""

import contextlib
import errno
import json
import os
import time

from .common import Fail, hostname, progress
from .mounts import describe_mount
from .repo import Repo


def lock_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock")


def marker_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock.held")


def holder_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock.json")


_HELD = {}  # lock file path -> (the fd whose flock this process holds, the marker's fd or None)


# How long a new holder waits for probes' instants on the marker before it goes on unmarked.
MARKER_WAIT_S = 2.0


def _flag(name: str) -> int:
    import fcntl

    return getattr(fcntl, name)


def _open_lock(path: str) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _flock(fd: int, how: str, path: str) -> bool:
    """flock(LOCK_SH or LOCK_EX) without waiting: False when another process holds a conflicting
    lock ("would block"). Any other error means the filesystem cannot lock: never "locked"."""
    import fcntl

    try:
        fcntl.flock(fd, _flag(how) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise no_lock_support(path, exc) from None
    return True


def no_lock_support(path: str, exc: OSError) -> Fail:
    """ENOLCK (NFS without lockd), EOPNOTSUPP or EINVAL (Lustre without -o flock, some FUSE
    filesystems): the mount must change, waiting will not help."""
    names = {**errno.errorcode, errno.EOPNOTSUPP: "EOPNOTSUPP"}  # Linux calls 95 ENOTSUP first
    name = names.get(exc.errno, "errno %s" % exc.errno)
    return Fail(
        "StateError",
        "cannot lock %s: flock failed with %s (%s) on its filesystem (%s); mount it with lock support "
        "(NFS: lockd running, or NFSv4; Lustre: -o flock) or keep the checkout on a local filesystem"
        % (path, name, exc.strerror or exc, describe_mount(path)),
    )


def _lock_is_held(repo: Repo) -> bool:
    """Whether some process holds the lock (this one included): a shared flock on the marker for an
    instant, so deploy.lock itself is never touched by a probe."""
    path = marker_path(repo)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return not _flock(fd, "LOCK_SH", path)
    finally:
        os.close(fd)  # closing drops the probe's own shared lock


def _mark_held(repo: Repo):
    """The holder's exclusive flock on the marker, for probes to see (its fd, or None when probes
    kept it busy for MARKER_WAIT_S: the marker only informs, deploy.lock alone excludes)."""
    path = marker_path(repo)
    fd = _open_lock(path)
    deadline = time.monotonic() + MARKER_WAIT_S
    try:
        while not _flock(fd, "LOCK_EX", path):
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.002)
    except Fail:
        os.close(fd)
        raise
    return fd


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


def locked_by(repo: Repo) -> Fail:
    owner = _holder_soon(repo)
    who = "by %s" % describe_owner(owner) if owner else "(its holder is still starting)"
    return Fail(
        "LockError",
        "checkout %s is locked %s; wait for it to finish (the lock goes when that process ends)" % (repo.path, who),
    )


def _take(repo: Repo):
    """(lock fd, marker fd or None) once this process holds deploy.lock; None when another does."""
    fd = _open_lock(lock_path(repo))
    try:
        if _flock(fd, "LOCK_EX", lock_path(repo)):
            return fd, _mark_held(repo)
    except Fail:
        os.close(fd)
        raise
    os.close(fd)
    return None


def acquire(repo: Repo, req: dict) -> None:
    """Take the checkout's lock for the rest of this process (or until release): fcntl.flock on
    .git/ddeploy/deploy.lock, which the kernel drops when the process dies, so there is never a
    stale lock to break. The holder's record beside it only says who holds it. Not reentrant: a
    command that runs several steps holds it once around all of them."""
    fds = _take(repo)
    if fds is None:
        raise locked_by(repo)
    _HELD[lock_path(repo)] = fds
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


@contextlib.contextmanager
def holding(repo: Repo, req: dict):
    """The lock held for the with block."""
    acquire(repo, req)
    try:
        yield
    finally:
        release(repo)


def release(repo: Repo) -> None:
    """Drop the record, then the flocks (the files stay: unlinking one would let two processes
    lock two different files of the same name). The marker goes first: a probe may say "free" a
    moment early, never "held" once the lock is free."""
    fds = _HELD.pop(lock_path(repo), None)
    if fds is None:
        return
    try:
        os.unlink(holder_path(repo))
    except OSError:
        pass
    lock_fd, marker_fd = fds
    if marker_fd is not None:
        os.close(marker_fd)
    os.close(lock_fd)
