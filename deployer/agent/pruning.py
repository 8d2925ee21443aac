"""Pruning the dev snapshots' patch files kept under .git/ddeploy/sets/ (each edit of the
overlay ships one)."""

import os

DEV_SETS_KEPT = 3


def prune_dev_sets(current, keep: int = DEV_SETS_KEPT) -> None:
    """After a dev snapshot is applied, keep only the newest `keep` dev snapshots' patch files
    under .git/ddeploy/sets/ (each edit of the overlay ships one); released sets always stay.
    Rollback never needs them: it returns to recorded commits."""
    if not current or "+dev." not in os.path.basename(current):
        return
    root = os.path.dirname(current)
    others = [os.path.join(root, d) for d in os.listdir(root) if "+dev." in d and d != os.path.basename(current)]
    others.sort(key=lambda d: os.stat(d).st_mtime, reverse=True)
    import shutil

    for old in others[keep - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
