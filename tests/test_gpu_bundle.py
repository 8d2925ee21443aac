"""scripts/gpu-bundle.sh: the GPU check's bundle imports its whole chain beside torch alone.

Builds the bundle (wheels for this python, from the local pip index), then runs
`python gpu-check/run.py` in a fresh venv holding only torch 2.13.0 (CPU), numpy and triton
(the Triton attention kernels import it; the GPU machine has it): every component the GPU run
imports must print its line, then the check must stop with the "no CUDA device" exit (2).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NVCC = "/usr/local/cuda/bin/nvcc"
BASE = Path.home() / ".cache/ddeploy/base/sglang-0.5.23/python/sglang"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
COMPONENTS = (
    "import msgspec ",
    "import apache-tvm-ffi 0.1.11 ",
    "import ninja ",
    "import DDTree modules (15): ",
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


@needs_base
def test_bundle_is_small_and_carries_no_sglang_package_init(bundle):
    assert bundle.stat().st_size < 16 * 2**20  # the GPU machine takes 64 MiB
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
    assert "gpu-check/run.py" in names
    assert "gpu-check/sglang/kernels/jit/csrc/speculative/ddtree.cuh" in names
    assert "gpu-check/sglang/kernels/jit/utils/compile/loader.py" in names
    assert "gpu-check/sglang/__init__.py" not in names
    assert "gpu-check/sglang/srt/utils/common.py" not in names
    assert any(n.startswith("gpu-check/wheels/apache_tvm_ffi-0.1.11-") for n in names)


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
