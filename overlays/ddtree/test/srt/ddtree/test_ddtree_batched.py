"""Batched builder: equals the heap builder exactly (order, ties, padding)."""

from __future__ import annotations

import math

import pytest
import torch

import sglang.srt.speculative.ddtree_batched as ddtree_batched
from sglang.srt.speculative.ddtree_batched import DDTreeBatch, build_ddtree_batched
from sglang.srt.speculative.ddtree_retrieve import (
    compile_ddtree_retrieve,
    ddtree_full_mask,
)
from sglang.srt.speculative.ddtree_topk import ddtree_shard_topk, merge_ddtree_topk
from sglang.srt.speculative.ddtree_tree import build_ddtree_tree_from_topk

VECTOR_LP = torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]))
VECTOR_IDS = torch.tensor([[10, 11], [20, 21], [30, 31]])


def _random_drafts(gen: torch.Generator, bs: int, depth: int, k: int, mode: int):
    """mode 0: continuous; 1: values on a 1/4 grid (exact ties); 2: identical rows per
    depth on a 1/2 grid (massive ties, children tie across parents); 3: zero log-probs
    (a child ties its parent, ties across depths); 4: steps of one ulp on offsets that
    grow with depth (float64 sums round, and rounding merges sums whose exact values
    differ: the case the pair rule's certificate exists for)."""
    x = -torch.rand(bs, depth, k, generator=gen, dtype=torch.float64) * 3
    if mode == 4:
        steps = torch.randint(0, 6, (bs, depth, k), generator=gen).to(torch.float64)
        offsets = torch.tensor([0.5, 0.0, 1.5, 3.0, 6.0], dtype=torch.float64)
        offset = offsets[:depth]  # depth <= 5
        scale = torch.tensor([1.0, 1.0, 4.0, 8.0, 16.0], dtype=torch.float64)[:depth]
        x = -(offset[None, :, None] + steps * 2.0**-53 * scale[None, :, None])
    elif mode == 1:
        x = torch.round(x * 4) / 4
    elif mode == 2:
        x = (torch.round(x * 2) / 2)[:, :1, :].expand(bs, depth, k).clone()
    elif mode == 3:
        x = torch.where(
            torch.rand(bs, depth, k, generator=gen) < 0.4,
            torch.zeros_like(x),
            torch.round(x),
        )
    x = torch.sort(x, dim=-1, descending=True).values
    ids = (
        torch.argsort(torch.rand(bs, depth, k, generator=gen), dim=-1)
        + 100 * torch.arange(depth)[None, :, None]
    )
    return x, ids


def _assert_equals_heap(
    batch: DDTreeBatch, log_probs: torch.Tensor, ids: torch.Tensor, budget: int
) -> None:
    for b in range(log_probs.shape[0]):
        ref = build_ddtree_tree_from_topk(log_probs[b], ids[b], budget)
        n = ref.tokens.numel()
        assert int(batch.num_nodes[b]) == n + 1
        assert batch.tokens[b, 1 : n + 1].tolist() == ref.tokens.tolist()
        assert batch.parents[b, : n + 1].tolist() == ref.parents.tolist()
        assert batch.depths[b, 1 : n + 1].tolist() == ref.depths.tolist()
        assert batch.ranks[b, 1 : n + 1].tolist() == ref.ranks.tolist()
        weights = batch.node_logws[b, 1 : n + 1].tolist()
        assert weights == ref.node_logws.tolist()  # bit-exact
        pad = slice(n + 1, budget + 1)
        assert set(batch.tokens[b, pad].tolist()) <= {-1} and set(
            batch.parents[b, pad].tolist()
        ) <= {-1}


def test_design_test_vector_batched() -> None:
    batch = build_ddtree_batched(
        VECTOR_LP[None].repeat(2, 1, 1),
        VECTOR_IDS[None].repeat(2, 1, 1),
        5,
        root_tokens=torch.tensor([7, 8]),
    )
    assert batch.tokens.tolist() == [[7, 10, 20, 30, 11, 21], [8, 10, 20, 30, 11, 21]]
    assert batch.depths.tolist() == [[0, 1, 2, 3, 1, 2]] * 2
    assert batch.parents.tolist() == [[-1, 0, 1, 2, 0, 1]] * 2
    assert [round(w, 3) for w in batch.node_logws[0].tolist()] == [
        0.0,
        -0.357,
        -0.868,
        -1.091,
        -1.204,
        -1.273,
    ]
    assert batch.num_nodes.tolist() == [6, 6] and batch.num_slots == 6
    assert (
        batch.tokens.dtype == batch.parents.dtype == batch.depths.dtype == torch.int64
    )
    assert batch.node_logws.dtype == torch.float64


