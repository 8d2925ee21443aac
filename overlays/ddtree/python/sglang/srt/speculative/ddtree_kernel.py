"""DDTree tree build on CUDA: SGLang JIT kernel (one thread block per request).

The kernel (``sglang/kernels/jit/csrc/speculative/ddtree.cuh``) runs the best-first
selection of ``ddtree_core.cuh`` and writes tokens, parents, depths, positions, the
retrieve arrays and the FULL_MASK rows in one launch. Its outputs equal the batched
torch builder (``ddtree_batched``) exactly; ``scripts/gpu_check.py`` and the overlay
tests compare them.

SGLang is imported inside functions only, so this module imports with torch alone (the
prebuild entry point and CPU-only tests rely on that).
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.speculative.ddtree_batched import DDTreeBatch

# load_jit's marker; the JIT cache directory is named sgl_kernel_jit_<marker>.
JIT_MODULE_ARGS = ("speculative_ddtree",)
# Relative to sglang/kernels/jit/csrc, the way load_jit resolves cuda_files.
CUDA_FILES = ("speculative/ddtree.cuh",)
CUDA_WRAPPERS = (("build_ddtree", "build_ddtree"),)
# Every file the compiled module depends on (for the build cache's source hash).
SOURCE_FILES = ("speculative/ddtree.cuh", "speculative/ddtree_core.cuh")
MAX_BUDGET = 1024
MAX_DEPTH = 64
MAX_TOPK = 32767  # ranks are int16 in shared memory


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
    """Load the JIT module (built on a cache miss, for the current arch)."""
    from sglang.kernels.jit.utils import load_jit

    return load_jit(
        *JIT_MODULE_ARGS, cuda_files=list(CUDA_FILES), cuda_wrappers=list(CUDA_WRAPPERS)
    )


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
    except Exception:
        # SGLang's JIT runtime is missing or broken here: use the torch builder.
        return False
    return True


def supports(log_probs: torch.Tensor, budget: int) -> bool:
    """Whether the kernel handles this draft (else callers use the torch builder)."""
    if os.environ.get("SGLANG_DDTREE_DISABLE_KERNEL") == "1":
        # Debugging: force the torch path.
        return False
    if not log_probs.is_cuda or budget > MAX_BUDGET or log_probs.dim() != 3:
        return False
    if log_probs.shape[1] > MAX_DEPTH or log_probs.shape[2] > MAX_TOPK:
        return False
    return is_available()


@dataclass
class DDTreeVerifyTensors:
    """Verify inputs of a batch, N = budget + 1 slots per request (SGLang/EAGLE layout).

    positions [bs * N] int64 (prefix_len + depth); retrieve_index [bs, N] int64 (b * N +
    i); retrieve_next_token / retrieve_next_sibling [bs, N] int64 (local slots, -1 =
    none); tree_mask [sum_b N * (prefix_len_b + N)] bool, FULL_MASK layout (True = may
    attend).
    """

    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    tree_mask: torch.Tensor


def mask_offsets(prefix_lens: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Start of each request's FULL_MASK block: sum of N * (prefix + N) before it."""
    sizes = num_nodes * (prefix_lens + num_nodes)
    return torch.cumsum(sizes, dim=0) - sizes


def _empty_tree(log_probs: torch.Tensor, budget: int) -> "DDTreeBatch":
    from sglang.srt.speculative.ddtree_batched import DDTreeBatch, count_possible_nodes

    bs, depth, topk = log_probs.shape
    shape, device = (bs, budget + 1), log_probs.device
    return DDTreeBatch(
        tokens=torch.empty(shape, dtype=torch.int64, device=device),
        depths=torch.empty(shape, dtype=torch.int64, device=device),
        parents=torch.empty(shape, dtype=torch.int64, device=device),
        ranks=torch.empty(shape, dtype=torch.int64, device=device),
        node_logws=torch.empty(shape, dtype=torch.float64, device=device),
        num_nodes=torch.full(
            (bs,),
            count_possible_nodes(depth, topk, budget) + 1,
            dtype=torch.int64,
            device=device,
        ),
        budget=budget,
    )


def _launch(log_probs, token_ids, budget, root_tokens, tree, verify_args) -> None:
    bs = log_probs.shape[0]
    if root_tokens is None:
        root_tokens = torch.full((bs,), -1, dtype=torch.int64, device=log_probs.device)
    _module().build_ddtree(
        log_probs.to(torch.float64).contiguous(),
        token_ids.to(torch.int64).contiguous(),
        root_tokens.to(torch.int64).contiguous(),
        tree.tokens,
        tree.depths,
        tree.parents,
        tree.ranks,
        tree.node_logws,
        *verify_args,
        budget,
    )


def build_tree_cuda(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor] = None,
) -> "DDTreeBatch":
    """The ddtree_batched.DDTreeBatch of a CUDA batch, one launch, no host sync.

    log_probs [bs, L, K] float (cast to float64), token_ids [bs, L, K] int32/int64,
    root_tokens [bs] or None (-1). Inputs are assumed checked by ddtree_batched (shapes,
    values).
    """
    tree = _empty_tree(log_probs, budget)
    none = torch.empty(0, dtype=torch.int64, device=log_probs.device)
    _launch(
        log_probs, token_ids, budget, root_tokens, tree, (none,) * 6 + (none.bool(),)
    )
    return tree


def build_tree_and_verify_cuda(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
    prefix_lens: torch.Tensor,
    *,
    prefix_lens_sum: Optional[int] = None,
) -> tuple["DDTreeBatch", DDTreeVerifyTensors]:
    """Tree plus verify inputs (positions, retrieve arrays, FULL_MASK) in one launch.

    prefix_lens [bs] int: tokens already in the KV cache per request. Pass
    prefix_lens_sum (a host int, as SGLang's batch keeps it) to size the mask without a
    device sync.
    """
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"expected 0 <= budget <= {MAX_BUDGET}, got {budget}")
    bs, device, n = log_probs.shape[0], log_probs.device, budget + 1
    if prefix_lens.shape != (bs,):
        raise ValueError(
            f"expected prefix_lens of shape [{bs}], got {tuple(prefix_lens.shape)}"
        )
    prefix_lens = prefix_lens.to(device=device, dtype=torch.int64).contiguous()
    if prefix_lens_sum is None:
        # One sync; hot paths pass it in.
        prefix_lens_sum = int(prefix_lens.sum().item())
    tree = _empty_tree(log_probs, budget)
    new = functools.partial(torch.empty, dtype=torch.int64, device=device)
    verify = DDTreeVerifyTensors(
        positions=new((bs * n,)),
        retrieve_index=new((bs, n)),
        retrieve_next_token=new((bs, n)),
        retrieve_next_sibling=new((bs, n)),
        tree_mask=torch.empty(
            (n * prefix_lens_sum + bs * n * n,), dtype=torch.bool, device=device
        ),
    )
    _launch(
        log_probs,
        token_ids,
        budget,
        root_tokens,
        tree,
        (
            prefix_lens,
            mask_offsets(prefix_lens, n),
            verify.positions,
            verify.retrieve_index,
            verify.retrieve_next_token,
            verify.retrieve_next_sibling,
            verify.tree_mask,
        ),
    )
    return tree, verify
