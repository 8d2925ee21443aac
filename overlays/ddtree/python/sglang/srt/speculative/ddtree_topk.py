"""Top-K draft log-probs across tensor-parallel vocabulary shards, as pure functions.

With the LM head split over TP ranks, rank r holds logits for global ids
[vocab_start_r, vocab_start_r + real_rows_r) plus, possibly, padding rows at the end of
its slice (vocabulary padded to a multiple). DDTree needs per depth the global top-K
tokens and their log-probs normalised over the whole real vocabulary. Each rank reduces
its slice to a triple that is cheap to all-gather:
  top_logits  float32 [T, k]  the shard's k best logits, descending
  top_ids     int64   [T, k]  their GLOBAL token ids (vocab_start + local row)
  lse         float32 [T]     logsumexp over the shard's real rows (padding excluded)
(T = rows, e.g. bs * L draft positions). When a shard has fewer than k real rows, the
missing entries are logit -inf with id -1 and never win.

Merge: global lse = logsumexp of the shard lses; the k best (logit, id) pairs over all
shards ordered by logit descending, ties to the lower global id; log-prob = logit -
global lse. Ties are decided on the raw float32 logits, so the result equals the top-K
of the concatenated full-vocabulary logits (same ids, same order; log-probs up to
float32 rounding of the lse).
"""

from __future__ import annotations

from typing import Sequence

import torch


def _sort_desc_lower_id_first(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation [T, C] by (value desc, id asc); ids -1 (missing) go last."""
    id_key = torch.where(ids < 0, torch.iinfo(torch.int64).max, ids)
    by_id = torch.sort(id_key, dim=1, stable=True).indices
    by_value = torch.sort(
        values.gather(1, by_id), dim=1, descending=True, stable=True
    ).indices
    return by_id.gather(1, by_value)


def topk_lower_id_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices int64 [T, k] of the k largest values per row of values float [T, V],
    by (value desc, index asc): what a stable descending sort's first k columns are.

    torch.topk picks the k-th value; of the entries equal to it only the lowest
    indices that complete k are kept (a cumulative count), then the k winners
    are ordered. O(V) elementwise work instead of a full-row sort.
    """
    if k == 0:
        return torch.empty(
            (values.shape[0], 0), dtype=torch.int64, device=values.device
        )
    kth = torch.topk(values, k, dim=1).values[:, -1:]
    above = values > kth
    at = values == kth
    need = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
    keep = above | (at & (at.cumsum(dim=1, dtype=torch.int32) <= need))
    index = torch.topk(keep.to(torch.uint8), k, dim=1).indices  # exactly k kept
    return index.gather(1, _sort_desc_lower_id_first(values.gather(1, index), index))


def ddtree_shard_topk(
    shard_logits: torch.Tensor, k: int, vocab_start: int, real_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shard's triple: top_logits float32 [T, k], global ids int64 [T, k], lse [T].

    shard_logits: float [T, V_shard] (V_shard >= real_rows; rows past real_rows are
    padding). Ties inside the shard go to the lower id (``topk_lower_id_first``), so
    the merge is deterministic.
    """
    if shard_logits.dim() != 2:
        raise ValueError(
            "expected shard_logits of shape [T, V_shard], "
            f"got {tuple(shard_logits.shape)}"
        )
    if not 0 <= real_rows <= shard_logits.shape[1]:
        raise ValueError(
            f"expected 0 <= real_rows <= V_shard = {shard_logits.shape[1]}, "
            f"got {real_rows}"
        )
    if k < 1:
        raise ValueError(f"expected k >= 1, got {k}")
    rows = shard_logits.shape[0]
    real = shard_logits[:, :real_rows].to(torch.float32)
    lse = (
        torch.logsumexp(real, dim=1)
        if real_rows > 0
        else torch.full((rows,), float("-inf"), device=real.device)
    )
    order = topk_lower_id_first(real, min(k, real_rows))
    top = real.gather(1, order)
    ids = order.to(torch.int64) + vocab_start
    if top.shape[1] < k:  # a shard with fewer than k real rows
        pad = k - top.shape[1]
        top = torch.cat([top, top.new_full((rows, pad), float("-inf"))], dim=1)
        ids = torch.cat([ids, ids.new_full((rows, pad), -1)], dim=1)
    return top, ids, lse


def merge_ddtree_topk(
    top_logits: Sequence[torch.Tensor],
    top_ids: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    k: int,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge R shard triples into (log_probs float32 [T, k], token_ids int64 [T, k]).

    top_logits[r]: float [T, k_r]; top_ids[r]: int64 [T, k_r] global ids (-1 = missing);
    lses[r]: float [T]. Shapes are always checked (no device read). validate=True also
    raises ValueError when a row has fewer than k real candidates, which reads a flag
    back to the host (a device sync on CUDA); a per-step caller whose shards hold at
    least k real rows in total passes validate=False, and the merge then has no host
    read (a missing candidate would come back as id -1 with log-prob -inf).
    """
    if not (len(top_logits) == len(top_ids) == len(lses)) or len(lses) == 0:
        raise ValueError(
            "expected one (top_logits [T, k], top_ids [T, k], lse [T]) triple per shard"
        )
    rows = lses[0].shape[0]
    for r, (vals, ids, lse) in enumerate(zip(top_logits, top_ids, lses)):
        if (
            vals.dim() != 2
            or vals.shape[0] != rows
            or ids.shape != vals.shape
            or lse.shape != (rows,)
        ):
            raise ValueError(
                f"expected shard {r}: top_logits and top_ids [{rows}, k_r], "
                f"lse [{rows}], got {tuple(vals.shape)}, {tuple(ids.shape)}, "
                f"{tuple(lse.shape)}"
            )
    values = torch.cat([v.to(torch.float32) for v in top_logits], dim=1)
    ids = torch.cat([i.to(torch.int64) for i in top_ids], dim=1)
    if values.shape[1] < k:
        raise ValueError(
            f"expected at least k = {k} candidates over all shards, "
            f"got {values.shape[1]}"
        )
    lse = torch.logsumexp(
        torch.stack([l.to(torch.float32) for l in lses], dim=0), dim=0
    )
    order = _sort_desc_lower_id_first(values, ids)[:, :k]
    best_ids = ids.gather(1, order)
    if validate and bool((best_ids < 0).any()):
        raise ValueError(
            f"expected at least k = {k} real vocabulary rows over all shards"
        )
    return values.gather(1, order) - lse[:, None], best_ids
