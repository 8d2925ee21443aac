"""`ddeploy test --remote`: the applied set's overlay tests under pytest, a JUnit report inside
.git, its totals recorded in the state (section tests). The pytest command line and the JUnit
totals are used by the client's local runs too (deployer/ops/overlay_tests.py)."""

import os
import subprocess
import sys

from .bytecode import pycache_dir
from .common import Fail, now, progress, test_pause
from .repo import Repo
from .state import read_state, update_section


TEST_DIR = "test/srt/ddtree"


def pytest_argv(python: str, junit: str, k=None) -> list:
    """The overlay tests' pytest command line (run in the checkout, or in the overlay locally)."""
    argv = [python, "-m", "pytest", TEST_DIR, "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit2"]
    return argv + ["--junitxml=" + junit] + (["-k", k] if k else [])


def junit_totals(xml_text: str):
    """Totals over every <testsuite> of a pytest JUnit report, or None when it cannot be read."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(xml_text)  # noqa: S314 - the report pytest just wrote here
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    duration = sum(float(s.get("time", 0) or 0) for s in suites)
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "tests": total["tests"],
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
        "duration": duration,
    }


def describe_totals(t: dict) -> str:
    return "%d passed, %d failed, %d skipped, %d errors in %.1fs" % (
        t["passed"],
        t["failed"],
        t["skipped"],
        t["errors"],
        t["duration"],
    )


def check_applied_for_tests(state: dict, req: dict) -> dict:
    applied = state.get("applied")
    name = req["target"]["name"]
    if not applied:
        raise Fail(
            "StateError",
            "no patch set is applied to %s, so it has no overlay tests; push one first "
            "(ddeploy push --host %s)" % (req["checkout"], name),
        )
    want = req.get("requested")
    if want and applied.get("fingerprint") != want["fingerprint"]:
        raise Fail(
            "StateError",
            "%s %s is applied, not the requested %s %s; push %s first or drop --version"
            % (applied.get("name"), applied.get("version"), want["name"], want["version"], want["version"]),
        )
    return applied


def op_test(repo: Repo, req: dict) -> dict:
    """pytest on the applied set's overlay tests, JUnit report inside .git; the report comes back in
    the reply and its totals are recorded in the state (section tests). With `push` in the request
    (a dev snapshot: its set and push options), this agent pushes it first: one call, one process.
    The checkout's lock is held for the push and the tests together: no push changes the tree
    under a test run."""
    from .lock import holding
    from .patch_files import Scratch, load_patches
    from .push import need_checkout, push_held

    if not req.get("push"):
        with holding(repo, req):
            return run_tests(repo, req, None)
    need_checkout(repo)
    push_req = dict(req, **req["push"])
    with Scratch("ddeploy-push-") as workdir:
        patches = load_patches(push_req, workdir)  # NeedShip before the lock, as a push
        with holding(repo, req):
            return run_tests(repo, req, push_held(repo, push_req, patches))


def run_tests(repo: Repo, req: dict, pushed) -> dict:
    """The tests of op_test, the lock held; `pushed`: the push's reply when it pushed first."""
    test_pause(req, "before_tests")
    _c, state = read_state(repo)
    applied = check_applied_for_tests(state, req)
    opts = req.get("options", {})
    reports = os.path.join(repo.ddir, "test-reports")
    os.makedirs(reports, exist_ok=True)
    junit = os.path.join(reports, "%s.xml" % req["stamp"])
    progress(
        "running %s of %s %s with %s%s"
        % (
            TEST_DIR,
            applied.get("name"),
            applied.get("version"),
            req["target"]["python"],
            " (-k %s)" % opts["k"] if opts.get("k") else "",
        )
    )
    argv = pytest_argv(req["target"]["python"], junit, opts.get("k"))
    env = dict(os.environ, PYTHONPYCACHEPREFIX=pycache_dir(repo))
    sys.stderr.flush()
    try:  # all of pytest's output on stderr: the client streams it line by line as `[host] ...`
        rc = subprocess.run(argv, cwd=repo.path, env=env, stdout=2, stderr=2).returncode
    except OSError as exc:
        rc = 127
        progress("%s: %s" % (argv[0], exc.strerror))
    try:
        with open(junit, errors="replace") as fh:
            xml_text = fh.read()
    except FileNotFoundError:
        xml_text = None
    totals = junit_totals(xml_text) if xml_text is not None else None
    record = {
        "ok": bool(totals and totals["failed"] == 0 and totals["errors"] == 0 and totals["tests"] > 0 and rc == 0),
        "rc": rc,
        "version": applied.get("version"),
        "k": opts.get("k"),
        "at": now(),
        "report": req.get("report") or junit,
    }
    record.update(totals or {})
    record["summary"] = describe_totals(totals) if totals else "pytest exit %d" % rc
    update_section(repo, "tests", lambda _old: record, "test %s: %s" % (applied.get("version"), record["summary"]))
    return {"ok": True, "record": record, "junit": xml_text, "host_report": junit, "push": pushed}
