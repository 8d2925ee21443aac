"""prepare_ddtree_verify (what ddtree_step calls) composes builder and retrieve."""

import pytest
import torch

from sglang.srt.speculative import ddtree_utils
from sglang.srt.speculative.ddtree_batched import build_ddtree_batched
from sglang.srt.speculative.ddtree_retrieve import (
    compile_ddtree_retrieve,
    ddtree_full_mask,
    ddtree_positions,
)
from sglang.srt.speculative.ddtree_utils import prepare_ddtree_verify, resolve_tree_topk


def _design_vector():
    log_probs = torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]))
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    return log_probs[None], ids[None]


def test_design_vector_through_the_facade():
    log_probs, ids = _design_vector()
    tree, verify = prepare_ddtree_verify(
        log_probs, ids, 5, torch.tensor([7]), torch.tensor([4])
    )
    assert tree.tokens.tolist() == [[7, 10, 20, 30, 11, 21]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 0, 1]]
    assert verify.retrieve_index.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert verify.retrieve_next_token.tolist() == [[1, 2, 3, -1, -1, -1]]
    assert verify.retrieve_next_sibling.tolist() == [[-1, 4, 5, -1, -1, -1]]
    assert verify.positions.tolist() == [4, 5, 6, 7, 5, 6]
    # Node 3 (token 30, depth 3) sees the prefix, the root, nodes 1 and 2, and itself.
    rows = verify.tree_mask.view(6, 4 + 6)
    assert rows[3].tolist() == [True] * 4 + [True, True, True, True, False, False]
    assert [round(x, 3) for x in tree.node_logws[0, 1:].tolist()] == [
        -0.357,
        -0.868,
        -1.091,
        -1.204,
        -1.273,
    ]


def test_facade_equals_the_composed_parts_on_random_batches():
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        bs, depth, k = (
            3,
            int(torch.randint(1, 6, (1,), generator=gen)),
            int(torch.randint(1, 5, (1,), generator=gen)),
        )
        budget = int(torch.randint(0, 20, (1,), generator=gen))
        logits = torch.randn(bs, depth, 50, generator=gen)
        top = torch.log_softmax(logits, -1).topk(k, dim=-1)
        prefix = torch.randint(0, 9, (bs,), generator=gen)
        tree, verify = prepare_ddtree_verify(
            top.values, top.indices, budget, None, prefix
        )
        ref = build_ddtree_batched(top.values, top.indices, budget)
        assert torch.equal(tree.parents, ref.parents) and torch.equal(
            tree.tokens, ref.tokens
        )
        retrieve = compile_ddtree_retrieve(ref.parents, ref.node_logws)
        assert torch.equal(verify.retrieve_next_token, retrieve.retrieve_next_token)
        assert torch.equal(verify.retrieve_next_sibling, retrieve.retrieve_next_sibling)
        assert torch.equal(verify.positions, ddtree_positions(ref.depths, prefix))
        assert torch.equal(verify.tree_mask, ddtree_full_mask(ref.parents, prefix))


def test_facade_rejects_bad_prefix_lens_and_drafts():
    log_probs, ids = _design_vector()
    with pytest.raises(ValueError, match=r"prefix_lens of shape \[1\]"):
        prepare_ddtree_verify(log_probs, ids, 5, None, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="budget"):
        prepare_ddtree_verify(log_probs, ids, -1, None, torch.tensor([1]))
    with pytest.raises(ValueError):
        prepare_ddtree_verify(
            log_probs.flip(-1), ids, 5, None, torch.tensor([1])
        )  # unsorted


@pytest.mark.parametrize(
    "budget,topk,vocab,expected",
    [(64, None, 163840, 64), (64, 8, 163840, 8), (300, None, 100, 100)],
)
def test_resolve_tree_topk_defaults_to_min_budget_vocab(budget, topk, vocab, expected):
    assert resolve_tree_topk(budget, topk, vocab) == expected


def test_resolve_tree_topk_rejects_out_of_range():
    with pytest.raises(ValueError, match="top-K"):
        resolve_tree_topk(8, 0, 100)
    with pytest.raises(ValueError, match="budget"):
        resolve_tree_topk(0, None, 100)


def test_public_api_is_complete():
    for name in ddtree_utils.__all__:
        assert hasattr(ddtree_utils, name), name
