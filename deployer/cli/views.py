"""How outcomes read to a person: one-line summaries and tables. The only place with display
strings such as "3 file(s)" or "-"; `--json` carries the outcomes' data instead."""

from __future__ import annotations

import time
from typing import Any

import click

from ..errors import ConnectError
from ..ops.fleet import HostResult
from ..ops.deploy import HostStatus
from ..ops.kernel_build import PushBuild
from ..patchset import PatchSet
from ..transport.protocol import (
    BuildRecord,
    LockOwner,
    LockReleaseReply,
    LogReply,
    Plan,
    PlanReply,
    PushReply,
    RollbackReply,
    TestRecord,
)
from ..transport.protocol_build import BuildReply
from .output import table


def summary(result: HostResult, describe_ok) -> str:
    return describe_ok(result.outcome.result) if result.ok else result.message


def set_label(name: str, version: str, dev: bool) -> str:
    return f"{name} {'dev snapshot ' if dev else ''}{version}"


def describe_plan(plan: Plan, ps: PatchSet) -> str:
    label = set_label(ps.name, ps.version, ps.dev)
    if plan.blocked:
        return f"blocked: {plan.blocked}"
    if plan.action == "noop":
        return f"no change ({label} already applied)"
    if plan.action == "restore":
        return f"would save hand edits and restore {label}"
    verb = f"replace {plan.from_} with" if plan.action == "replace" else "apply"
    return f"would {verb} {label} ({len(ps.patches)} patches, {len(ps.files)} files)"


def describe_push(res: PushReply | PlanReply, ps: PatchSet) -> str:
    if isinstance(res, PlanReply):
        return describe_plan(res.plan, ps) + diff_note(res)
    label = set_label(ps.name, ps.version, ps.dev)
    if not res.changed or res.applied is None:
        return f"unchanged ({label} already applied)"
    over = f" over {res.plan.from_}" if res.plan.from_ else ""
    saved = f"; hand edits saved as {res.saved}" if res.saved else ""
    return f"applied {label}{over} ({len(res.applied.patches)} patches, head {res.applied.head[:12]}){saved}"


def diff_note(res: PlanReply) -> str:
    d = res.diff
    if d is None:
        return ""
    if d.text is None:
        return f"; {d.note}"
    cut = f", cut at {len(d.text.encode())} of {d.bytes} bytes" if d.truncated else ""
    return f"; diff: {len(d.files)} file(s){cut}"


def plan_diffs(results: list[HostResult]) -> list[str]:
    """Each planned host's diff under a `# host` header, styled (click.echo drops it off a terminal)."""
    out = []
    for r in results:
        d = r.outcome.result.diff if r.ok and isinstance(r.outcome.result, PlanReply) else None
        if d is None or not d.text:
            continue
        lines = [click.style(f"# {r.host}: {len(d.files)} file(s) would change", bold=True)]
        lines += [_diff_line(ln) for ln in d.text.splitlines()]
        if d.truncated:
            lines.append(click.style(f"# {r.host}: diff cut at {len(d.text.encode())} of {d.bytes} bytes", fg="yellow"))
        out.append("\n".join(lines) + "\n")
    return out


def _diff_line(line: str) -> str:
    if line.startswith(("+++", "---", "diff ", "index ")):
        return click.style(line, bold=True)
    if line.startswith("@@"):
        return click.style(line, fg="cyan")
    if line.startswith(("+", "-")):
        return click.style(line, fg="green" if line[0] == "+" else "red")
    return line


def describe_push_build(res: PushBuild | PlanReply, ps: PatchSet) -> str:
    if not isinstance(res, PushBuild):
        return describe_push(res, ps)
    pushed = describe_push(res.push, ps)
    if not res.push.changed:
        return pushed
    if res.build is None:
        return f"{pushed}; kernel sources unchanged, no build"
    return f"{pushed}; {describe_build(res.build)}"


def describe_rollback(res: RollbackReply) -> str:
    if not res.changed:
        return res.message or "unchanged"
    saved = f"; hand edits saved as {res.saved}" if res.saved else ""
    target = res.to or f"pre-deploy state (tree {(res.tree or '')[:12]})"
    return f"rolled back {res.from_} -> {target}{saved}"


def describe_lock(lock: LockOwner | None) -> str:
    if lock is None:
        return "free"
    age = time.time() - (lock.time if lock.time is not None else time.time())
    stale = " (stale: that process is gone)" if lock.alive is False else ""
    return f"held by {lock.by} pid {lock.pid or '?'} running `{lock.command or '?'}` for {age:.0f}s{stale}"


def describe_lock_release(res: LockReleaseReply) -> str:
    return f"released the lock of {describe_lock(res.lock)}" if res.released else "no lock held"


def describe_build(res: BuildReply) -> str:
    plan = res.plan
    if not res.changed:
        return f"up to date ({plan.arch}, {plan.reason})"
    modules = ", ".join(f"{m.get('module')} {m.get('status')}" for m in (res.build or {}).get("modules", []))
    return f"built {plan.arch} with nvcc {plan.toolkit.nvcc}: {modules}"


