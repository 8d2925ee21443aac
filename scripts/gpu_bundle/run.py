#!/usr/bin/env python3
"""The DDTree GPU check, run from its bundle on a bare GPU machine (torch, nvcc, Triton).

    tar xzf gpu-check.tar.gz && python gpu-check/run.py [--checks-only]

Installs the carried wheels into gpu-check/site (pip --no-index --no-deps --target),
imports the DDTree modules and SGLang's JIT loader and Triton attention kernels without
SGLang's package init (shells.py), prints one line per component, then runs parts (a)-(g)
of parts.py on the GPU, one table per part, then checks (h)-(j) of targets.py (the dispatch
cap, the sampling target; a PASS / FAIL / SKIPPED (reason) line each; --checks-only: these
alone). nvcc comes from $CUDA_HOME / $CUDA_PATH, else
PATH, the way SGLang's loader resolves it. Exit: 0 every comparison exact and no check
FAILed (SKIPPED does not fail); 1 a comparison
failed or a component is missing; 2 no CUDA device.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE = HERE / "site"
WHEELS = HERE / "wheels"


class ExitStatus(enum.IntEnum):
    OK = 0
    FAILED = 1
    NO_CUDA = 2


def say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


def install_wheels() -> None:
    """pip-install the carried wheels into SITE once (a marker names what was installed)."""
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    marker = SITE / ".installed"
    if marker.is_file() and marker.read_text() == "\n".join(wheels):
        return
    shutil.rmtree(SITE, ignore_errors=True)
    if importlib.util.find_spec("pip") is None:
        unpack_wheels(wheels)
    else:
        argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        subprocess.run([*argv, "--target", str(SITE), *wheels], check=True)
    marker.write_text("\n".join(wheels))


def unpack_wheels(wheels: list[str]) -> None:
    """No pip in this python: a wheel is a zip; its .data/scripts go to SITE/bin."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(SITE)
    for script in SITE.glob("*.data/scripts/*"):
        (SITE / "bin").mkdir(exist_ok=True)
        script.chmod(0o755)
        script.replace(SITE / "bin" / script.name)


def activate_site() -> None:
    sys.path.insert(0, str(SITE))
    os.environ["PATH"] = f"{SITE / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"


def ddtree_modules() -> list[str]:
    names = sorted(p.stem for p in (HERE / "sglang/srt/speculative").glob("ddtree_*.py"))
    for name in names:
        importlib.import_module(f"sglang.srt.speculative.{name}")
    return names


def component_lines() -> list[str]:
    """Import every component the GPU run needs; one line each: name, version, path."""
    return [*package_lines(), *sglang_lines(), *toolchain_lines()]


def package_lines() -> list[str]:
    import msgspec
    import numpy
    import torch
    import triton
    import tvm_ffi

    return [
        f"torch {torch.__version__} {Path(torch.__file__).parent}",
        f"numpy {numpy.__version__} {Path(numpy.__file__).parent}",
        f"triton {triton.__version__} {Path(triton.__file__).parent}",
        f"msgspec {msgspec.__version__} {Path(msgspec.__file__).parent}",
        f"apache-tvm-ffi {_dist('apache-tvm-ffi')} {Path(tvm_ffi.__file__).parent}",
        f"ninja {_dist('ninja')} {shutil.which('ninja')}",
    ]


def sglang_lines() -> list[str]:
    names = ddtree_modules()
    from sglang.kernels.jit.utils import load_jit
    from sglang.kernels.ops.attention import decode_attention, extend_attention
    from sglang.srt.speculative import ddtree_kernel

    base = (HERE / "sglang" / "BASE").read_text().strip()
    digest = ddtree_kernel.source_hash()[:16]
    return [
        f"DDTree modules ({len(names)}): {' '.join(names)} {Path(ddtree_kernel.__file__).parent}",
        f"DDTree kernel sources sha256 {digest} {ddtree_kernel.csrc_dir()}",
        f"SGLang JIT loader ({base}) load_jit {sys.modules[load_jit.__module__].__file__}",
        f"SGLang Triton attention ({base}) extend_attention_fwd {extend_attention.__file__}",
        f"SGLang Triton attention ({base}) decode_attention_fwd {decode_attention.__file__}",
    ]


def toolchain_lines() -> list[str]:
    """What load_jit will compile and link with, resolved by SGLang's own toolchain module."""
    from sglang.kernels.jit.utils.compile import toolchain

    includes, libdir, name = toolchain.tvm_ffi_paths()
    nvcc = Path(toolchain.cuda_home()) / "bin" / "nvcc"
    found = "present" if nvcc.is_file() else "MISSING"
    return [
        f"tvm-ffi link inputs lib{name} in {libdir}, headers {includes[0]}",
        f"nvcc {nvcc} ({found}; {_cuda_home_source()})",
    ]


def _dist(name: str) -> str:
    return importlib.metadata.version(name)


def _cuda_home_source() -> str:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return f"from ${var}"
    return "from nvcc on PATH" if shutil.which("nvcc") else "no nvcc on PATH: SGLang's default"


def main() -> int:
    try:
        install_wheels()
    except subprocess.CalledProcessError:
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        say(
            f"the carried wheels do not install on python {here}: GPU_BUNDLE_PYTHON={here} bash "
            "scripts/gpu-bundle.sh OUT.tar.gz makes a bundle for it"
        )
        return ExitStatus.FAILED
    activate_site()
    sys.path.insert(0, str(HERE))
    import shells

    shells.register(HERE)
    try:
        lines = component_lines()
    except (ImportError, OSError) as exc:  # OSError: a carried shared library fails to load
        name = getattr(exc, "name", None) or type(exc).__name__
        say(f"cannot import {name}: {exc}; rebuild the bundle (scripts/gpu-bundle.sh)")
        return ExitStatus.FAILED
    for line in lines:
        say(f"import {line}")
    import parts
    import targets
    import torch

    say(f"import GPU check parts {' '.join(f.__name__ for f in parts.PARTS)} {parts.__file__}")
    say(f"import GPU checks {' '.join(f.__name__ for f in targets.CHECKS)} {targets.__file__}")
    if not torch.cuda.is_available():
        say("no CUDA device (torch.cuda.is_available() is False): imports OK, GPU parts not run")
        return ExitStatus.NO_CUDA
    parts_ok = "--checks-only" in sys.argv[1:] or parts.run_all(say)
    checks_ok = targets.run_checks(say)
    return ExitStatus.OK if parts_ok and checks_ok else ExitStatus.FAILED


if __name__ == "__main__":
    sys.exit(main())
