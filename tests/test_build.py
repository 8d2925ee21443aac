"""`ddeploy build` on real sshd hosts: real nvcc compiles through SGLang's JIT loader.

Compiles are the expensive part (6-10 s per module per arch on 2 cores, 25-40 s for SGLang's
sampling verify, which includes flashinfer's headers): the first build of k1 (sm_120) and k2
(sm_103) happens once per session (`built`); the rebuild test adds one source hash on k1 (the
sampling module is reused); the host python without flashinfer compiles the other two once more.
Every failure case stops before nvcc runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import subprocess

import pytest

from host_env import TOOLKIT, jit_leaves, make_host_python, variant_inventory

pytestmark = [pytest.mark.sshd, pytest.mark.nvcc]

NVCC = "/usr/local/cuda/bin/nvcc"
# The hosts' python shares this venv's packages: SGLang's JIT loader needs its runtime (setup-venv.sh --full).
MISSING = (
    f"no CUDA toolkit at {NVCC}"
    if not os.path.exists(NVCC)
    else "SGLang's runtime packages are not installed (scripts/setup-venv.sh --full)"
    if importlib.util.find_spec("tvm_ffi") is None
    else "flashinfer's headers are not installed (scripts/setup-venv.sh --full)"
    if importlib.util.find_spec("flashinfer") is None
    else f"the CUDA toolkit {TOOLKIT} has no cuRAND headers (scripts/setup-venv.sh --full makes one)"
    if not (TOOLKIT / "include" / "curand.h").exists()
    else None
)
MODULES = ("speculative_ddtree", "speculative_tree", "speculative_sampling")
needs_nvcc = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def state_of(host) -> dict:
    return json.loads(host.git("cat-file", "blob", "refs/ddeploy/state:state.json"))


def push(cli, fleet, set_dir, *names) -> None:
    args = [a for n in names for a in ("--host", n)]
    r = cli("push", *args, "--version", str(set_dir), inventory=fleet.inventory_dir)
    assert r.code == 0, r.stderr


def source_hash(host) -> str:
    """What build.py hashes, recomputed here from the files on disk."""
    files = sorted(
        p.relative_to(host.checkout).as_posix()
        for p in (host.checkout / "python/sglang/kernels/jit").rglob("ddtree*")
        if p.is_file()
    )
    files += [f"python/sglang/srt/speculative/{n}" for n in ("ddtree_build.py", "ddtree_kernel.py")]
    lines = "".join(f"{hashlib.sha256((host.checkout / f).read_bytes()).hexdigest()}  {f}\n" for f in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


@pytest.fixture(scope="session")
def built(cli, python_hosts, kernel_sets):
    """The good set pushed to k1 and k2 and built there once; yields the CLI result."""
    if MISSING:
        pytest.skip(MISSING)
    push(cli, python_hosts, kernel_sets["good"], "k1", "k2")
    return cli("build", "--host", "k1", "--host", "k2", "--json", inventory=python_hosts.inventory_dir)


@pytest.fixture
def fleet(cli, python_hosts, kernel_sets):
    """The session fleet with the good set applied on both hosts (restored after a test changed it)."""
    push(cli, python_hosts, kernel_sets["good"], "k1", "k2")
    return python_hosts


@needs_nvcc
def test_build_compiles_for_each_hosts_arch_and_records_it(built, python_hosts):
    assert built.code == 0, built.stderr
    k1, k2 = python_hosts.hosts
    for host, tag, compute in ((k1, "sm120", "compute_120"), (k2, "sm103", "compute_103")):
        digest = source_hash(host)
        for module in MODULES:
            [leaf] = jit_leaves(host.root, module)
            assert leaf.parts[-5] == tag + ("f" if tag == "sm120" else "a")
            assert leaf.parts[-6] == digest[:16]  # one cache dir per kernel-source hash
            assert compute in (leaf.parent / "build.ninja").read_text()
        rec = state_of(host)["builds"][f"sm_{tag[2:]}"]
        assert rec["ok"] and rec["nvcc"] == "13.0" and rec["source_hash"] == digest and rec["version"] == "0.1.0"
        assert rec["cache_dir"] == str(host.root / "jit" / digest[:16])
        modules = {m["module"]: m for m in rec["modules"]}
        assert {name: m["status"] for name, m in modules.items()} == dict.fromkeys(MODULES, "built")
        assert modules["speculative_sampling"]["path"] == str(jit_leaves(host.root, "speculative_sampling")[0])
        assert host.git("status", "--porcelain") == ""  # bytecode went into .git, not the work tree
    assert "[k1] ddtree_build: built speculative_ddtree arch=12.0" in built.stderr
    assert "[k2] ddtree_build: built speculative_tree arch=10.3" in built.stderr
    assert "[k1] ddtree_build: built speculative_sampling arch=12.0" in built.stderr
    assert "[k2] ddtree_build: built speculative_sampling arch=10.3" in built.stderr
    assert "speculative_ddtree built, speculative_tree built, speculative_sampling built" in built.stderr
    assert (
        f"SGLANG_JIT_CACHE_DIR={k1.root / 'jit' / source_hash(k1)[:16]} SGLANG_CRASH_ON_JIT_COMPILE=1" in built.stderr
    )
    results = {r["host"]: r for r in json.loads(built.stdout)}
    assert results["k1"]["changed"] and results["k2"]["changed"]


@needs_nvcc
def test_second_build_is_a_noop_and_status_shows_the_build(cli, built, fleet):
    k1 = fleet.hosts[0]
    before = {p: p.stat().st_mtime_ns for p in jit_leaves(k1.root, "speculative_ddtree")}
    r = cli("build", "--host", "k1", "--json", inventory=fleet.inventory_dir)
    assert r.code == 0, r.stderr
    assert "[k1] nothing to build: already built for these sources (version 0.1.0" in r.stderr
    assert json.loads(r.stdout)[0]["changed"] is False
    assert {p: p.stat().st_mtime_ns for p in jit_leaves(k1.root, "speculative_ddtree")} == before
    status = cli("status", "--host", "k1", inventory=fleet.inventory_dir)
    assert status.code == 0, status.stderr
    assert "sm_120 ok" in status.stderr


@needs_nvcc
def test_changed_kernel_source_rebuilds_and_rollback_reuses_the_old_build(cli, built, fleet, kernel_sets):
    k1 = fleet.hosts[0]
    old_hash = source_hash(k1)
    r = cli(
        "push",
        "--host",
        "k1",
        "--version",
        str(kernel_sets["kernel_changed"]),
        "--build",
        inventory=fleet.inventory_dir,
    )
    assert r.code == 0, r.stderr
    new_hash = source_hash(k1)
    assert new_hash != old_hash
    assert "[k1] building (no build for these kernel sources, arch and nvcc yet)" in r.stderr
    dirs = {leaf.parts[-6] for leaf in jit_leaves(k1.root, "speculative_ddtree")}
    assert dirs == {old_hash[:16], new_hash[:16]}
    rec = state_of(k1)["builds"]["sm_120"]
    assert rec["source_hash"] == new_hash
    # Only the DDTree kernel depends on the changed source: SGLang's own modules are reused.
    statuses = {m["module"]: m["status"] for m in rec["modules"]}
    assert statuses == {"speculative_ddtree": "built", "speculative_tree": "cached", "speculative_sampling": "cached"}
    # Back to 0.1.0: its build is still cached, so push --build finds nothing to compile.
    r = cli("push", "--host", "k1", "--version", str(kernel_sets["good"]), "--build", inventory=fleet.inventory_dir)
    assert r.code == 0, r.stderr
    assert "[k1] nothing to build: already built for these sources (version 0.1.0" in r.stderr
    assert state_of(k1)["builds"]["sm_120"]["source_hash"] == old_hash


@needs_nvcc
def test_push_build_skips_the_build_when_kernel_sources_did_not_change(cli, built, fleet, kernel_sets):
    r = cli(
        "push", "--host", "k2", "--version", str(kernel_sets["broken_test"]), "--build", inventory=fleet.inventory_dir
    )
    assert r.code == 0, r.stderr
    assert "[k2] kernel sources unchanged by this push; no build" in r.stderr
    assert "[k2] building (" not in r.stderr and "ddtree_build:" not in r.stderr
    rec = state_of(fleet.hosts[1])["builds"]["sm_103"]  # the 0.1.0 build now serves 0.1.2 (same sources)
    assert rec["ok"] and rec["version"] == "0.1.2"


@needs_nvcc
def test_force_recompiles_what_the_cache_already_has(cli, built, fleet):
    k2 = fleet.hosts[1]
    before = {p: p.stat().st_mtime_ns for p in jit_leaves(k2.root, "speculative_ddtree")}
    r = cli("build", "--host", "k2", "--force", inventory=fleet.inventory_dir)
    assert r.code == 0, r.stderr
    assert "[k2] building (--force)" in r.stderr
    assert "[k2] ddtree_build: built speculative_ddtree arch=10.3" in r.stderr
    assert "[k2] ddtree_build: built speculative_tree arch=10.3" in r.stderr
    after = {p: p.stat().st_mtime_ns for p in jit_leaves(k2.root, "speculative_ddtree")}
    assert any(after.get(p) != t for p, t in before.items())  # the .so was written again


@needs_nvcc
def test_a_new_torch_on_the_host_means_a_new_build(cli, built, fleet, tmp_path):
    from importlib import metadata

    # An upgraded torch as the host python sees it: distribution metadata with another version,
    # first on its path (the torch it imports is the same one).
    version = metadata.version("torch") + ".post1"
    dist = tmp_path / "site" / f"torch-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    inv = variant_inventory(fleet, tmp_path / "inv", "k1", env={"PYTHONPATH": str(dist.parent)})
    r = cli("build", "--host", "k1", "--json", inventory=inv)
    assert r.code == 0, r.stderr
    assert (
        f"[k1] building (the host's python packages changed since the last build (now torch {version}, "
        f"flashinfer-python {metadata.version('flashinfer-python')}, apache-tvm-ffi "
        f"{metadata.version('apache-tvm-ffi')}))" in r.stderr
    )
    assert json.loads(r.stdout)[0]["data"]["plan"]["packages"]["torch"] == version
    assert "nothing to build" in cli("build", "--host", "k1", inventory=inv).stderr
    # The build for the torch it had before is still known: going back builds nothing.
    back = cli("build", "--host", "k1", inventory=fleet.inventory_dir)
    assert back.code == 0, back.stderr
    assert "[k1] nothing to build: already built for these sources (version 0.1.0" in back.stderr


def _fake_tool(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{text}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_an_arch_the_toolkit_lacks_fails_clearly(cli, fleet, tmp_path):
    inv = variant_inventory(fleet, tmp_path / "inv", "k1", gpu={"arch": "sm_70"})
    r = cli("build", "--host", "k1", inventory=inv)
    assert r.code == 8, r.stderr
    assert f"nvcc 13.0 at {TOOLKIT}/bin/nvcc cannot build sm_70 (its --list-gpu-arch: compute_75" in r.stderr


def test_an_nvcc_too_old_for_sm103_fails_clearly(cli, fleet, tmp_path):
    cuda = tmp_path / "cuda-12.8"
    _fake_tool(cuda / "bin" / "nvcc", 'echo "Cuda compilation tools, release 12.8, V12.8.93"\n')
    inv = variant_inventory(fleet, tmp_path / "inv", "k2", env={"CUDA_HOME": str(cuda)})
    r = cli("build", "--host", "k2", inventory=inv)
    assert r.code == 8, r.stderr
    assert "[k2] FAILED" in r.stderr and f"sm_103 needs nvcc >= 12.9, but {cuda}/bin/nvcc is 12.8" in r.stderr


def test_a_missing_nvcc_fails_clearly(cli, fleet, tmp_path):
    inv = variant_inventory(fleet, tmp_path / "inv", "k1", env={"CUDA_HOME": str(tmp_path / "no-cuda")})
    r = cli("build", "--host", "k1", inventory=inv)
    assert r.code == 8, r.stderr
    assert "[k1] FAILED" in r.stderr and f"no working nvcc at {tmp_path / 'no-cuda'}/bin/nvcc" in r.stderr


def test_inventory_and_nvidia_smi_disagreeing_fails_naming_both(cli, fleet, tmp_path):
    real = subprocess.run(["sh", "-c", "echo $PATH"], capture_output=True, text=True).stdout.strip()
    _fake_tool(
        tmp_path / "bin" / "nvidia-smi",
        'echo "NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0"\n'
        'echo "NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0"\n',
    )
    inv = variant_inventory(fleet, tmp_path / "inv", "k2", env={"PATH": f"{tmp_path / 'bin'}:{real}"})
    r = cli("build", "--host", "k2", inventory=inv)
    assert r.code == 8, r.stderr
    assert (
        "inventory says gpu.arch sm_103 (NVIDIA B300 SXM6)" in r.stderr
        and "nvidia-smi reports NVIDIA RTX PRO 6000 Blackwell Server Edition, compute capability 12.0 (sm_120)"
        in r.stderr
    )


@needs_nvcc
def test_a_matching_nvidia_smi_confirms_the_arch(cli, built, fleet, tmp_path):
    real = subprocess.run(["sh", "-c", "echo $PATH"], capture_output=True, text=True).stdout.strip()
    _fake_tool(tmp_path / "bin" / "nvidia-smi", 'echo "NVIDIA B300 SXM6, 10.3"\n')
    inv = variant_inventory(fleet, tmp_path / "inv", "k2", env={"PATH": f"{tmp_path / 'bin'}:{real}"})
    r = cli("build", "--host", "k2", inventory=inv)
    assert r.code == 0, r.stderr
    assert "[k2] arch sm_103 (NVIDIA B300 SXM6, checked with nvidia-smi)" in r.stderr


def test_build_refuses_a_checkout_without_a_patch_set(cli, python_hosts, tmp_path):
    from deployer.patchset.sglang_base import clone_base

    clone_base(tmp_path / "pristine")
    inv = variant_inventory(python_hosts, tmp_path / "inv", "k1", checkout=str(tmp_path / "pristine"))
    r = cli("build", "--host", "k1", inventory=inv)
    assert r.code == 8, r.stderr
    assert "[k1] FAILED" in r.stderr
    assert f"no patch set is applied to {tmp_path / 'pristine'}; push one first" in r.stderr


@needs_nvcc
def test_a_compile_error_fails_the_host_with_nvccs_diagnostics(cli, built, fleet, kernel_sets):
    k1 = fleet.hosts[0]
    push(cli, fleet, kernel_sets["kernel_broken"], "k1")
    r = cli("build", "--host", "k1", inventory=fleet.inventory_dir)
    assert r.code == 8, r.stderr
    nvcc_lines = [
        line for line in r.stderr.splitlines() if line.startswith("[k1] ddtree_build:   speculative_ddtree: ")
    ]
    assert any("ddtree_core.cuh" in line and "error" in line for line in nvcc_lines), r.stderr  # nvcc's own words
    assert "kernel build for sm_120 failed (exit 1): speculative_ddtree:" in r.stderr
    assert state_of(k1)["builds"]["sm_120"]["ok"] is False
    assert "sm_120 FAILED" in cli("status", "--host", "k1", inventory=fleet.inventory_dir).stderr
    push(cli, fleet, kernel_sets["good"], "k1")
    r = cli("build", "--host", "k1", inventory=fleet.inventory_dir)  # the good build is still there
    assert r.code == 0 and "nothing to build" in r.stderr, r.stderr
    assert state_of(k1)["builds"]["sm_120"]["ok"] is True


@needs_nvcc
def test_a_host_python_without_flashinfer_skips_the_sampling_kernel_and_says_why(cli, fleet, kernel_sets, tmp_path):
    from deployer.patchset.sglang_base import clone_base

    # k1 with a second checkout (its own state, k1's stays as it is) and a python env that lacks flashinfer.
    checkout = tmp_path / "sglang"
    clone_base(checkout)
    python = make_host_python(tmp_path / "venv", checkout, without="flashinfer")
    env = {"DDEPLOY_JIT_CACHE_ROOT": str(tmp_path / "jit")}
    inv = variant_inventory(fleet, tmp_path / "inv", "k1", checkout=str(checkout), python=str(python), env=env)
    r = cli("push", "--host", "k1", "--version", str(kernel_sets["good"]), "--build", inventory=inv)
    assert r.code == 0, r.stderr
    assert (
        "[k1] ddtree_build: skipped speculative_sampling arch=12.0: flashinfer is not installed in this python env "
        "(speculative_sampling needs its headers)" in r.stderr
    )
    assert "speculative_ddtree built, speculative_tree built, speculative_sampling skipped" in r.stderr
    assert jit_leaves(tmp_path, "speculative_sampling") == [] and len(jit_leaves(tmp_path, "speculative_tree")) == 1
    state = subprocess.run(
        ["git", "-C", str(checkout), "cat-file", "blob", "refs/ddeploy/state:state.json"],
        capture_output=True,
        text=True,
        check=True,
    )
    modules = {m["module"]: m for m in json.loads(state.stdout)["builds"]["sm_120"]["modules"]}
    assert modules["speculative_sampling"]["status"] == "skipped"
    assert "flashinfer is not installed" in modules["speculative_sampling"]["reason"]
