"""Deploy operations on one host: plan, push, status, rollback, log, lock status/release.

Each is one agent session (one SSH connection): the agent (deployer/agent/) does the
host-side work as one transaction and owns the on-disk format; this module only builds requests
and returns the typed replies.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..errors import BaseTreeError, ConflictError, DriftError
from ..inventory import Host
from ..locations import cache_dir
from ..patchset import PatchSet
from ..transport.agent_client import AgentSession, agent_session
from ..transport.early_agents import EarlyAgents
from ..transport.protocol import (
    Applied,
    BaseCheck,
    BuildRecord,
    LaunchSummary,
    LockOwner,
    LockReleaseReply,
    LockReply,
    LogReply,
    PlanReply,
    PushReply,
    Record,
    Reply,
    RollbackReply,
    StatusReply,
    TestRecord,
)
from .outcome import Outcome, Say

R = TypeVar("R", bound=Reply)

SETS_DIR = ".git/ddeploy/sets"


@dataclass(frozen=True)
class Options:
    dry_run: bool = False
    three_way: bool = False
    force: bool = False
    accept_new_host_keys: bool = False
    command: str = "ddeploy"
    to: str | None = None
    diff: bool = False  # plan / push --dry-run: also the unified diff push would make
    early: EarlyAgents | None = field(default=None, compare=False, repr=False)  # sessions opened ahead


class HostStatus(Record):
    """`ddeploy status` of one host, as data (the human table is rendered from it)."""

    reachable: bool = True
    head: str
    branch: str | None = None
    base: BaseCheck | None = None  # the newest release's base gate at the pre-deploy commit (or HEAD)
    applied: Applied | None = None
    drift: list[str] = []
    lock: LockOwner | None = None
    builds: dict[str, BuildRecord] = {}
    tests: TestRecord | None = None
    bench: dict[str, Any] | None = None  # the last `ddeploy bench` (docs/json.md)
    launch: LaunchSummary | None = None  # the host's last launch
    interrupted: bool = False


def session(host: Host, opts: Options):
    return agent_session(host, accept_new_host_keys=opts.accept_new_host_keys, command=opts.command, early=opts.early)


def ensure_local_checkout(host: Host, say: Say) -> None:
    """The built-in `local` host's checkout is a clone of the pristine base, made on first use."""
    if host.is_local and not (Path(host.checkout) / ".git").exists():
        from ..patchset.sglang_base import clone_base

        say(f"first use: creating {host.checkout} from the pristine SGLang base (builds the base if needed)")
        clone_base(Path(host.checkout))


def set_dir(host: Host, ps: PatchSet) -> str:
    """Where the set lives on the host once shipped (so a repeated push sends only metadata)."""
    return f"{host.checkout.rstrip('/')}/{SETS_DIR}/{ps.name}-{ps.version}-{ps.fingerprint()[:12]}"


def set_request(ps: PatchSet, *, remote_dir: str | None, inline: bool) -> dict[str, Any]:
    """The patch set as the agent sees it: metadata, plus the patches' bytes when `inline`."""
    patches = []
    for p in ps.patches:
        entry: dict[str, Any] = {"name": p.name, "sha256": p.sha256, "files": list(p.files)}
        if inline:
            entry["data_b64"] = base64.b64encode(p.data).decode()
        patches.append(entry)
    return {
        "name": ps.name,
        "version": ps.version,
        "fingerprint": ps.fingerprint(),
        "base_tree": ps.base_tree,
        "base_version": ps.base_version,
        "dev": ps.dev,
        "files": ps.files,
        "preimages": ps.preimages(),
        "patches": patches,
        "dir": remote_dir,
    }


def options_request(opts: Options) -> dict[str, Any]:
    # pause: a test-only hook that widens the window in which a test cuts the connection
    return {
        "options": {
            "force": opts.force,
            "three_way": opts.three_way,
            "to": opts.to,
            "diff": opts.diff,
            "pause": os.environ.get("DDEPLOY_TEST_AGENT_PAUSE", ""),
        }
    }


def plan_host(host: Host, ps: PatchSet, opts: Options, say: Say) -> Outcome:
    ensure_local_checkout(host, say)
    request = {**options_request(opts), "set": set_request(ps, remote_dir=None, inline=True)}
    with session(host, opts) as agent:
        res = agent.call("plan", request, PlanReply, stream=say)
    for line in plan_details(res):
        say(line)
    if res.plan.blocked:  # a plan that push would refuse fails, so scripts can gate on it
        err = {"DriftError": DriftError, "BaseTreeError": BaseTreeError}.get(res.plan.blocked_kind, ConflictError)
        raise err(f"push would be refused: {res.plan.blocked}", host=host.name)
    return Outcome(res)


