"""Verify a released patch set: checksums and path safety (the loader), then the whole series
applied strictly to a fresh clone of the pristine base (per patch `clean` / `conflict (files)`,
stopping at the first conflict), then `git apply -R --check` patch by patch in reverse order
back to the exact base tree, and finally the overlay's own tests run inside the patched clone,
importing the modules from the clone's `python/` (never from the overlay).

The base itself is only ever cloned, never modified.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .sglang_base import clone_base, ensure_base
from ..errors import BaseTreeError, UsageError
from .export import EXPORT_ENV
from .local_git import git, git_out
from .release import Patch, PatchSet

CLEAN, CONFLICT, NOT_REACHED = "clean", "conflict", "not reached"
# What importing the patched tree's `sglang` package needs (its __init__ imports these); without
# them the overlay tests die half-way through SGLang's package init, so verify refuses up front.
SGLANG_RUNTIME = (
    "numpy",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "triton",
    "PIL",
    "starlette",
    "msgspec",
    "pydantic",
    "zmq",
    "tqdm",
    "IPython",
    "aiohttp",
    "tvm_ffi",
    "transformers",
    "dill",
    "sentencepiece",
    "compressed_tensors",
    "gguf",
    "openai",
    "partial_json_parser",
    "einops",
    "torch",
)
# Index-only: the scratch clone has no checkout until the tests need one; same strict matching.
_APPLY_ARGS = ("apply", "--cached", "--whitespace=nowarn")
_ERROR_SUFFIXES = (
    ": patch does not apply",
    ": already exists in working directory",
    ": does not exist in index",
    ": already exists in index",
    ": No such file or directory",
    ": wrong type",
    ": does not match index",
)


@dataclass(frozen=True)
class PatchResult:
    name: str
    concern: str
    status: str  # clean | conflict | not reached
    files: tuple[str, ...] = ()  # the conflicting files
    detail: str = ""  # git's first error line

    def line(self) -> str:
        if self.status == CONFLICT:
            return f"{self.name}: conflict ({', '.join(self.files)})"
        return f"{self.name}: {self.status}"


@dataclass(frozen=True)
class TestRun:
    returncode: int
    summary: str  # pytest's last line
    output: str = field(repr=False, default="")

    @property
    def passed(self) -> bool:
        return self.returncode == 0


@dataclass
class VerifyReport:
    ident: str
    against: str  # what the set was applied to
    results: list[PatchResult]
    reversed_ok: bool | None = None  # each patch reversed cleanly, back to the base tree
    reverse_detail: str = ""
    tests: TestRun | None = None
    tests_note: str = ""

    @property
    def conflict(self) -> PatchResult | None:
        return next((r for r in self.results if r.status == CONFLICT), None)

    @property
    def ok(self) -> bool:
        return self.conflict is None and bool(self.reversed_ok) and (self.tests is None or self.tests.passed)


def conflict_files(stderr: str, patch: Patch) -> tuple[str, ...]:
    """The files git apply complained about (falls back to all files of the patch)."""
    found: dict[str, None] = {}
    for line in stderr.splitlines():
        if line.startswith("error: patch failed: "):
            found.setdefault(line[len("error: patch failed: ") :].rsplit(":", 1)[0], None)
        elif line.startswith("error: "):
            for suffix in _ERROR_SUFFIXES:
                if line.endswith(suffix):
                    found.setdefault(line[len("error: ") : -len(suffix)], None)
    files = [f for f in found if f in patch.files] or list(found) or list(patch.files)
    return tuple(files)


def apply_series(work: Path, ps: PatchSet) -> list[PatchResult]:
    """Apply the patches in order, strictly; stop at the first that does not apply."""
    results: list[PatchResult] = []
    for patch in ps.patches:
        if results and results[-1].status != CLEAN:
            results.append(PatchResult(patch.name, patch.concern, NOT_REACHED))
            continue
        check = git(work, *_APPLY_ARGS, "--check", "-", input=patch.data, check=False, env=EXPORT_ENV)
        if check.returncode != 0:
            err = check.stderr.decode(errors="replace")
            first = next((ln for ln in err.splitlines() if ln.startswith("error:")), err.strip())
            results.append(PatchResult(patch.name, patch.concern, CONFLICT, conflict_files(err, patch), first))
            continue
        git(work, *_APPLY_ARGS, "-", input=patch.data, env=EXPORT_ENV)
        results.append(PatchResult(patch.name, patch.concern, CLEAN))
    return results


def index_tree(work: Path) -> str:
    return git_out(work, "write-tree")


def reverse_series(work: Path, ps: PatchSet, base_tree: str) -> tuple[bool, str]:
    """`git apply -R --check` then reverse each patch, last first; the result must be the base tree."""
    for patch in reversed(ps.patches):
        proc = git(work, *_APPLY_ARGS, "-R", "--check", "-", input=patch.data, check=False, env=EXPORT_ENV)
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            return False, f"{patch.name} is not applied ({err[0] if err else 'git apply -R --check failed'})"
        git(work, *_APPLY_ARGS, "-R", "-", input=patch.data, env=EXPORT_ENV)
    tree = index_tree(work)
    if tree != base_tree:
        return False, f"reversing the series gives tree {tree}, not the base tree {base_tree}"
    return True, ""


def check_out(work: Path, tree: str) -> None:
    """Write the patched tree's files into the (so far empty) work tree of the clone."""
    git(work, "read-tree", tree)
    git(work, "checkout-index", "-a", "-f")


