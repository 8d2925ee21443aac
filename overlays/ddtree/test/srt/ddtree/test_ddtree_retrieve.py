"""Retrieve arrays, positions and attention masks in SGLang's layouts."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.ddtree_batched import build_ddtree_batched
from sglang.srt.speculative.ddtree_tree import build_ddtree_tree_from_topk
from sglang.srt.speculative.ddtree_retrieve import (
    compile_ddtree_retrieve,
    ddtree_ancestor_mask,
    ddtree_full_mask,
    ddtree_positions,
)

VECTOR_LP = torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]))
VECTOR_IDS = torch.tensor([[10, 11], [20, 21], [30, 31]])


@pytest.fixture(scope="module")
def random_batch():
    """Trees with weight ties (24 requests, L=4, K=3, budget 45) and with padding
    (L=2: 12 real nodes, budget 20)."""
    gen = torch.Generator().manual_seed(5)
    lp = torch.round(-torch.rand(24, 4, 3, generator=gen, dtype=torch.float64) * 8) / 4
    lp = torch.sort(lp, dim=-1, descending=True).values
    ids = torch.argsort(torch.rand(24, 4, 3, generator=gen), dim=-1)
    big = build_ddtree_batched(lp, ids, 45)
    padded = build_ddtree_batched(lp[:, :2, :], ids[:, :2, :], 20)  # 12 real, 8 pad
    return big, padded


def test_design_test_vector_retrieve_arrays() -> None:
    batch = build_ddtree_batched(VECTOR_LP[None], VECTOR_IDS[None], 5)
    r = compile_ddtree_retrieve(batch.parents, batch.node_logws)
    assert r.retrieve_index.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert r.retrieve_next_token.tolist() == [[1, 2, 3, -1, -1, -1]]
    assert r.retrieve_next_sibling.tolist() == [[-1, 4, 5, -1, -1, -1]]
    single = compile_ddtree_retrieve(batch.parents[0])
    assert single.retrieve_index.tolist() == [0, 1, 2, 3, 4, 5]
    assert single.retrieve_next_token.tolist() == [1, 2, 3, -1, -1, -1]
    assert single.retrieve_next_sibling.tolist() == [-1, 4, 5, -1, -1, -1]


def test_retrieve_index_is_global_and_int64() -> None:
    batch = build_ddtree_batched(
        VECTOR_LP[None].repeat(3, 1, 1), VECTOR_IDS[None].repeat(3, 1, 1), 5
    )
    r = compile_ddtree_retrieve(batch.parents)
    assert r.retrieve_index.tolist() == [
        list(range(b * 6, b * 6 + 6)) for b in range(3)
    ]
    for t in (r.retrieve_index, r.retrieve_next_token, r.retrieve_next_sibling):
        assert t.dtype == torch.int64 and t.shape == (3, 6)
    # Local slots, not global.
    assert r.retrieve_next_token.tolist() == [[1, 2, 3, -1, -1, -1]] * 3


def _walk(next_token: list[int], next_sibling: list[int]) -> list[tuple[int, int]]:
    """(node, parent) in DFS order following the retrieve pointers from the root."""
    seen, stack = [(0, -1)], [0]
    while stack:
        node = stack.pop()
        child, children = next_token[node], []
        while child != -1:
            children.append(child)
            child = next_sibling[child]
        seen.extend((c, node) for c in children)
        stack.extend(reversed(children))
    return seen


def test_traversal_visits_every_node_once_children_by_weight(random_batch) -> None:
    for batch in random_batch:
        r = compile_ddtree_retrieve(batch.parents, batch.node_logws)
        # Slot order gives the same arrays.
        r_plain = compile_ddtree_retrieve(batch.parents)
        assert torch.equal(r.retrieve_next_token, r_plain.retrieve_next_token)
        assert torch.equal(r.retrieve_next_sibling, r_plain.retrieve_next_sibling)
        for b in range(batch.parents.shape[0]):
            n = int(batch.num_nodes[b])
            visits = _walk(
                r.retrieve_next_token[b].tolist(), r.retrieve_next_sibling[b].tolist()
            )
            assert sorted(v for v, _ in visits) == list(range(n))
            assert all(p == int(batch.parents[b, v]) for v, p in visits)
            for node in range(n):
                kids = [c for c, p in visits if p == node]
                weights = [batch.node_logws[b, c].item() for c in kids]
                assert weights == sorted(weights, reverse=True)
                assert [batch.ranks[b, c].item() for c in kids] == sorted(
                    batch.ranks[b, c].item() for c in kids
                )
            assert r.retrieve_next_token[b, n:].tolist() == [-1] * (batch.num_slots - n)
            assert r.retrieve_next_sibling[b, n:].tolist() == [-1] * (
                batch.num_slots - n
            )


def test_siblings_follow_log_weight_when_slots_disagree() -> None:
    # Root with children 1, 2, 3 whose weights put 3 first, then 1, then 2.
    parents = torch.tensor([[-1, 0, 0, 0, 1]])
    logws = torch.tensor([[0.0, -2.0, -3.0, -1.0, -2.5]])
    r = compile_ddtree_retrieve(parents, logws)
    assert r.retrieve_next_token.tolist() == [[3, 4, -1, -1, -1]]
    assert r.retrieve_next_sibling.tolist() == [[-1, 2, -1, 1, -1]]


def test_positions_are_prefix_plus_depth() -> None:
    batch = build_ddtree_batched(
        VECTOR_LP[None].repeat(2, 1, 1), VECTOR_IDS[None].repeat(2, 1, 1), 5
    )
    pos = ddtree_positions(batch.depths, torch.tensor([7, 100]))
    assert pos.tolist() == [7, 8, 9, 10, 8, 9, 100, 101, 102, 103, 101, 102]
    assert pos.dtype == torch.int64
    padded = build_ddtree_batched(VECTOR_LP[None, :1, :1], VECTOR_IDS[None, :1, :1], 3)
    assert ddtree_positions(padded.depths, torch.tensor([4])).tolist() == [4, 5, 4, 4]


def _ancestors_or_self(parents: list[int], node: int) -> set[int]:
    out = {node}
    while parents[node] >= 0:
        node = parents[node]
        out.add(node)
    return out


def test_mask_row_allows_exactly_prefix_root_ancestors_and_self(random_batch) -> None:
    for batch in random_batch:
        bs, n = batch.parents.shape
        seq_lens = torch.arange(bs) % 5 + 1  # includes short prefixes
        full = ddtree_full_mask(batch.parents, seq_lens, int(seq_lens.sum()))
        tree = ddtree_ancestor_mask(batch.parents)
        assert full.dtype == torch.bool and full.shape == (
            int(seq_lens.sum()) * n + bs * n * n,
        )
        assert tree.shape == (bs, n, n)
        start = 0
        for b in range(bs):
            seq = int(seq_lens[b])
            block = full[start : start + n * (seq + n)].view(n, seq + n)
            start += n * (seq + n)
            parents = batch.parents[b].tolist()
            for i in range(n):
                allowed = _ancestors_or_self(parents, i) | {0}
                expected = [True] * seq + [j in allowed for j in range(n)]
                assert block[i].tolist() == expected
                assert tree[b, i].tolist() == expected[seq:]
                assert block[i].any()
        assert start == full.numel()


def test_full_mask_matches_sglang_index_formula() -> None:
    """Cell (b, row x, tree column j) sits at N*N*b + prefix_sum_b*N + (seq_b+N)*x +
    seq_b + j, the offset SGLang's build_tree_kernel_efficient writes (FULL_MASK)."""
    batch = build_ddtree_batched(
        VECTOR_LP[None].repeat(2, 1, 1), VECTOR_IDS[None].repeat(2, 1, 1), 5
    )
    seq_lens = torch.tensor([3, 2])
    full = ddtree_full_mask(batch.parents, seq_lens)
    n = 6
    prefix_sum = [0, 3]
    for b in range(2):
        seq = int(seq_lens[b])
        for x in range(n):
            base = n * n * b + prefix_sum[b] * n + (seq + n) * x
            assert full[base : base + seq].all()
            row = full[base + seq : base + seq + n].tolist()
            assert row == [
                j in (_ancestors_or_self(batch.parents[b].tolist(), x) | {0})
                for j in range(n)
            ]


