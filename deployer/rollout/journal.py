"""A rollout's event log and its exclusion.

Every step and every gate sample is one JSON line in `<cache>/rollouts/<id>/events.jsonl`
(appended and flushed as it happens, so a killed client loses at most the line being written).
The log is also the rollout's state: `--resume` replays it (the plan, the units finished, each
unit's reference measurement) and goes on from there.

Exclusion: a rollout holds an exclusive lock (fcntl.flock, released by the kernel when the
process ends, however it ends) on `<cache>/rollouts/hosts/<host>.lock` for every host it covers,
for its whole run; a second rollout over any of them is refused, naming the holder. The locks
guard one client machine's rollouts; on the hosts themselves, the checkout lock (push) and the
launch lock (launch, stop) still exclude any two commands from anywhere.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StateError
from ..locations import cache_dir

FINAL = ("done", "failed")  # a rollout in one of these states is over; paused/interrupted resume


def rollouts_dir() -> Path:
    return cache_dir() / "rollouts"


def new_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(2).hex()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Journal:
    """Appends events to one rollout's log."""

    def __init__(self, rollout_id: str):
        self.id = rollout_id
        self.path = rollouts_dir() / rollout_id / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **data: Any) -> None:
        line = json.dumps({"at": now(), "event": event, **data}, sort_keys=True)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


@dataclass
class Replay:
    """What a rollout's log says so far."""

    id: str
    plan: dict[str, Any]
    spec: dict[str, Any]
    source: dict[str, Any]  # the patch set: version argument, name, version, fingerprint
    finished: dict[str, str] = field(default_factory=dict)  # unit -> pass, inconclusive, rolled-back, ...
    references: dict[str, dict[str, Any]] = field(default_factory=dict)  # unit -> its Measurement
    state: str = "interrupted"  # running ended without a final event: the client was cut
    failures: int = 0

    @property
    def over(self) -> bool:
        return self.state in FINAL


def replay(rollout_id: str) -> Replay:
    path = rollouts_dir() / rollout_id / "events.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise StateError(f"no rollout {rollout_id} on this machine ({path}: {exc.strerror or exc})") from None
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # the line a killed client was writing
    if not events or events[0].get("event") != "plan":
        raise StateError(f"rollout {rollout_id}: its log {path} does not start with the plan")
    first = events[0]
    out = Replay(rollout_id, first["plan"], first["spec"], first["source"])
    for ev in events[1:]:
        kind = ev.get("event")
        if kind == "reference":
            out.references[ev["unit"]] = ev["measurement"]
        elif kind == "unit-done":
            out.finished[ev["unit"]] = ev["result"]
            out.failures += ev["result"] in ("rolled-back", "put-back-failed")
        elif kind == "rollout":
            out.state = ev["state"]
    return out


def all_ids() -> list[str]:
    """Every rollout on this machine, oldest first (ids sort by start time)."""
    root = rollouts_dir()
    return sorted(p.name for p in root.iterdir() if (p / "events.jsonl").is_file()) if root.is_dir() else []


def latest() -> str | None:
    """The newest rollout on this machine."""
    ids = all_ids()
    return ids[-1] if ids else None


def last_failed(hosts: set[str]) -> tuple[str, set[str]] | None:
    """The failed rollout that is the last one to have covered some of `hosts`, and those hosts;
    None when every host's last rollout ended otherwise (or there was none)."""
    left = set(hosts)
    for rollout_id in reversed(all_ids()):
        if not left:
            break
        try:
            past = replay(rollout_id)
        except StateError:
            continue  # an unreadable log says nothing about the hosts
        covered = {h for u in past.plan["units"] for h in u["hosts"]} & left
        if covered and past.state == "failed":
            return rollout_id, covered
        left -= covered
    return None


def hold_hosts(stack: ExitStack, hosts: list[str], rollout_id: str) -> None:
    """Lock every host for this rollout (until the stack closes or the process ends), or raise
    naming the rollout that holds one."""
    lock_dir = rollouts_dir() / "hosts"
    lock_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(hosts):  # one order for everyone: two rollouts never wait on each other
        fd = os.open(lock_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        stack.callback(os.close, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another rollout"
            raise StateError(
                f"host {name} is in rollout {holder}, running on this machine now; wait for it to end "
                "(or stop it with Ctrl-C and `ddeploy rollout --resume` later)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{rollout_id} (pid {os.getpid()})".encode(), 0)


def passed_recently(unit: str, version: str, window_s: float) -> tuple[str, str] | None:
    """(rollout id, when) of the newest rollout in which `unit` passed its gates on `version`
    within the last `window_s` seconds; None otherwise."""
    if window_s <= 0:
        return None
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - window_s))
    for rollout_id in reversed(all_ids()):
        path = rollouts_dir() / rollout_id / "events.jsonl"
        try:
            lines = path.read_text().splitlines()
            events = [json.loads(line) for line in lines if line.strip()]
        except (OSError, ValueError):
            continue
        if not events or events[0].get("event") != "plan" or events[0]["plan"].get("version") != version:
            continue
        for ev in events:
            measured = ev.get("event") == "gate" and ev.get("unit") == unit and ev.get("gate") == "greedy"
            if measured and ev.get("verdict") == "pass" and ev.get("at", "") >= since:
                return rollout_id, ev["at"]
    return None