def plan_details(res: PlanReply) -> list[str]:
    """One progress line per patch checked and per hand edit found."""
    lines = [
        f"patch {p.name}: {'applies' if p.ok else 'CONFLICT ' + str(p.error)} ({', '.join(p.files)})"
        for p in res.plan.patches
    ]
    base = res.plan.base
    lines += [f"not the base: {m.why}" for m in (base.mismatched if base else [])]
    return lines + [f"{'in the way' if d in res.plan.in_the_way else 'hand edit'}: {d}" for d in res.plan.drift]


def push_host(host: Host, ps: PatchSet, opts: Options, say: Say) -> Outcome:
    if opts.dry_run:
        return plan_host(host, ps, opts, say)
    ensure_local_checkout(host, say)
    with session(host, opts) as agent:
        res = push_with(agent, ps, opts, say)
    return Outcome(res, changed=res.changed)


def shipped_marker(host: Host, ps: PatchSet) -> Path:
    """Where this client notes that it shipped `ps` to `host` (a hint, never trusted: the agent
    checks every patch's sha256 on the host and asks for the set again when it differs)."""
    address = f"{host.ssh.host}:{host.ssh.port}" if host.ssh else host.connection
    key = hashlib.sha256(f"{host.name}\0{address}\0{host.checkout}".encode()).hexdigest()[:16]
    return cache_dir() / "shipped" / key / ps.fingerprint()


def push_with(
    agent: AgentSession,
    ps: PatchSet,
    opts: Options,
    say: Say,
    *,
    op: str = "push",
    extra: dict[str, Any] | None = None,
    model: type[R] = PushReply,  # type: ignore[assignment]
    timeout: float | None = None,
) -> R:
    """`op` is `push` or an operation that pushes first (push-build), `extra` the rest of its
    request; the set goes as with_set sends it. `timeout`: seconds the call may take (None: the
    connection's command timeout)."""
    request = {**options_request(opts), **(extra or {})}
    return with_set(agent, ps, say, lambda s, **kw: agent.call(op, {**request, "set": s}, model, timeout=timeout, **kw))


def with_set(agent: AgentSession, ps: PatchSet, say: Say, call: Callable[..., R]) -> R:
    """call(set request, stream=, passthrough=): an agent call that pushes `ps`, in one round trip
    either way: a set this client has not shipped to the host goes with the first call; a set it
    has goes as checksums only, and in the rare case that the host lost or altered it (the agent
    answers NeedShip) a second call on the same connection carries it."""
    remote_dir = set_dir(agent.host, ps)
    marker = shipped_marker(agent.host, ps)
    kind = "dev snapshot " if ps.dev else ""
    shipping = f"shipping {ps.name} {kind}{ps.version} ({len(ps.patches)} patches) to {remote_dir}"
    if marker.exists():
        res = call(set_request(ps, remote_dir=remote_dir, inline=False), stream=say, passthrough=("NeedShip",))
        if res.ok:
            return res
    say(shipping)
    res = call(set_request(ps, remote_dir=remote_dir, inline=True), stream=say)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # a read-only cache costs one more round trip next time, nothing else
    return res


def rollback_host(host: Host, opts: Options, say: Say) -> Outcome:
    with session(host, opts) as agent:
        res = agent.call("rollback", options_request(opts), RollbackReply, stream=say)
    return Outcome(res, changed=res.changed)


def status_host(host: Host, opts: Options, say: Say, expect: PatchSet | None = None) -> Outcome:
    """`expect`: also check that the files this set touches hold, at the checkout's pre-deploy
    commit (HEAD when nothing is applied), exactly what its patches were made against."""
    request: dict[str, Any] = {}
    if expect is not None:
        request["expect"] = {
            "name": expect.name,
            "version": expect.version,
            "base_version": expect.base_version,
            "preimages": expect.preimages(),
        }
    with session(host, opts) as agent:
        facts = agent.call("status", request, StatusReply, stream=say).facts
    state = facts.state
    return Outcome(
        HostStatus(
            head=facts.head,
            branch=facts.branch,
            base=facts.base,
            applied=state.applied,
            drift=facts.drift,
            lock=facts.lock,
            builds=state.builds,
            tests=state.tests,
            bench=state.bench,
            launch=facts.launch,
            interrupted=facts.journal,
        )
    )


def log_host(host: Host, opts: Options, say: Say) -> Outcome:
    with session(host, opts) as agent:
        return Outcome(agent.call("log", {}, LogReply, stream=say))


def lock_status_host(host: Host, opts: Options, say: Say) -> Outcome:
    with session(host, opts) as agent:
        return Outcome(agent.call("lock-status", {}, LockReply, stream=say))


def lock_release_host(host: Host, opts: Options, say: Say) -> Outcome:
    with session(host, opts) as agent:
        res = agent.call("lock-release", {}, LockReleaseReply, stream=say)
    return Outcome(res, changed=res.released)


__all__ = [
    "Options",
    "HostStatus",
    "Outcome",
    "Reply",
    "plan_host",
    "push_host",
    "push_with",
    "rollback_host",
    "status_host",
    "log_host",
    "lock_status_host",
    "lock_release_host",
]
