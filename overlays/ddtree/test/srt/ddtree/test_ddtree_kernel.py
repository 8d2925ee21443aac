"""The DDTree CUDA kernel: its algorithm, its build, and (on a GPU) its outputs.

- The kernel's per-request code (csrc/speculative/ddtree_core.cuh) is plain C++:
  compiled here with the host compiler, driven the way the CUDA kernel drives it, it
  must equal the design's test vector and the batched torch reference (builder +
  retrieve + mask) on random batches.
- Compile-only: SGLang's load_jit really builds the module for sm_120 with nvcc into a
  temp JIT cache, from a full SGLang tree: the patched checkout under test, or the
  pristine base with this overlay applied (skipped only when nvcc, apache-tvm-ffi or
  another of SGLang's runtime packages is missing, named in the reason).
- On CUDA: the kernel equals the batched reference exactly (skipped without a GPU).
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# conftest.py points sglang at the tree under test.
from sglang.srt.speculative import ddtree_kernel
from sglang.srt.speculative.ddtree_batched import build_ddtree_batched
from sglang.srt.speculative.ddtree_retrieve import (
    compile_ddtree_retrieve,
    ddtree_full_mask,
    ddtree_positions,
)

from cpu_engine.fixtures import sglang_source_python

# The CUDA kernel's body, step for step, on one host thread (no __syncthreads needed).
HOST_SHIM = r"""
#include "ddtree_core.cuh"
#include <vector>
using namespace sglang::ddtree;
extern "C" int ddtree_build_host(
    const double* lp, const int64_t* ids, const int64_t* root_tokens,
    const int64_t* prefix_lens, int bs, int L, int K, int budget, int64_t* tokens,
    int64_t* depths, int64_t* parents, int64_t* ranks, double* node_logws,
    int64_t* positions, int64_t* retrieve_index, int64_t* next_token,
    int64_t* next_sibling, bool* mask) {
  const int N = budget + 1;
  std::vector<Candidate> heap(N);
  std::vector<double> w(N);
  std::vector<int32_t> parent(N), last_child(N);
  std::vector<int16_t> depth(N), rank(N);
  const Nodes nodes{w.data(), parent.data(), depth.data(), rank.data()};
  for (int b = 0; b < bs; ++b) {
    const int64_t row = int64_t(b) * N, prefix = prefix_lens[b];
    const int64_t draft = int64_t(b) * L * K;
    const int count = select_nodes(lp + draft, L, K, budget, nodes, heap.data());
    for (int i = 0; i < N; ++i)
      write_node(nodes, i, count, K, ids + draft, root_tokens[b], tokens + row,
                 depths + row, parents + row, ranks + row, node_logws + row);
    link_nodes(nodes, count, N, last_child.data(), next_token + row,
               next_sibling + row);
    for (int i = 0; i < N; ++i)
      write_verify_slot(nodes, i, count, N, b, prefix, positions + row,
                        retrieve_index + row);
    for (int i = 0; i < N; ++i) {
      bool* r = mask + i * (prefix + N);
      for (int64_t c = 0; c < prefix; ++c) r[c] = true;
      write_mask_row(nodes, i, count, N, r + prefix);
    }
    mask += N * (prefix + N);
  }
  return 0;
}
"""

TREE = ("tokens", "depths", "parents", "ranks", "node_logws")
VERIFY = (
    "positions",
    "retrieve_index",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "tree_mask",
)


def random_batch(gen: torch.Generator) -> tuple:
    """A valid random draft.

    Returns (log_probs [bs, L, K], token_ids, root_tokens, prefix_lens, budget).

    Half the batches draw log-probs from multiples of ln 2, so path weights tie exactly
    and the rank-tuple tie-break decides; budgets run past the draft's size (padding)
    and down to 0.
    """
    bs = int(torch.randint(1, 5, (1,), generator=gen))
    depth = int(torch.randint(1, 7, (1,), generator=gen))
    topk = int(torch.randint(1, 7, (1,), generator=gen))
    budget = int(torch.randint(0, 40, (1,), generator=gen))
    if torch.rand(1, generator=gen) < 0.5:
        lp = -torch.randint(0, 4, (bs, depth, topk), generator=gen).to(
            torch.float64
        ) * math.log(2.0)
    else:
        lp = torch.log(
            torch.rand(bs, depth, topk, generator=gen, dtype=torch.float64) * 0.999
            + 1e-6
        )
    lp = torch.sort(lp, dim=-1, descending=True).values
    ids = torch.stack(
        [torch.randperm(1000, generator=gen)[:topk] for _ in range(bs * depth)]
    ).view(bs, depth, topk)
    roots = torch.randint(0, 1000, (bs,), generator=gen)
    prefix = torch.randint(0, 6, (bs,), generator=gen)
    return lp, ids, roots, prefix, budget


def reference_build(
    log_probs, token_ids, root_tokens, prefix_lens, budget
) -> dict[str, torch.Tensor]:
    """The CPU reference: batched builder, retrieve compile, positions and FULL_MASK."""
    tree = build_ddtree_batched(
        log_probs.cpu(), token_ids.cpu(), budget, root_tokens.cpu()
    )
    retrieve = compile_ddtree_retrieve(tree.parents)
    out = {name: getattr(tree, name) for name in TREE}
    out.update(
        positions=ddtree_positions(tree.depths, prefix_lens.cpu()),
        retrieve_index=retrieve.retrieve_index,
        retrieve_next_token=retrieve.retrieve_next_token,
        retrieve_next_sibling=retrieve.retrieve_next_sibling,
        tree_mask=ddtree_full_mask(tree.parents, prefix_lens.cpu()),
    )
    return out


def _host_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


@pytest.fixture(scope="module")
def host_core(tmp_path_factory):
    cxx = _host_compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler (c++/g++) to compile ddtree_core.cuh")
    work = tmp_path_factory.mktemp("ddtree_core")
    (work / "shim.cpp").write_text(HOST_SHIM)
    lib = work / "ddtree_core.so"
    subprocess.run(
        [
            cxx,
            "-O2",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-I",
            str(ddtree_kernel.csrc_dir() / "speculative"),
            str(work / "shim.cpp"),
            "-o",
            str(lib),
        ],
        check=True,
        capture_output=True,
    )
    return ctypes.CDLL(str(lib))


def build_on_host(
    lib, log_probs, token_ids, root_tokens, prefix_lens, budget
) -> dict[str, torch.Tensor]:
    """Run the kernel's code on the CPU; returns the kernel's outputs as CPU tensors."""
    bs, depth, topk = log_probs.shape
    n = budget + 1
    lp = log_probs.to(torch.float64).contiguous()
    ids, roots, prefix = (
        t.to(torch.int64).contiguous() for t in (token_ids, root_tokens, prefix_lens)
    )
    out = {name: torch.full((bs, n), -7, dtype=torch.int64) for name in TREE + VERIFY}
    out["positions"] = out["positions"].view(-1)
    out["node_logws"] = torch.zeros(bs, n, dtype=torch.float64)
    out["tree_mask"] = torch.zeros(int(n * prefix.sum()) + bs * n * n, dtype=torch.bool)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    lib.ddtree_build_host(
        ptr(lp),
        ptr(ids),
        ptr(roots),
        ptr(prefix),
        bs,
        depth,
        topk,
        budget,
        *(ptr(out[name]) for name in TREE + VERIFY),
    )
    return out


def assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str
) -> None:
    for name, expected in want.items():
        actual = got[name].cpu()
        assert (
            actual.dtype == expected.dtype
        ), f"{where}: {name} dtype {actual.dtype} != {expected.dtype}"
        assert torch.equal(
            actual, expected
        ), f"{where}: {name} differs\n got {actual}\nwant {expected}"


def test_core_builds_the_design_test_vector(host_core):
    lp = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]], dtype=torch.float64).log()
    ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    out = build_on_host(host_core, lp, ids, torch.tensor([7]), torch.tensor([3]), 5)
    assert out["tokens"].tolist() == [[7, 10, 20, 30, 11, 21]]
    assert out["depths"].tolist() == [[0, 1, 2, 3, 1, 2]]
    assert out["parents"].tolist() == [[-1, 0, 1, 2, 0, 1]]
    assert out["positions"].tolist() == [3, 4, 5, 6, 4, 5]
    assert out["retrieve_index"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert out["retrieve_next_token"].tolist() == [[1, 2, 3, -1, -1, -1]]
    assert out["retrieve_next_sibling"].tolist() == [[-1, 4, 5, -1, -1, -1]]
    weights = [round(w, 3) for w in out["node_logws"][0, 1:].tolist()]
    assert weights == [-0.357, -0.868, -1.091, -1.204, -1.273]
    mask = out["tree_mask"].view(6, 3 + 6)
    assert mask[:, :3].all()  # every row sees the whole prefix
    T, F = True, False
    assert mask[4, 3:].tolist() == [T, F, F, F, T, F]  # token 11: root + itself
    assert mask[3, 3:].tolist() == [T, T, T, T, F, F]  # token 30: its chain


@pytest.mark.parametrize("seed", range(6))
def test_core_equals_batched_reference_on_random_batches(host_core, seed):
    gen = torch.Generator().manual_seed(seed)
    for trial in range(40):
        batch = random_batch(gen)
        got = build_on_host(host_core, *batch)
        assert_same(
            got,
            reference_build(*batch),
            f"seed {seed} trial {trial} shapes {tuple(batch[0].shape)} "
            f"budget {batch[4]}",
        )


def test_core_equals_batched_reference_on_large_budgets(host_core):
    gen = torch.Generator().manual_seed(99)
    for trial in range(6):
        lp, ids, roots, prefix, _ = random_batch(gen)
        depth, topk = 8, 12
        lp = torch.sort(
            torch.log(torch.rand(2, depth, topk, generator=gen, dtype=torch.float64)),
            dim=-1,
            descending=True,
        ).values
        ids = torch.stack(
            [torch.randperm(5000, generator=gen)[:topk] for _ in range(2 * depth)]
        ).view(2, depth, topk)
        batch = (
            lp,
            ids,
            roots[:1].repeat(2),
            prefix[:1].repeat(2),
            int(torch.randint(100, 300, (1,), generator=gen)),
        )
        assert_same(
            build_on_host(host_core, *batch),
            reference_build(*batch),
            f"large trial {trial}",
        )


def test_core_pads_when_the_draft_has_fewer_nodes_than_the_budget(host_core):
    # 2 nodes exist, budget 4.
    lp = torch.log(torch.tensor([[[0.5, 0.5]]], dtype=torch.float64))
    batch = (lp, torch.tensor([[[5, 6]]]), torch.tensor([1]), torch.tensor([2]), 4)
    got = build_on_host(host_core, *batch)
    assert_same(got, reference_build(*batch), "padding")
    assert got["tokens"][0, :3].tolist() == [1, 5, 6]  # equal weights: rank order


def _jit_toolchain_missing() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if not (Path(cuda_home) / "bin" / "nvcc").exists():
        return f"no nvcc under CUDA_HOME={cuda_home}"
    if importlib.util.find_spec("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed"
    return None


def _run_in_tree(python_dir: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """``python argv`` importing SGLang from ``python_dir`` (a full tree)."""
    paths = (str(python_dir), os.environ.get("PYTHONPATH"))
    path = os.pathsep.join(p for p in paths if p)
    env = {
        **os.environ,
        "CUDA_HOME": os.environ.get("CUDA_HOME") or "/usr/local/cuda",
        "PYTHONPATH": path,
    }
    cmd = [sys.executable, *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


# Prints the top-level package whose absence stops SGLang's JIT loader from importing.
_LOADER_PROBE = """
try:
    import sglang.kernels.jit.utils
