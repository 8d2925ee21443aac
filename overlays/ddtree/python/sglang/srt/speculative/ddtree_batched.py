"""Batched DDTree builder: the heap builder's trees for [bs, L, K] drafts, tensor ops.

Output contract (``DDTreeBatch``; N = budget + 1 slots per request, slot 0 = root):
  tokens      int64   [bs, N]  slot 0 = root_tokens[b] (or -1 when none given);
                               drafted nodes 1..n in heap order; padding -1
  depths      int64   [bs, N]  root 0, nodes 1..L, padding -1
  parents     int64   [bs, N]  root -1, node i -> parent slot (< i), padding -1
  ranks       int64   [bs, N]  rank of the node's token at its depth (0..K-1);
                               root and padding -1
  node_logws  float64 [bs, N]  path log-weight; root 0.0, padding -inf
  num_nodes   int64   [bs]     real slots including the root: 1 + min(budget, sum_d K^d)
All tensors live on the input's device. Padding appears only when the draft holds fewer
than ``budget`` nodes in total (sum over d of K^d < budget); real nodes fill 0..n.

Node order and tie-break: exactly ``ddtree_tree.build_ddtree_tree_from_topk`` (heap
order = increasing key (-weight, rank tuple), rank tuples compared lexicographically, a
prefix first).

Float rule (any re-implementation, e.g. the CUDA kernel, must follow it to match bit for
bit): log-probs are cast to float64; a node's weight is
``weight(parent) + lp64[d - 1, rank]`` with root weight 0.0, one IEEE round-to-nearest
float64 add per edge, formed root -> leaf (never re-associated, no FMA, no float32
accumulation). Weights compare with ``>``/``==`` on those float64 values.

Algorithm (why a tensor version can be exact): a node's key is larger than its parent's
and its previous sibling's, so the heap pops nodes in global key order and the tree is
the ``budget`` smallest keys over all nodes. Per depth d we keep the best B (= budget)
children of the nodes kept at depth d - 1, where a child's weight is
parent weight + lp[d - 1, j].

Pruning, exact without any counting argument on float sums:
  * the floor: the B-th best weight among the nodes kept so far (B distinct real
    nodes). A node strictly below it has B nodes with smaller keys, and so do its
    descendants (rounding is monotone and log-probs are <= 0, so a child never outweighs
    its parent). Candidates below the floor are dropped; parents below it get no
    children; the loop stops at the first depth where no row has a candidate left.
  * rank B and beyond: such a child has B better siblings.
On the accelerator path (fixed shapes, so the floor cannot shrink them) a third rule
keeps the candidates to about B ln B per depth instead of B * min(K, B):
  * the pair rule: with parents in key order (slot i), only pairs with
    (i + 1) * (j + 1) <= B can be among the best B in exact arithmetic. Float64
    rounding can merge two sums and break that counting argument, so each parent's
    first pair the rule cut is certified: its key must be larger than the B-th kept
    child's at that depth, or its weight below the final floor. If not, the build is
    redone without the pair rule. Exact ties never fail the certificate (keys are
    compared in full); only rounding merges can (tests build such drafts).
Selection: one topk by weight; when the best weights are all distinct that is key order.
When weights tie, the entries at or above the boundary weight are ordered by an exact
integer key (start of their run of equal weights, lexicographic key). Keys inside a
depth use the per-depth lexicographic position of the parent's rank tuple; keys across
depths use the preorder index of the kept-node trie (= lexicographic order of rank
tuples with prefixes first); both are only computed when weights tie.

Where it runs: on CPU (serving has no CUDA kernel there) it reads small values back
(free on CPU) to shrink each depth to the parents and ranks that can reach the floor, to
stop early and to skip tie work when nothing ties; one request (bs = 1) runs the heap
loop itself. On CUDA it is only the fallback for drafts the JIT kernel does not take
(``ddtree_kernel.supports``: e.g. budget > 1024); there it runs fixed shapes with the
pair rule, and its one host read per build is the certificate (a device sync;
``_host_reads``). The outputs are identical either way.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Union

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
    validate:    run the value checks of ``check_draft_values`` (five host reads, each a
                 device sync on CUDA); shapes are always checked, without a read.
                 Per-step callers that trust their draft head pass False: the build
                 then has no host read on CUDA (kernel or torch fallback); on CPU it
                 reads small values back, which costs no sync there.
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
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
) -> Optional[DDTreeBatch]:
    """Extension point for a CUDA kernel; returns None to use the torch path.

    A CUDA implementation (``ddtree_kernel.py``) plugs in here: when
    ``log_probs.is_cuda`` and its kernel is available, return a ``DDTreeBatch`` that
    equals ``_build_torch`` on every input, bit for bit (the float rule and order in the
    module docstring). Inputs arrive already shape-checked (and value-checked when the
    caller asked for it).
    """
    # --- kernel build concern (ddtree_kernel.py): CUDA inputs the kernel supports ---
    if not log_probs.is_cuda:
        return None
    from sglang.srt.speculative import ddtree_kernel

    if not ddtree_kernel.supports(log_probs, budget):
        return None
    return ddtree_kernel.build_tree_cuda(log_probs, token_ids, budget, root_tokens)
    # --- end kernel build concern ---


def count_possible_nodes(depth: int, k: int, cap: int) -> int:
    """min(cap, sum_{d=1..depth} k^d): how many draft nodes a [depth, k] draft holds."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= cap:
            return cap
    return total


