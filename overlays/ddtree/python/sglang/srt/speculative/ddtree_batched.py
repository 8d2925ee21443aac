"""Batched DDTree builder: the heap builder's trees for [bs, L, K] drafts, as tensor ops.

Output contract (``DDTreeBatch``; N = budget + 1 slots per request, slot 0 = root):
  tokens      int64   [bs, N]  slot 0 = root_tokens[b] (or -1 when none given); drafted nodes
                               1..n in heap order; padding -1
  depths      int64   [bs, N]  root 0, nodes 1..L, padding -1
  parents     int64   [bs, N]  root -1, node i -> parent slot (< i), padding -1
  ranks       int64   [bs, N]  rank of the node's token at its depth (0..K-1); root and padding -1
  node_logws  float64 [bs, N]  path log-weight; root 0.0, padding -inf
  num_nodes   int64   [bs]     real slots including the root: 1 + min(budget, sum_d K^d)
All tensors live on the input's device. Padding appears only when the draft holds fewer than
``budget`` nodes in total (sum over d of K^d < budget); real nodes always fill 0..n.

Node order and tie-break: exactly ``ddtree_tree.build_ddtree_tree_from_topk`` (heap order =
increasing key (-weight, rank tuple), rank tuples compared lexicographically, a prefix first).

Float rule (any re-implementation, e.g. the CUDA kernel, must follow it to match bit for
bit): log-probs are cast to float64; a node's weight is ``weight(parent) + lp64[d - 1, rank]``
with root weight 0.0, one IEEE round-to-nearest float64 add per edge, formed root -> leaf
(never re-associated, no FMA, no float32 accumulation). Weights compare with ``>``/``==``
on those float64 values.

Algorithm (why a tensor version can be exact): a node's key is larger than its parent's and
its previous sibling's, so the heap pops nodes in global key order and the tree is the
``budget`` smallest keys over all nodes. Per depth d we keep the best B (= budget) children
of the nodes kept at depth d - 1, where a child's weight is parent weight + lp[d - 1, j].
With parents in key order (slot i), only pairs with (i + 1) * (j + 1) <= B can be among the
best B in exact arithmetic; float64 rounding can in principle merge two sums and break that
counting argument, so the pruned result is certified (every pruned pair's best child must
weigh strictly less than the B-th selected node) and, if the certificate fails, the build is
redone without pruning (all P * K pairs), which is exact without any counting argument. The
certificate costs one device-to-host read per call. Keys inside a depth use the per-depth
lexicographic position of the parent's rank tuple; keys across depths use the preorder index
of the kept-node trie (= lexicographic order of rank tuples with prefixes first).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.speculative.ddtree_checks import (
    check_budget,
    check_draft_shapes,
    check_draft_values,
    check_root_tokens,
)


@dataclass
class DDTreeBatch:
    """Padded draft trees of a batch; see the module docstring for the full contract."""

    tokens: torch.Tensor  # int64 [bs, N]
    depths: torch.Tensor  # int64 [bs, N]
    parents: torch.Tensor  # int64 [bs, N]
    ranks: torch.Tensor  # int64 [bs, N]
    node_logws: torch.Tensor  # float64 [bs, N]
    num_nodes: torch.Tensor  # int64 [bs]
    budget: int

    @property
    def num_slots(self) -> int:
        """N = budget + 1, the verify width per request."""
        return self.budget + 1


@dataclass
class _Level:
    """Nodes kept at one depth, in key order. All [bs, P]; invalid slots have weight -inf."""

    weight: torch.Tensor  # float64
    lexpos: torch.Tensor  # int64, lexicographic rank of the rank tuple among this level's slots
    parent: torch.Tensor  # int64, slot in the previous level
    rank: torch.Tensor  # int64
    valid: torch.Tensor  # bool


def build_ddtree_batched(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> DDTreeBatch:
    """Build one DDTree per request.

    log_probs:   float [bs, L, K], per depth sorted descending, finite, <= 0.
    token_ids:   int32/int64 [bs, L, K], distinct within each depth row.
    budget:      draft nodes per request, root excluded; N = budget + 1.
    root_tokens: optional int32/int64 [bs], written to tokens[:, 0] (else -1).
    validate:    run the value checks (one host read each); shapes are always checked.
    """
    check_budget(budget)
    check_draft_shapes(log_probs, token_ids, batched=True)
    if root_tokens is not None:
        check_root_tokens(root_tokens, log_probs.shape[0])
    if validate:
        check_draft_values(log_probs, token_ids)
    kernel_result = _cuda_build(log_probs, token_ids, budget, root_tokens)
    if kernel_result is not None:
        return kernel_result
    return _build_torch(log_probs, token_ids, budget, root_tokens)


def _cuda_build(
    log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int, root_tokens: Optional[torch.Tensor]
) -> Optional[DDTreeBatch]:
    """Extension point for a CUDA kernel; returns None to use the torch path.

    A CUDA implementation (``ddtree_kernel.py``) plugs in here: when ``log_probs.is_cuda``
    and its kernel is available, return a ``DDTreeBatch`` that equals ``_build_torch`` on
    every input, bit for bit (the float rule and order in the module docstring). Inputs
    arrive already shape-checked (and value-checked when the caller asked for it).
    """
    # --- kernel build concern (ddtree_kernel.py): CUDA inputs the kernel supports ---
    if not log_probs.is_cuda:
        return None
    from sglang.srt.speculative import ddtree_kernel

    if not ddtree_kernel.supports(log_probs, budget):
        return None
    return ddtree_kernel.build_tree_cuda(log_probs, token_ids, budget, root_tokens)
    # --- end kernel build concern ---


def _build_torch(
    log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int, root_tokens: Optional[torch.Tensor]
) -> DDTreeBatch:
    """The tensor-op builder: pruned selection, certified; unpruned fallback if needed."""
    lp = log_probs.detach().to(torch.float64)
    result, certified = _select_trees(lp, token_ids, budget, root_tokens, prune=True)
    if not bool(certified):  # the one host read: rare float64 near-ties need the full pairs
        result, _ = _select_trees(lp, token_ids, budget, root_tokens, prune=False)
    return result


def count_possible_nodes(depth: int, k: int, cap: int) -> int:
    """min(cap, sum_{d=1..depth} k^d): how many draft nodes a [depth, k] draft holds."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= cap:
            return cap
    return total


