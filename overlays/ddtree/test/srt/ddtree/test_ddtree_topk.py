"""TP top-K merge: equals the top-K of the concatenated full-vocabulary logits."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.ddtree_topk import (
    ddtree_shard_topk,
    merge_ddtree_topk,
    topk_lower_id_first,
)


def _reference(full_logits: torch.Tensor, k: int):
    """log_softmax over the whole vocabulary; ties to the lower id (stable sort)."""
    order = torch.sort(full_logits, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.log_softmax(full_logits, dim=1).gather(1, order), order


def _shard(full_logits: torch.Tensor, sizes: list[int], padded: int):
    """Split [T, V] into shards padded to `padded` rows of large garbage (ignored)."""
    shards, start = [], 0
    for size in sizes:
        part = full_logits[:, start : start + size]
        garbage = torch.full((full_logits.shape[0], padded - size), 1e4)
        shards.append((torch.cat([part, garbage], dim=1), start, size))
        start += size
    return shards


@pytest.mark.parametrize("integer_logits", [False, True])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_merge_equals_topk_of_full_vocabulary(integer_logits: bool, k: int) -> None:
    gen = torch.Generator().manual_seed(k + 100 * integer_logits)
    logits = torch.randn(40, 50, generator=gen) * 3
    if integer_logits:  # many exact ties, some straddling shard boundaries
        logits = torch.round(logits)
    shards = _shard(logits, [13, 13, 13, 11], padded=13)
    triples = [ddtree_shard_topk(x, k, start, size) for x, start, size in shards]
    log_probs, ids = merge_ddtree_topk(
        [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples], k
    )
    ref_lp, ref_ids = _reference(logits, k)
    assert ids.dtype == torch.int64 and log_probs.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(log_probs, ref_lp, atol=2e-6, rtol=0)
    assert bool((log_probs[:, 1:] <= log_probs[:, :-1]).all())


def test_shard_triple_excludes_padding_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 99.0, 99.0]])
    top, ids, lse = ddtree_shard_topk(logits, 2, vocab_start=10, real_rows=3)
    assert ids.tolist() == [[12, 11]] and top.tolist() == [[3.0, 2.0]]
    assert lse.item() == pytest.approx(
        torch.logsumexp(torch.tensor([1.0, 2.0, 3.0]), 0).item()
    )


def test_small_shard_pads_with_missing_entries() -> None:
    top, ids, lse = ddtree_shard_topk(
        torch.tensor([[0.5, 9.0]]), 3, vocab_start=3, real_rows=1
    )
    assert ids.tolist() == [[3, -1, -1]] and top[0, 1:].tolist() == [float("-inf")] * 2
    other = ddtree_shard_topk(
        torch.tensor([[1.0, 0.0, 2.0]]), 3, vocab_start=0, real_rows=3
    )
    log_probs, merged = merge_ddtree_topk(
        [top, other[0]], [ids, other[1]], [lse, other[2]], 3
    )
    assert merged.tolist() == [[2, 0, 3]]
    ref_lp, _ = _reference(torch.tensor([[1.0, 0.0, 2.0, 0.5]]), 3)
    torch.testing.assert_close(log_probs, ref_lp)


def test_merge_without_validation_returns_missing_entries() -> None:
    """validate=False skips the only host read; a short row shows up as id -1, -inf."""
    logits = torch.tensor([[3.0, 1.0], [0.5, 2.0]])
    vals, ids, lse = ddtree_shard_topk(logits, 3, vocab_start=10, real_rows=2)
    with pytest.raises(ValueError, match="real vocabulary rows"):
        merge_ddtree_topk([vals], [ids], [lse], 3)
    log_probs, token_ids = merge_ddtree_topk([vals], [ids], [lse], 3, validate=False)
    assert token_ids.tolist() == [[10, 11, -1], [11, 10, -1]]
    assert torch.isneginf(log_probs[:, 2]).all()
    full, full_ids = merge_ddtree_topk([vals], [ids], [lse], 2, validate=False)
    assert torch.equal(full, log_probs[:, :2]) and torch.equal(
        full_ids, token_ids[:, :2]
    )


def test_bf16_shards_are_merged_in_float32() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(2)).to(
        torch.bfloat16
    )
    triples = [
        ddtree_shard_topk(logits[:, :10], 4, 0, 10),
        ddtree_shard_topk(logits[:, 10:], 4, 10, 10),
    ]
    log_probs, ids = merge_ddtree_topk(*zip(*triples), 4)
    ref_lp, ref_ids = _reference(logits.float(), 4)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(log_probs, ref_lp, atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: ddtree_shard_topk(torch.zeros(3), 1, 0, 3),
            r"shard_logits of shape \[T, V_shard\]",
        ),
        (
            lambda: ddtree_shard_topk(torch.zeros(1, 3), 1, 0, 4),
            "real_rows <= V_shard = 3",
        ),
        (lambda: ddtree_shard_topk(torch.zeros(1, 3), 0, 0, 3), "k >= 1"),
        (lambda: merge_ddtree_topk([], [], [], 1), "one .* triple per shard"),
        (
            lambda: merge_ddtree_topk(
                [torch.zeros(2, 2)],
                [torch.zeros(2, 2, dtype=torch.int64)],
                [torch.zeros(3)],
                1,
            ),
            r"shard 0: top_logits and top_ids \[3, k_r\]",
        ),
        (
            lambda: merge_ddtree_topk(
                [torch.zeros(1, 2)], [torch.tensor([[0, 1]])], [torch.zeros(1)], 3
            ),
            "at least k = 3 candidates",
        ),
        (
            lambda: merge_ddtree_topk(
                [torch.tensor([[0.0, float("-inf")]])],
                [torch.tensor([[0, -1]])],
                [torch.zeros(1)],
                2,
            ),
            "at least k = 2 real vocabulary rows",
        ),
    ],
)
def test_topk_rejects_bad_inputs(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("k", [1, 3, 8, 64])
@pytest.mark.parametrize("ties", ["none", "some", "all"])
def test_topk_lower_id_first_equals_the_stable_sort(k: int, ties: str) -> None:
    """torch.topk plus the tie rule picks what the stable sort picked, in its order,
    also when the k-th value is tied across the cut (the case torch.topk alone
    leaves unspecified)."""
    gen = torch.Generator().manual_seed(k)
    values = torch.randn(30, 200, generator=gen)
    if ties == "some":
        values = torch.round(values * 2) / 2  # a handful of distinct values
    elif ties == "all":
        values = torch.zeros(30, 200)
    want = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    got = topk_lower_id_first(values, k)
    assert got.dtype == torch.int64 and torch.equal(got, want)