@dataclass
class _Level:
    """Nodes kept at one depth, [bs, n] in key order; invalid slots (weight -inf) last.

    ``lexpos`` (lexicographic rank of the slot's rank tuple within the level; invalid
    slots keep their own slot number) and its inverse ``slot_of_lex`` are only needed to
    break weight ties, so they are computed on demand (``_ensure_lexpos``).
    """

    weight: torch.Tensor  # float64
    parent: torch.Tensor  # int64, slot in the previous level
    rank: torch.Tensor  # int64
    lexpos: Optional[torch.Tensor] = None  # int64
    slot_of_lex: Optional[torch.Tensor] = None  # int64

    @property
    def valid(self) -> torch.Tensor:
        return self.weight > float("-inf")


def _build_torch(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
) -> DDTreeBatch:
    """The tensor-op builder (the heap loop for one request on CPU)."""
    lp = log_probs.detach().to(torch.float64)
    if _host_reads(lp.device):  # CPU: the floor alone prunes, exactly
        if lp.shape[0] == 1:
            return _build_single(lp, token_ids, budget, root_tokens)
        return _select_trees(lp, token_ids, budget, root_tokens, prune=False)[0]
    result, certified = _select_trees(lp, token_ids, budget, root_tokens, prune=True)
    # The accelerator path's one host read (a sync): rarely, a float64 rounding merge
    # defeated the pair rule, and the build is redone without it.
    if not bool(certified):
        result, _ = _select_trees(lp, token_ids, budget, root_tokens, prune=False)
    return result


def _build_single(
    lp: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
) -> DDTreeBatch:
    """One request on CPU: the heap loop itself (the reference) as a DDTreeBatch.

    With nothing to batch, ~100 tensor ops of a few microseconds each cost more than the
    heap's ``budget`` pops; the heap forms the same float64 sums, so the result is the
    same.
    """
    from sglang.srt.speculative.ddtree_tree import build_ddtree_tree_from_topk

    tree = build_ddtree_tree_from_topk(lp[0], token_ids[0], budget, validate=False)
    real = tree.tokens.numel()
    root = (
        root_tokens.to(torch.int64)[:, None]
        if root_tokens is not None
        else torch.full((1, 1), -1)
    )
    return _padded_batch(
        1,
        budget,
        real,
        lp.device,
        tokens=(root, tree.tokens[None], -1),
        depths=(0, tree.depths[None], -1),
        parents=(-1, tree.parents[None, 1:], -1),
        ranks=(-1, tree.ranks[None], -1),
        node_logws=(0.0, tree.node_logws[None], float("-inf")),
    )