def test_single_tree_masks() -> None:
    batch = build_ddtree_batched(VECTOR_LP[None], VECTOR_IDS[None], 5)
    tree = ddtree_ancestor_mask(batch.parents[0])
    assert tree.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: compile_ddtree_retrieve(torch.tensor([[[-1]]])),
            r"parents of shape \[bs, N\]",
        ),
        (
            lambda: compile_ddtree_retrieve(torch.tensor([[-1.0, 0.0]])),
            "int64 or int32",
        ),
        (
            lambda: compile_ddtree_retrieve(torch.tensor([[0, 0]])),
            r"parents\[:, 0\] == -1",
        ),
        (
            lambda: compile_ddtree_retrieve(torch.tensor([[-1, 1]])),
            "parents precede children",
        ),
        (
            lambda: compile_ddtree_retrieve(torch.tensor([[-1, 0]]), torch.zeros(1, 3)),
            r"node_logws of shape \(1, 2\)",
        ),
        (
            lambda: ddtree_positions(torch.tensor([[0, 1]]), torch.tensor([1, 2])),
            r"prefix_lens of shape \[1\]",
        ),
        (
            lambda: ddtree_positions(torch.tensor([[0, 1]]), torch.tensor([1.0])),
            "int64 or int32",
        ),
        (
            lambda: ddtree_full_mask(torch.tensor([[-1, 0]]), torch.tensor([[3]])),
            r"seq_lens of shape \[1\]",
        ),
        (
            lambda: ddtree_ancestor_mask(torch.tensor([[-1, -2]])),
            "parents precede children",
        ),
    ],
)
def test_retrieve_and_mask_reject_bad_inputs(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_retrieve_accepts_a_heap_result_and_pads_it_to_the_budget():
    log_probs = torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]))
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    tree = build_ddtree_tree_from_topk(log_probs, ids, 5)
    got = compile_ddtree_retrieve(tree)
    assert got.retrieve_next_token.tolist() == [1, 2, 3, -1, -1, -1]
    assert got.retrieve_next_sibling.tolist() == [-1, 4, 5, -1, -1, -1]
    small = build_ddtree_tree_from_topk(log_probs[:1], ids[:1], 5)  # only 2 nodes exist
    padded = compile_ddtree_retrieve(small, budget=5)
    assert padded.retrieve_index.tolist() == [0, 1, 2, 3, 4, 5]
    assert padded.retrieve_next_token.tolist() == [1, -1, -1, -1, -1, -1]
    assert padded.retrieve_next_sibling.tolist() == [-1, 2, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="budget"):
        compile_ddtree_retrieve(tree, budget=2)


def test_retrieve_accepts_a_batched_tree():
    gen = torch.Generator().manual_seed(3)
    top = torch.log_softmax(torch.randn(4, 3, 30, generator=gen), -1).topk(4, dim=-1)
    batch = build_ddtree_batched(top.values, top.indices, 9)
    direct = compile_ddtree_retrieve(batch.parents, batch.node_logws)
    via_tree = compile_ddtree_retrieve(batch)
    for name in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert torch.equal(getattr(direct, name), getattr(via_tree, name)), name