def _select_trees(
    lp: torch.Tensor, token_ids: torch.Tensor, budget: int, root_tokens: Optional[torch.Tensor], prune: bool
) -> tuple[DDTreeBatch, torch.Tensor]:
    """Select the budget best nodes; returns the batch and a 0-dim bool certificate."""
    bs, depth, k = lp.shape
    device = lp.device
    levels = [_root_level(bs, device)]
    for d in range(1, depth + 1):
        if budget == 0:
            break
        levels.append(_expand_level(levels[-1], lp[:, d - 1, :], budget, prune))
    certified = _certify(levels, lp, budget) if prune else torch.ones((), dtype=torch.bool, device=device)
    preorder = _preorder(levels)
    return _assemble(levels, preorder, token_ids, budget, root_tokens), certified


def _root_level(bs: int, device: torch.device) -> _Level:
    zeros = torch.zeros((bs, 1), dtype=torch.int64, device=device)
    return _Level(
        weight=torch.zeros((bs, 1), dtype=torch.float64, device=device),
        lexpos=zeros,
        parent=zeros - 1,
        rank=zeros - 1,
        valid=torch.ones((bs, 1), dtype=torch.bool, device=device),
    )


def _candidate_pairs(num_parents: int, k: int, budget: int, prune: bool, device: torch.device):
    """(parent slot i, rank j) pairs to score: (i+1)*(j+1) <= budget when pruning, else all.

    Returns slots [C], ranks [C] and widths [P] (pairs per parent slot), int64.
    """
    slots, ranks, widths = _pair_lists(num_parents, k, budget, prune)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return as_tensor(slots), as_tensor(ranks), as_tensor(widths)


