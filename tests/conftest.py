"""Shared pytest fixtures.

- `_isolated_cache` (session, autouse): DDEPLOY_CACHE_DIR points at a session tmp dir, so tests
  never touch the user's cache; the pristine base is linked in read-only from the user's cache
  when it is already built there (else built once into the tmp cache), and DDEPLOY_SGLANG_WHEEL
  names the cached wheel. Yields the tmp cache Path.
- `sshd_fleet` (session): an SshdFleet (see tests/sshd_hosts.py) of 3 real OpenSSH hosts h1..h3 on
  127.0.0.11-13, each with its own clone of the base. Torn down at session end, also on failure.
- `hosts` (function): the same fleet, reset before the test (no kept connections, all hosts up with
  their original keys, known_hosts rewritten, every checkout at the pristine base with no ddeploy
  refs). Use this one in tests so they stay independent: `hosts.hosts[0].checkout`, `hosts.inventory_dir`, ...
- `ddeploy` (function): run the real CLI in-process against the fleet's inventory:
  `r = ddeploy("push", "--host", "h1", "--version", str(set_dir))` -> Result(code, stdout, stderr).
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sshd_hosts import SshdFleet  # noqa: E402


# Test tiers: `pytest -m "not slow"` is the fast tier (no sshd hosts, no nvcc, no kernel-set
# exports); a test is slow when marked so, when it needs the sshd or nvcc markers, or when it uses
# a fixture that starts hosts or exports patch sets.
SLOW_FIXTURES = {"sshd_fleet", "hosts", "ddeploy", "python_hosts", "kernel_sets", "patch_sets", "real_release"}


# Parallel runs (scripts/test.sh: pytest-xdist, `--dist loadgroup`): the tests of one module here
# run on one worker, so a module's fixtures are set up once (the overlay's conftest.py puts its
# CPU-engine tests in one group of their own). Groups go out longest first, so that the last units
# the scheduler hands out are short: the CPU-engine tests, then these modules (minutes each,
# docs/testing.md), then the rest in file order.
LONG_GROUPS = (
    "cpu-engine",
    "test_serving.py",
    "cpu-engine-mla",
    "cpu-engine-sampling",
    "cpu-engine-dp",
    "test_build.py",
    "test_launch.py",
    "test_remote_test.py",
)
TESTS_DIR = Path(__file__).resolve().parent


def _group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return marker.args[0] if marker.args else marker.kwargs.get("name")


def _rank(item) -> int:
    group = _group(item)
    return LONG_GROUPS.index(group) if group in LONG_GROUPS else len(LONG_GROUPS)


@pytest.hookimpl(wrapper=True)  # around the other hooks: they group the overlay's tests
def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = {m.name for m in item.iter_markers()} & {"sshd", "nvcc"}
        if needs or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        path = Path(str(item.path)).resolve()
        if path.parent == TESTS_DIR and _group(item) is None:
            item.add_marker(pytest.mark.xdist_group(path.name))
    result = yield
    items.sort(key=_rank)  # stable: file order within a rank
    return result


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    from deployer.patchset.sglang_base import SGLANG_VERSION

    real = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddeploy"
    if os.environ.get("DDEPLOY_CACHE_DIR"):
        real = Path(os.environ["DDEPLOY_CACHE_DIR"])
    cache = tmp_path_factory.mktemp("ddeploy-cache")
    real_base = real / "base" / f"sglang-{SGLANG_VERSION}"
    if (real_base / ".git").is_dir():
        (cache / "base").mkdir()
        (cache / "base" / real_base.name).symlink_to(real_base)
    wheels = sorted((real / "wheels").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDEPLOY_CACHE_DIR", str(cache))
        # Refused connects are still retried (3 times), just without the user's 1 s, 2 s, 4 s waits.
        mp.setenv("DDEPLOY_CONNECT_BACKOFF", os.environ.get("DDEPLOY_CONNECT_BACKOFF", "0.05"))
        # Kept connections stay on (DDEPLOY_CONTROL_PERSIST unset: the users' default), with the
        # masters' sockets in a directory of this session's own (short: a socket path has 108 bytes).
        control = Path(tempfile.mkdtemp(prefix="ddc-"))
        mp.setenv("DDEPLOY_CONTROL_DIR", str(control))
        if wheels and not os.environ.get("DDEPLOY_SGLANG_WHEEL"):
            mp.setenv("DDEPLOY_SGLANG_WHEEL", str(wheels[0]))
        try:
            yield cache
        finally:
            close_kept_connections()
            shutil.rmtree(control, ignore_errors=True)


def close_kept_connections() -> None:
    """Close every master of this session (as `ddeploy disconnect`): each test starts with fresh
    connections, and the commands within a test share them as a user's commands do."""
    from deployer.transport.control import disconnect

    disconnect()


@pytest.fixture(scope="session")
def sshd_fleet(tmp_path_factory, _isolated_cache):
    fleet = SshdFleet.start(tmp_path_factory.mktemp("sshd"), count=3)
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def hosts(sshd_fleet):
    close_kept_connections()
    sshd_fleet.reset()
    yield sshd_fleet


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str, inventory: Path | None = None) -> Result:
    """Run `ddeploy [-i inventory] args...` in-process, capturing exit code and both streams."""
    from deployer.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = [*(["-i", str(inventory)] if inventory else []), *args]
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def ddeploy(hosts):
    return lambda *args: run_cli(*args, inventory=hosts.inventory_dir)


@pytest.fixture(scope="session")
def patch_sets(tmp_path_factory, _isolated_cache):
    """{"v1": Path, "v2": Path}: small patch-set directories (see sshd_hosts.build_test_patch_sets)."""
    from sshd_hosts import build_test_patch_sets

    return build_test_patch_sets(tmp_path_factory.mktemp("sets"))


@pytest.fixture(scope="session")
def python_hosts(tmp_path_factory, _isolated_cache):
    """sshd hosts k1 (sm_120) and k2 (sm_103) whose python imports SGLang from their own checkout
    (tests/host_env.py); for `ddeploy build` and `ddeploy test --remote`."""
    from host_env import start_python_fleet

    fleet = start_python_fleet(tmp_path_factory.mktemp("pyhosts"))
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="session")
def kernel_sets(tmp_path_factory, _isolated_cache):
    """{"good", "kernel_changed", "broken_test", "kernel_broken"}: patch sets exported from a snapshot of the
    overlay (tests/host_env.py)."""
    from host_env import export_test_sets

    return export_test_sets(tmp_path_factory.mktemp("kernel-sets"))


@pytest.fixture(scope="session")
def cli():
    """run_cli for tests that pass their own inventory (`from conftest import` is ambiguous when the
    overlay's tests, which have their own conftest.py, are collected in the same session)."""
    return run_cli