def test_root_token_defaults_to_minus_one() -> None:
    batch = build_ddtree_batched(VECTOR_LP[None], VECTOR_IDS[None], 2)
    assert batch.tokens.tolist() == [[-1, 10, 20]]


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_batched_equals_heap_on_random_drafts(mode: int) -> None:
    gen = torch.Generator().manual_seed(1234 + mode)
    for _ in range(60):  # 5 modes x 60 batches x 16 requests = 4800 trees
        depth = int(torch.randint(1, 6, (1,), generator=gen))
        k = int(torch.randint(1, 6, (1,), generator=gen))
        budget = int(torch.randint(0, 40, (1,), generator=gen))
        lp, ids = _random_drafts(gen, 16, depth, k, mode)
        _assert_equals_heap(build_ddtree_batched(lp, ids, budget), lp, ids, budget)


def test_pruned_and_unpruned_selection_both_equal_heap() -> None:
    """The pair rule whenever it certifies itself, and the unpruned fallback always.

    Exact ties (modes 1-3) certify: the certificate compares full keys, and the pair
    rule only fails when rounding merges two sums (mode 4), which it must catch."""
    gen = torch.Generator().manual_seed(99)
    certified_runs = uncertified_runs = 0
    for trial in range(100):
        depth, k, budget = 4, 4, int(torch.randint(5, 60, (1,), generator=gen))
        lp, ids = _random_drafts(gen, 32 if trial % 5 == 4 else 8, depth, k, trial % 5)
        lp64 = lp.to(torch.float64)
        pruned, certified = ddtree_batched._select_trees(
            lp64, ids, budget, None, prune=True
        )
        if bool(certified):
            certified_runs += 1
            _assert_equals_heap(pruned, lp, ids, budget)
        else:
            uncertified_runs += 1
        full, _ = ddtree_batched._select_trees(lp64, ids, budget, None, prune=False)
        _assert_equals_heap(full, lp, ids, budget)
    runs = (certified_runs, uncertified_runs)
    assert certified_runs > 0 and uncertified_runs > 0, runs  # both exercised


def test_certificate_catches_over_pruning(monkeypatch) -> None:
    """Narrow the candidate pairs far below the safe bound: whenever the certificate
    still passes, the pruned trees must equal the heap's; and it must fail on some
    inputs, where the accelerator path's fallback repairs the build."""
    real_pairs = ddtree_batched._pair_lists.__wrapped__

    def narrow(num_parents, k, budget, prune):
        slots, ranks, widths = real_pairs(num_parents, k, budget, prune)
        if not prune:
            return slots, ranks, widths
        widths = tuple(min(w, 2 if i < 2 else 1) for i, w in enumerate(widths))
        slots = tuple(i for i, w in enumerate(widths) for _ in range(w))
        ranks = tuple(j for w in widths for j in range(w))
        return slots, ranks, widths

    monkeypatch.setattr(ddtree_batched, "_pair_lists", narrow)
    gen = torch.Generator().manual_seed(17)
    caught = passed = 0
    for trial in range(40):
        budget = int(torch.randint(3, 30, (1,), generator=gen))
        lp, ids = _random_drafts(gen, 8, 3, 4, trial % 4)
        if trial % 2:
            # Steep drafts and small budgets: the narrowed pairs can still suffice.
            lp[..., 1:] -= 20.0
            budget = 3 + trial % 5
        pruned, certified = ddtree_batched._select_trees(
            lp.to(torch.float64), ids, budget, None, prune=True
        )
        if bool(certified):
            passed += 1
            _assert_equals_heap(pruned, lp, ids, budget)
        else:
            caught += 1
        with monkeypatch.context() as accelerator:
            accelerator.setattr(ddtree_batched, "_host_reads", lambda device: False)
            repaired = build_ddtree_batched(lp, ids, budget)
        _assert_equals_heap(repaired, lp, ids, budget)
    assert caught > 0 and passed > 0, (caught, passed)


def test_large_budget_typical_shape() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 15, 32, generator=gen) * 3
    lp, ids = torch.sort(torch.log_softmax(logits, dim=-1), dim=-1, descending=True)
    batch = build_ddtree_batched(lp, ids, 256)
    _assert_equals_heap(batch, lp, ids, 256)


