"""`ddeploy lock status|release`: the lock's holder, and removing a dead holder's record."""

import os

from .common import Fail
from .lock import describe_owner, holder_path, read_lock
from .repo import Repo


def op_lock_status(repo: Repo, req: dict) -> dict:
    return {"ok": True, "lock": read_lock(repo)}


def op_lock_release(repo: Repo, req: dict) -> dict:
    """Remove a dead holder's record. A live holder's lock is the kernel's: it ends with the process."""
    owner = read_lock(repo)
    if owner is not None and owner["alive"]:
        raise Fail(
            "LockError",
            "checkout %s is locked by %s, which is still running; the lock goes when it ends "
            "(stop it with `kill %s` on the host if it hangs)"
            % (repo.path, describe_owner(owner), owner.get("pid", "PID")),
        )
    if owner is not None:
        try:
            os.unlink(holder_path(repo))
        except OSError:
            pass
    return {"ok": True, "released": owner is not None, "lock": owner}