def _host_reads(device: torch.device) -> bool:
    """Whether the builder may read small values back to size tensors and skip work.

    On CPU a read is free, and it lets the builder shrink every depth to the parents and
    ranks that can still reach the tree, stop at the last useful depth, and skip the
    tie-breaking work when no weights tie. On an accelerator each read is a sync, so
    there the builder runs fixed shapes (same results, more work) and reads once, for
    the pair rule's certificate.
    """
    return device.type == "cpu"


def _select_trees(
    lp: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
    prune: bool,
) -> tuple[DDTreeBatch, Union[bool, torch.Tensor]]:
    """Select the budget best nodes of every request; lp is float64 [bs, L, K].

    Returns the batch and its certificate: a 0-dim bool tensor, False when the pair
    rule (only with ``prune``) may have cut a node of the tree; the Python bool True
    when it cut nothing (so there is nothing to read back).
    """
    bs, depth, k = lp.shape
    device = lp.device
    dynamic = _host_reads(device)
    levels = [_root_level(bs, device)]
    risky: list[torch.Tensor] = []  # per depth: heaviest cut pair not cleared
    if budget > 0:
        levels.append(_first_level(lp[:, 0, :], budget))
        best = levels[1].weight
        for d in range(2, depth + 1):
            lp_d = lp[:, d - 1, :]
            floor = _pool_floor(best, budget)
            sizes = _active_sizes(levels[-1], lp_d, floor, budget, dynamic)
            if sizes is None:
                break  # no row has a node left that can reach the tree
            expanded = _expand_level(levels, lp_d, floor, budget, sizes, prune, dynamic)
            if expanded is None:
                break
            level, level_risky = expanded
            levels.append(level)
            if level_risky is not None:
                risky.append(level_risky)
            best = _top_values(torch.cat([best, level.weight], dim=1), budget)
    batch = _assemble(levels, token_ids, budget, root_tokens, dynamic)
    if not risky:
        return batch, True
    # A cut pair below the final floor has ``budget`` kept nodes ahead of it: harmless.
    final_floor = _pool_floor(best, budget)
    heaviest = torch.cat(risky, dim=1).amax(1, keepdim=True)
    harmful = heaviest > float("-inf")
    if final_floor is not None:
        harmful &= heaviest >= final_floor
    return batch, ~harmful.any()


def _root_level(bs: int, device: torch.device) -> _Level:
    zeros = torch.zeros((bs, 1), dtype=torch.int64, device=device)
    return _Level(
        weight=torch.zeros((bs, 1), dtype=torch.float64, device=device),
        parent=zeros - 1,
        rank=zeros - 1,
        lexpos=zeros,
        slot_of_lex=zeros,
    )


def _first_level(lp_1: torch.Tensor, budget: int) -> _Level:
    """Depth 1: the root's children j < min(K, budget), in key order (= rank order)."""
    bs, k = lp_1.shape
    n = min(k, budget)
    ranks = torch.arange(n, dtype=torch.int64, device=lp_1.device).expand(bs, n)
    # Float rule: 0.0 (the root weight) + lp; e.g. -0.0 becomes 0.0.
    weight = lp_1[:, :n] + 0.0
    return _Level(
        weight=weight,
        parent=torch.zeros((bs, n), dtype=torch.int64, device=lp_1.device),
        rank=ranks,
        lexpos=ranks,
        slot_of_lex=ranks,
    )


def _top_values(weight: torch.Tensor, budget: int) -> torch.Tensor:
    """The min(budget, n) largest weights per row, in no particular order."""
    if weight.shape[1] <= budget:
        return weight
    return torch.topk(weight, budget, dim=1, sorted=False).values


def _pool_floor(best: torch.Tensor, budget: int) -> Optional[torch.Tensor]:
    """[bs, 1] floor: the budget-th best weight kept so far (None while fewer are kept).

    ``best`` holds the best min(budget, kept) weights per row, unordered.

    Exact pruning without any counting argument: ``budget`` kept nodes weigh at least
    the floor, so a node strictly below it has ``budget`` nodes with smaller keys and is
    not in the tree; nor are its descendants (a child never outweighs its parent in
    float64 either: rounding is monotone and log-probs are <= 0).
    """
    if best.shape[1] < budget:
        return None
    return best.amin(1, keepdim=True)


