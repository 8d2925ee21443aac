"""Heap builder: the design's test vector, edge cases, and brute-force optimality."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

import sglang.srt.speculative.ddtree_batched as ddtree_batched
import sglang.srt.speculative.ddtree_checks as ddtree_checks
import sglang.srt.speculative.ddtree_retrieve as ddtree_retrieve
import sglang.srt.speculative.ddtree_topk as ddtree_topk
import sglang.srt.speculative.ddtree_tree as ddtree_tree
import sglang.srt.speculative.ddtree_verify as ddtree_verify
from sglang.srt.speculative.ddtree_tree import build_ddtree_tree_from_topk

VECTOR_LP = torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]))
VECTOR_IDS = torch.tensor([[10, 11], [20, 21], [30, 31]])


def test_modules_load_from_tree_root(tree_root: Path) -> None:
    for module in (
        ddtree_tree,
        ddtree_batched,
        ddtree_checks,
        ddtree_retrieve,
        ddtree_verify,
        ddtree_topk,
    ):
        path = Path(module.__file__).resolve()
        assert path.is_relative_to(
            tree_root / "python" / "sglang" / "srt" / "speculative"
        ), path


def test_design_test_vector_exactly() -> None:
    tree = build_ddtree_tree_from_topk(VECTOR_LP, VECTOR_IDS, 5)
    assert tree.tokens.tolist() == [10, 20, 30, 11, 21]
    assert tree.depths.tolist() == [1, 2, 3, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 1]
    assert [round(w, 3) for w in tree.node_logws.tolist()] == [
        -0.357,
        -0.868,
        -1.091,
        -1.204,
        -1.273,
    ]
    assert tree.child_maps == [{10: 1, 11: 4}, {20: 2, 21: 5}, {30: 3}, {}, {}, {}]
    assert tree.ranks.tolist() == [0, 0, 0, 1, 1]
    assert tree.num_nodes == 6


def test_weights_are_float64_sums_root_to_leaf() -> None:
    lp64 = VECTOR_LP.to(torch.float64).tolist()
    tree = build_ddtree_tree_from_topk(VECTOR_LP, VECTOR_IDS, 5)
    expected = [
        0.0 + lp64[0][0],
        (0.0 + lp64[0][0]) + lp64[1][0],
        ((0.0 + lp64[0][0]) + lp64[1][0]) + lp64[2][0],
    ]
    assert tree.node_logws.dtype == torch.float64
    assert tree.node_logws[:3].tolist() == expected  # bit-exact, not approximately


def test_budget_zero_is_root_only() -> None:
    tree = build_ddtree_tree_from_topk(VECTOR_LP, VECTOR_IDS, 0)
    assert tree.tokens.tolist() == [] and tree.parents.tolist() == [-1]
    assert tree.child_maps == [{}]


def test_k1_is_the_linear_dflash_chain() -> None:
    lp = torch.log(torch.tensor([[0.9], [0.5], [0.7], [0.2]]))
    ids = torch.tensor([[5], [6], [7], [8]])
    for budget in range(0, 7):
        tree = build_ddtree_tree_from_topk(lp, ids, budget)
        n = min(budget, 4)
        assert tree.tokens.tolist() == [5, 6, 7, 8][:n]
        assert tree.parents.tolist() == list(range(-1, n))
        assert tree.depths.tolist() == list(range(1, n + 1))


def test_budget_larger_than_the_draft_takes_every_node() -> None:
    tree = build_ddtree_tree_from_topk(VECTOR_LP, VECTOR_IDS, 100)
    assert tree.tokens.numel() == 2 + 4 + 8
    weights = tree.node_logws.tolist()
    assert weights == sorted(weights, reverse=True)
    paths = {_path(tree, i) for i in range(1, tree.num_nodes)}
    assert len(paths) == 14


def test_l1_is_a_star_of_the_best_tokens() -> None:
    lp = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    ids = torch.tensor([[3, 1, 4, 2]])
    tree = build_ddtree_tree_from_topk(lp, ids, 3)
    assert tree.tokens.tolist() == [3, 1, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 0]


def test_ties_break_on_the_rank_tuple() -> None:
    # Every weight ties at each depth: order is (0,), (1,), (0,0), (0,1), (1,0), ...
    lp = torch.full((2, 2), math.log(0.5))
    ids = torch.tensor([[1, 2], [3, 4]])
    tree = build_ddtree_tree_from_topk(lp, ids, 6)
    assert [_path(tree, i) for i in range(1, 7)] == [
        (0,),
        (1,),
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    # A zero log-prob makes a child tie its parent: the prefix (parent) pops first.
    lp = torch.tensor([[0.0, -1.0], [0.0, -1.0]])
    tree = build_ddtree_tree_from_topk(lp, ids, 4)
    assert [_path(tree, i) for i in range(1, 5)] == [(0,), (0, 0), (0, 1), (1,)]


def _path(tree, node: int) -> tuple[int, ...]:
    ranks = [-1] + tree.ranks.tolist()
    out = []
    while node > 0:
        out.append(ranks[node])
        node = int(tree.parents[node])
    return tuple(reversed(out))


def _all_paths(depth: int, k: int) -> list[tuple[int, ...]]:
    return [
        p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_tree_maximises_expected_path_mass_by_brute_force(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    depth, k = (3, 2) if seed % 2 == 0 else (2, 3)
    probs = torch.rand(depth, k, generator=gen, dtype=torch.float64) + 0.05
    probs = torch.sort(
        probs / probs.sum(dim=1, keepdim=True) * 0.9, dim=1, descending=True
    ).values
    lp = torch.log(probs)
    ids = torch.arange(depth * k).reshape(depth, k)
    paths = _all_paths(depth, k)
    mass = {p: math.exp(sum(lp[d, j].item() for d, j in enumerate(p))) for p in paths}
    for budget in range(1, len(paths) + 1):
        best = max(
            sum(mass[p] for p in subset)
            for subset in itertools.combinations(paths, budget)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)  # prefix-closed
        )
        tree = build_ddtree_tree_from_topk(lp, ids, budget)
        got = sum(math.exp(w) for w in tree.node_logws.tolist())
        assert got == pytest.approx(best, rel=1e-12, abs=0)


@pytest.mark.parametrize(
    ("log_probs", "token_ids", "budget", "match"),
    [
        (torch.zeros(3), torch.zeros(3, dtype=torch.int64), 1, r"shape \[L, K\]"),
        (
            torch.zeros(2, 2),
            torch.zeros(2, 3, dtype=torch.int64),
            1,
            r"token_ids of shape \(2, 2\)",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int64),
            torch.zeros(2, 2, dtype=torch.int64),
            1,
            "float dtype",
        ),
        (torch.zeros(2, 2), torch.zeros(2, 2), 1, "int64 or int32"),
        (
            torch.zeros(0, 2),
            torch.zeros(0, 2, dtype=torch.int64),
            1,
            "L >= 1 and K >= 1",
        ),
        (torch.tensor([[0.0, float("nan")]]), torch.tensor([[1, 2]]), 1, "finite"),
        (
            torch.tensor([[float("-inf"), float("-inf")]]),
            torch.tensor([[1, 2]]),
            1,
            "finite",
        ),
        (torch.tensor([[0.5, -1.0]]), torch.tensor([[1, 2]]), 1, "<= 0"),
        (torch.tensor([[-2.0, -1.0]]), torch.tensor([[1, 2]]), 1, "sorted descending"),
        (torch.tensor([[-1.0, -2.0]]), torch.tensor([[7, 7]]), 1, "distinct token_ids"),
        (torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1, 7]]), 1, ">= 0"),
        (torch.tensor([[-1.0, -2.0]]), torch.tensor([[1, 7]]), -1, "budget >= 0"),
        (torch.tensor([[-1.0, -2.0]]), torch.tensor([[1, 7]]), 1.0, "Python int"),
    ],
)
def test_heap_builder_rejects_bad_inputs(log_probs, token_ids, budget, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_ddtree_tree_from_topk(log_probs, token_ids, budget)


def test_heap_builder_rejects_non_tensors_and_mixed_devices() -> None:
    with pytest.raises(ValueError, match="tensors of shape"):
        build_ddtree_tree_from_topk([[-1.0]], torch.tensor([[1]]), 1)
    with pytest.raises(ValueError, match="on one device"):
        build_ddtree_tree_from_topk(
            torch.tensor([[-1.0]]),
            torch.ones(1, 1, dtype=torch.int64, device="meta"),
            1,
        )


def test_duplicates_in_different_depths_are_fine() -> None:
    # The same token at two depths is an ordinary path (e.g. "the the"), not a sibling
    # clash.
    tree = build_ddtree_tree_from_topk(
        torch.log(torch.tensor([[0.6, 0.4], [0.6, 0.4]])),
        torch.tensor([[1, 2], [1, 2]]),
        3,
    )
    assert tree.tokens.tolist() == [1, 2, 1]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
