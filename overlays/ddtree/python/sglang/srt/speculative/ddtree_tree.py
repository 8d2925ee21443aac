"""DDTree best-first heap builder for one request: the reference semantics.

DDTree (Ringel & Romano, 2026) turns one block-diffusion draft pass into a draft tree.
The draft gives, per depth d = 1..L, the top-K log-probs (sorted descending, normalised
over the whole vocabulary) and their token ids. A node is a path of ranks (j_1, ...,
j_d); its token is token_ids[d-1, j_d] and its weight the sum of log_probs[k-1, j_k]
along the path.

Heap order (the contract every other builder, CPU or CUDA, reproduces):
  * node 0 is the root (the previous bonus token, weight 0.0);
  * the heap starts with (depth 1, rank 0); each pop becomes node n + 1 and pushes at
    most its next sibling (same parent, rank + 1, if rank + 1 < K) and its first child
    (depth + 1, rank 0, if depth < L);
  * the heap key is (-weight, rank tuple): ties in weight break on the rank tuple,
    lexicographically, a prefix sorting first;
  * it stops after ``budget`` pops or when the heap is empty.

Float rule: log-probs are cast to float64 and a child's weight is formed as
``weight(parent) + float64(log_probs[d - 1, rank])`` (root weight 0.0, one IEEE add per
edge, root -> leaf). ``ddtree_batched`` and the CUDA kernel form the very same sums, so
all builders agree on near-ties bit for bit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from sglang.srt.speculative.ddtree_checks import (
    check_budget,
    check_draft_shapes,
    check_draft_values,
)


@dataclass
class DDTreeBuildResult:
    """One request's draft tree, in heap order. n = number of drafted nodes (<= budget).

    tokens:     int64 [n]    token of nodes 1..n (the root's token is not stored here)
    depths:     int64 [n]    depth of nodes 1..n (1-based; the root has depth 0)
    parents:    int64 [n+1]  parent node index; parents[0] = -1 (root)
    child_maps: list of n+1 dicts, child_maps[i][token] = child node index of node i
    node_logws: float64 [n]  path log-weight of nodes 1..n (the root's is 0.0)
    ranks:      int64 [n]    rank of each node's token among the K at its depth
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    child_maps: list[dict[int, int]]
    node_logws: torch.Tensor
    ranks: torch.Tensor

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return int(self.parents.numel())


def build_ddtree_tree_from_topk(
    log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int, validate: bool = True
) -> DDTreeBuildResult:
    """Best-first DDTree over a factorised top-K draft.

    log_probs: float [L, K], sorted descending per depth, finite, <= 0.
    token_ids: int32/int64 [L, K], distinct within each depth row.
    budget:    draft nodes to select, root excluded (0 -> root only).
    """
    check_budget(budget)
    check_draft_shapes(log_probs, token_ids, batched=False)
    if validate:
        check_draft_values(log_probs, token_ids)
    lp = log_probs.detach().to(device="cpu", dtype=torch.float64).tolist()
    ids = token_ids.detach().to(device="cpu", dtype=torch.int64).tolist()
    return _pop_nodes(lp, ids, budget)


def _pop_nodes(
    lp: list[list[float]], ids: list[list[int]], budget: int
) -> DDTreeBuildResult:
    """The heap loop itself; weights are Python floats (IEEE float64), root -> leaf."""
    depth_limit, k = len(lp), len(lp[0])
    weights, parents, depths, ranks, tokens = [0.0], [-1], [0], [-1], []
    child_maps: list[dict[int, int]] = [{}]
    # Entry: (-weight, rank tuple, parent node, weight); rank tuples make keys unique.
    heap = [(-(0.0 + lp[0][0]), (0,), 0, 0.0 + lp[0][0])] if budget > 0 else []
    while heap and len(tokens) < budget:
        _, path, parent, weight = heapq.heappop(heap)
        node, depth, rank = len(weights), len(path), path[-1]
        token = ids[depth - 1][rank]
        weights.append(weight)
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        tokens.append(token)
        child_maps.append({})
        child_maps[parent][token] = node
        if rank + 1 < k:
            sib = weights[parent] + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib, path[:-1] + (rank + 1,), parent, sib))
        if depth < depth_limit:
            child = weight + lp[depth][0]
            heapq.heappush(heap, (-child, path + (0,), node, child))
    return DDTreeBuildResult(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        depths=torch.tensor(depths[1:], dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        child_maps=child_maps,
        node_logws=torch.tensor(weights[1:], dtype=torch.float64),
        ranks=torch.tensor(ranks[1:], dtype=torch.int64),
    )