def test_float32_and_int32_inputs_follow_the_float64_rule() -> None:
    gen = torch.Generator().manual_seed(3)
    lp, ids = _random_drafts(gen, 4, 3, 3, 0)
    lp32, ids32 = lp.to(torch.float32), ids.to(torch.int32)
    batch = build_ddtree_batched(lp32, ids32, 10)
    _assert_equals_heap(batch, lp32, ids32, 10)


def test_edge_cases_budget_zero_k1_l1_and_padding() -> None:
    lp = torch.log(torch.tensor([[[0.5, 0.3], [0.6, 0.2]]]))
    ids = torch.tensor([[[1, 2], [3, 4]]])
    root_only = build_ddtree_batched(lp, ids, 0, root_tokens=torch.tensor([9]))
    assert root_only.tokens.tolist() == [[9]] and root_only.parents.tolist() == [[-1]]
    assert root_only.num_nodes.tolist() == [1]

    chain = build_ddtree_batched(lp[:, :, :1], ids[:, :, :1], 5)
    assert chain.tokens.tolist() == [[-1, 1, 3, -1, -1, -1]]
    assert chain.parents.tolist() == [[-1, 0, 1, -1, -1, -1]]
    assert chain.depths.tolist() == [[0, 1, 2, -1, -1, -1]]
    assert chain.num_nodes.tolist() == [3]
    assert chain.node_logws[0, 3:].tolist() == [-math.inf] * 3

    star = build_ddtree_batched(lp[:, :1, :], ids[:, :1, :], 2)
    assert star.tokens.tolist() == [[-1, 1, 2]] and star.parents.tolist() == [
        [-1, 0, 0]
    ]

    everything = build_ddtree_batched(lp, ids, 50)
    assert everything.num_nodes.tolist() == [7] and everything.tokens.shape == (1, 51)
    _assert_equals_heap(everything, lp, ids, 50)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_probs": torch.zeros(2, 2)}, r"shape \[bs, L, K\]"),
        (
            {"token_ids": torch.zeros(1, 2, 3, dtype=torch.int64)},
            r"token_ids of shape \(1, 2, 2\)",
        ),
        ({"budget": -3}, "budget >= 0"),
        ({"root_tokens": torch.tensor([1, 2])}, r"root_tokens of shape \[1\]"),
        ({"root_tokens": torch.tensor([1.0])}, "int64 or int32"),
        (
            {"log_probs": torch.tensor([[[-1.0, -0.5], [-1.0, -2.0]]])},
            "sorted descending",
        ),
        ({"token_ids": torch.tensor([[[1, 2], [3, 3]]])}, "distinct token_ids"),
    ],
)
def test_batched_builder_rejects_bad_inputs(kwargs, match) -> None:
    args = {
        "log_probs": torch.tensor([[[-0.5, -1.0], [-1.0, -2.0]]]),
        "token_ids": torch.tensor([[[1, 2], [3, 4]]]),
        "budget": 3,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_ddtree_batched(**args)


def test_count_possible_nodes() -> None:
    assert ddtree_batched.count_possible_nodes(3, 2, 100) == 14
    assert ddtree_batched.count_possible_nodes(15, 1, 100) == 15
    assert ddtree_batched.count_possible_nodes(15, 256, 512) == 512


@pytest.mark.parametrize("host_reads", [True, False])
def test_fixed_shape_and_host_read_paths_agree_with_heap(
    monkeypatch, host_reads: bool
) -> None:
    """Without host reads (the accelerator path: fixed shapes, no early stop,
    tie-breaking always on) and with them (CPU: shrunk shapes, early stop, tie work only
    on ties), the trees are the heap's, on all draft modes."""
    monkeypatch.setattr(ddtree_batched, "_host_reads", lambda device: host_reads)
    gen = torch.Generator().manual_seed(4321)
    for trial in range(50):
        depth = int(torch.randint(1, 6, (1,), generator=gen))
        k = int(torch.randint(1, 6, (1,), generator=gen))
        budget = int(torch.randint(0, 50, (1,), generator=gen))
        lp, ids = _random_drafts(gen, 16, depth, k, trial % 5)
        _assert_equals_heap(build_ddtree_batched(lp, ids, budget), lp, ids, budget)


def test_large_batch_shortcuts_agree_with_heap(monkeypatch) -> None:
    """The floor-narrowed pairs (on by size only: large batches) on every draft mode,
    switched on here for small ones."""
    monkeypatch.setattr(ddtree_batched, "_NARROW_MIN_SCORES", 0)
    gen = torch.Generator().manual_seed(2468)
    for trial in range(60):
        if trial == 30:
            # The two-sort tie-break that replaces the integer key near int64 overflow.
            monkeypatch.setattr(ddtree_batched, "_KEY_LIMIT", 0)
        depth = int(torch.randint(1, 6, (1,), generator=gen))
        k = int(torch.randint(1, 7, (1,), generator=gen))
        budget = int(torch.randint(0, 50, (1,), generator=gen))
        lp, ids = _random_drafts(gen, 16, depth, k, trial % 5)
        _assert_equals_heap(build_ddtree_batched(lp, ids, budget), lp, ids, budget)
    # Peaked: deep trees, ties from float32.
    logits = torch.randn(8, 15, 64, generator=gen) * 6
    lp, ids = torch.sort(torch.log_softmax(logits, dim=-1), dim=-1, descending=True)
    _assert_equals_heap(build_ddtree_batched(lp, ids, 64), lp, ids, 64)


def test_single_request_path_equals_tensor_path() -> None:
    """bs = 1 on CPU runs the heap loop: same fields, dtypes, shapes and padding as the
    tensor path (which the other tests check against the heap)."""
    gen = torch.Generator().manual_seed(1357)
    for trial in range(40):
        depth = int(torch.randint(1, 5, (1,), generator=gen))
        k = int(torch.randint(1, 5, (1,), generator=gen))
        budget = int(torch.randint(0, 30, (1,), generator=gen))
        lp, ids = _random_drafts(gen, 1, depth, k, trial % 5)
        root = torch.tensor([5], dtype=torch.int32) if trial % 2 else None
        single = build_ddtree_batched(
            lp.to(torch.float32), ids.to(torch.int32), budget, root_tokens=root
        )
        lp64 = lp.to(torch.float32).to(torch.float64)
        tensor, _ = ddtree_batched._select_trees(
            lp64, ids.to(torch.int32), budget, root, prune=False
        )
        for name in ("tokens", "depths", "parents", "ranks", "node_logws", "num_nodes"):
            got, want = getattr(single, name), getattr(tensor, name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tolist() == want.tolist(), name
        assert single.budget == budget


def test_per_step_calls_with_validate_false_read_almost_nothing_back(monkeypatch):
    """The worker's per-step calls with validate=False, on the accelerator's code path:
    the only read of a tensor value back to Python is the batched builder's certificate
    (one ``bool``); the merge, retrieve arrays and mask read nothing."""
    monkeypatch.setattr(ddtree_batched, "_host_reads", lambda device: False)
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 40, generator=gen)
    shard_a = ddtree_shard_topk(logits[:, :24], 4, vocab_start=0, real_rows=20)
    shard_b = ddtree_shard_topk(logits[:, 24:], 4, vocab_start=20, real_rows=16)
    lp, ids = _random_drafts(gen, 3, 3, 4, 2)
    seq_lens = torch.tensor([5, 0, 9])
    reads: list[str] = []
    real_bool = torch.Tensor.__bool__

    def counted_bool(self) -> bool:
        reads.append("__bool__")
        return real_bool(self)

    def host_read(self, *args, **kwargs):
        raise AssertionError("a tensor value was read back to the host")

    with monkeypatch.context() as patch:
        for name in ("__int__", "__float__", "item", "tolist", "numpy"):
            patch.setattr(torch.Tensor, name, host_read)
        patch.setattr(torch.Tensor, "__bool__", counted_bool)
        shards = [list(triple) for triple in zip(shard_a, shard_b)]
        merged = merge_ddtree_topk(*shards, 4, validate=False)
        assert reads == []
        batch = build_ddtree_batched(lp, ids, 10, validate=False)
        assert reads == ["__bool__"]  # the pair rule's certificate
        retrieve = compile_ddtree_retrieve(batch.parents, validate=False)
        mask = ddtree_full_mask(batch.parents, seq_lens, 14, validate=False)
        assert reads == ["__bool__"]
    assert merged[1].shape == (6, 4) and retrieve.retrieve_index.shape == (3, 11)
    assert mask.shape == (14 * 11 + 3 * 11 * 11,)
    _assert_equals_heap(batch, lp, ids, 10)
