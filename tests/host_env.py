"""Test hosts with a python environment like a real host's, for `ddeploy build` / `test --remote`.

A real host has SGLang installed editable from its checkout plus SGLang's runtime packages. Here
each sshd test host gets a tiny venv made from the shared venv's base interpreter whose
site-packages holds one .pth: the host checkout's `python/` (exactly what `pip install -e`
writes) and the shared venv's site-packages (torch, tvm-ffi, triton, ... no stub modules).

    fleet = start_python_fleet(root)       # 2 sshd hosts k1 (sm_120) and k2 (sm_103), own venvs
    sets = export_test_sets(root / "sets") # good / kernel_changed / broken_test / kernel_broken sets
    variant_inventory(fleet, dest, "k1", env={...}, gpu={"arch": "sm_70"})  # one host edited
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

from sshd_hosts import SshdFleet

PROJECT = Path(__file__).resolve().parent.parent
OVERLAY = PROJECT / "overlays" / "ddtree"
KERNEL_CORE = "python/sglang/kernels/jit/csrc/speculative/ddtree_core.cuh"
BROKEN_TEST = "test/srt/ddtree/test_ddtree_kernel_broken.py"


# The toolkit setup-venv.sh --full completed with cuRAND's headers (SGLang's sampling kernel needs them).
VENV_CUDA = Path(sys.prefix) / "cuda"
TOOLKIT = VENV_CUDA if VENV_CUDA.exists() else Path("/usr/local/cuda")


def make_host_python(venv: Path, checkout: Path, *, without: str | None = None) -> Path:
    """A venv whose python imports sglang from `checkout` and packages from the shared venv
    (all of them but the distribution `without`, e.g. "flashinfer": a host env that lacks it)."""
    python = venv / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    shared = sysconfig.get_paths()["purelib"]
    if without:
        shared = str(site_packages_without(Path(shared), without, venv / "shared-site-packages"))
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    # Line 1 is a path (the editable checkout); line 2 runs site.addsitedir so the shared venv's
    # own .pth files are honoured too.
    (site / "ddeploy-test-host.pth").write_text(f"{checkout / 'python'}\nimport site; site.addsitedir({shared!r})\n")
    return python


def site_packages_without(shared: Path, name: str, dest: Path) -> Path:
    """`dest`: links to every entry of `shared` except package `name` and its dist-info."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in shared.iterdir():
        if entry.name != name and not entry.name.startswith(f"{name}_python-"):
            (dest / entry.name).symlink_to(entry)
    return dest


def start_python_fleet(root: Path, count: int = 2) -> SshdFleet:
    """sshd hosts k1.. on 127.0.0.41.. with their own venvs and JIT cache roots."""
    fleet = SshdFleet.start(root, count=count, first_octet=41, prefix="k")
    try:
        for h in fleet.hosts:
            python = make_host_python(h.root / "venv", h.checkout)
            edit_inventory(
                fleet.inventory_dir / f"{h.name}.yaml",
                python=str(python),
                env={"DDEPLOY_JIT_CACHE_ROOT": str(h.root / "jit"), "CUDA_HOME": str(TOOLKIT)},
            )
    except BaseException:
        fleet.close()
        raise
    return fleet


def edit_inventory(path: Path, **changes) -> None:
    """Update one host file: dict values merge into the existing mapping, others replace."""
    doc = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        doc[key] = {**(doc.get(key) or {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def variant_inventory(fleet: SshdFleet, dest: Path, host: str, **changes) -> Path:
    """A copy of the fleet's inventory with one host edited (see edit_inventory)."""
    shutil.copytree(fleet.inventory_dir, dest)
    edit_inventory(dest / f"{host}.yaml", **changes)
    return dest


def export_test_sets(root: Path) -> dict[str, Path]:
    """Patch sets exported from a snapshot of the overlay: 0.1.0 good, 0.1.1 kernel source changed,
    0.1.2 = 0.1.0 with a deliberately failing kernel test added, 0.1.3 = 0.1.0 with a kernel source
    nvcc rejects."""
    from deployer.patchset.export import export_patch_set

    sets: dict[str, Path] = {}
    overlay = root / "overlay"
    shutil.copytree(OVERLAY, overlay, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    sets["good"] = export_patch_set(overlay, root / "released", version="0.1.0", date="2026-11-29").path
    core = (overlay / KERNEL_CORE).read_bytes()
    (overlay / KERNEL_CORE).write_bytes(core + b"// test edit: a changed kernel source must trigger a rebuild\n")
    sets["kernel_changed"] = export_patch_set(overlay, root / "released", version="0.1.1", date="2026-11-29").path
    (overlay / KERNEL_CORE).write_bytes(core)  # 0.1.2 = 0.1.0 + a broken test, same kernel sources
    (overlay / BROKEN_TEST).write_text(
        '"""Deliberately broken (ddeploy test --remote must report it)."""\n\n\n'
        "def test_deliberately_broken():\n    assert 1 + 1 == 3\n"
    )
    sets["broken_test"] = export_patch_set(overlay, root / "released", version="0.1.2", date="2026-11-29").path
    (overlay / BROKEN_TEST).unlink()
    (overlay / KERNEL_CORE).write_bytes(core + b"\nthis is not C++;\n")
    sets["kernel_broken"] = export_patch_set(overlay, root / "released", version="0.1.3", date="2026-11-29").path
    (overlay / KERNEL_CORE).write_bytes(core)
    return sets


def jit_leaves(host_root: Path, module: str) -> list[Path]:
    """Every cached .so of `module` under the host's JIT cache root (all source hashes, all archs)."""
    return sorted((host_root / "jit").glob(f"*/sm*/sgl_kernel_jit_{module}*/build-*/deps-*/*.so"))
