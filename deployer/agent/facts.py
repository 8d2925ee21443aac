"""The facts of a checkout: HEAD and the state record from one git process (what push and
rollback work from), plus the branch, drift, lock and interrupted journal (what status and plan
report)."""

import os

from .common import STATE_REF, Fail
from .lock import read_lock
from .repo import Repo
from .state import _state_blob, parse_state
from .transaction import journal_path


def head_facts(repo: Repo) -> dict:
    """{head, tree, state, state_commit}: HEAD and the state record, from one git process. What
    push and rollback work from; facts() adds what status and plan report."""
    if not os.path.isdir(repo.gitdir):
        raise Fail("StateError", "%s is not a git checkout (no .git directory); clone SGLang there first" % repo.path)
    head, tree, *record = repo.objects(["HEAD^{commit}", "HEAD^{tree}", STATE_REF + "^{commit}"], more=_state_blob)
    if not head:
        raise Fail("StateError", "%s has no commit checked out" % repo.path)
    state_commit, state = parse_state(repo, *record)
    return {"head": head[0], "tree": tree and tree[0], "state": state, "state_commit": state_commit}


def facts(repo: Repo) -> dict:
    f = head_facts(repo)
    head, applied = f["head"], f["state"].get("applied")
    drift = repo.dirty()
    if applied and head != applied.get("head"):
        drift = ["HEAD moved from %s to %s" % (applied["head"][:12], head[:12])] + drift
    return {
        "head": head,
        "tree": f["tree"],
        "branch": repo.branch(),
        "state": f["state"],
        "state_commit": f["state_commit"],
        "drift": drift,
        "lock": read_lock(repo),
        "journal": os.path.exists(journal_path(repo)),
    }
