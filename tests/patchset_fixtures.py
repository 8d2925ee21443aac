"""Fixtures and helpers for the patch-set tests (import with `from patchset_fixtures import *`).

- `pristine_base` (session): the verified SGLang 0.5.23 base from the session cache that
  tests/conftest.py isolates (built once per session from the cached wheel when needed).
- `small_overlay` (function): a tiny overlay in tmp (one module, one test, the real wiring hunk)
  so export/verify runs take about a second.
- `patches_root` (function): an empty released-sets root in tmp, exported as DDEPLOY_PATCHES_DIR.
- `run_main(*args)`: the real `ddeploy` entry point (with its error boundary) in-process.
- `write_raw_set(dir, {name: bytes})`: a hand-made set whose manifest checksums match, to feed the
  loader hostile patches.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from deployer.patchset.sglang_base import Base, ensure_base
from deployer.locations import overlay_dir

REAL_WIRING_HUNK = overlay_dir() / "hunks" / "wiring.patch"

PROBE_MODULE = '''"""A tiny overlay module: the verify width of a DDTree budget."""


def verify_width(budget: int) -> int:
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    return budget + 1
'''

PROBE_TEST = """import os
from pathlib import Path

import ddtree_probe


def test_probe_is_imported_from_the_patched_tree():
    root = Path(os.environ["DDTREE_SGLANG_ROOT"]).resolve()
    assert Path(ddtree_probe.__file__).resolve().is_relative_to(root / "python")


def test_verify_width():
    assert ddtree_probe.verify_width(4) == {expected}
"""

SMALL_CONCERNS = {
    "name": "ddtree",
    "concerns": [
        {
            "id": "builder",
            "title": "DDTree: probe builder",
            "description": "A probe module and its test.",
            "files": ["python/ddtree_probe/*.py", "test/srt/ddtree/test_*.py"],
        },
        {
            "id": "retrieve",
            "title": "DDTree: retrieve (empty here)",
            "description": "Nothing yet.",
            "files": ["python/ddtree_retrieve/**/*.py"],
        },
        {
            "id": "wiring",
            "title": "DDTree: SGLang wiring",
            "description": "Server args for DDTree.",
            "files": [],
            "hunks": ["hunks/wiring.patch"],
        },
    ],
}


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def run_main(*args: str) -> Result:
    """`ddeploy args...` through deployer.cli.main (DeployError -> message + exit code)."""
    from deployer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Result(code, out.getvalue(), err.getvalue())


def make_overlay(root: Path, *, expected: int = 5, concerns: dict | None = None) -> Path:
    """Write the small overlay under root; `expected` != 5 makes its test fail."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "concerns.yaml").write_text(yaml.safe_dump(concerns or SMALL_CONCERNS, sort_keys=False))
    files = {
        "python/ddtree_probe/__init__.py": PROBE_MODULE,
        "test/srt/ddtree/test_probe.py": PROBE_TEST.format(expected=expected),
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "hunks").mkdir(exist_ok=True)
    shutil.copyfile(REAL_WIRING_HUNK, root / "hunks" / "wiring.patch")
    return root


def write_raw_set(dest: Path, patches: dict[str, bytes], *, tree: str = "") -> Path:
    """A patch set directory with a series and a manifest whose sha256s match the given bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, data in patches.items():
        (dest / name).write_bytes(data)
        entries.append(
            {
                "name": name,
                "concern": name.split("-", 2)[-1].removesuffix(".patch"),
                "sha256": hashlib.sha256(data).hexdigest(),
                "files": [],
            }
        )
    (dest / "series").write_text("".join(f"{n}\n" for n in patches))
    manifest = {
        "name": "ddtree",
        "version": dest.name,
        "created": "2026-11-29",
        "base": {"sglang": "0.5.23", "tree": tree},
        "patches": entries,
    }
    (dest / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return dest


@pytest.fixture(scope="session")
def pristine_base() -> Base:
    return ensure_base()


@pytest.fixture
def small_overlay(tmp_path) -> Path:
    return make_overlay(tmp_path / "overlay")


@pytest.fixture
def patches_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "patches"
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(root))
    return root / "ddtree"
