"""Import the DDTree modules of the tree under test without SGLang's package init.

Tree root: $DDTREE_SGLANG_ROOT, else three directories above this file
(``overlays/ddtree`` in this repository, the checkout root inside a patched SGLang
tree). When an installed ``sglang`` already resolves to ``<root>/python/sglang`` it
is imported for real; otherwise ``sglang``, ``sglang.srt`` and
``sglang.srt.speculative`` are registered as bare package shells whose ``__path__``
points into ``<root>/python`` (no code of their own), so
``import sglang.srt.speculative.ddtree_*`` loads exactly the files of that tree.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

TREE_ROOT = Path(
    os.environ.get("DDTREE_SGLANG_ROOT") or Path(__file__).resolve().parents[3]
).resolve()
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.speculative")


def _installed_sglang_is_this_tree() -> bool:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        return False
    locations = [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    return (TREE_ROOT / "python" / "sglang") in locations


def _register_package_shells() -> None:
    for name in _PACKAGES:
        module = sys.modules.get(name)
        path = str(TREE_ROOT / "python" / Path(*name.split(".")))
        if module is None:
            module = types.ModuleType(name)
            module.__path__ = [path]
            module.__package__ = name
            sys.modules[name] = module
        elif path not in list(getattr(module, "__path__", [])):
            raise RuntimeError(
                f"{name} is already imported from elsewhere; cannot test {TREE_ROOT}"
            )
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


if not _installed_sglang_is_this_tree():
    _register_package_shells()


def pytest_configure(config: pytest.Config) -> None:
    # The real-server tests and the nvcc build are marked slow; registered here
    # because a patched SGLang checkout's own pytest configuration does not know it.
    config.addinivalue_line(
        "markers", "slow: real sglang.launch_server processes or an nvcc build"
    )
    # pytest-xdist's, registered for runs without it (a test host's checkout).
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker")


# Fixtures that reach the CPU engine's servers or tree: every test using one runs in
# an xdist group (--dist loadgroup), so one worker's session server pool serves
# the whole group and each configuration starts once. Modules whose servers no
# other module asks for form groups of their own, which the other worker can take.
ENGINE_FIXTURES = frozenset({"server_pool", "cpu_sglang_python"})
ENGINE_GROUP = "cpu-engine"
OWN_GROUPS = {
    "test_ddtree_engine_mla.py": "cpu-engine-mla",
    "test_ddtree_engine_sampling.py": "cpu-engine-sampling",
    "test_ddtree_engine_tp2_sampling.py": "cpu-engine-sampling",
    "test_ddtree_engine_dp.py": "cpu-engine-dp",
}


# How many servers a group's pool keeps alive (default: the pool's 2). The
# Llama servers of the cpu-engine group are the smallest; with three, the greedy
# modules' last servers outlive the next module's first start, so
# test_ddtree_engine_greedy_requests finds the greedy module's last two running
# and test_ddtree_engine_refusals finds one of them still running (one start
# fewer each, docs/testing.md). The MLA and DP groups' TP 2 servers keep two.
POOL_SIZES = {ENGINE_GROUP: 3}
DEFAULT_POOL_SIZE = 2


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.path)).resolve()
        if here in path.parents and ENGINE_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            group = OWN_GROUPS.get(path.name, ENGINE_GROUP)
            # First: it is the group even if another hook groups the item too.
            item.add_marker(pytest.mark.xdist_group(group), append=False)


def _group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group") if item else None
    return marker.args[0] if marker and marker.args else None


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures are set up
def pytest_runtest_setup(item) -> None:
    size = POOL_SIZES.get(_group(item), DEFAULT_POOL_SIZE)
    item.config.stash[POOL_SIZE] = size
    pool = item.config.stash.get(SERVER_POOL, None)
    if pool is not None:
        pool.resize(size)


def pytest_runtest_teardown(item, nextitem) -> None:
    # The engine groups ask for disjoint servers and run one after another on a
    # worker: when a group's last test is done its pooled servers only hold
    # memory (and CPU, for a DP server's controller), so they stop.
    pool = item.config.stash.get(SERVER_POOL, None)
    if pool is not None and _group(item) != _group(nextitem):
        pool.close()


@pytest.fixture(scope="session")
def tree_root() -> Path:
    return TREE_ROOT


# The CPU engine's fixtures, defined here so every module shares one session-scoped
# scratch tree (imported into each module, each would build its own).
from cpu_engine.fixtures import (  # noqa: E402,F401
    POOL_SIZE,
    SERVER_POOL,
    cpu_sglang_python,
    server_log_dir,
    server_pool,
    tiny_models,
)
