"""scripts/gpu-bundle.sh: the GPU check's bundle imports its whole chain beside torch alone.

Builds the bundle (wheels for this python, from the local pip index), then runs
`python gpu-check/run.py` in a fresh venv holding only torch 2.13.0 (CPU), numpy and triton
(the Triton attention kernels import it; the GPU machine has it): every component the GPU run
imports must print its line, then the check must stop with the "no CUDA device" exit (2).
Those are slow. The fast tests run checks (h)-(j) (scripts/gpu_bundle/targets.py) on CPU:
the overlay's rules and sampling module and SGLang 0.5.23's environ.py loaded from their files,
flashinfer's renorm kernels replaced by targets.STAND_IN (a sort-based stand-in with their
interface), each with a negative control that must FAIL.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

slow = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NVCC = "/usr/local/cuda/bin/nvcc"
BASE = Path.home() / ".cache/ddeploy/base/sglang-0.5.23/python/sglang"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
COMPONENTS = (
    "import msgspec ",
    "import apache-tvm-ffi 0.1.11 ",
    "import ninja ",
    "import DDTree modules (16): ",
    "import DDTree kernel sources sha256 ",
    "import SGLang JIT loader (sglang 0.5.23",
    "import SGLang Triton attention (sglang 0.5.23 + overlays/ddtree @ ",
    " extend_attention_fwd ",
    " decode_attention_fwd ",
    "import torch 2.13.0",
    "import nvcc ",
    "import tvm-ffi link inputs libtvm_ffi ",
    "import GPU check parts part_a_build part_b_exactness part_c_timing part_d_attention part_e_head "
    "part_f_memory part_g_verify_width ",
    "import GPU checks check_dispatch_cap check_sampling_target check_sampling_cost ",
)

needs_base = pytest.mark.skipif(not BASE.is_dir(), reason=f"no SGLang 0.5.23 base tree at {BASE}")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "gpu-check.tar.gz"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(Path.home())}
    env["GPU_BUNDLE_PYTHON"] = PYTHON
    subprocess.run(["bash", str(REPO / "scripts/gpu-bundle.sh"), str(out)], env=env, check=True)
    return out


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "torch-only"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0", "numpy", "triton"], check=True)
    return venv / "bin/python"


@slow
@needs_base
def test_bundle_is_small_and_carries_no_sglang_package_init(bundle):
    assert bundle.stat().st_size < 16 * 2**20  # the GPU machine takes 64 MiB
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
    assert "gpu-check/run.py" in names
    assert "gpu-check/sglang/kernels/jit/csrc/speculative/ddtree.cuh" in names
    assert "gpu-check/sglang/kernels/jit/utils/compile/loader.py" in names
    assert "gpu-check/targets.py" in names
    assert "gpu-check/sglang/srt/layers/moe/token_dispatcher/deepep.py" in names
    assert "gpu-check/sglang/kernels/ops/sampling/renorm_triton.py" in names
    assert "gpu-check/sglang/__init__.py" not in names
    assert "gpu-check/sglang/srt/utils/common.py" not in names
    assert any(n.startswith("gpu-check/wheels/apache_tvm_ffi-0.1.11-") for n in names)


@slow
@needs_base
def test_check_imports_everything_then_stops_without_cuda(bundle, torch_only_python, tmp_path):
    with tarfile.open(bundle) as tar:
        tar.extractall(tmp_path, filter="data")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    argv = [str(torch_only_python), str(tmp_path / "gpu-check/run.py")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 2, done.stdout + done.stderr
    for component in COMPONENTS:
        assert component in out, f"missing {component!r} in:\n{out}"
    assert out.rstrip().endswith("GPU parts not run")
    assert "no CUDA device" in out.splitlines()[-1]
    assert (tmp_path / "gpu-check/site/tvm_ffi").is_dir()


BUILD_FOR_SM90 = """
import os, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root / "site"), str(root)]
os.environ["PATH"] = f"{root / 'site' / 'bin'}:{os.environ['PATH']}"
import shells
shells.register(root)
from sglang.kernels.jit.utils import override_jit_cuda_arch
from sglang.srt.speculative import ddtree_kernel
with override_jit_cuda_arch(9, 0):
    print("build_ddtree" if hasattr(ddtree_kernel.load_module(), "build_ddtree") else "missing")
