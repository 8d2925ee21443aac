"""Run one per-host operation over many hosts: bounded parallelism, live `[host]` output, a
result per host as data (never an exception that stops the others), a summary table.

    results = run_fleet(hosts, lambda host, say: push_host(host, ps, opts, say), parallel=4)
    print_summary(results); exit_for(results)
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from .engine import Outcome, Say
from .errors import DeployError, HostsFailed
from .inventory import Host
from .output import table

Operation = Callable[[Host, Say], Outcome]


@dataclass
class HostResult:
    host: str
    ok: bool
    summary: str
    duration: float
    changed: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    error: DeployError | None = None
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "failed")

    def to_json(self) -> dict[str, Any]:
        out = {"host": self.host, "ok": self.ok, "status": self.status, "changed": self.changed,
               "summary": self.summary, "duration_s": round(self.duration, 3), "data": self.data}
        if self.error is not None:
            out["error"] = {"type": type(self.error).__name__, "message": str(self.error),
                            "exit_code": self.error.exit_code}
        return out


class Progress:
    """Serialises output from worker threads: `[host] line` on stderr; on a terminal a footer
    line shows which hosts are still running."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.lock = threading.Lock()
        self.running: dict[str, float] = {}
        self.done = 0
        self.total = total
        self._stop = threading.Event()
        if self.tty:  # keep the footer's clocks moving while hosts work silently
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self.lock:
                if self.running:
                    self.stream.write("\r\x1b[K" + self._footer())
                    self.stream.flush()

    def _footer(self) -> str:
        names = ", ".join(f"{h} {time.monotonic() - t:.0f}s" for h, t in self.running.items())
        return f"[{self.done}/{self.total} done] running: {names}"

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        if self.tty and self.running:
            self.stream.write(self._footer())
        self.stream.flush()

    def line(self, host: str, text: str) -> None:
        with self.lock:
            self._write(f"[{host}] {text}")

    def start(self, host: str) -> None:
        with self.lock:
            self.running[host] = time.monotonic()
            self._write(f"[{host}] started")

    def finish(self, result: HostResult) -> None:
        with self.lock:
            self.running.pop(result.host, None)
            self.done += 1
            verdict = "ok" if result.ok else "FAILED"
            self._write(f"[{result.host}] {verdict} in {result.duration:.2f}s: {result.summary}")

    def close(self) -> None:
        self._stop.set()
        if self.tty:
            with self.lock:
                self.stream.write("\r\x1b[K")
                self.stream.flush()


def run_one(host: Host, op: Operation, progress: Progress) -> HostResult:
    progress.start(host.name)
    t0 = time.monotonic()
    try:
        out = op(host, lambda text: progress.line(host.name, text))
        res = HostResult(host.name, True, out.summary, time.monotonic() - t0, out.changed, out.data)
    except DeployError as exc:
        msg = str(exc).removeprefix(f"[{host.name}] ")
        res = HostResult(host.name, False, msg, time.monotonic() - t0, error=exc)
    except Exception as exc:  # noqa: BLE001 - a bug on one host must not hide the others' results
        err = DeployError(f"internal error: {type(exc).__name__}: {exc}", host=host.name)
        res = HostResult(host.name, False, str(err).removeprefix(f"[{host.name}] "), time.monotonic() - t0, error=err)
    progress.finish(res)
    return res


def run_fleet(hosts: list[Host], op: Operation, *, parallel: int = 4, fail_fast: bool = False,
              progress: Progress | None = None) -> list[HostResult]:
    """Run op on every host (at most `parallel` at once); results in inventory order."""
    progress = progress or Progress(len(hosts))
    results: dict[str, HostResult] = {}
    pending = list(hosts)
    failed = False
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        running: dict[Future, Host] = {}
        while pending or running:
            while pending and len(running) < max(1, parallel) and not (fail_fast and failed):
                host = pending.pop(0)
                running[pool.submit(run_one, host, op, progress)] = host
            if fail_fast and failed and not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                res = fut.result()
                results[running.pop(fut).name] = res
                failed = failed or not res.ok
    for host in pending:  # --fail-fast: never started
        results[host.name] = HostResult(host.name, False, "skipped (--fail-fast after a failure)", 0.0, skipped=True)
    progress.close()
    return [results[h.name] for h in hosts]


def summary_table(results: list[HostResult]) -> str:
    rows = [[r.host, ("ok: " if r.ok else ("SKIPPED: " if r.skipped else "FAILED: ")) + r.summary,
             f"{r.duration:.2f}s"] for r in results]
    return table(rows, ["host", "result", "duration"])


def raise_if_failed(results: list[HostResult]) -> None:
    """Exit non-zero when any host failed; a single kind of failure keeps its own exit code."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return
    codes = {r.error.exit_code for r in failed if r.error is not None}
    err = HostsFailed(f"{len(failed)} of {len(results)} host(s) failed: {', '.join(r.host for r in failed)}")
    if len(codes) == 1:
        err.exit_code = codes.pop()
    raise err