def run_overlay_tests(work: Path, ps: PatchSet, timeout: float) -> tuple[TestRun | None, str]:
    """pytest on <clone>/test/srt/<name> with the clone's python/ first on sys.path."""
    tests = work / "test" / "srt" / ps.name
    if not tests.is_dir():
        return None, f"no overlay tests in the set (test/srt/{ps.name} is absent)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update({"PYTHONPATH": str(work / "python"), "DDTREE_SGLANG_ROOT": str(work), "PYTHONDONTWRITEBYTECODE": "1"})
    cmd = [sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "--rootdir", str(work)]
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return TestRun(124, f"overlay tests timed out after {timeout:.0f} s"), ""
    out = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    return TestRun(proc.returncode, lines[-1] if lines else f"pytest exited {proc.returncode}", out), ""


def missing_runtime() -> list[str]:
    """SGLang's runtime packages this python lacks (the light venv of scripts/setup-venv.sh)."""
    return [name for name in SGLANG_RUNTIME if importlib.util.find_spec(name) is None]


def check_test_runtime() -> None:
    missing = missing_runtime()
    if missing:
        raise UsageError(
            f"the overlay tests import the patched SGLang, and this python ({sys.executable}) lacks "
            f"its runtime packages: {', '.join(missing)}; run `bash scripts/setup-venv.sh --full`, "
            f"or pass --no-tests"
        )


def verify_patch_set(
    ps: PatchSet, *, against: Path | None = None, run_tests: bool = True, tests_timeout: float = 1800.0
) -> VerifyReport:
    """Verify ps (already checksum- and path-checked by its loader) on a clone of the base.

    `against`: another git checkout to clone and apply to instead of the pristine base (only read)."""
    if run_tests:
        check_test_runtime()
    if against is None:
        base = ensure_base(ps.base_version)
        if ps.base_tree and base.tree != ps.base_tree:
            raise BaseTreeError(
                f"patch set {ps.ident} was made for base tree {ps.base_tree}, but the "
                f"SGLang {base.version} base is {base.tree}; rebuild it with `ddeploy base fetch --rebuild`"
            )
        source, desc = base.path, f"the pristine SGLang {base.version} base (tree {base.tree[:12]})"
    else:
        source, desc = against, f"the checkout {against} (its HEAD, cloned)"
    with tempfile.TemporaryDirectory(prefix="ddeploy-verify-") as tmp:
        work = clone_base(Path(tmp) / "sglang", ps.base_version or "0.5.23", source=source, checkout=False)
        start_tree = index_tree(work)
        report = VerifyReport(ps.ident, desc, apply_series(work, ps))
        if report.conflict is not None:
            return report
        patched = index_tree(work)
        report.reversed_ok, report.reverse_detail = reverse_series(work, ps, start_tree)
        if run_tests:
            check_out(work, patched)
            report.tests, report.tests_note = run_overlay_tests(work, ps, tests_timeout)
        else:
            report.tests_note = "overlay tests skipped (--no-tests)"
    return report
