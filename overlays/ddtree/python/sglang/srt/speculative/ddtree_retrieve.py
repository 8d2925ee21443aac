"""Compile a DDTree into SGLang's verify inputs: retrieve arrays, positions, the mask.

Conventions (those of SGLang's EAGLE tree kernels, ``build_tree_kernel_efficient``):
  * N = budget + 1 slots per request, slot 0 = root; padding slots have parent -1.
  * retrieve_index        int64 [bs, N]  global slot b * N + i (padding slots too).
  * retrieve_next_token   int64 [bs, N]  local index of the first child, -1 = none.
  * retrieve_next_sibling int64 [bs, N]  local index of the next sibling, -1 = none.
    Siblings are ordered by cumulative log-weight descending, ties by slot index; for a
    DDTree in heap order that is simply slot order. Padding slots: -1 / -1.
  * positions             int64 [bs * N] prefix_len[b] + depth (root = prefix_len[b]);
    padding slots get prefix_len[b] (they are never accepted).
  * FULL_MASK             bool  [sum_b N * (seq_len[b] + N)]: per request an
    N x (seq_len + N) row-major block, requests concatenated in batch order; row i
    allows (True) every prefix column, the root column, the columns of i's ancestors and
    of i itself. A padding row allows the prefix, the root and itself (never empty).
  * tree-only mask        bool  [bs, N, N]: the last N columns of each FULL_MASK block
    (SGLang's QLEN_ONLY layout is its flattening, ``.reshape(-1)``).
Single trees: pass parents of shape [N]; retrieve arrays come back [N], the tree
mask [N, N].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from sglang.srt.speculative.ddtree_checks import (
    check_int_vector,
    check_parents_values,
    check_tree_tensors,
)


@dataclass
class DDTreeRetrieve:
    """SGLang's retrieve arrays for a batch of trees; all int64 [bs, N]."""

    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


def _as_batch(parents: torch.Tensor) -> torch.Tensor:
    return (
        parents.unsqueeze(0)
        if isinstance(parents, torch.Tensor) and parents.dim() == 1
        else parents
    )


def compile_ddtree_retrieve(
    parents: Union[torch.Tensor, Any],
    node_logws: Optional[torch.Tensor] = None,
    validate: bool = True,
    budget: Optional[int] = None,
) -> DDTreeRetrieve:
    """Retrieve arrays from parent pointers.

    parents:    int64 [bs, N] or [N] (a single tree: the arrays come back [N]); root -1,
                node i's parent < i, padding -1. A built tree (``DDTreeBuildResult`` or
                ``DDTreeBatch``) may be passed instead; its parents and weights are
                used.
    node_logws: optional float [bs, N] or [N] path log-weights; orders siblings by
                weight descending (ties by slot). Without it siblings follow slot
                order, which is the same order for trees from the DDTree builders.
    validate:   check the parent values (``check_parents_values``: two host reads, each
                a device sync on CUDA); shapes are always checked. Per-step callers pass
                False, and the compile then has no host read.
    budget:     pad a single tree to N = budget + 1 slots (a heap result has only its
                nodes).
    """
    parents, node_logws = _tree_arrays(parents, node_logws, budget)
    single = isinstance(parents, torch.Tensor) and parents.dim() == 1
    parents = _as_batch(parents)
    check_tree_tensors(parents)
    if node_logws is not None:
        node_logws = _as_batch(node_logws)
        check_tree_tensors(parents, [("node_logws", node_logws)])
    if validate:
        check_parents_values(parents)
    parents = parents.to(torch.int64)
    bs, n = parents.shape
    device = parents.device
    slot = torch.arange(n, dtype=torch.int64, device=device).expand(bs, n)
    retrieve_index = (
        slot + torch.arange(bs, dtype=torch.int64, device=device)[:, None] * n
    )
    # Children grouped by parent, in sibling order.
    order = _sibling_order(parents, node_logws)
    par_sorted = parents.gather(1, order)
    is_child = par_sorted >= 0
    next_in_order = torch.cat([order[:, 1:], torch.full_like(order[:, :1], -1)], dim=1)
    next_par = torch.cat(
        [par_sorted[:, 1:], torch.full_like(par_sorted[:, :1], -2)], dim=1
    )
    sibling_sorted = torch.where(is_child & (next_par == par_sorted), next_in_order, -1)
    next_sibling = torch.full_like(parents, -1).scatter_(1, order, sibling_sorted)
    prev_par = torch.cat(
        [torch.full_like(par_sorted[:, :1], -2), par_sorted[:, :-1]], dim=1
    )
    first = is_child & (prev_par != par_sorted)
    # Scatter each first child into its parent's slot; the other entries go to a dump
    # column (n).
    target = torch.where(first, par_sorted, n)
    next_token = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    next_token.scatter_(1, target, torch.where(first, order, -1))
    result = DDTreeRetrieve(
        retrieve_index, next_token[:, :n].contiguous(), next_sibling
    )
    if single:
        return DDTreeRetrieve(
            *(
                t[0]
                for t in (
                    result.retrieve_index,
                    result.retrieve_next_token,
                    result.retrieve_next_sibling,
                )
            )
        )
    return result