except ModuleNotFoundError as exc:
    print(exc.name.partition(".")[0])
"""


def _missing_runtime_package(python_dir: Path) -> str | None:
    """A third-party package SGLang's loader needs and this python lacks, else None."""
    proc = _run_in_tree(python_dir, ["-c", _LOADER_PROBE])
    missing = proc.stdout.strip()
    return missing if proc.returncode == 0 and missing not in ("", "sglang") else None


@pytest.mark.slow  # nvcc, and a copy of the base when the tree is the overlay
def test_kernel_compiles_for_sm120_through_sglang_load_jit(tmp_path, tree_root):
    reason = _jit_toolchain_missing()
    if reason:
        pytest.skip(reason)
    # SGLang's loader lives in the full tree: the tree under test if it is one (a
    # patched checkout), else the base with the overlay applied (this repository).
    python_dir = sglang_source_python(tree_root, tmp_path / "tree")
    argv = ["-m", "sglang.srt.speculative.ddtree_build", "--arch", "12.0"]
    argv += ["--cache-dir", str(tmp_path / "jit"), "--modules", "speculative_ddtree"]
    proc = _run_in_tree(python_dir, argv)
    missing = _missing_runtime_package(python_dir) if proc.returncode else None
    shutil.rmtree(tmp_path / "tree", ignore_errors=True)  # the base copy, 130 MB
    if missing:
        pytest.skip(
            f"SGLang's runtime package {missing} is not installed "
            "(scripts/setup-venv.sh --full)"
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = list(
        (tmp_path / "jit").glob(
            "sm120*/sgl_kernel_jit_speculative_ddtree/build-*/deps-*/*.so"
        )
    )
    assert len(built) == 1, proc.stderr[-3000:]
    ninja = (built[0].parent / "build.ninja").read_text()
    assert (
        "compute_120" in ninja
        and "ddtree.cuh" in (built[0].parent / "cuda.cu").read_text()
    )


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the kernel-vs-reference check needs a GPU",
)
def test_kernel_equals_batched_reference_on_cuda():
    gen = torch.Generator().manual_seed(1234)
    for trial in range(200):
        lp, ids, roots, prefix, budget = batch = random_batch(gen)
        tree, verify = ddtree_kernel.build_tree_and_verify_cuda(
            lp.cuda(), ids.cuda(), budget, roots.cuda(), prefix.cuda()
        )
        got = {
            **{name: getattr(tree, name) for name in TREE},
            **{name: getattr(verify, name) for name in VERIFY},
        }
        assert_same(got, reference_build(*batch), f"trial {trial}")
        # Through _cuda_build.
        dispatched = build_ddtree_batched(lp.cuda(), ids.cuda(), budget, roots.cuda())
        assert_same(
            {name: getattr(dispatched, name) for name in TREE},
            {name: got[name].cpu() for name in TREE},
            f"trial {trial} via build_ddtree_batched",
        )


def test_wrapper_rejects_a_budget_over_the_kernel_limit():
    with pytest.raises(ValueError, match="budget"):
        ddtree_kernel.build_tree_and_verify_cuda(
            torch.zeros(1, 2, 2),
            torch.zeros(1, 2, 2, dtype=torch.int64),
            5000,
            None,
            torch.zeros(1, dtype=torch.int64),
        )


def test_cpu_inputs_are_not_sent_to_the_kernel():
    assert not ddtree_kernel.supports(torch.zeros(1, 2, 2), 4)


def test_mask_offsets_follow_full_mask_layout():
    offsets = ddtree_kernel.mask_offsets(torch.tensor([3, 0, 5]), 4)
    assert offsets.tolist() == [0, 4 * (3 + 4), 4 * (3 + 4) + 4 * (0 + 4)]
    assert len(ddtree_kernel.source_hash()) == 64
