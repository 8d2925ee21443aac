"""The state record, refs/ddeploy/state: a chain of commits whose tree holds state.json, each
change installed with a compare-and-swap, so concurrent writers never lose each other's updates."""

import json
import time

from .common import Fail, STATE_REF, ZERO
from .repo import Repo


def read_state(repo: Repo):
    """(commit of refs/ddeploy/state or None, its state.json as a dict, defaults filled in)."""
    return parse_state(repo, *repo.objects([STATE_REF + "^{commit}"], more=_state_blob))


def _state_blob(found: list) -> list:
    """After the state ref's commit: the name of its state.json (nothing when there is no record)."""
    return [found[-1][0] + ":state.json"] if found[-1] else []


def parse_state(repo: Repo, commit, blob=None):
    """read_state from the objects found for `STATE_REF^{commit}` and then `_state_blob`."""
    state = {"schema": 1, "applied": None, "pre_deploy": None}
    if commit:
        data = blob[2] if blob and blob[1] == "blob" else b""  # what `git cat-file blob` would print
        try:
            state.update(json.loads(data.decode()))
        except ValueError:
            raise Fail("StateError", "%s in %s has no readable state.json" % (STATE_REF, repo.path)) from None
    return commit and commit[0], state


def write_state(repo: Repo, old, state: dict, message: str):
    blob = repo.out("hash-object", "-w", "--stdin", input=(json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
    tree = repo.out("mktree", input=("100644 blob %s\tstate.json\n" % blob).encode())
    commit = repo.out("commit-tree", tree, *(["-p", old] if old else []), "-m", message)
    ok = repo.run("update-ref", "-m", message, STATE_REF, commit, old or ZERO, check=False).returncode == 0
    return commit if ok else None


def commit_state(repo: Repo, engine_part: dict, message: str) -> None:
    """CAS the engine's sections onto the latest record; other writers' sections are kept."""
    for _ in range(20):
        old, state = read_state(repo)
        state.update(engine_part)
        if write_state(repo, old, state, message):
            return
        time.sleep(0.05)
    raise Fail("StateError", "%s kept changing while recording; run the command again" % STATE_REF)


def update_section(repo: Repo, section: str, change, message: str) -> dict:
    """CAS one non-engine section (builds, tests): change(old value) -> new value, on the latest record."""
    for _ in range(20):
        old, state = read_state(repo)
        state[section] = change(state.get(section))
        if write_state(repo, old, state, message):
            return state
        time.sleep(0.05)
    raise Fail("StateError", "%s kept changing while recording; run the command again" % STATE_REF)