def _tree_arrays(
    tree: Union[torch.Tensor, Any],
    node_logws: Optional[torch.Tensor],
    budget: Optional[int],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(parents, node_logws) of tensors or a built tree, padded when budget is given."""
    parents = tree
    if not isinstance(tree, torch.Tensor) and hasattr(tree, "parents"):
        parents = tree.parents
        if node_logws is None and getattr(tree, "node_logws", None) is not None:
            node_logws = tree.node_logws
            if node_logws.shape[-1] == parents.shape[-1] - 1:
                # A heap result omits the root's 0.0.
                root = torch.zeros(
                    node_logws.shape[:-1] + (1,),
                    dtype=node_logws.dtype,
                    device=node_logws.device,
                )
                node_logws = torch.cat([root, node_logws], dim=-1)
    if budget is not None and isinstance(parents, torch.Tensor):
        if (
            isinstance(budget, bool)
            or not isinstance(budget, int)
            or budget + 1 < parents.shape[-1]
        ):
            raise ValueError(
                f"expected budget >= {parents.shape[-1] - 1} (the tree's nodes), "
                f"got {budget}"
            )
        pad = budget + 1 - parents.shape[-1]
        parents = torch.nn.functional.pad(parents, (0, pad), value=-1)
        if node_logws is not None:
            node_logws = torch.nn.functional.pad(
                node_logws.to(torch.float64), (0, pad), value=float("-inf")
            )
    return parents, node_logws


def _sibling_order(
    parents: torch.Tensor, node_logws: Optional[torch.Tensor]
) -> torch.Tensor:
    """Slots sorted by (parent, -log-weight, slot); roots/padding (parent -1) first."""
    bs, n = parents.shape
    order = (
        torch.arange(n, dtype=torch.int64, device=parents.device)
        .expand(bs, n)
        .contiguous()
    )
    if node_logws is not None:
        by_weight = torch.sort(
            node_logws.to(torch.float64), dim=1, descending=True, stable=True
        ).indices
        order = by_weight
    by_parent = torch.sort(parents.gather(1, order), dim=1, stable=True).indices
    return order.gather(1, by_parent)


def ddtree_positions(depths: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """Positions int64 [bs * N] = prefix_lens[b] + depth (padding, depth -1: prefix).

    depths: int64 [bs, N] (root 0, padding -1); prefix_lens: int64 [bs] tokens before
    the root.
    """
    depths = _as_batch(depths)
    check_tree_tensors(depths)
    check_int_vector("prefix_lens", prefix_lens, depths.shape[0])
    return (
        prefix_lens.to(torch.int64)[:, None] + depths.to(torch.int64).clamp(min=0)
    ).reshape(-1)


def ddtree_ancestor_mask(parents: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Tree-only mask bool [bs, N, N]: [b, i, j] iff j is i, i's ancestor or the root.

    A single tree, parents [N], gives [N, N]. Pointer doubling: ceil(log2 N) rounds of
    [bs, N, N] ops, no host reads. validate=True checks the parent values first (two
    host reads, device syncs on CUDA); per-step callers pass False.
    """
    if isinstance(parents, torch.Tensor) and parents.dim() == 1:
        return ddtree_ancestor_mask(parents[None], validate)[0]
    parents = _as_batch(parents)
    check_tree_tensors(parents)
    if validate:
        check_parents_values(parents)
    bs, n = parents.shape
    device = parents.device
    # Column n is a sink for "no parent" so gathers never go out of range.
    jump = torch.where(parents >= 0, parents.to(torch.int64), n)
    jump = torch.cat(
        [jump, torch.full((bs, 1), n, dtype=torch.int64, device=device)], dim=1
    )
    reach = (
        torch.eye(n + 1, dtype=torch.bool, device=device)
        .expand(bs, n + 1, n + 1)
        .clone()
    )
    reach[:, :, n] = False
    steps = 1
    while steps < n:
        # reach_k[i] holds i and its first k - 1 ancestors; add the k-th ancestor's.
        reach = reach | reach.gather(1, jump[:, :, None].expand(bs, n + 1, n + 1))
        jump = jump.gather(1, jump)
        steps *= 2
    mask = reach[:, :n, :n]
    mask[:, :, 0] = True
    return mask


def ddtree_full_mask(
    parents: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_sum: Optional[int] = None,
    validate: bool = True,
) -> torch.Tensor:
    """SGLang FULL_MASK: bool [seq_lens_sum * N + bs * N * N], see the module docstring.

    parents:      int64 [bs, N].
    seq_lens:     int64 [bs], prefix tokens per request (without the draft).
    seq_lens_sum: their sum as a host int (pass it to avoid a device read).
    validate:     check the parent values (two host reads, device syncs on CUDA). With
                  validate=False and seq_lens_sum given, no host read at all.
    """
    parents = _as_batch(parents)
    tree = ddtree_ancestor_mask(parents, validate=validate)
    bs, n = parents.shape
    check_int_vector("seq_lens", seq_lens, bs)
    seq_lens = seq_lens.to(device=parents.device, dtype=torch.int64)
    if seq_lens_sum is None:
        seq_lens_sum = int(seq_lens.sum())
    mask = torch.ones(
        seq_lens_sum * n + bs * n * n, dtype=torch.bool, device=parents.device
    )
    # Block b starts after the blocks of requests 0..b-1, each N * (seq_len + N) long.
    block = n * (seq_lens + n)
    start = torch.cumsum(block, dim=0) - block
    rows = torch.arange(n, dtype=torch.int64, device=parents.device)
    index = (
        start[:, None, None]
        + rows[None, :, None] * (seq_lens + n)[:, None, None]
        + seq_lens[:, None, None]
        + rows[None, None, :]
    )
    mask[index.reshape(-1)] = tree.reshape(-1)
    return mask
