"""Per-host operations of the remote engine: push, plan, status, rollback, log, lock.

Each function does the whole job for one host and returns an Outcome (a one-line summary plus
data for --json); failures raise DeployError subclasses, which the fleet turns into per-host
results. The host-side work is one agent transaction (deployer/remote/agent.py).
"""

from __future__ import annotations

import base64
import getpass
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .connection import Connection, Timeouts, open_connection
from .errors import ConflictError, DriftError
from .inventory import Host
from .patchset import PatchSet
from .remote import call_agent

Say = Callable[[str], None]
SETS_DIR = ".git/ddeploy/sets"


@dataclass(frozen=True)
class Options:
    dry_run: bool = False
    three_way: bool = False
    force: bool = False
    accept_new_host_keys: bool = False
    command: str = "ddeploy"
    to: str | None = None


@dataclass
class Outcome:
    summary: str
    data: dict[str, Any] = field(default_factory=dict)
    changed: bool = False


def who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def connect(host: Host, opts: Options) -> Connection:
    return open_connection(host, accept_new_host_keys=opts.accept_new_host_keys, timeouts=Timeouts.from_env())


def ensure_local_checkout(host: Host, say: Say) -> None:
    """The built-in `local` host's checkout is a clone of the pristine base, made on first use."""
    if host.is_local and not (Path(host.checkout) / ".git").exists():
        from .base import clone_base

        say(f"first use: creating {host.checkout} from the pristine SGLang base (builds the base if needed)")
        clone_base(Path(host.checkout))


def set_request(ps: PatchSet, *, remote_dir: str | None) -> dict[str, Any]:
    """The patch set as the agent sees it: metadata plus a host directory, or the patches inline."""
    patches = []
    for p in ps.patches:
        entry: dict[str, Any] = {"name": p.name, "sha256": p.sha256, "files": list(p.files)}
        if remote_dir is None:
            entry["data_b64"] = base64.b64encode(p.data).decode()
        patches.append(entry)
    return {"name": ps.name, "version": ps.version, "fingerprint": ps.fingerprint(), "base_tree": ps.base_tree,
            "base_version": ps.base_version, "files": ps.files, "patches": patches, "dir": remote_dir}


def _request(ps: PatchSet | None, opts: Options, remote_dir: str | None = None) -> dict[str, Any]:
    req: dict[str, Any] = {"by": who(), "command": opts.command,
                           "options": {"force": opts.force, "three_way": opts.three_way, "to": opts.to,
                                       # test-only hook: widen the window in which a test cuts the connection
                                       "pause": os.environ.get("DDEPLOY_TEST_AGENT_PAUSE", "")}}
    if ps is not None:
        req["set"] = set_request(ps, remote_dir=remote_dir)
    return req


def plan_host(host: Host, ps: PatchSet, opts: Options, say: Say) -> Outcome:
    ensure_local_checkout(host, say)
    with connect(host, opts) as conn:
        res = call_agent(conn, host, "plan", _request(ps, opts), stream=say)
    plan = res["plan"]
    for line in plan_details(plan):
        say(line)
    if plan.get("blocked"):  # a plan that push would refuse fails, so scripts can gate on it
        err = DriftError if plan.get("drift") and not opts.force else ConflictError
        raise err(f"push would be refused: {plan['blocked']}", host=host.name)
    return Outcome(describe_plan(plan, ps), {"plan": plan})


def plan_details(plan: dict[str, Any]) -> list[str]:
    """One line per patch checked and per hand edit found."""
    lines = [f"patch {p['name']}: {'applies' if p['ok'] else 'CONFLICT ' + str(p['error'])} "
             f"({', '.join(p['files'])})" for p in plan.get("patches", [])]
    lines += [f"hand edit: {d}" for d in plan.get("drift", [])]
    return lines


def describe_plan(plan: dict[str, Any], ps: PatchSet) -> str:
    if plan.get("blocked"):
        return f"blocked: {plan['blocked']}"
    if plan["action"] == "noop":
        return f"no change ({ps.name} {ps.version} already applied)"
    if plan["action"] == "restore":
        return f"would save hand edits and restore {ps.name} {ps.version}"
    verb = f"replace {plan['from']} with" if plan["action"] == "replace" else "apply"
    return f"would {verb} {ps.name} {ps.version} ({len(ps.patches)} patches, {len(ps.files)} files)"


