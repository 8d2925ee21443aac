"""`ddeploy test`: run the overlay's unit tests (they ship in the patch set under test/srt/ddtree/)
on hosts, with the host's python against the patched checkout, or locally against the overlay.

Per host: refuse unless a patch set is applied (and, with --version, unless it is that set);
run pytest with a JUnit report written inside the checkout's .git (the work tree stays clean),
stream its output as `[host] ...`, rsync the report back, summarise it (passed / failed /
skipped / errors, duration) and record the summary in the host's state (section "tests").
A host whose tests fail, or whose pytest cannot run, is that host's failure; the others go on.
"""

from __future__ import annotations

import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .connection import Connection, LocalConnection, open_connection
from .engine import Outcome
from .errors import DeployError, OverlayTestsFailed, StateError
from .inventory import Host, local_host
from .patchset import PatchSet
from .paths import active_overlay_dir, cache_dir
from .state import read_state, update_state

Say = Callable[[str], None]
TEST_DIR = "test/srt/ddtree"
REMOTE_REPORTS = ".git/ddeploy/test-reports"
PYCACHE = ".git/ddeploy/pycache"  # bytecode of test runs goes here: the work tree stays clean


@dataclass(frozen=True)
class TestOptions:
    __test__ = False  # not a pytest class

    expr: str | None = None
    requested: PatchSet | None = None
    report_dir: Path | None = None
    accept_new_host_keys: bool = False

    @property
    def reports(self) -> Path:
        return self.report_dir or cache_dir() / "test-reports"


@dataclass
class JUnitSummary:
    tests: int
    passed: int
    failed: int
    errors: int
    skipped: int
    duration: float

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.errors == 0 and self.tests > 0

    def describe(self) -> str:
        return (f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped, {self.errors} errors "
                f"in {self.duration:.1f}s")


def parse_junit(path: Path) -> JUnitSummary:
    """Totals over every <testsuite> of a pytest JUnit report."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise DeployError(f"cannot read the JUnit report {path}: {exc}") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    duration = sum(float(s.get("time", 0) or 0) for s in suites)
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return JUnitSummary(total["tests"], passed, total["failures"], total["errors"], total["skipped"], duration)


def pytest_argv(python: str, test_dir: str, junit: str, expr: str | None) -> list[str]:
    # All output on stderr: the connection streams stderr line by line as `[host] ...`.
    return ["sh", "-c", 'exec "$@" 1>&2', "sh", python, "-m", "pytest", test_dir, "-q", "-p", "no:cacheprovider",
            "-o", "junit_family=xunit2", f"--junitxml={junit}", *(["-k", expr] if expr else [])]


def check_applied(state: dict[str, Any], host: Host, requested: PatchSet | None) -> dict[str, Any]:
    applied = state.get("applied")
    if not applied:
        raise StateError(f"no patch set is applied to {host.checkout}, so it has no overlay tests; push one first "
                         f"(ddeploy push --host {host.name})", host=host.name)
    if requested is not None and applied.get("fingerprint") != requested.fingerprint():
        raise StateError(f"{applied.get('name')} {applied.get('version')} is applied, not the requested "
                         f"{requested.name} {requested.version}; push {requested.version} first or drop --version",
                         host=host.name)
    return applied


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{time.monotonic_ns() % 1000000:06d}"


def run_suite(conn: Connection, python: str, cwd: str, junit_remote: str, local: Path, expr: str | None,
              say: Say) -> tuple[int, JUnitSummary | None]:
    """pytest on the connection, then fetch its report to `local`; (rc, summary or None)."""
    res = conn.run(pytest_argv(python, TEST_DIR, junit_remote, expr), cwd=cwd, check=False, stream=say,
                   env={"PYTHONPYCACHEPREFIX": f"{cwd.rstrip('/')}/{PYCACHE}"})
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn.rsync_from(junit_remote, str(local))
    except DeployError:
        return res.rc, None  # pytest died before writing a report
    return res.rc, parse_junit(local)


def _record(summary: JUnitSummary | None, rc: int, version: str | None, expr: str | None, report: Path) -> dict:
    return {"ok": bool(summary and summary.ok and rc == 0), "rc": rc, "version": version, "k": expr,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "report": str(report),
            **(asdict(summary) if summary else {}), "summary": summary.describe() if summary else f"pytest exit {rc}"}


def verdict(host: str, record: dict[str, Any]) -> Outcome:
    """Outcome for a passing run; OverlayTestsFailed (carrying the record) otherwise."""
    if record["ok"]:
        return Outcome(f"{record['summary']}; report {record['report']}", {"tests": record})
    if "tests" not in record:
        msg = f"pytest exited {record['rc']} without a JUnit report; see the output above"
    elif record["tests"] == 0:
        msg = f"no tests ran (pytest exit {record['rc']}); check -k and the checkout's {TEST_DIR}"
    else:
        msg = f"tests failed: {record['summary']}; report {record['report']}"
    err = OverlayTestsFailed(msg, host=host)
    err.data = {"tests": record}
    raise err


def test_host(host: Host, opts: TestOptions, say: Say) -> Outcome:
    """Run the overlay tests of the applied patch set on one host (see the module docstring)."""
    with open_connection(host, accept_new_host_keys=opts.accept_new_host_keys) as conn:
        applied = check_applied(read_state(conn, host), host, opts.requested)
        stamp = _stamp()
        reports = f"{host.checkout.rstrip('/')}/{REMOTE_REPORTS}"
        conn.run(["mkdir", "-p", reports])
        say(f"running {TEST_DIR} of {applied.get('name')} {applied.get('version')} with {host.python}"
            + (f" (-k {opts.expr})" if opts.expr else ""))
        local = opts.reports / host.name / f"{stamp}.xml"
        rc, summary = run_suite(conn, host.python, host.checkout, f"{reports}/{stamp}.xml", local, opts.expr, say)
        record = _record(summary, rc, applied.get("version"), opts.expr, local)
        update_state(conn, host, "tests", record, message=f"test {applied.get('version')}: {record['summary']}")
    return verdict(host.name, record)


def test_local(opts: TestOptions, say: Say) -> Outcome:
    """The same suite on this machine, against the overlay ($DDEPLOY_OVERLAY_DIR or overlays/ddtree)."""
    overlay = active_overlay_dir()
    conn = LocalConnection(local_host())
    stamp = _stamp()
    local = opts.reports / "local" / f"{stamp}.xml"
    local.parent.mkdir(parents=True, exist_ok=True)
    say(f"running {overlay / TEST_DIR} with {sys.executable}" + (f" (-k {opts.expr})" if opts.expr else ""))
    res = conn.run(pytest_argv(sys.executable, TEST_DIR, str(local), opts.expr), cwd=str(overlay), check=False,
                   stream=say)
    summary = parse_junit(local) if local.exists() else None
    return verdict("local", _record(summary, res.rc, "overlay", opts.expr, local))


def result_rows(results: list) -> list[list[str]]:
    """Per-host table rows: host, verdict, passed, failed, skipped, errors, duration."""
    rows = []
    for r in results:
        data = r.data if r.ok else (getattr(r.error, "data", None) or {})
        t = data.get("tests") or {}
        counts = [str(t.get(k, "-")) for k in ("passed", "failed", "skipped", "errors")]
        duration = f"{t['duration']:.1f}s" if "duration" in t else "-"
        rows.append([r.host, "ok" if r.ok else ("skipped" if r.skipped else "FAILED"), *counts, duration])
    return rows
