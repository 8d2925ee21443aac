"""Prebuild the JIT kernels of the DDTree path for one CUDA arch, without a GPU.

    python -m sglang.srt.speculative.ddtree_build --arch 12.0 [--cache-dir D] [--json]

Compiles, through SGLang's own ``load_jit`` under ``override_jit_cuda_arch`` (so the
cache keys are exactly the ones a server computes at run time):
  * ``speculative_ddtree``   the DDTree tree-build kernel (ddtree_kernel.py),
  * ``speculative_tree``     SGLang's tree module (greedy verify),
  * ``speculative_sampling`` SGLang's sampling verify, when flashinfer's headers are
                             installed and the toolkit has cuRAND's (skipped with
                             the reason otherwise).
into ``$SGLANG_JIT_CACHE_DIR``. Serve afterwards with the same SGLANG_JIT_CACHE_DIR and
SGLANG_CRASH_ON_JIT_COMPILE=1, so a missed build fails loudly instead of compiling per
rank.

Human lines go to stderr; ``--json`` prints a summary to stdout. Exit 1 if a build
failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

# The deployed target model's vocab (it sets the sampling kernel's vec size).
KIMI_K2_VOCAB = 163840


@dataclass
class ModuleResult:
    module: str
    arch: str
    status: str  # built | cached | skipped | failed
    seconds: float = 0.0
    path: Optional[str] = None
    reason: Optional[str] = None


@dataclass
class BuildSummary:
    arch: str
    cache_dir: str
    modules: list[ModuleResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(m.status != "failed" for m in self.modules)


def parse_arch(text: str) -> tuple[int, int]:
    """'12.0', '120', 'sm_120' or 'sm_120f' -> (12, 0)."""
    raw = text.strip().lower().removeprefix("sm_").rstrip("af")
    if "." in raw:
        major, _, minor = raw.partition(".")
    elif raw.isdigit() and len(raw) >= 2:
        major, minor = raw[:-1], raw[-1]
    else:
        raise ValueError(
            f"cannot read CUDA arch {text!r}; expected e.g. 12.0, 10.3 or sm_120"
        )
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(
            f"cannot read CUDA arch {text!r}; expected e.g. 12.0, 10.3 or sm_120"
        )
    return int(major), int(minor)


def _shared_objects(root: Path) -> set[Path]:
    return set(root.glob("*/*/build-*/deps-*/*.so")) if root.is_dir() else set()


def _find_leaf(root: Path, module: str) -> Optional[Path]:
    """Newest cached .so of `module` (cached under sgl_kernel_jit_<module>...)."""
    found = [
        p
        for p in _shared_objects(root)
        if p.parts[-4].startswith(f"sgl_kernel_jit_{module}")
    ]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _build_one(
    name: str,
    arch: str,
    root: Path,
    load: Callable[[], object],
    log: Callable[[str], None],
) -> ModuleResult:
    before = _shared_objects(root)
    start = time.monotonic()
    try:
        load()
    except Exception as exc:
        # A compiler error: show nvcc's diagnostics, keep building the others.
        lines = str(exc).splitlines()
        for line in lines[-200:]:
            log(f"  {name}: {line}")
        detail = " ".join(" ".join(lines).split())[-2000:]
        return ModuleResult(
            name, arch, "failed", time.monotonic() - start, reason=detail
        )
    seconds = time.monotonic() - start
    new = sorted(
        p
        for p in _shared_objects(root) - before
        if p.parts[-4].startswith(f"sgl_kernel_jit_{name}")
    )
    if new:
        return ModuleResult(name, arch, "built", seconds, path=str(new[-1]))
    leaf = _find_leaf(root, name)
    return ModuleResult(name, arch, "cached", seconds, path=str(leaf) if leaf else None)


def _load_ddtree() -> object:
    from sglang.srt.speculative import ddtree_kernel

    return ddtree_kernel.load_module()


def _load_tree() -> object:
    from sglang.kernels.ops.speculative.tree import _jit_tree_module

    return _jit_tree_module()


def _sampling_loader(vocab_size: int) -> Callable[[], object]:
    def load() -> object:
        from sglang.kernels.ops.speculative.sampling import _jit_sampling_module

        # Same arguments as tree_speculative_sampling_target_only (DFlash passes
        # deterministic=True).
        return _jit_sampling_module(math.gcd(4, vocab_size), True)

    return load


def sampling_skip_reason() -> Optional[str]:
    """Why speculative_sampling cannot be built here, or None when it can."""
    if importlib.util.find_spec("flashinfer") is None:
        return (
            "flashinfer is not installed in this python env "
            "(speculative_sampling needs its headers)"
        )
    try:
        from sglang.kernels.jit.utils.deps import REGISTERED_DEPENDENCIES

        REGISTERED_DEPENDENCIES["flashinfer"]()
    except Exception as exc:
        return f"flashinfer headers not usable: {' '.join(str(exc).split())}"
    from sglang.kernels.jit.utils.compile.toolchain import cuda_home

    return curand_skip_reason(Path(cuda_home()))


def curand_skip_reason(home: Path) -> Optional[str]:
    """flashinfer's sampling.cuh includes <curand.h>; a toolkit assembled from pip
    wheels lacks it, and nvcc would fail the whole build on it."""
    dirs = [home / "include", *home.glob("targets/*/include")]
    for var in ("CPATH", "CPLUS_INCLUDE_PATH"):
        dirs += [Path(d) for d in os.environ.get(var, "").split(os.pathsep) if d]
    dirs += [Path("/usr/local/include"), Path("/usr/include")]
    if any((d / "curand.h").is_file() for d in dirs):
        return None
    return (
        f"the CUDA toolkit at {home} has no cuRAND headers (curand.h, which "
        "flashinfer's sampling.cuh includes); install cuRAND's dev package for "
        "this CUDA version or point CUDA_HOME at a full toolkit"
    )


MODULES = ("speculative_ddtree", "speculative_tree", "speculative_sampling")


def build_all(
    major: int,
    minor: int,
    *,
    vocab_size: int = KIMI_K2_VOCAB,
    only: Optional[list[str]] = None,
    log: Callable[[str], None] = lambda s: None,
) -> BuildSummary:
    """Build the modules (all, or `only`) for (major, minor).

    The builds land in the configured SGLANG_JIT_CACHE_DIR.
    """
    from sglang.kernels.jit.utils import override_jit_cuda_arch
    from sglang.kernels.jit.utils.compile.cache import cache_root

    arch = f"{major}.{minor}"
    root = cache_root()
    # Building without a GPU is the point: SGLang's "Cannot detect CUDA architecture"
    # is noise here.
    logging.getLogger("sglang.kernels.jit.utils.arch").setLevel(logging.ERROR)
    summary = BuildSummary(arch=arch, cache_dir=str(root))
    modules = [
        ("speculative_ddtree", _load_ddtree),
        ("speculative_tree", _load_tree),
        ("speculative_sampling", _sampling_loader(vocab_size)),
    ]
    modules = [(name, load) for name, load in modules if only is None or name in only]
    with override_jit_cuda_arch(major, minor):
        for name, load in modules:
            reason = sampling_skip_reason() if name == "speculative_sampling" else None
            if reason:
                result = ModuleResult(name, arch, "skipped", reason=reason)
            else:
                log(f"building {name} for sm_{major}{minor} ...")
                result = _build_one(name, arch, root, load, log)
            summary.modules.append(result)
            log(_describe(result))
    return summary


def _describe(m: ModuleResult) -> str:
    if m.status in ("built", "cached"):
        return f"{m.status} {m.module} arch={m.arch} in {m.seconds:.1f}s -> {m.path}"
    return f"{m.status} {m.module} arch={m.arch}: {m.reason}"


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sglang.srt.speculative.ddtree_build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--arch",
        required=True,
        help="CUDA compute capability to build for, e.g. 12.0 or 10.3",
    )
    p.add_argument("--cache-dir", help="JIT cache root (sets SGLANG_JIT_CACHE_DIR)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=KIMI_K2_VOCAB,
        help="target vocab size; picks the sampling kernel variant "
        "(default: Kimi K2.6)",
    )
    p.add_argument(
        "--modules", nargs="+", choices=MODULES, help="build only these (default: all)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="recompile even when the cache has a build (SGLANG_JIT_FORCE_RECOMPILE; "
        "an existing cache entry is kept, delete it for a fresh one)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    try:
        major, minor = parse_arch(args.arch)
    except ValueError as exc:
        print(f"ddtree_build: error: {exc}", file=sys.stderr)
        return 2
    if args.cache_dir:
        os.environ["SGLANG_JIT_CACHE_DIR"] = str(
            Path(args.cache_dir).expanduser().resolve()
        )
    if args.force:
        os.environ["SGLANG_JIT_FORCE_RECOMPILE"] = "1"
    os.environ.pop("SGLANG_CRASH_ON_JIT_COMPILE", None)  # building is the point here

    def log(line: str) -> None:
        print(f"ddtree_build: {line}", file=sys.stderr, flush=True)

    summary = build_all(
        major, minor, vocab_size=args.vocab_size, only=args.modules, log=log
    )
    if args.json:
        print(
            json.dumps(
                {
                    "arch": summary.arch,
                    "cache_dir": summary.cache_dir,
                    "ok": summary.ok,
                    "modules": [asdict(m) for m in summary.modules],
                },
                indent=2,
            )
        )
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