"""


@slow
@needs_base
@pytest.mark.nvcc
@pytest.mark.skipif(not Path(NVCC).is_file(), reason=f"no nvcc at {NVCC}")
def test_bundle_builds_the_kernel_with_the_nvcc_on_path(bundle, torch_only_python, tmp_path):
    """Part (a) without a GPU: SGLang's load_jit compiles ddtree.cuh for sm_90 (H200)."""
    with tarfile.open(bundle) as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "gpu-check"
    # run.py installs the carried wheels into gpu-check/site (then exits 2: no GPU).
    subprocess.run([str(torch_only_python), str(root / "run.py")], capture_output=True, check=False)
    env = {"PATH": f"{Path(NVCC).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    env["SGLANG_JIT_CACHE_DIR"] = str(tmp_path / "jit")
    argv = [str(torch_only_python), "-c", BUILD_FOR_SM90, str(root)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "build_ddtree"
    assert list((tmp_path / "jit").rglob("*.so"))


@slow
@needs_base
def test_a_bundle_for_another_python_says_how_to_rebuild(torch_only_python, tmp_path):
    other = "3.12" if PYTHON != "3.12" else "3.13"
    out = tmp_path / "other.tar.gz"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(Path.home())}
    env["GPU_BUNDLE_PYTHON"] = other
    subprocess.run(["bash", str(REPO / "scripts/gpu-bundle.sh"), str(out)], env=env, check=True)
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path, filter="data")
    argv = [str(torch_only_python), str(tmp_path / "gpu-check/run.py")]
    done = subprocess.run(argv, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the carried wheels do not install on python {PYTHON}: " in done.stdout
    assert f"GPU_BUNDLE_PYTHON={PYTHON} bash scripts/gpu-bundle.sh" in done.stdout


# ---- checks (h)-(j) on CPU ----------------------------------------------------------------

SPECULATIVE = REPO / "overlays/ddtree/python/sglang/srt/speculative"
DEEPEP = BASE / "srt/layers/moe/token_dispatcher/deepep.py"
SMALL_CASES = (("random", 48, 4096), ("tie-heavy", 48, 4096))


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def targets():
    sys.path.insert(0, str(REPO / "scripts/gpu_bundle"))
    try:
        import targets as module
    finally:
        sys.path.pop(0)
    return module


@pytest.fixture(scope="module")
def rules():
    return _load("gpu_bundle_test_ddtree_rules", SPECULATIVE / "ddtree_rules.py")


@pytest.fixture(scope="module")
def sampling():
    return _load("gpu_bundle_test_ddtree_sampling", SPECULATIVE / "ddtree_sampling.py")


@pytest.fixture(scope="module")
def environ():
    return _load("gpu_bundle_test_sglang_environ", BASE / "srt/environ.py")


@needs_base
def test_dispatch_cap_passes_with_sglangs_environ_and_dispatcher_source(targets, rules, environ, monkeypatch):
    monkeypatch.delenv(targets.CAP_VAR, raising=False)
    check = targets.check_dispatch_cap(rules, environ, "no_such_module.deepep", DEEPEP)
    assert check.status == "PASS", check.verdict()
    assert f"envs.{targets.CAP_VAR}.get() = 774" in "\n".join(check.lines)
    assert "DeepEP's low-latency buffer is never built here" in check.verdict()
    assert targets.CAP_VAR not in __import__("os").environ  # the check restores the environment


@needs_base
def test_dispatch_cap_fails_when_sglang_parses_another_value(targets, rules, environ, tmp_path):
    """Negative controls: an environ that ignores the variable; a dispatcher without the assert."""
    stale = SimpleNamespace(envs=SimpleNamespace(**{targets.CAP_VAR: SimpleNamespace(get=lambda: 128)}))
    check = targets.check_dispatch_cap(rules, stale, "no_such_module.deepep", DEEPEP)
    assert check.status == "FAIL" and "as 128, the rules assume 774" in check.reason
    edited = tmp_path / "deepep.py"
    edited.write_text(DEEPEP.read_text().replace("num_max_dispatch_tokens_per_rank <= 1024", "True"))
    check = targets.check_dispatch_cap(rules, environ, "no_such_module.deepep", edited)
    assert check.status == "FAIL", check.verdict()


@needs_base
def test_dispatch_cap_says_what_it_skips_without_the_dispatcher(targets, rules, environ):
    check = targets.check_dispatch_cap(rules, environ, "no_such_module.deepep", Path("/nonexistent.py"))
    assert check.status == "PASS"
    assert "skipped: the dispatcher's own read: no_such_module.deepep neither imports" in check.verdict()


def test_the_stand_in_follows_flashinfers_threshold_semantics(targets):
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]])
    kept = targets.stand_in_top_k_renorm_probs(probs, torch.tensor([2]))
    assert (kept > 0).tolist() == [[True, True, True, False, False]]  # ties at the pivot kept
    kept = targets.stand_in_top_p_renorm_probs(probs, torch.tensor([0.5]))
    assert (kept > 0).tolist() == [[True, True, True, False, False]]
    assert torch.allclose(kept.sum(-1), torch.ones(1))


