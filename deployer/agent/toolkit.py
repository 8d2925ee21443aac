"""The host's GPUs and CUDA toolkit for a kernel build: nvidia-smi against the inventory's
arch, CUDA_HOME and nvcc (version, --list-gpu-arch) against what the arch needs."""

import os
import re

from .common import Fail, last_text_line, run_tool

# Minimum nvcc per arch (archs not listed rely on `nvcc --list-gpu-arch`).
MIN_NVCC = {(9, 0): (11, 8), (10, 0): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9), (11, 0): (13, 0)}


class Toolkit:
    def __init__(self, cuda_home: str, version: tuple, archs):
        self.cuda_home, self.version, self.archs = cuda_home, tuple(version), archs

    @property
    def version_text(self) -> str:
        return "%d.%d" % self.version


def parse_nvidia_smi(text: str) -> list:
    """`name, compute_cap` CSV lines (noheader) -> [(name, (major, minor))]."""
    gpus = []
    for line in text.strip().splitlines():
        name, _, cap = line.rpartition(",")
        m = re.match(r"\s*(\d+)\.(\d+)\s*\Z", cap)
        if not name.strip() or not m:
            raise Fail("BuildError", "cannot read nvidia-smi output line %r (expected 'name, compute_cap')" % line)
        gpus.append((name.strip(), (int(m.group(1)), int(m.group(2)))))
    return gpus


def parse_nvcc_version(text: str):
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_gpus_match(target: dict, gpus):
    """The inventory's arch against nvidia-smi's (None where the host has no nvidia-smi)."""
    if not gpus:
        return None
    want = tuple(target["capability"])
    for name, cap in gpus:
        if cap != want:
            raise Fail(
                "BuildError",
                "inventory says gpu.arch %s (%s) in %s, but nvidia-smi reports %s, compute "
                "capability %d.%d (sm_%d%d); fix gpu.arch in the inventory"
                % (target["arch"], target["model"], target["source"], name, cap[0], cap[1], cap[0], cap[1]),
            )
    return gpus[0][0]


def probe_gpus():
    rc, out, err = run_tool(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
    if rc == 127:
        return None
    if rc != 0:
        raise Fail("BuildError", "nvidia-smi failed (exit %d): %s" % (rc, last_text_line(err)))
    return parse_nvidia_smi(out)


def resolve_cuda_home(target: dict) -> str:
    """CUDA_HOME from the inventory, else /usr/local/cuda, else the toolkit of the nvcc on PATH."""
    if target.get("cuda_home"):
        return target["cuda_home"]
    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        return "/usr/local/cuda"
    import shutil

    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise Fail(
            "BuildError",
            "no CUDA toolkit found (no CUDA_HOME in %s, no /usr/local/cuda, no nvcc on PATH); "
            "install CUDA >= 12.8 or set env.CUDA_HOME" % target["source"],
        )
    real = os.path.realpath(nvcc)
    try:  # a wrapper script (exec /path/bin/nvcc "$@") names the real toolkit
        with open(real, errors="replace") as fh:
            m = re.search(r"^exec (/\S*/bin/nvcc) ", fh.read(4096), re.M)
        real = m.group(1) if m else real
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(real))


def probe_toolkit(target: dict, cuda_home: str) -> Toolkit:
    nvcc = cuda_home.rstrip("/") + "/bin/nvcc"
    rc, out, _err = run_tool([nvcc, "--version"])
    if rc != 0:
        where = "CUDA_HOME=%s%s" % (cuda_home, " from %s" % target["source"] if target.get("cuda_home") else "")
        raise Fail(
            "BuildError",
            "no working nvcc at %s (%s; exit %d); install the CUDA toolkit (>= 12.8 for "
            "Blackwell) or point env.CUDA_HOME at one" % (nvcc, where, rc),
        )
    version = parse_nvcc_version(out)
    if version is None:
        raise Fail("BuildError", "cannot read the version from `%s --version`: %r" % (nvcc, out.strip()[-200:]))
    rc, listed, _err = run_tool([nvcc, "--list-gpu-arch"])
    archs = frozenset(re.findall(r"compute_\d+[af]?", listed)) if rc == 0 else None
    return Toolkit(cuda_home, version, archs or None)


def check_toolkit_supports(target: dict, toolkit: Toolkit) -> None:
    major, minor = target["capability"]
    arch = "sm_%d%d" % (major, minor)
    need = MIN_NVCC.get((major, minor))
    nvcc = "%s/bin/nvcc" % toolkit.cuda_home
    if need and toolkit.version < need:
        raise Fail(
            "BuildError",
            "%s needs nvcc >= %d.%d, but %s is %s; install a newer CUDA toolkit on the host "
            "or point env.CUDA_HOME at one" % (arch, need[0], need[1], nvcc, toolkit.version_text),
        )
    if toolkit.archs is not None and "compute_%d%d" % (major, minor) not in toolkit.archs:
        listed = " ".join(sorted(toolkit.archs, key=lambda a: int(re.sub(r"\D", "", a))))
        raise Fail(
            "BuildError",
            "nvcc %s at %s cannot build %s (its --list-gpu-arch: %s); use a toolkit that "
            "supports %s" % (toolkit.version_text, nvcc, arch, listed, arch),
        )