def push_host(host: Host, ps: PatchSet, opts: Options, say: Say) -> Outcome:
    if opts.dry_run:
        return plan_host(host, ps, opts, say)
    ensure_local_checkout(host, say)
    remote_dir = f"{host.checkout.rstrip('/')}/{SETS_DIR}/{ps.name}-{ps.version}-{ps.fingerprint()[:12]}"
    request = _request(ps, opts, remote_dir)
    with connect(host, opts) as conn:
        # One round trip when the set is already on the host (a repeated push); else rsync it first.
        res = call_agent(conn, host, "push", request, stream=say, passthrough=("NeedShip",))
        if not res.get("ok"):
            say(f"shipping {ps.name} {ps.version} ({len(ps.patches)} patches) with rsync")
            conn.rsync_to(f"{ps.path}/", f"{remote_dir}/", checksum=True)
            res = call_agent(conn, host, "push", request, stream=say)
    if not res["changed"]:
        return Outcome(f"unchanged ({ps.name} {ps.version} already applied)", res)
    applied = res["applied"]
    over = f" over {res['plan']['from']}" if res["plan"].get("from") else ""
    saved = f"; hand edits saved as {res['saved']}" if res.get("saved") else ""
    return Outcome(f"applied {ps.name} {ps.version}{over} ({len(applied['patches'])} patches, "
                   f"head {applied['head'][:12]}){saved}", res, changed=True)


def rollback_host(host: Host, opts: Options, say: Say) -> Outcome:
    with connect(host, opts) as conn:
        res = call_agent(conn, host, "rollback", _request(None, opts), stream=say)
    if not res["changed"]:
        return Outcome(res.get("message", "unchanged"), res)
    saved = f"; hand edits saved as {res['saved']}" if res.get("saved") else ""
    target = res["to"] or f"pre-deploy state (tree {res['tree'][:12]})"
    return Outcome(f"rolled back {res['from']} -> {target}{saved}", res, changed=True)


def status_host(host: Host, opts: Options, say: Say) -> Outcome:
    with connect(host, opts) as conn:
        res = call_agent(conn, host, "status", _request(None, opts), stream=say)
    row = status_row(res["facts"])
    return Outcome(f"{row['applied']}; drift: {row['drift']}; lock: {row['lock']}", {"reachable": True, **row,
                                                                                      "facts": res["facts"]})


def status_row(facts: dict[str, Any]) -> dict[str, Any]:
    state = facts["state"]
    applied = state.get("applied")
    lock = facts.get("lock")
    drift = facts.get("drift") or []
    return {"applied": f"{applied['name']} {applied['version']}" if applied else "none",
            "drift": f"{len(drift)} file(s)" if drift else "none",
            "drift_files": drift,
            "lock": ("-" if lock is None else
                     f"{lock.get('by', '?')} pid {lock.get('pid', '?')}{' (stale)' if lock.get('alive') is False else ''}"),
            "builds": summarize_builds(state.get("builds")), "tests": summarize_tests(state.get("tests")),
            "interrupted": bool(facts.get("journal"))}


def summarize_builds(builds: Any) -> str:
    if not builds or not isinstance(builds, dict):
        return "-"
    parts = []
    for arch, info in sorted(builds.items()):
        ok = info.get("ok") if isinstance(info, dict) else None
        version = f" ({info['version']})" if isinstance(info, dict) and info.get("version") else ""
        parts.append(f"{arch}{'' if ok is None else (' ok' if ok else ' FAILED')}{version}")
    return ", ".join(parts)


def summarize_tests(tests: Any) -> str:
    if not tests or not isinstance(tests, dict):
        return "-"
    verdict = {True: "ok", False: "FAILED"}.get(tests.get("ok"), "?")
    detail = tests.get("summary") or (f"{tests['passed']} passed" if "passed" in tests else "")
    return f"{verdict} {detail}".strip()


def log_host(host: Host, opts: Options, say: Say) -> Outcome:
    with connect(host, opts) as conn:
        res = call_agent(conn, host, "log", {"by": who()}, stream=say)
    return Outcome(f"{len(res['entries'])} record(s)", {"entries": res["entries"]})


def lock_status_host(host: Host, opts: Options, say: Say) -> Outcome:
    with connect(host, opts) as conn:
        res = call_agent(conn, host, "lock-status", {"by": who()}, stream=say)
    return Outcome(describe_lock(res["lock"]), {"lock": res["lock"]})


def lock_release_host(host: Host, opts: Options, say: Say) -> Outcome:
    with connect(host, opts) as conn:
        res = call_agent(conn, host, "lock-release", {"by": who()}, stream=say)
    if not res["released"]:
        return Outcome("no lock held", res)
    return Outcome(f"released the lock of {describe_lock(res['lock'])}", res, changed=True)


def describe_lock(lock: dict[str, Any] | None) -> str:
    if lock is None:
        return "free"
    age = time.time() - float(lock.get("time", time.time()))
    stale = " (stale: that process is gone)" if lock.get("alive") is False else ""
    return (f"held by {lock.get('by', '?')} pid {lock.get('pid', '?')} running `{lock.get('command', '?')}` "
            f"for {age:.0f}s{stale}")
