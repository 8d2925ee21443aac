"""Switching the work tree as one transaction: a journal written before the switch (so any later
run rolls an interrupted one forward), the idempotent per-file switch, the state commit, and
hand edits saved (--force) before it."""

import json
import os
import time

from .bytecode import drop_bytecode
from .common import ZERO, now, progress
from .repo import Repo
from .state import commit_state


def journal_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "journal.json")


def save_edits(repo: Repo, files: list, req: dict, op: str) -> str:
    """Save the hand edits in `files` (and a moved HEAD) under refs/ddeploy/saved/<stamp>, shaped
    like a `git stash` entry so nothing staged is lost: a commit I (HEAD plus the index's version of
    these paths) and on top a commit W (parents HEAD and I) with their work-tree version, untracked
    and ignored files included. The ref names W: `git stash apply --index REF` brings both back."""
    work = os.path.join(repo.ddir, "tmp")
    os.makedirs(work, exist_ok=True)
    env = {"GIT_INDEX_FILE": os.path.join(work, "save-index-%d" % os.getpid())}
    real = [p for p in files if not p.startswith("HEAD moved")]
    head = repo.rev("HEAD^{commit}")
    stamp = "%s %s" % (op, req.get("by", "?"))
    try:
        repo.run("read-tree", "HEAD", env=env)
        if real:
            staged = repo.run("ls-files", "-s", "-z", "--", *real).stdout  # the real index's entries
            repo.run("rm", "-q", "-r", "--cached", "--ignore-unmatch", "--", *real, env=env)
            entries = [e for e in staged.split(b"\0") if e and b"\t" in e and e.split(b"\t")[0].split()[2] == b"0"]
            if entries:
                repo.run("update-index", "-z", "--index-info", input=b"\0".join(entries) + b"\0", env=env)
        index_tree = repo.out("write-tree", env=env)
        note = "index on %s: saved before %s" % (head[:12], stamp)
        index_commit = repo.out("commit-tree", index_tree, "-p", head, "-m", note)
        if real:
            repo.run("add", "-A", "-f", "--", *real, env=env)
        tree = repo.out("write-tree", env=env)
    finally:
        if os.path.exists(env["GIT_INDEX_FILE"]):
            os.unlink(env["GIT_INDEX_FILE"])
    msg = "ddeploy: hand edits saved before %s\n\n%s\n" % (stamp, "\n".join(files))
    commit = repo.out("commit-tree", tree, "-p", head, "-p", index_commit, "-m", msg)
    ref = "refs/ddeploy/saved/%s-%d" % (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), os.getpid())
    repo.run("update-ref", ref, commit, ZERO)
    progress(
        "saved hand edits in %d path(s) as %s (work tree and index; recover: git -C %s stash apply --index %s)"
        % (len(files), ref, repo.path, ref)
    )
    if real:
        switch_files(repo, "HEAD", real)
    return ref


def switch_files(repo: Repo, target: str, files: list) -> None:
    """Make index and work tree match `target` for exactly these paths (idempotent)."""
    if not files:
        return
    present = set(f for f in repo.out("ls-tree", "-r", "-z", "--name-only", target, "--", *files).split("\0") if f)
    if present:
        repo.run("checkout", target, "--", *sorted(present))
    for path in sorted(set(files) - present):
        repo.run("rm", "-q", "-f", "--cached", "--ignore-unmatch", "--", path)
        full = os.path.join(repo.path, path)
        if os.path.islink(full) or os.path.isfile(full):
            os.unlink(full)
        elif os.path.isdir(full):
            import shutil

            shutil.rmtree(full)  # only after save_edits kept it: an untracked tree in the way
        prune_empty_parents(repo, path)


def prune_empty_parents(repo: Repo, path: str) -> None:
    """Remove the directories above a removed file that are now empty (never a non-empty one)."""
    parent = os.path.dirname(path)
    while parent:
        try:
            os.rmdir(os.path.join(repo.path, parent))
        except OSError:  # not empty, or already gone: stop at the first that stays
            if os.path.isdir(os.path.join(repo.path, parent)):
                return
        parent = os.path.dirname(parent)


def write_journal(repo: Repo, journal: dict) -> None:
    tmp = journal_path(repo) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(journal, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, journal_path(repo))


def finish(repo: Repo, j: dict, pause_mid_switch: float = 0.0) -> None:
    """Roll a journaled transaction forward: work tree, HEAD, refs, then the state record."""
    if pause_mid_switch:  # test hook: leave the work tree half switched for a while
        switch_files(repo, j["target"], j["files"][:1])
        progress("pausing %.1fs in the middle of the switch (test hook)" % pause_mid_switch)
        time.sleep(pause_mid_switch)
    switch_files(repo, j["target"], j["files"])
    # The branch (else a detached HEAD) and the operation's refs move in one transaction.
    if j.get("branch"):
        head = ["update refs/heads/%s %s" % (j["branch"], j["target"])]
    else:
        head = ["option no-deref", "update HEAD %s" % j["target"]]
    refs = [
        ("update %s %s" % (ref, value)) if value else ("delete %s" % ref) for ref, value in j.get("refs", {}).items()
    ]
    repo.run("update-ref", "-m", j["message"], "--stdin", input="".join(c + "\n" for c in head + refs).encode())
    if j.get("branch"):
        repo.run("symbolic-ref", "HEAD", "refs/heads/" + j["branch"])
    commit_state(repo, j["state"], j["message"])
    os.unlink(journal_path(repo))


def recover(repo: Repo) -> bool:
    path = journal_path(repo)
    if not os.path.exists(path):
        return False
    with open(path) as fh:
        j = json.load(fh)
    progress("completing an interrupted %s (%s)" % (j.get("op", "?"), j.get("message", "").splitlines()[0]))
    finish(repo, j)
    # What the switch rewrote before it was cut is not known: every file it covers loses its
    # bytecode (a push drops only what it changed, bytecode.drop_changed; this path is rare).
    drop_bytecode(repo, j["files"])
    return True


def transact(
    repo: Repo,
    req: dict,
    op: str,
    target: str,
    old_head: str,
    extra_files: list,
    engine_state: dict,
    refs: dict,
    message: str,
    branch,
) -> None:
    files = sorted(set(repo.diff_names(old_head, target)) | set(extra_files))
    journal = {
        "op": op,
        "target": target,
        "files": files,
        "branch": branch,
        "refs": refs,
        "state": engine_state,
        "message": message,
        "by": req.get("by"),
        "command": req.get("command"),  # the real command line, as the lock owner records it
        "started": now(),
    }
    # Test hook (DDEPLOY_TEST_AGENT_PAUSE="[before_switch|mid_switch:]SECONDS"): a window in which
    # a test cuts the connection or kills this process.
    where, _, secs = str(req.get("options", {}).get("pause") or "").rpartition(":")
    pause = float(secs or 0)
    if pause and where in ("", "before_switch"):
        progress("pausing %.1fs before switching the checkout (test hook)" % pause)
        time.sleep(pause)
    write_journal(repo, journal)
    finish(repo, journal, pause if where == "mid_switch" else 0.0)
