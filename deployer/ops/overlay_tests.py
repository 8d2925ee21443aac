"""`ddeploy test`: the overlay's unit tests (shipped in the patch set under test/srt/ddtree/), on
hosts with the host's python against the patched checkout, or locally against the overlay.

With --overlay, the overlay's dev snapshot (deployer/patchset/snapshot.py) is pushed first by the
same agent call, a no-op when it is already applied, and the tests then require exactly it.
On a host the agent does it in one call: refuse unless a patch set is applied (and, with
--version, unless it is that set), run pytest with a JUnit report inside the checkout's .git
(the work tree stays clean) and its output streamed as `[host] ...`, record the totals in the
host's state (section "tests") and send the report back in its reply, saved under --report-dir.
A host whose tests fail, or whose pytest cannot run, is that host's failure; the others go on.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..agent.overlay_tests import TEST_DIR, describe_totals, junit_totals, pytest_argv
from ..transport.connection import LocalConnection
from ..errors import DeployError, OverlayTestsFailed
from ..inventory import Host, local_host
from ..patchset import PatchSet
from ..locations import active_overlay_dir, cache_dir
from ..transport.agent_client import AgentSession, agent_session
from ..transport.early_agents import EarlyAgents
from ..transport.protocol import TestRecord, TestReply
from .deploy import Options, ensure_local_checkout, options_request, with_set
from .outcome import Outcome, Say


@dataclass(frozen=True)
class TestOptions:
    __test__ = False  # not a pytest class

    expr: str | None = None
    requested: PatchSet | None = None
    snapshot: PatchSet | None = None  # --overlay: the dev snapshot pushed before the tests run
    overlay: Path | None = None  # the overlay a local run tests (default: the active overlay)
    report_dir: Path | None = None
    accept_new_host_keys: bool = False
    command: str = "ddeploy test"
    early: EarlyAgents | None = field(default=None, compare=False, repr=False)  # sessions opened ahead

    @property
    def reports(self) -> Path:
        return self.report_dir or cache_dir() / "test-reports"


@dataclass(frozen=True)
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
        return describe_totals(self.__dict__)  # the agent's wording, for local and remote runs alike


def parse_junit(path: Path) -> JUnitSummary:
    """Totals over every <testsuite> of a pytest JUnit report (the agent's reading of it)."""
    try:
        totals = junit_totals(path.read_text(errors="replace"))
    except OSError as exc:
        raise DeployError(f"cannot read the JUnit report {path}: {exc.strerror}") from None
    if totals is None:
        raise DeployError(f"cannot read the JUnit report {path}: not a JUnit XML file") from None
    return JUnitSummary(**totals)


def stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{time.monotonic_ns() % 1000000:06d}"


def verdict(host: str, record: TestRecord) -> Outcome:
    """Outcome for a passing run; OverlayTestsFailed (carrying the record as its data) otherwise."""
    if record.ok:
        return Outcome(record)
    if record.tests is None:
        msg = f"pytest exited {record.rc} without a JUnit report; see the output above"
    elif record.tests == 0:
        msg = f"no tests ran (pytest exit {record.rc}); check -k and the checkout's {TEST_DIR}"
    else:
        msg = f"tests failed: {record.summary}; report {record.report}"
    err = OverlayTestsFailed(msg, host=host)
    err.data = record.to_data()
    raise err


def test_host(host: Host, opts: TestOptions, say: Say) -> Outcome:
    """Run the overlay tests of the applied patch set on one host (see the module docstring); with
    a dev snapshot, the same agent call pushes it first (a no-op when it is already applied)."""
    if opts.snapshot is not None:
        ensure_local_checkout(host, say)
    accept, command = opts.accept_new_host_keys, opts.command
    with agent_session(host, accept_new_host_keys=accept, command=command, early=opts.early) as agent:
        local, res = run_tests(agent, opts, say)
    if res.junit is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(res.junit)
    outcome = verdict(host.name, res.record)
    return Outcome(outcome.result, changed=bool(res.push and res.push.changed))


def push_options(opts: TestOptions) -> Options:
    return Options(accept_new_host_keys=opts.accept_new_host_keys, command=opts.command)


def run_tests(agent: AgentSession, opts: TestOptions, say: Say) -> tuple[Path, TestReply]:
    """One `test` call (with the dev snapshot's push in it): the local path its JUnit report
    belongs at, and the agent's reply."""
    host, run = agent.host, stamp()
    local = opts.reports / host.name / f"{run}.xml"
    requested = opts.snapshot or opts.requested
    request = {
        "target": {"name": host.name, "python": host.python},
        "stamp": run,
        "report": str(local),
        # pause: the test-only hook of push's options (DDEPLOY_TEST_AGENT_PAUSE)
        "options": {"k": opts.expr, "pause": os.environ.get("DDEPLOY_TEST_AGENT_PAUSE", "")},
        "requested": None
        if requested is None
        else {"name": requested.name, "version": requested.version, "fingerprint": requested.fingerprint()},
    }
    if opts.snapshot is None:
        return local, agent.call("test", request, TestReply, stream=say)
    push = options_request(push_options(opts))

    def call(set_request: dict, **kw) -> TestReply:
        return agent.call("test", {**request, "push": {**push, "set": set_request}}, TestReply, **kw)

    return local, with_set(agent, opts.snapshot, say, call)


def test_local(opts: TestOptions, say: Say) -> Outcome:
    """The same suite on this machine, against the overlay ($DDEPLOY_OVERLAY_DIR or overlays/ddtree)."""
    overlay = opts.overlay or active_overlay_dir()
    conn = LocalConnection(local_host())
    local = opts.reports / "local" / f"{stamp()}.xml"
    local.parent.mkdir(parents=True, exist_ok=True)
    say(f"running {overlay / TEST_DIR} with {sys.executable}" + (f" (-k {opts.expr})" if opts.expr else ""))
    argv = ["sh", "-c", 'exec "$@" 1>&2', "sh", *pytest_argv(sys.executable, str(local), opts.expr)]
    res = conn.run(argv, cwd=str(overlay), check=False, stream=say)
    summary = parse_junit(local) if local.exists() else None
    totals = {} if summary is None else {**summary.__dict__, "summary": summary.describe()}
    record = TestRecord(
        ok=bool(summary and summary.ok and res.rc == 0),
        rc=res.rc,
        version="overlay",
        k=opts.expr,
        at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        report=str(local),
        **{"summary": f"pytest exit {res.rc}", **totals},
    )
    return verdict("local", record)
