"""pytest fixtures for the CPU engine tests: the SGLang source to serve, tiny models.

Import them into a test module (a ``conftest.py`` inside ``cpu_engine/`` would not
reach sibling test modules)::

    from cpu_engine.fixtures import cpu_sglang_python, tiny_models  # noqa: F401

Which SGLang is served (``cpu_sglang_python``, session scope):

* The tree under test is ``$DDTREE_SGLANG_ROOT``, else the directory three levels
  above ``test/srt/ddtree`` (the same rule as that directory's ``conftest.py``).
* If it is a full SGLang tree (``python/sglang/launch_server.py`` exists: a patched
  checkout, or the clone ``ddeploy patches verify`` tests in), its ``python/`` is
  the source.
* Otherwise it is this project's ``overlays/ddtree``: the source is built in a tmp
  dir from the pristine base (``ddeploy base fetch``: ``$DDEPLOY_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/ddeploy`` or ``~/.cache/ddeploy``, then ``base/sglang-0.5.23``)
  with the overlay's ``python/`` files copied over and its hunks (in
  ``concerns.yaml`` order, else ``hunks/*.patch`` sorted) applied by ``git apply``
  without fuzz.
* Either way :func:`cpu_tree.prepare_cpu_tree` then copies that source and applies
  the test-only CPU changes; the fixture's value is the copy's ``python/`` dir (the
  sgl_kernel stand-in lies beside it, ``launch_server`` finds it).
* The copy is byte-compiled and kept in the artefact cache (``cache``) under the
  content of what it is made from: the full tree's sources, or the base commit
  and the overlay's files, plus the harness. A run whose inputs are unchanged
  starts from it at once; a changed input builds a new one.

The tests need SGLang's runtime packages (``scripts/setup-venv.sh --full``): without
them the server tests skip with the missing package named.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .cpu_tree import cached_cpu_tree
from .models import TinyModels, cached_tiny_models
from .pool import ServerPool

SGLANG_VERSION = "0.5.23"
TEST_DIR = Path(__file__).resolve().parents[1]  # test/srt/ddtree
# What `python -m sglang.launch_server` imports on CPU beyond torch/transformers.
RUNTIME_MODULES = ("fastapi", "uvicorn", "uvloop", "zmq", "xgrammar", "orjson",
                   "msgspec", "pybase64", "setproctitle", "partial_json_parser")


def tree_root() -> Path:
    """The tree under test (see the module docstring)."""
    explicit = os.environ.get("DDTREE_SGLANG_ROOT")
    return Path(explicit or TEST_DIR.parents[2]).resolve()


def missing_runtime_modules() -> list[str]:
    return [m for m in RUNTIME_MODULES if importlib.util.find_spec(m) is None]


def base_dir(version: str = SGLANG_VERSION) -> Path:
    """The pristine base repository (``ddeploy base fetch``), verified when the
    deploy tool is importable; a clear error when it has not been built."""
    try:
        from deployer.base import ensure_base
    except ImportError:
        cache = os.environ.get("DDEPLOY_CACHE_DIR") or str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddeploy"
        )
        path = Path(cache) / "base" / f"sglang-{version}"
    else:
        path = ensure_base(version).path
    if not (path / "python" / "sglang" / "launch_server.py").is_file():
        raise RuntimeError(
            f"no pristine SGLang {version} base at {path}: run `ddeploy base fetch`"
        )
    return path


def _hunks_in_order(overlay: Path) -> list[Path]:
    try:
        import yaml

        spec = yaml.safe_load((overlay / "concerns.yaml").read_text())
        concerns = spec.get("concerns", [])
        listed = [overlay / h for c in concerns for h in c.get("hunks") or []]
    except (ImportError, OSError):
        listed = []
    rest = sorted(p for p in (overlay / "hunks").glob("*.patch") if p not in listed)
    return listed + rest


def build_overlay_source(overlay: Path, dest: Path) -> Path:
    """The base with ``overlay``'s files and hunks, at ``dest``; returns
    ``dest/python``. Hunks apply strictly (``git apply``, no fuzz)."""
    base, overlay = base_dir(), Path(overlay).resolve()  # hunks apply from dest
    shutil.copytree(base / "python", dest / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    src = overlay / "python"
    for path in sorted(src.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            target = dest / "python" / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    # A repository of its own, so git apply resolves a/ b/ paths from dest.
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    for hunk in _hunks_in_order(overlay):
        proc = subprocess.run(["git", "apply", "--whitespace=nowarn", str(hunk)],
                              cwd=dest, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{hunk.name} does not apply to the base: "
                               f"{proc.stderr.strip()}")
    return dest / "python"


def is_full_tree(root: Path) -> bool:
    return (root / "python" / "sglang" / "launch_server.py").is_file()


def source_key_parts(root: Path) -> tuple:
    """What identifies the SGLang source of ``root`` (see ``cache.content_key``):
    a full tree's ``sglang/`` files, else the base's git tree id and the
    overlay's files (the source is built from exactly these)."""
    if is_full_tree(root):
        return (root / "python" / "sglang",)
    base = base_dir()
    tree_id = subprocess.run(
        ["git", "-C", str(base), "rev-parse", "HEAD^{tree}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    parts = [f"base {tree_id}", root / "python", root / "hunks"]
    if (root / "concerns.yaml").is_file():
        parts.append(root / "concerns.yaml")
    return tuple(parts)


def cpu_tree_python(root: Path, skip=()) -> Path:
    """The ``python/`` dir of the cached CPU tree of ``root`` (module docstring)."""
    return cached_cpu_tree(
        source_key_parts(root), lambda work: sglang_source_python(root, work), skip
    )


def sglang_source_python(root: Path, workdir: Path) -> Path:
    """The ``python/`` dir of the SGLang to test (built under ``workdir`` if the
    tree under test is the overlay, not a full tree)."""
    if is_full_tree(root):
        return root / "python"
    return build_overlay_source(root, workdir / "sglang-src")


@pytest.fixture(scope="session")
def cpu_sglang_python() -> Path:
    """The ``python/`` dir of a CPU-ready copy of the SGLang under test (cached,
    read-only for tests: copy it to change it)."""
    missing = missing_runtime_modules()
    if missing:
        pytest.skip(f"SGLang runtime packages missing ({', '.join(missing)}): "
                    "run scripts/setup-venv.sh --full")
    return cpu_tree_python(tree_root())


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    """A tiny float32 Llama target and a DFlash draft (vocab 64, block size 4),
    from the artefact cache (read-only for tests)."""
    return cached_tiny_models()


@pytest.fixture(scope="session")
def server_log_dir(tmp_path_factory) -> Path:
    """Where test servers write their logs (named in failures)."""
    return tmp_path_factory.mktemp("sglang-logs")


# Where the session's pool is kept for the hook that empties it between groups
# (conftest.py: ``pytest_runtest_teardown``).
SERVER_POOL = pytest.StashKey[ServerPool]()
# How many servers the current test's group keeps alive (set per test by
# conftest.py's ``pytest_runtest_setup``; the pool's default where unset).
POOL_SIZE = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def server_pool(cpu_sglang_python, server_log_dir, pytestconfig):
    """The session's :class:`pool.ServerPool` over the CPU tree under test: ask it
    for servers by configuration instead of starting them (docs/testing.md).
    Emptied when a group of engine tests ends, since no later test asks for its
    servers."""
    pool = ServerPool(cpu_sglang_python, server_log_dir)
    pool.resize(pytestconfig.stash.get(POOL_SIZE, pool.max_alive))
    pytestconfig.stash[SERVER_POOL] = pool
    yield pool
    del pytestconfig.stash[SERVER_POOL]
    pool.close()