def describe_test(record: TestRecord) -> str:
    return f"{record.summary}; report {record.report}"


def describe_log(res: LogReply) -> str:
    return f"{len(res.entries)} record(s)"


# --- status ------------------------------------------------------------------------------------


def applied_text(status: HostStatus) -> str:
    a = status.applied
    return set_label(a.name, a.version, a.dev) if a else "none"


def checkout_text(status: HostStatus) -> str:
    """HEAD (and branch), and whether the touched files hold the base the newest release expects."""
    head = f"{status.head[:12]}{' ' + status.branch if status.branch else ''}"
    base = status.base
    if base is None:
        return head
    if not base.mismatched:
        return f"{head}, base ok"
    return f"{head}, {len(base.mismatched)} file(s) not the base"


def drift_text(status: HostStatus) -> str:
    return f"{len(status.drift)} file(s)" if status.drift else "none"


def lock_cell(lock: LockOwner | None) -> str:
    if lock is None:
        return "-"
    return f"{lock.by} pid {lock.pid or '?'}{' (stale)' if lock.alive is False else ''}"


def builds_text(builds: dict[str, BuildRecord]) -> str:
    if not builds:
        return "-"
    parts = []
    for arch, info in sorted(builds.items()):
        verdict = "" if info.ok is None else (" ok" if info.ok else " FAILED")
        version = f" ({info.version})" if info.version else ""
        parts.append(f"{arch}{verdict}{version}")
    return ", ".join(parts)


def tests_text(tests: TestRecord | None) -> str:
    if tests is None:
        return "-"
    verdict = {True: "ok", False: "FAILED"}.get(tests.ok, "?")
    detail = tests.summary or (f"{tests.passed} passed" if tests.passed is not None else "")
    return f"{verdict} {detail}".strip()


def bench_text(bench: dict[str, Any] | None) -> str:
    """The last bench in one cell: topology, each config's best output tokens/s, the greedy check."""
    if not bench:
        return "-"
    best: dict[str, float] = {}
    for row in bench.get("configs", []):
        best[row["config"]] = max(best.get(row["config"], 0.0), row.get("output_tokens_per_s") or 0.0)
    parts = [f"{name} {tps:.1f} tok/s" for name, tps in best.items()]
    greedy = bench.get("greedy") or {}
    check = {True: ", greedy equal", False: ", GREEDY DIFFERS"}.get(greedy.get("equal"), "")
    return f"{bench.get('topology')}: {' vs '.join(parts)}{check} ({bench.get('at') or '?'})"


