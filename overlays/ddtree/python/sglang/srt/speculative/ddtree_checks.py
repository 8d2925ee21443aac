"""Input checks for the DDTree draft-tree modules.

Every check raises ``ValueError`` naming the shape or dtype it expected, so a caller
that feeds the wrong tensor learns what to pass instead. The checks on tensor *values*
(finiteness, sort order, duplicates) read the data back to the host: builders take a
``validate`` flag so a hot path that already trusts its draft head can skip them.

Per-step use: every ``validate`` flag defaults to True (a caller that has not thought
about it gets the checks) and each value check is one host read, a device sync on CUDA.
A worker calling ``build_ddtree_batched``, ``compile_ddtree_retrieve``,
``ddtree_full_mask`` (with ``seq_lens_sum`` given) or ``merge_ddtree_topk`` per decode
step passes ``validate=False``; the shape and dtype checks stay and read nothing. The
verify functions (``ddtree_verify``) only check shapes and never read back on CUDA.

Why each value check exists:
  * log-probs must be finite and <= 0: a path weight is a sum of log-probs, and the
    batched builder relies on a child never outweighing its parent.
  * log-probs sorted descending per depth: rank j is the j-th best token at that depth,
    the order the heap pushes siblings in.
  * token ids distinct within a depth row: the K ids of depth d are the children of
    every parent at depth d - 1; a duplicate makes two siblings carry the same token,
    which the sampling verify double-counts (no longer lossless) and greedy verify
    cannot tell apart.
"""

from __future__ import annotations

from typing import Sequence

import torch

_INT_DTYPES = (torch.int32, torch.int64)


def check_budget(budget: int) -> None:
    """``budget``: number of draft nodes, root excluded; a non-negative Python int."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(
            f"expected budget to be a Python int >= 0, got {type(budget).__name__}"
        )
    if budget < 0:
        raise ValueError(
            f"expected budget >= 0 (draft nodes, root excluded), got {budget}"
        )


def check_draft_shapes(
    log_probs: torch.Tensor, token_ids: torch.Tensor, batched: bool
) -> None:
    """log_probs float [L, K] (or [bs, L, K]); token_ids int32/int64, the same shape."""
    want = "[bs, L, K]" if batched else "[L, K]"
    ndim = 3 if batched else 2
    if not isinstance(log_probs, torch.Tensor) or not isinstance(
        token_ids, torch.Tensor
    ):
        raise ValueError(
            f"expected log_probs and token_ids to be tensors of shape {want}"
        )
    if log_probs.dim() != ndim:
        raise ValueError(
            f"expected log_probs of shape {want}, got {tuple(log_probs.shape)}"
        )
    if not log_probs.is_floating_point():
        raise ValueError(
            f"expected log_probs {want} of a float dtype, got {log_probs.dtype}"
        )
    if token_ids.shape != log_probs.shape:
        raise ValueError(
            f"expected token_ids of shape {tuple(log_probs.shape)} "
            f"(same as log_probs {want}), got {tuple(token_ids.shape)}"
        )
    if token_ids.dtype not in _INT_DTYPES:
        raise ValueError(
            f"expected token_ids {want} of dtype int64 or int32, got {token_ids.dtype}"
        )
    if log_probs.shape[-2] < 1 or log_probs.shape[-1] < 1:
        raise ValueError(
            f"expected log_probs {want} with L >= 1 and K >= 1, "
            f"got {tuple(log_probs.shape)}"
        )
    if log_probs.device != token_ids.device:
        raise ValueError(
            "expected log_probs and token_ids on one device, "
            f"got {log_probs.device} and {token_ids.device}"
        )


def check_draft_values(log_probs: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Values of a draft [..., L, K]: finite, <= 0, sorted descending along K, distinct
    ids. Each check is one host read (a device sync on CUDA)."""
    if not bool(torch.isfinite(log_probs).all()):
        raise ValueError("expected finite log_probs [..., L, K]; found NaN or +-inf")
    if bool((log_probs > 0).any()):
        raise ValueError(
            "expected log_probs [..., L, K] <= 0 (log-probabilities); "
            "found a positive value"
        )
    if log_probs.shape[-1] > 1 and bool(
        (log_probs[..., 1:] > log_probs[..., :-1]).any()
    ):
        raise ValueError(
            "expected log_probs [..., L, K] sorted descending along K (rank 0 = best)"
        )
    if token_ids.shape[-1] > 1:
        ids = torch.sort(token_ids, dim=-1).values
        if bool((ids[..., 1:] == ids[..., :-1]).any()):
            raise ValueError(
                "expected distinct token_ids within each depth row [..., d, :] "
                "(they are siblings; duplicates break lossless verification)"
            )
    if bool((token_ids < 0).any()):
        raise ValueError("expected token_ids [..., L, K] >= 0")


def check_root_tokens(root_tokens: torch.Tensor, bs: int) -> None:
    """root_tokens: int32/int64 [bs], the previous bonus token of each request."""
    if not isinstance(root_tokens, torch.Tensor) or root_tokens.shape != (bs,):
        got = (
            tuple(root_tokens.shape)
            if isinstance(root_tokens, torch.Tensor)
            else type(root_tokens).__name__
        )
        raise ValueError(
            f"expected root_tokens of shape [{bs}] (one per request), got {got}"
        )
    if root_tokens.dtype not in _INT_DTYPES:
        raise ValueError(
            f"expected root_tokens [{bs}] of dtype int64 or int32, "
            f"got {root_tokens.dtype}"
        )


def check_tree_tensors(
    parents: torch.Tensor, others: Sequence[tuple[str, torch.Tensor]] = ()
) -> None:
    """parents int64 [bs, N] (N >= 1, node 0 = root); named companions of its shape."""
    if (
        not isinstance(parents, torch.Tensor)
        or parents.dim() != 2
        or parents.shape[1] < 1
    ):
        got = (
            tuple(parents.shape)
            if isinstance(parents, torch.Tensor)
            else type(parents).__name__
        )
        raise ValueError(f"expected parents of shape [bs, N] with N >= 1, got {got}")
    if parents.dtype not in _INT_DTYPES:
        raise ValueError(
            f"expected parents [bs, N] of dtype int64 or int32, got {parents.dtype}"
        )
    for name, tensor in others:
        if not isinstance(tensor, torch.Tensor) or tensor.shape != parents.shape:
            got = (
                tuple(tensor.shape)
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            raise ValueError(
                f"expected {name} of shape {tuple(parents.shape)} "
                f"(same as parents [bs, N]), got {got}"
            )


def check_parents_values(parents: torch.Tensor) -> None:
    """Node 0 is the root (-1), a real node's parent has a smaller index, padding is -1.

    Two host reads (device syncs on CUDA).
    """
    n = parents.shape[1]
    if bool((parents[:, 0] != -1).any()):
        raise ValueError(
            "expected parents[:, 0] == -1 (node 0 is the root) in parents [bs, N]"
        )
    idx = torch.arange(n, device=parents.device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        raise ValueError(
            "expected -1 <= parents[b, i] < i in parents [bs, N] "
            "(parents precede children)"
        )


def check_int_vector(name: str, tensor: torch.Tensor, length: int) -> None:
    """An int32/int64 vector of the given length (e.g. prefix lengths per request)."""
    if not isinstance(tensor, torch.Tensor) or tensor.shape != (length,):
        got = (
            tuple(tensor.shape)
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise ValueError(f"expected {name} of shape [{length}], got {got}")
    if tensor.dtype not in _INT_DTYPES:
        raise ValueError(
            f"expected {name} [{length}] of dtype int64 or int32, got {tensor.dtype}"
        )