def test_sampling_target_passes_against_the_stand_in(targets, sampling):
    check = targets.check_sampling_target(targets.STAND_IN, sampling, device="cpu", cases=SMALL_CASES)
    assert check.status == "PASS", check.verdict() + "\n" + "\n".join(check.lines)
    rows = [line.split(" | ") for line in check.lines[1:]]
    assert [row[2] for row in rows] == ["bisection", "top-k bound"] * 2
    assert all(row[3] == "48" and row[5] == "0" for row in rows[:2])  # random: every row equal
    assert all(int(row[4]) > 0 and row[5] == "0" for row in rows[2:])  # ties at the cut: allowed, counted


def test_sampling_target_fails_on_a_wrong_kept_set(targets, sampling):
    """Negative controls: a kernel keeping one token too many; an overlay ignoring top-p."""

    def top_k_plus_one(probs, top_k):
        return targets.stand_in_top_k_renorm_probs(probs, torch.as_tensor(top_k) + 1)

    broken = SimpleNamespace(top_k_renorm_probs=top_k_plus_one, top_p_renorm_probs=targets.stand_in_top_p_renorm_probs)
    check = targets.check_sampling_target(broken, sampling, device="cpu", cases=SMALL_CASES[:1])
    assert check.status == "FAIL" and "kept by one side only" in check.reason

    def no_top_p(logits, params, backend="pytorch"):
        return sampling.plain_sampling_probs(logits, replace(params, need_top_p=False), backend)

    overlay = SimpleNamespace(SamplingRows=sampling.SamplingRows, plain_sampling_probs=no_top_p)
    check = targets.check_sampling_target(targets.STAND_IN, overlay, device="cpu", cases=SMALL_CASES[:1])
    assert check.status == "FAIL"


def test_sampling_cost_table_on_cpu(targets, sampling):
    """(j)'s table with a stand-in for DFlash's target (same keywords) and a wall-clock measure."""
    calls = []

    def dflash_target(*, next_token_logits, sampling_info, draft_token_num, bs, max_top_k=None):
        calls.append((tuple(next_token_logits.shape), draft_token_num, bs, max_top_k))
        return torch.softmax(next_token_logits, -1).view(bs, draft_token_num, -1)

    def measure(fn):
        fn()
        return 2.0, 100.0

    check = targets.check_sampling_cost(
        sampling, dflash_target, bs=2, width=3, vocab=512, device="cpu", measure=measure
    )
    assert check.status == "PASS"
    assert calls == [((6, 512), 3, 2, 50), ((6, 512), 3, 2, None)]
    assert sum("| 1.00x | 1.00x" in line for line in check.lines) == 4


def test_sampling_cost_without_dflash_is_skipped_with_the_reason(targets, sampling):
    check = targets.check_sampling_cost(
        sampling, None, bs=2, width=3, vocab=512, device="cpu", measure=lambda fn: (fn(), 1.0, 1.0)[1:]
    )
    assert check.status == "SKIPPED" and "dflash_utils does not import here" in check.reason
    assert all("| - | -" in line for line in check.lines[1:])


def test_run_checks_fails_on_a_fail_or_a_raise_not_on_a_skip(targets, capsys):
    said = []
    skipped = lambda: targets.Check("(x) skipped").skip("no GPU")  # noqa: E731
    assert targets.run_checks(said.append, (skipped,))
    assert said == ["(x) skipped: SKIPPED (no GPU)"]

    def broken():
        """(y) broken"""
        raise RuntimeError("boom")

    assert not targets.run_checks(said.append, (skipped, broken))
    assert said[-1] == "(y) broken: FAIL (RuntimeError: boom)"