@functools.lru_cache(maxsize=256)
def _pair_lists(num_parents: int, k: int, budget: int, prune: bool):
    slots, ranks, widths = [], [], []
    for i in range(num_parents):
        width = min(k, budget // (i + 1)) if prune else k
        slots.extend([i] * width)
        ranks.extend(range(width))
        widths.append(width)
    return tuple(slots), tuple(ranks), tuple(widths)


def _sort_by_key(weight: torch.Tensor, lexkey: torch.Tensor) -> torch.Tensor:
    """Permutation [bs, C] ordering by (weight desc, lexkey asc): two stable sorts."""
    by_lex = torch.sort(lexkey, dim=1, stable=True).indices
    by_weight = torch.sort(weight.gather(1, by_lex), dim=1, descending=True, stable=True).indices
    return by_lex.gather(1, by_weight)


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv [bs, M] with inv[b, perm[b, i]] = i (perm is a permutation of 0..M-1 per row)."""
    ids = torch.arange(perm.shape[1], device=perm.device).expand_as(perm)
    return torch.empty_like(perm).scatter_(1, perm, ids)


def _expand_level(prev: _Level, lp_d: torch.Tensor, budget: int, prune: bool) -> _Level:
    """Best ``budget`` children at the next depth. lp_d: float64 [bs, K].

    Candidates are laid out in lexicographic order of their rank tuples (parent's lexpos,
    then rank), so one stable sort by weight (descending) yields key order.
    """
    bs, k = lp_d.shape
    slots, ranks, widths = _candidate_pairs(prev.weight.shape[1], k, budget, prune, lp_d.device)
    num = slots.numel()
    # Lexicographic position of candidate (i, j): start of parent i's run in lex order + j.
    width_lex = widths.take(_inverse_permutation(prev.lexpos))
    run_start = (torch.cumsum(width_lex, dim=1) - width_lex).gather(1, prev.lexpos)
    # index_select, not x[:, idx]: advanced indexing is orders of magnitude slower on CPU.
    lex_of_cand = run_start.index_select(1, slots) + ranks
    cand_at_lex = _inverse_permutation(lex_of_cand)  # [bs, C] candidate id per lex position
    slot_lex = slots.take(cand_at_lex)
    rank_lex = ranks.take(cand_at_lex)
    valid_lex = prev.valid.gather(1, slot_lex)
    weight_lex = prev.weight.gather(1, slot_lex) + lp_d.gather(1, rank_lex)  # float rule: parent + lp
    weight_lex = torch.where(valid_lex, weight_lex, torch.full_like(weight_lex, float("-inf")))
    keep = torch.sort(weight_lex, dim=1, descending=True, stable=True).indices[:, : min(budget, num)]
    # New lexpos: rank of each kept lex position among the kept ones (invalid ones come last,
    # because invalid parents hold the last lex positions of their level).
    kept_mark = torch.zeros_like(lex_of_cand).scatter_(1, keep, 1)
    lexpos = (torch.cumsum(kept_mark, dim=1) - 1).gather(1, keep)
    return _Level(
        weight=weight_lex.gather(1, keep),
        lexpos=lexpos,
        parent=slot_lex.gather(1, keep),
        rank=rank_lex.gather(1, keep),
        valid=valid_lex.gather(1, keep),
    )


def _certify(levels: list[_Level], lp: torch.Tensor, budget: int) -> torch.Tensor:
    """True when no pruned pair could belong to the tree (see module docstring).

    For parent slot i the first pruned rank is its pair width (min(K, budget // (i + 1)));
    that child's weight must be strictly below the budget-th best kept weight (-inf if fewer
    were kept, which fails). The argument holds for any widths, so the certificate reads them
    from ``_pair_lists`` rather than re-deriving the bound.
    """
    k = lp.shape[2]
    if budget == 0:
        return torch.ones((), dtype=torch.bool, device=lp.device)
    kept = torch.cat([lvl.weight for lvl in levels[1:]], dim=1)
    take = min(budget, kept.shape[1])
    threshold = torch.sort(kept, dim=1, descending=True).values[:, take - 1 : take]
    if take < budget:
        threshold = torch.full_like(threshold, float("-inf"))
    ok = torch.ones((), dtype=torch.bool, device=lp.device)
    for d in range(1, len(levels)):
        parent = levels[d - 1]
        first_pruned = _pair_lists(parent.weight.shape[1], k, budget, True)[2]
        if min(first_pruned) >= k:  # nothing was pruned below this level
            continue
        idx = torch.tensor([min(j, k - 1) for j in first_pruned], dtype=torch.int64, device=lp.device)
        has_pruned = torch.tensor([j < k for j in first_pruned], dtype=torch.bool, device=lp.device)
        pruned_weight = parent.weight + lp[:, d - 1, :].index_select(1, idx)
        safe = ~parent.valid | ~has_pruned | (pruned_weight < threshold)
        ok = ok & safe.all()
    return ok


def _preorder(levels: list[_Level]) -> list[torch.Tensor]:
    """Preorder index of each kept slot in the trie of kept nodes (children in rank order)."""
    sizes = [lvl.valid.to(torch.int64) for lvl in levels]
    for d in range(len(levels) - 1, 0, -1):
        sizes[d - 1] = sizes[d - 1].scatter_add(1, levels[d].parent, sizes[d])
    pre = [torch.zeros_like(levels[0].lexpos)]
    for d in range(1, len(levels)):
        lvl = levels[d]
        slot_of_lex = _inverse_permutation(lvl.lexpos)  # lex order groups siblings, rank order
        size_lex = sizes[d].gather(1, slot_of_lex)
        parent_lex = lvl.parent.gather(1, slot_of_lex)
        before = torch.cumsum(size_lex, dim=1) - size_lex
        group_start = torch.full_like(pre[d - 1], torch.iinfo(torch.int64).max)
        group_start = group_start.scatter_reduce(1, parent_lex, before, reduce="amin", include_self=True)
        pre_lex = pre[d - 1].gather(1, parent_lex) + 1 + before - group_start.gather(1, parent_lex)
        pre.append(torch.empty_like(pre_lex).scatter_(1, slot_of_lex, pre_lex))
    return pre


def _assemble(
    levels: list[_Level],
    preorder: list[torch.Tensor],
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
) -> DDTreeBatch:
    """Global best ``budget`` over the kept levels, in key order, as padded [bs, N] tensors."""
    bs, depth, k = token_ids.shape
    device = token_ids.device
    n = budget + 1
    real = count_possible_nodes(depth, k, budget)
    root_token = (
        root_tokens.to(torch.int64) if root_tokens is not None else torch.full((bs,), -1, dtype=torch.int64, device=device)
    )
    out = _empty_batch(bs, n, budget, real, root_token, device)
    if budget == 0 or len(levels) == 1:
        return out
    kept = levels[1:]
    weight = torch.cat([lvl.weight for lvl in kept], dim=1)
    pre = torch.cat(preorder[1:], dim=1)
    level_of = torch.cat(
        [torch.full((lvl.weight.shape[1],), d + 1, dtype=torch.int64, device=device) for d, lvl in enumerate(kept)]
    )
    offsets = [0]
    for lvl in levels:
        offsets.append(offsets[-1] + lvl.weight.shape[1])
    offset_of = torch.tensor(offsets[:-1], dtype=torch.int64, device=device)
    parent_flat = torch.cat([lvl.parent + offsets[d] for d, lvl in enumerate(kept)], dim=1)
    rank_flat = torch.cat([lvl.rank for lvl in kept], dim=1)

    # Kept slots always cover the tree; min() only guards results the certificate rejects.
    real = min(real, weight.shape[1])
    order = _sort_by_key(weight, pre)[:, :real]  # [bs, real] indices into the kept levels
    sel_depth = level_of.take(order)
    sel_rank = rank_flat.gather(1, order)
    # Map every kept slot (flattened over all levels, root = 0) to its node index.
    node_of = torch.full((bs, offsets[-1]), -1, dtype=torch.int64, device=device)
    node_of[:, 0] = 0
    node_ids = torch.arange(1, real + 1, dtype=torch.int64, device=device).expand(bs, real)
    node_of.scatter_(1, order + offset_of[1], node_ids)
    sel_parent = node_of.gather(1, parent_flat.gather(1, order))

    flat_tok = token_ids.to(torch.int64).reshape(bs, depth * k)
    out.tokens[:, 1 : real + 1] = flat_tok.gather(1, (sel_depth - 1) * k + sel_rank)
    out.depths[:, 1 : real + 1] = sel_depth
    out.parents[:, 1 : real + 1] = sel_parent
    out.ranks[:, 1 : real + 1] = sel_rank
    out.node_logws[:, 1 : real + 1] = weight.gather(1, order)
    return out


def _empty_batch(bs: int, n: int, budget: int, real: int, root_token: torch.Tensor, device) -> DDTreeBatch:
    """All-padding batch with the root filled in."""
    neg = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    batch = DDTreeBatch(
        tokens=neg.clone(),
        depths=neg.clone(),
        parents=neg.clone(),
        ranks=neg.clone(),
        node_logws=torch.full((bs, n), float("-inf"), dtype=torch.float64, device=device),
        num_nodes=torch.full((bs,), real + 1, dtype=torch.int64, device=device),
        budget=budget,
    )
    batch.tokens[:, 0] = root_token
    batch.depths[:, 0] = 0
    batch.node_logws[:, 0] = 0.0
    return batch