def _num(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


CONFIG_NAMES = {"ddtree": "DDTree"}  # as a verdict names a config; the others by their own name


def bench_head(result: dict[str, Any]) -> str:
    p = result["params"]
    repeats, warmup = p.get("repeats", 1), p.get("warmup", 0)
    runs = f"medians of {repeats} runs" if repeats > 1 else "one run"
    warm = f"{warmup} warm-up run{'' if warmup == 1 else 's'}"
    return (
        f"host {result['host']}, topology {result['topology']} ({result.get('applied') or 'no patch set'}): "
        f"{p['requests']} requests of {p['input_len']} -> {p['output_len']} tokens, temperature {p['temperature']:g}, "
        f"SGLang's benchmark client on the host; {runs} per concurrency after {warm} per config"
    )


def bench_row(r: dict[str, Any]) -> list[str]:
    label = r["config"] + (f" B={r['tree_budget']} K={r['tree_topk']}" if r["config"] == "ddtree" else "")
    low, high = r.get("output_tokens_per_s_min"), r.get("output_tokens_per_s_max")
    spread = f"{_num(low)}-{_num(high)}" if r.get("repeats", 1) > 1 and low is not None else "-"
    return [
        f"{label} (W={r['verify_width'] or '-'})",
        str(r["concurrency"]),
        _num(r["accept_length"], ".2f"),
        _num(r.get("verify_count"), "d"),
        _num(r["output_tokens_per_s"]),
        spread,
        "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
        f"{_num(r['ttft_ms_median'])} / {_num(r['ttft_ms_p99'])}",
        f"{_num(r['itl_ms_median'])} / {_num(r['itl_ms_p99'])}",
    ]


def speedup_verdict(row: dict[str, Any], baseline: str) -> str:
    """One concurrency's speedup: shown when its interval leaves out 1.0, else inside the noise."""
    name = CONFIG_NAMES.get(row["config"], row["config"])
    lead = f"speedup at concurrency {row['concurrency']}: "
    shown = f"{name} {row['speedup']:.2f}x {baseline}"
    iv = row.get("speedup_interval")
    if iv is None:
        return lead + f"{shown} (under 2 runs a side: no interval; --repeats 2 or more gives one)"
    span = f"{iv['low']:.2f}-{iv['high']:.2f} over {iv['runs'][0]}x{iv['runs'][1]} runs"
    if iv["excludes_one"]:
        return lead + f"{shown} ({span})"
    return lead + f"inside the noise ({span}): no difference shown"


def greedy_verdict(result: dict[str, Any]) -> str:
    g, baseline = result["greedy"], result.get("compare")
    if not g["checked"]:
        return "greedy check: not run (it needs --compare and temperature 0)"
    if g["equal"]:
        first = result["configs"][0]["config"]
        return f"greedy check: {g['prompts']} prompts, {first} equals {baseline} token for token"
    d = g["difference"]
    return (
        f"greedy check: FAILED on probe prompt {d['prompt']} at output token {d['position']} "
        f"({d['got']} vs {baseline}'s {d['baseline']})"
    )


def bench_table(result: dict[str, Any]) -> str:
    """`ddeploy bench`: a heading, one row per (config, concurrency), the speedup verdicts, the
    greedy verdict."""
    baseline = result.get("compare")
    rows = [bench_row(r) for r in result["configs"]]
    headers = ["config", "concurrency", "accept length", "verify steps", "output tok/s", "runs min-max",
               f"vs {baseline or '-'}", "TTFT ms p50 / p99", "ITL ms p50 / p99"]  # fmt: skip
    verdicts = [speedup_verdict(r, baseline) for r in result["configs"] if r.get("speedup") is not None]
    return "\n".join([bench_head(result), table(rows, headers), *verdicts, greedy_verdict(result)])


def launch_text(launch) -> str:
    """The last launch in one cell: topology and what runs of it ('-': nothing launched)."""
    if launch is None:
        return "-"
    if launch.error:
        return f"unreadable: {launch.error}"[:60]
    name = launch.topology + (f" ({launch.variant})" if launch.variant else "")
    if launch.state == "running" and launch.alive == launch.units:
        return f"{name} running ({launch.units} unit{'s' if launch.units != 1 else ''}, since {launch.started_at})"
    if launch.state == "running":
        return f"{name} exited ({launch.alive} of {launch.units} units alive; `ddeploy logs`)"
    return f"{name} {launch.state} ({launch.stopped_at or launch.started_at})"


def describe_status(status: HostStatus) -> str:
    return (
        f"{checkout_text(status)}; applied: {applied_text(status)}; drift: {drift_text(status)}; "
        f"lock: {lock_cell(status.lock)}; launch: {launch_text(status.launch)}"
    )


def status_table(results: list[HostResult]) -> str:
    rows = []
    for r in results:
        if r.ok:
            s: HostStatus = r.outcome.result
            rows.append(
                [
                    r.host,
                    "yes",
                    checkout_text(s),
                    applied_text(s),
                    drift_text(s),
                    lock_cell(s.lock),
                    builds_text(s.builds),
                    tests_text(s.tests),
                    launch_text(s.launch),
                    bench_text(s.bench),
                ]
            )
        elif isinstance(r.error, ConnectError):
            rows.append([r.host, f"no: {r.message}"[:70], *["?"] * 8])
        else:  # reachable, but the checkout cannot be read (missing, not git, ...)
            rows.append([r.host, "yes", f"error: {r.message}"[:70], *["?"] * 7])
    head = ["host", "reachable", "checkout", "applied", "drift", "lock", "builds", "tests", "launch", "bench"]
    return table(rows, head)


# --- fleet summaries ---------------------------------------------------------------------------


def summary_table(results: list[HostResult], describe_ok) -> str:
    rows = [
        [
            r.host,
            ("ok: " if r.ok else ("SKIPPED: " if r.skipped else "FAILED: ")) + summary(r, describe_ok),
            f"{r.duration:.2f}s",
        ]
        for r in results
    ]
    return table(rows, ["host", "result", "duration"])


def history_table(res: LogReply) -> str:
    rows = [[e.date, e.commit[:12], e.message] for e in res.entries]
    return table(rows, ["date", "record", "what"]) if rows else "(nothing yet)"


def test_rows(results: list[HostResult]) -> list[list[str]]:
    """Per-host rows: host, verdict, passed, failed, skipped, errors, duration."""
    rows = []
    for r in results:
        t: dict[str, Any] = r.data
        counts = [str(t[k]) if t.get(k) is not None else "-" for k in ("passed", "failed", "skipped", "errors")]
        duration = f"{t['duration']:.1f}s" if t.get("duration") is not None else "-"
        rows.append([r.host, "ok" if r.ok else ("skipped" if r.skipped else "FAILED"), *counts, duration])
    return rows


def test_table(results: list[HostResult]) -> str:
    return table(test_rows(results), ["host", "result", "passed", "failed", "skipped", "errors", "duration"])


def result_json(r: HostResult) -> dict[str, Any]:
    """One host's result for --json: stable data fields, no display strings (docs/remote.md)."""
    out: dict[str, Any] = {
        "host": r.host,
        "ok": r.ok,
        "status": r.status,
        "changed": r.changed,
        "duration_s": round(r.duration, 3),
        "data": r.data,
    }
    if r.error is not None:
        out["error"] = {"type": type(r.error).__name__, "message": str(r.error), "exit_code": int(r.error.exit_code)}
    return out
