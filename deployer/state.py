"""What ddeploy has done to a checkout, recorded in git on the host itself.

`refs/ddeploy/state` points at a chain of commits (parent = the previous record) whose tree holds
one file, `state.json`. Every change is a new commit installed with a compare-and-swap
(`git update-ref <ref> <new> <old>`), so concurrent writers never lose each other's updates and the
chain is the history (`ddeploy log`). Other refs under `refs/ddeploy/`:
    versions/<V>     head commit of version V as last applied (one commit per patch on top of the
                     pre-deploy commit), kept so `rollback --to V` works offline
    pre-deploy       the recorded pre-deploy commit while a version is applied
    saved/<stamp>    hand edits saved by `--force` (a commit on top of the HEAD they were made on)

state.json schema (version 1; absent keys mean "never happened"):
    {
      "schema": 1,
      "applied": null | {                 # what the checkout's HEAD is now
          "name": "ddtree", "version": "0.1.0", "fingerprint": "<sha256 of patch names+hashes>",
          "patches": [{"name": "0001-....patch", "sha256": "...", "commit": "<commit it made>"}],
          "files": ["python/sglang/..."], "head": "<commit>", "tree": "<tree>",
          "three_way": false, "by": "user@host", "at": "2026-11-29T10:00:00Z"},
      "pre_deploy": null | {"commit": "...", "tree": "...", "branch": "main" | null},
      "last": {"action": "push" | "rollback", "version": "0.1.0" | null, "from": "0.0.9" | null,
               "by": "...", "at": "...", "saved": "refs/ddeploy/saved/<stamp>" | null},
      "builds": {...},   # owned by `ddeploy build` (kernel builds), e.g. per arch:
                         # {"sm_120": {"nvcc": "13.0", "source_hash": "...", "cache_dir": "...",
                         #             "ok": true, "at": "...", "version": "0.1.0"}}
      "tests": {...}     # owned by `ddeploy test` (last remote test run), e.g.
                         # {"ok": true, "passed": 12, "failed": 0, "at": "...", "version": "0.1.0",
                         #  "summary": "12 passed in 3.1s"}
    }

Use from other commands (any section name except the engine's own "applied", "pre_deploy", "last"):
    with open_connection(host) as conn:
        update_state(conn, host, "builds", {"sm_120": {...}}, message="build sm_120")
        read_state(conn, host).get("tests")
"""

from __future__ import annotations

import json
from typing import Any

from .connection import Connection
from .errors import StateError
from .inventory import Host

STATE_REF = "refs/ddeploy/state"
STATE_FILE = "state.json"
SCHEMA = 1
ENGINE_SECTIONS = ("applied", "pre_deploy", "last", "schema")
ZERO = "0" * 40
_IDENTITY = {"GIT_AUTHOR_NAME": "ddeploy", "GIT_AUTHOR_EMAIL": "ddeploy@localhost",
             "GIT_COMMITTER_NAME": "ddeploy", "GIT_COMMITTER_EMAIL": "ddeploy@localhost"}


def empty_state() -> dict[str, Any]:
    return {"schema": SCHEMA, "applied": None, "pre_deploy": None}


def _git(conn: Connection, host: Host, *args: str, input: bytes | None = None, check: bool = True):
    return conn.run(["git", "-C", host.checkout, *args], input=input, check=check, env=_IDENTITY)


def state_commit(conn: Connection, host: Host) -> str | None:
    """The commit the state ref points at, or None before the first deploy."""
    res = _git(conn, host, "rev-parse", "-q", "--verify", f"{STATE_REF}^{{commit}}", check=False)
    return res.stdout.strip() or None


def read_state_at(conn: Connection, host: Host, commit: str | None) -> dict[str, Any]:
    if commit is None:
        return empty_state()
    res = _git(conn, host, "cat-file", "blob", f"{commit}:{STATE_FILE}", check=False)
    try:
        data = json.loads(res.stdout) if res.rc == 0 else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise StateError(f"{STATE_REF} in {host.checkout} has no readable {STATE_FILE}; inspect it with "
                         f"`git -C {host.checkout} log {STATE_REF}`", host=host.name)
    return {**empty_state(), **data}


def read_state(conn: Connection, host: Host) -> dict[str, Any]:
    """The current state record (empty_state() when nothing was ever deployed)."""
    return read_state_at(conn, host, state_commit(conn, host))


def write_state(conn: Connection, host: Host, state: dict[str, Any], *, old: str | None, message: str) -> str | None:
    """Commit state on top of `old` and move the ref only if it still points at `old` (CAS).
    Returns the new commit, or None when someone else moved the ref first."""
    blob = _git(conn, host, "hash-object", "-w", "--stdin",
                input=json.dumps(state, indent=2, sort_keys=True).encode() + b"\n").stdout.strip()
    tree = _git(conn, host, "mktree", input=f"100644 blob {blob}\t{STATE_FILE}\n".encode()).stdout.strip()
    parent = ["-p", old] if old else []
    commit = _git(conn, host, "commit-tree", tree, *parent, "-m", message).stdout.strip()
    swap = _git(conn, host, "update-ref", "-m", message, STATE_REF, commit, old or ZERO, check=False)
    return commit if swap.rc == 0 else None


def update_state(conn: Connection, host: Host, section: str, value: Any, *, message: str,
                 attempts: int = 5) -> dict[str, Any]:
    """Set one section of the state (e.g. "builds", "tests") atomically; returns the new state."""
    if section in ENGINE_SECTIONS:
        raise StateError(f"state section {section!r} belongs to the deploy engine", host=host.name)
    for _ in range(attempts):
        old = state_commit(conn, host)
        state = read_state_at(conn, host, old)
        state[section] = value
        if write_state(conn, host, state, old=old, message=message):
            return state
    raise StateError(f"{STATE_REF} in {host.checkout} kept changing under us; retry", host=host.name)


def state_history(conn: Connection, host: Host, limit: int = 100) -> list[dict[str, Any]]:
    """Newest first: {"commit", "date", "message", "state"} for each record in the chain."""
    res = _git(conn, host, "log", f"-{limit}", "--format=%H%x09%cI%x09%s", STATE_REF, "--", check=False)
    out = []
    for line in res.stdout.splitlines():
        commit, date, message = line.split("\t", 2)
        out.append({"commit": commit, "date": date, "message": message,
                    "state": read_state_at(conn, host, commit)})
    return out
