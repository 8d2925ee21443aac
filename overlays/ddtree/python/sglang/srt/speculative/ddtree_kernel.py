"""DDTree tree build on CUDA: SGLang JIT kernel (one thread block per request).

The kernel (``sglang/kernels/jit/csrc/speculative/ddtree.cuh``) runs the best-first
selection of ``ddtree_core.cuh`` and writes tokens, parents, depths, positions, the retrieve
arrays and the FULL_MASK rows in one launch. Its outputs equal the batched torch builder
(``ddtree_batched``) exactly; ``scripts/gpu_check.py`` and the overlay tests compare them.

SGLang is imported inside functions only, so this module imports with torch alone (the
prebuild entry point and CPU-only tests rely on that).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

# load_jit's marker: the JIT cache directory is named after it (sgl_kernel_jit_<marker>).
JIT_MODULE_ARGS = ("speculative_ddtree",)
# Relative to sglang/kernels/jit/csrc, the way load_jit resolves cuda_files.
CUDA_FILES = ("speculative/ddtree.cuh",)
CUDA_WRAPPERS = (("build_ddtree", "build_ddtree"),)
# Every file the compiled module depends on (for the build cache's source hash).
SOURCE_FILES = ("speculative/ddtree.cuh", "speculative/ddtree_core.cuh")
MAX_BUDGET = 1024
MAX_DEPTH = 64


def csrc_dir() -> Path:
    """This tree's ``sglang/kernels/jit/csrc`` (next to this module's package)."""
    return Path(__file__).resolve().parents[2] / "kernels" / "jit" / "csrc"


def source_hash() -> str:
    """sha256 over the kernel's own sources, in a fixed order (names and contents)."""
    digest = hashlib.sha256()
    for rel in SOURCE_FILES:
        digest.update(rel.encode() + b"\0" + (csrc_dir() / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def load_module() -> Any:
    """Load (building on a cache miss) the JIT module; the build targets the current arch."""
    from sglang.kernels.jit.utils import load_jit

    return load_jit(*JIT_MODULE_ARGS, cuda_files=list(CUDA_FILES), cuda_wrappers=list(CUDA_WRAPPERS))


@functools.lru_cache(maxsize=1)
def _module() -> Any:
    return load_module()


@functools.lru_cache(maxsize=1)
def is_available() -> bool:
    """True when CUDA is present and SGLang's JIT loader is importable."""
    if not torch.cuda.is_available():
        return False
    try:
        import sglang.kernels.jit.utils  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class DDTreeKernelOutput:
    """Per request b, N = budget + 1 nodes (index 0 = root); all on the input's device.

    tokens, parents, depths, retrieve_index, retrieve_next_token, retrieve_next_sibling:
    [bs, N] int64; positions: [bs * N] int64; node_weights: [bs, N] float64 (root 0.0,
    padding -inf); tree_mask: [sum_b N * (prefix_len_b + N)] bool, FULL_MASK layout;
    num_nodes: [bs] int64, real nodes per request including the root.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    node_weights: torch.Tensor
    tree_mask: torch.Tensor

    @property
    def num_nodes(self) -> torch.Tensor:
        return (self.node_weights > float("-inf")).sum(dim=1)


def _check_inputs(log_probs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor,
                  prefix_lens: torch.Tensor, budget: int) -> None:
    if log_probs.dim() != 3 or token_ids.shape != log_probs.shape:
        raise ValueError(f"expected log_probs and token_ids of shape [bs, L, K], got "
                         f"{tuple(log_probs.shape)} and {tuple(token_ids.shape)}")
    bs, depth, _ = log_probs.shape
    if root_tokens.shape != (bs,) or prefix_lens.shape != (bs,):
        raise ValueError(f"expected root_tokens and prefix_lens of shape [{bs}], got "
                         f"{tuple(root_tokens.shape)} and {tuple(prefix_lens.shape)}")
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"expected 0 <= budget <= {MAX_BUDGET}, got {budget}")
    if depth > MAX_DEPTH:
        raise ValueError(f"expected at most {MAX_DEPTH} draft depths, got {depth}")
    if not log_probs.is_cuda:
        raise ValueError("build_ddtree_cuda needs CUDA tensors; use ddtree_batched on CPU")


def mask_offsets(prefix_lens: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Start of each request's FULL_MASK block: sum over earlier requests of N * (prefix + N)."""
    sizes = num_nodes * (prefix_lens + num_nodes)
    return torch.cumsum(sizes, dim=0) - sizes


def build_ddtree_cuda(log_probs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor,
                      prefix_lens: torch.Tensor, budget: int, *,
                      prefix_lens_sum: Optional[int] = None) -> DDTreeKernelOutput:
    """Build the trees of a batch with one kernel launch.

    log_probs [bs, L, K] (any float dtype; cast to float64, top-K sorted descending per depth),
    token_ids [bs, L, K], root_tokens [bs], prefix_lens [bs]. Pass prefix_lens_sum (a host int,
    as SGLang's batch keeps it) to size the mask without a device sync.
    """
    _check_inputs(log_probs, token_ids, root_tokens, prefix_lens, budget)
    bs, device, n = log_probs.shape[0], log_probs.device, budget + 1
    prefix_lens = prefix_lens.to(torch.int64).contiguous()
    if prefix_lens_sum is None:
        prefix_lens_sum = int(prefix_lens.sum().item())  # one sync; callers on hot paths pass it
    new = functools.partial(torch.empty, device=device)
    out = DDTreeKernelOutput(
        tokens=new((bs, n), dtype=torch.int64), parents=new((bs, n), dtype=torch.int64),
        depths=new((bs, n), dtype=torch.int64), positions=new((bs * n,), dtype=torch.int64),
        retrieve_index=new((bs, n), dtype=torch.int64), retrieve_next_token=new((bs, n), dtype=torch.int64),
        retrieve_next_sibling=new((bs, n), dtype=torch.int64), node_weights=new((bs, n), dtype=torch.float64),
        tree_mask=new((n * prefix_lens_sum + bs * n * n,), dtype=torch.bool))
    _module().build_ddtree(
        log_probs.to(torch.float64).contiguous(), token_ids.to(torch.int64).contiguous(),
        root_tokens.to(torch.int64).contiguous(), prefix_lens, mask_offsets(prefix_lens, n),
        out.tokens, out.parents, out.depths, out.positions, out.retrieve_index, out.retrieve_next_token,
        out.retrieve_next_sibling, out.node_weights, out.tree_mask, budget)
    return out
