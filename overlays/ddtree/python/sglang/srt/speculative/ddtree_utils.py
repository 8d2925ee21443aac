"""DDTree for SGLang's DFlash worker: one import for the whole verify-side API.

``prepare_ddtree_verify`` is called once per decode step (``ddtree_step``): from
the drafter's top-K log-probs it builds every request's draft tree and the tensors
SGLang's tree verify needs (positions, retrieve arrays, FULL_MASK). On CUDA, where
the DDTree JIT kernel is available, this is one fused launch; elsewhere the exact
torch path composes the batched builder and the retrieve compiler. Both give
identical tensors (see ddtree_kernel).

Only torch and the sibling ddtree modules are imported here.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.speculative.ddtree_batched import DDTreeBatch, build_ddtree_batched
from sglang.srt.speculative.ddtree_checks import (
    check_budget,
    check_draft_shapes,
    check_draft_values,
    check_int_vector,
    check_root_tokens,
)
from sglang.srt.speculative.ddtree_kernel import (
    DDTreeVerifyTensors,
    build_tree_and_verify_cuda,
    supports,
)
from sglang.srt.speculative.ddtree_retrieve import (
    DDTreeRetrieve,
    compile_ddtree_retrieve,
    ddtree_ancestor_mask,
    ddtree_full_mask,
    ddtree_positions,
)
from sglang.srt.speculative.ddtree_topk import ddtree_shard_topk, merge_ddtree_topk
from sglang.srt.speculative.ddtree_tree import (
    DDTreeBuildResult,
    build_ddtree_tree_from_topk,
)
from sglang.srt.speculative.ddtree_verify import (
    DDTreeVerifyResult,
    ddtree_verify_greedy,
    ddtree_verify_sampling,
)

__all__ = [
    "DDTreeBatch",
    "DDTreeBuildResult",
    "DDTreeRetrieve",
    "DDTreeVerifyResult",
    "DDTreeVerifyTensors",
    "build_ddtree_batched",
    "build_ddtree_tree_from_topk",
    "compile_ddtree_retrieve",
    "ddtree_ancestor_mask",
    "ddtree_full_mask",
    "ddtree_positions",
    "ddtree_shard_topk",
    "ddtree_verify_greedy",
    "ddtree_verify_sampling",
    "merge_ddtree_topk",
    "prepare_ddtree_verify",
    "resolve_tree_topk",
]


def resolve_tree_topk(budget: int, topk: Optional[int], vocab_size: int) -> int:
    """Draft top-K per depth: the tree-topk flag, else min(budget, vocab)."""
    if budget <= 0:
        raise ValueError(f"expected a positive DDTree budget, got {budget}")
    if vocab_size <= 0:
        raise ValueError(f"expected a positive vocab size, got {vocab_size}")
    k = min(budget, vocab_size) if topk is None else topk
    if not 0 < k <= vocab_size:
        raise ValueError(f"expected 0 < tree top-K <= vocab size {vocab_size}, got {k}")
    return k


def prepare_ddtree_verify(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
    prefix_lens: torch.Tensor,
    prefix_lens_sum: Optional[int] = None,
    validate: bool = True,
) -> tuple[DDTreeBatch, DDTreeVerifyTensors]:
    """Draft trees plus verify inputs for a batch, N = budget + 1 slots per request.

    log_probs [bs, L, K] float, token_ids [bs, L, K] int, root_tokens [bs] int or None,
    prefix_lens [bs] int (tokens already in the KV cache). prefix_lens_sum, a host int,
    sizes the mask without a device read. Returns (tree, verify tensors).
    """
    check_budget(budget)
    check_draft_shapes(log_probs, token_ids, batched=True)
    check_int_vector("prefix_lens", prefix_lens, log_probs.shape[0])
    if root_tokens is not None:
        check_root_tokens(root_tokens, log_probs.shape[0])
    if validate:
        check_draft_values(log_probs, token_ids)
    if supports(log_probs, budget):  # CUDA with the JIT kernel: one fused launch
        return build_tree_and_verify_cuda(
            log_probs,
            token_ids,
            budget,
            root_tokens,
            prefix_lens,
            prefix_lens_sum=prefix_lens_sum,
        )
    tree = build_ddtree_batched(
        log_probs, token_ids, budget, root_tokens, validate=False
    )
    retrieve = compile_ddtree_retrieve(tree.parents, tree.node_logws, validate=validate)
    prefix_lens = prefix_lens.to(device=log_probs.device, dtype=torch.int64)
    verify = DDTreeVerifyTensors(
        positions=ddtree_positions(tree.depths, prefix_lens),
        retrieve_index=retrieve.retrieve_index,
        retrieve_next_token=retrieve.retrieve_next_token,
        retrieve_next_sibling=retrieve.retrieve_next_sibling,
        tree_mask=ddtree_full_mask(
            tree.parents, prefix_lens, prefix_lens_sum, validate=validate
        ),
    )
    return tree, verify