def _active_sizes(
    prev: _Level,
    lp_d: torch.Tensor,
    floor: Optional[torch.Tensor],
    budget: int,
    dynamic: bool,
):
    """(parents, ranks) to score at this depth, or None when nothing can reach the tree.

    Parents at or above the floor are a prefix of the key order; the best parent's
    children at or above the floor bound every parent's (a sum is monotone in each
    operand). Without host reads (or without a floor yet) the full sizes are used; the
    floor mask makes the results identical. Invalid (-inf) parents only count while
    there is no floor.
    """
    ranks = min(lp_d.shape[1], budget)
    if not dynamic or floor is None:
        return prev.weight.shape[1], ranks
    alive = (prev.weight >= floor).sum(1)
    child_alive = ((prev.weight[:, :1] + lp_d[:, :ranks]) >= floor).sum(1)
    parents, ranks = torch.stack([alive, child_alive]).amax(1).tolist()
    return (parents, ranks) if parents > 0 and ranks > 0 else None


@dataclass(frozen=True)
class _Pairs:
    """Candidate (parent slot, rank) pairs of one depth, flattened, as device tensors.

    With the pair rule, ``first_cut`` (int64 [P], min(width, ranks - 1)) is each parent
    slot's first rank not scored and ``has_cut`` (bool [P]) whether the rule cut it;
    both None when it cut nothing.
    """

    slots: torch.Tensor  # int64 [C]
    ranks: torch.Tensor  # int64 [C]
    first_cut: Optional[torch.Tensor] = None
    has_cut: Optional[torch.Tensor] = None


def _candidate_pairs(
    num_parents: int, num_ranks: int, budget: int, prune: bool, device
) -> _Pairs:
    """(parent slot i, rank j < num_ranks) pairs to score: (i+1)*(j+1) <= budget with
    the pair rule, else all. Cached per device, keyed on ``_pair_lists`` itself so that
    a replaced pair rule takes effect.

    Only ranks cut by the pair rule need the certificate: rank ``num_ranks`` is exactly
    out (it is ``budget``, with ``budget`` better siblings, or it is below the floor for
    every parent, see ``_active_sizes``).
    """
    if not prune:
        return _all_pairs(num_parents, num_ranks, device)
    return _pair_tensors(_pair_lists, num_parents, num_ranks, budget, prune, device)


@functools.lru_cache(maxsize=1024)
def _all_pairs(num_parents: int, num_ranks: int, device) -> _Pairs:
    """Every pair (parent slot i < num_parents, rank j < num_ranks), parent-major."""
    slots = torch.arange(num_parents, device=device).repeat_interleave(num_ranks)
    ranks = torch.arange(num_ranks, device=device).repeat(num_parents)
    return _Pairs(slots=slots, ranks=ranks)


@functools.lru_cache(maxsize=1024)
def _pair_tensors(
    pair_lists, num_parents: int, num_ranks: int, budget: int, prune: bool, device
) -> _Pairs:
    slots, ranks, widths = pair_lists(num_parents, num_ranks, budget, prune)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    pairs = _Pairs(slots=as_tensor(slots), ranks=as_tensor(ranks))
    if min(widths) >= num_ranks:
        return pairs
    width = as_tensor(widths)
    first_cut = width.clamp(max=num_ranks - 1)
    return dataclasses.replace(pairs, first_cut=first_cut, has_cut=width < num_ranks)


