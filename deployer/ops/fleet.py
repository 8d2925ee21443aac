"""Run one per-host operation over many hosts: bounded parallelism, a result per host as data
(never an exception that stops the others), events for whoever shows progress.

    results = run_fleet(hosts, lambda host, say: push_host(host, ps, opts, say), parallel=4, events=progress)
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..errors import DeployError, ExitCode, HostsFailed
from ..inventory import Host
from .outcome import Outcome, Say

Operation = Callable[[Host, Say], Outcome]


@dataclass(frozen=True)
class HostResult:
    host: str
    ok: bool
    duration: float
    outcome: Outcome | None = None
    error: DeployError | None = None
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "failed")

    @property
    def changed(self) -> bool:
        return bool(self.outcome and self.outcome.changed)

    @property
    def data(self) -> dict[str, Any]:
        """The operation's result; for a failure, what the error carries (e.g. a test record)."""
        if self.outcome is not None:
            return self.outcome.to_data()
        return dict(getattr(self.error, "data", None) or {})

    @property
    def message(self) -> str:
        """The error's one line without the `[host]` prefix ('' when ok)."""
        if self.skipped:
            return "skipped (--fail-fast after a failure)"
        return str(self.error).removeprefix(f"[{self.host}] ") if self.error is not None else ""


class Events(Protocol):
    def start(self, host: str) -> None: ...
    def line(self, host: str, text: str) -> None: ...
    def finish(self, result: HostResult) -> None: ...


class Silent:
    def start(self, host: str) -> None:
        pass

    def line(self, host: str, text: str) -> None:
        pass

    def finish(self, result: HostResult) -> None:
        pass


def run_one(host: Host, op: Operation, events: Events) -> HostResult:
    events.start(host.name)
    t0 = time.monotonic()
    try:
        out = op(host, lambda text: events.line(host.name, text))
        res = HostResult(host.name, True, time.monotonic() - t0, outcome=out)
    except DeployError as exc:
        res = HostResult(host.name, False, time.monotonic() - t0, error=exc)
    except Exception as exc:  # noqa: BLE001 - a bug on one host must not hide the others' results
        err = DeployError(f"internal error: {type(exc).__name__}: {exc}", host=host.name)
        res = HostResult(host.name, False, time.monotonic() - t0, error=err)
    events.finish(res)
    return res


def run_fleet(
    hosts: list[Host], op: Operation, *, parallel: int = 4, fail_fast: bool = False, events: Events | None = None
) -> list[HostResult]:
    """Run op on every host (at most `parallel` at once); results in inventory order."""
    events = events or Silent()
    results: dict[str, HostResult] = {}
    pending = list(hosts)
    failed = False
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        running: dict[Future, Host] = {}
        while pending or running:
            while pending and len(running) < max(1, parallel) and not (fail_fast and failed):
                host = pending.pop(0)
                running[pool.submit(run_one, host, op, events)] = host
            if fail_fast and failed and not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                res = fut.result()
                results[running.pop(fut).name] = res
                failed = failed or not res.ok
    for host in pending:  # --fail-fast: never started
        results[host.name] = HostResult(host.name, False, 0.0, skipped=True)
    return [results[h.name] for h in hosts]


def raise_if_failed(results: list[HostResult]) -> None:
    """Exit non-zero when any host failed; a single kind of failure keeps its own exit code."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return
    codes = {r.error.exit_code for r in failed if r.error is not None}
    raise HostsFailed(
        f"{len(failed)} of {len(results)} host(s) failed: {', '.join(r.host for r in failed)}",
        exit_code=codes.pop() if len(codes) == 1 else ExitCode.FAILURE,
    )