@functools.lru_cache(maxsize=256)
def _pair_lists(num_parents: int, num_ranks: int, budget: int, prune: bool):
    """(slots, ranks, widths) as tuples: parent i scores ranks 0..width_i - 1."""
    slots, ranks, widths = [], [], []
    for i in range(num_parents):
        width = min(num_ranks, budget // (i + 1)) if prune else num_ranks
        slots.extend([i] * width)
        ranks.extend(range(width))
        widths.append(width)
    return tuple(slots), tuple(ranks), tuple(widths)


def _expand_level(
    levels: list[_Level],
    lp_d: torch.Tensor,
    floor: Optional[torch.Tensor],
    budget: int,
    sizes: tuple[int, int],
    prune: bool,
    dynamic: bool,
) -> Optional[tuple[_Level, Optional[torch.Tensor]]]:
    """Best ``budget`` children (by key) at the next depth, and the heaviest pair the
    pair rule cut there that the certificate has not cleared (None: it cut nothing).

    lp_d: float64 [bs, K]; sizes: (parent slots, ranks) to score (``_active_sizes``).
    Children below the floor are masked to -inf (invalid). None when no candidate can
    reach the floor (with host reads only).
    """
    prev = levels[-1]
    bs, k = lp_d.shape
    num_parents, num_ranks = sizes
    num_scores = num_parents * num_ranks * bs
    narrow = dynamic and not prune and floor is not None
    if narrow and num_scores >= _NARROW_MIN_SCORES:
        scored = prev.weight[:, :num_parents], lp_d[:, :num_ranks]
        pairs = _pairs_above_floor(*scored, floor)
        if pairs is None:
            return None
    else:
        pairs = _candidate_pairs(num_parents, num_ranks, budget, prune, lp_d.device)
    parent_weight = prev.weight.index_select(1, pairs.slots)
    child_lp = lp_d.index_select(1, pairs.ranks)
    weight = parent_weight + child_lp  # float rule: one float64 add per edge
    if floor is not None:
        weight.masked_fill_(weight < floor, float("-inf"))
    keep = min(budget, weight.shape[1])

    def lexkey(idx: torch.Tensor) -> torch.Tensor:
        """Lexicographic key of candidates' rank tuples: lexpos(parent) * K + rank."""
        parent_lexpos = _ensure_lexpos(levels, len(levels) - 1)
        parent_slots, ranks = pairs.slots.take(idx), pairs.ranks.take(idx)
        return parent_lexpos.gather(1, parent_slots) * k + ranks

    lex_range = prev.weight.shape[1] * k
    order, values = _select_by_key(weight, lexkey, keep, lex_range, dynamic)
    parent = pairs.slots.take(order)
    level = _Level(weight=values, parent=parent, rank=pairs.ranks.take(order))
    if pairs.first_cut is None:  # the pair rule cut nothing
        return level, None
    return level, _risky_cut(levels, level, lp_d, pairs, budget)


# Narrowing the pairs to the floor costs ~10 small ops; it pays off from about this
# many scores (parents x ranks x bs).
_NARROW_MIN_SCORES = 16384


def _pairs_above_floor(
    parent_weight: torch.Tensor, lp_d: torch.Tensor, floor: torch.Tensor
) -> Optional[_Pairs]:
    """Per parent slot, the rank prefix whose child can reach the floor in some row.

    parent_weight float64 [bs, P], lp_d float64 [bs, R], floor [bs, 1]; None if no pair
    can. Host reads; an over-count is harmless (the floor mask follows), an under-count
    is not, hence the margin: fl(w + lp) >= floor implies
    lp >= floor - w - 2^-52 * |floor|, far inside 1e-12 * (|floor| + |w|).
    """
    bs = parent_weight.shape[0]
    slack = (floor.abs() + parent_weight.abs()) * 1e-12
    bound = parent_weight - floor + slack
    bound.masked_fill_(parent_weight == float("-inf"), float("-inf"))
    neg_lp = torch.neg(lp_d).contiguous()
    reach = torch.searchsorted(neg_lp, bound.contiguous(), side="right")
    widths = reach.amax(0) if bs > 1 else reach[0]
    width_list = widths.tolist()
    total = sum(width_list)
    if total == 0:
        return None
    parent_ids = torch.arange(len(width_list), device=widths.device)
    slots = torch.repeat_interleave(parent_ids, widths, output_size=total)
    starts = torch.cumsum(widths, 0) - widths
    ranks = torch.arange(total, device=widths.device) - starts.index_select(0, slots)
    return _Pairs(slots=slots, ranks=ranks)


_KEY_LIMIT = 2**62  # exclusive bound of the integer tie-break keys (int64)


def _select_by_key(
    weight: torch.Tensor, lexkey, keep: int, lex_range: int, dynamic: bool
):
    """(indices, weights) of the ``keep`` smallest keys (-weight, lexkey) per row.

    ``lexkey(idx)`` returns the int64 lexicographic keys (< lex_range, unique among
    valid entries) of the entries ``idx`` [bs, m]; it is only called when weights tie.
    One topk finds the ``keep + 1`` best weights; if they are all distinct (so the
    boundary is strict too), weight order is key order. Otherwise every entry at or
    above the keep-th weight is taken in weight order, and a second topk orders them on
    an exact integer key: (start of the entry's run of equal weights, lexkey).
    """
    num = weight.shape[1]
    # A few spare entries, so that ties at the boundary rarely need a second topk.
    top = torch.topk(weight, min(keep + 1 + keep // 8, num), dim=1)
    # Equal finite neighbours differ by exactly 0; -inf neighbours (invalid) give nan.
    if dynamic and not bool((torch.diff(top.values[:, : keep + 1], dim=1) == 0).any()):
        return top.indices[:, :keep], top.values[:, :keep]
    last = top.values[:, keep - 1 : keep]
    # Entries at or above the keep-th weight.
    tied = int((weight >= last).sum(1).max()) if dynamic else num
    if tied > top.values.shape[1]:
        top = torch.topk(weight, tied, dim=1)
    values, idx = top.values[:, :tied], top.indices[:, :tied]
    if (tied + 1) * lex_range >= _KEY_LIMIT:
        # The integer key would overflow: two stable sorts instead.
        order = _sort_by_key(values, lexkey(idx))[:, :keep]
        return idx.gather(1, order), values.gather(1, order)
    ids = torch.arange(tied, device=weight.device).expand_as(idx)
    new_run = torch.ones_like(idx, dtype=torch.bool)
    new_run[:, 1:] = values[:, 1:] != values[:, :-1]
    run_start = torch.cummax(torch.where(new_run, ids, 0), dim=1).values
    key = torch.where(
        values >= last,
        run_start * lex_range + lexkey(idx),
        torch.iinfo(torch.int64).max,
    )
    order = torch.topk(key, keep, dim=1, largest=False).indices
    return idx.gather(1, order), values.gather(1, order)


def _sort_by_key(weight: torch.Tensor, lexkey: torch.Tensor) -> torch.Tensor:
    """Permutation [bs, C] ordering by (weight desc, lexkey asc): two stable sorts."""
    by_lex = torch.sort(lexkey, dim=1, stable=True).indices
    by_weight = torch.sort(
        weight.gather(1, by_lex), dim=1, descending=True, stable=True
    ).indices
    return by_lex.gather(1, by_weight)


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv [bs, M] with inv[b, perm[b, i]] = i (perm permutes 0..M-1 in each row)."""
    ids = torch.arange(perm.shape[1], device=perm.device).expand_as(perm)
    return torch.empty_like(perm).scatter_(1, perm, ids)


def _ensure_lexpos(levels: list[_Level], d: int) -> torch.Tensor:
    """levels[d].lexpos, computed (with those above it) on first use.

    A parent's kept children are a rank prefix (siblings are in key order by rank), so a
    child's lexicographic position is the number of kept children of the parents before
    its own in lex order, plus its rank. Invalid slots (the tail) keep their slot
    number.
    """
    lvl = levels[d]
    if lvl.lexpos is not None:
        return lvl.lexpos
    prev_lexpos = _ensure_lexpos(levels, d - 1)
    prev = levels[d - 1]
    valid = lvl.valid
    count = torch.zeros_like(prev.weight, dtype=torch.int64).scatter_add_(
        1, lvl.parent, valid.to(torch.int64)
    )
    count_lex = count.gather(1, prev.slot_of_lex)
    start = (torch.cumsum(count_lex, dim=1) - count_lex).gather(1, prev_lexpos)
    slot_ids = torch.arange(lvl.weight.shape[1], device=lvl.weight.device).expand_as(
        lvl.parent
    )
    lvl.lexpos = torch.where(valid, start.gather(1, lvl.parent) + lvl.rank, slot_ids)
    lvl.slot_of_lex = _inverse_permutation(lvl.lexpos)
    return lvl.lexpos


def _risky_cut(
    levels: list[_Level],
    level: _Level,
    lp_d: torch.Tensor,
    pairs: _Pairs,
    budget: int,
) -> torch.Tensor:
    """[bs, 1] heaviest pair the pair rule cut at this depth that might belong to its
    best children.

    Parent slot i's first cut rank is its pair width; later ranks and their descendants
    have larger keys. The pair is harmless when its key (-weight, lexkey) is larger
    than the budget-th kept child's (impossible to show if fewer were kept); the caller
    also clears any pair below the final floor (which is >= the budget-th kept child's
    weight). In exact arithmetic the pair rule never fails; float64 rounding can merge
    two sums and make it fail. No host reads.
    """
    prev = levels[-1]  # the new level is not appended yet
    k = lp_d.shape[1]
    num_parents = pairs.first_cut.shape[0]
    cut_lp = lp_d.index_select(1, pairs.first_cut)
    weight = prev.weight[:, :num_parents] + cut_lp  # float rule
    weight = weight.masked_fill(~pairs.has_cut, float("-inf"))
    if level.weight.shape[1] < budget:
        return weight.amax(1, keepdim=True)
    last = level.weight[:, budget - 1 : budget]
    # Pairs tied with the budget-th kept child are harmless when their lexkey is larger.
    lexpos = _ensure_lexpos(levels, len(levels) - 1)
    cut_lex = lexpos[:, :num_parents] * k + pairs.first_cut
    last_parent_lex = lexpos.gather(1, level.parent[:, budget - 1 :])
    last_lex = last_parent_lex * k + level.rank[:, budget - 1 :]
    cleared = (weight == last) & (cut_lex > last_lex)
    return weight.masked_fill(cleared, float("-inf")).amax(1, keepdim=True)


def _preorder(levels: list[_Level]) -> list[torch.Tensor]:
    """Preorder index of each kept slot in the trie of kept nodes (children by rank)."""
    for d in range(len(levels)):
        _ensure_lexpos(levels, d)
    sizes = [lvl.valid.to(torch.int64) for lvl in levels]
    for d in range(len(levels) - 1, 0, -1):
        sizes[d - 1] = sizes[d - 1].scatter_add(1, levels[d].parent, sizes[d])
    pre = [torch.zeros_like(levels[0].lexpos)]
    for d in range(1, len(levels)):
        lvl = levels[d]
        slot_of_lex = lvl.slot_of_lex  # lex order groups siblings, rank order
        size_lex = sizes[d].gather(1, slot_of_lex)
        parent_lex = lvl.parent.gather(1, slot_of_lex)
        before = torch.cumsum(size_lex, dim=1) - size_lex
        group_start = torch.full_like(pre[d - 1], torch.iinfo(torch.int64).max)
        group_start = group_start.scatter_reduce(
            1, parent_lex, before, reduce="amin", include_self=True
        )
        pre_lex = (
            pre[d - 1].gather(1, parent_lex)
            + 1
            + before
            - group_start.gather(1, parent_lex)
        )
        pre.append(torch.empty_like(pre_lex).scatter_(1, slot_of_lex, pre_lex))
    return pre


def _assemble(
    levels: list[_Level],
    token_ids: torch.Tensor,
    budget: int,
    root_tokens: Optional[torch.Tensor],
    dynamic: bool,
) -> DDTreeBatch:
    """Global best ``budget`` over the kept levels, in key order, padded to [bs, N].

    Across depths the lexicographic key is the preorder index in the trie of kept nodes;
    it is only computed when weights tie (see ``_select_by_key``).
    """
    bs, depth, k = token_ids.shape
    device = token_ids.device
    real = count_possible_nodes(depth, k, budget)
    root_token = (
        root_tokens.to(torch.int64)
        if root_tokens is not None
        else torch.full((bs,), -1, dtype=torch.int64, device=device)
    )
    if budget == 0 or len(levels) == 1:
        return _empty_batch(bs, budget + 1, budget, real, root_token, device)
    kept = levels[1:]
    sizes = tuple(lvl.weight.shape[1] for lvl in kept)
    weight = torch.cat([lvl.weight for lvl in kept], dim=1)
    # Kept slots always cover the tree (every tree node is kept at its depth) unless
    # the pair rule failed; min() guards the results the certificate rejects.
    real = min(real, weight.shape[1])

    def preorder(idx: torch.Tensor) -> torch.Tensor:
        return torch.cat(_preorder(levels)[1:], dim=1).gather(1, idx)

    order, sel_weight = _select_by_key(weight, preorder, real, 1 + sum(sizes), dynamic)
    level_of, offset_of = _level_tables(sizes, device)
    # Parents as indices into the concatenated kept levels; the root (parent of depth 1)
    # becomes -1.
    parent_flat = torch.cat(
        [kept[0].parent - 1]
        + [lvl.parent + offset_of[d] for d, lvl in enumerate(kept[1:])],
        dim=1,
    )
    rank_flat = torch.cat([lvl.rank for lvl in kept], dim=1)
    sel_depth = level_of.take(order)
    sel_rank = rank_flat.gather(1, order)
    # Node index of every kept slot (0 = not selected); the root is node 0 as well.
    node_of = torch.zeros((bs, weight.shape[1] + 1), dtype=torch.int64, device=device)
    node_of.scatter_(
        1,
        order + 1,
        torch.arange(1, real + 1, dtype=torch.int64, device=device).expand(bs, real),
    )
    sel_parent = node_of.gather(1, parent_flat.gather(1, order) + 1)
    sel_token = (
        token_ids.reshape(bs, depth * k)
        .gather(1, (sel_depth - 1) * k + sel_rank)
        .to(torch.int64)
    )

    return _padded_batch(
        bs,
        budget,
        real,
        device,
        tokens=(root_token[:, None], sel_token, -1),
        depths=(0, sel_depth, -1),
        parents=(-1, sel_parent, -1),
        ranks=(-1, sel_rank, -1),
        node_logws=(0.0, sel_weight, float("-inf")),
    )


@functools.lru_cache(maxsize=256)
def _level_tables(sizes: tuple[int, ...], device) -> tuple[torch.Tensor, list[int]]:
    """Depth of each slot of the concatenated kept levels; each level's first slot."""
    level_of = torch.cat(
        [torch.full((n,), d + 1, dtype=torch.int64) for d, n in enumerate(sizes)]
    ).to(device)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return level_of, offsets


def _padded_batch(bs: int, budget: int, real: int, device, **columns) -> DDTreeBatch:
    """DDTreeBatch from (root value, [bs, real] nodes, padding value) per field."""
    out = {}
    for name, (root, nodes, pad) in columns.items():
        parts = [
            (
                root
                if torch.is_tensor(root)
                else torch.full((bs, 1), root, dtype=nodes.dtype, device=device)
            ),
            nodes,
        ]
        if real < budget:
            parts.append(
                torch.full((bs, budget - real), pad, dtype=nodes.dtype, device=device)
            )
        out[name] = torch.cat(parts, dim=1)
    num_nodes = torch.full((bs,), real + 1, dtype=torch.int64, device=device)
    return DDTreeBatch(num_nodes=num_nodes, budget=budget, **out)


def _empty_batch(
    bs: int, n: int, budget: int, real: int, root_token: torch.Tensor, device
) -> DDTreeBatch:
    """All-padding batch with the root filled in."""
    neg = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    batch = DDTreeBatch(
        tokens=neg.clone(),
        depths=neg.clone(),
        parents=neg.clone(),
        ranks=neg.clone(),
        node_logws=torch.full(
            (bs, n), float("-inf"), dtype=torch.float64, device=device
        ),
        num_nodes=torch.full((bs,), real + 1, dtype=torch.int64, device=device),
        budget=budget,
    )
    batch.tokens[:, 0] = root_token
    batch.depths[:, 0] = 0
    batch.node_logws[:, 0] = 0.0
    return batch
