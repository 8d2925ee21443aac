"""The per-step pieces DFlashWorkerV2 calls, against straightforward loops."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sglang.srt.speculative.ddtree_step import (
    DDTREE_DENSE_SAMPLING_MAX_ELEMENTS,
    DDTreeAccept,
    accept_by_target_samples,
    accept_greedy,
    accept_kv_moves,
    accept_sampling,
    build_verify_step,
    commit_outputs,
    compact_hidden,
    use_dense_sampling,
)
from sglang.srt.speculative.ddtree_tree import build_ddtree_tree_from_topk


def _random_draft(gen, bs, depth, k, vocab):
    logits = torch.randn(bs, depth, vocab, generator=gen, dtype=torch.float64) * 2
    log_probs, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return log_probs.float(), ids


def _reference_tree(log_probs, ids, budget):
    """Per request: (tokens [n], parents [n+1], depths [n]) from the heap builder."""
    return [
        build_ddtree_tree_from_topk(log_probs[b], ids[b], budget)
        for b in range(log_probs.shape[0])
    ]


def _ancestors(parents, i):
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


def _children(parents, node):
    return [c for c in range(len(parents)) if parents[c] == node]


@pytest.mark.parametrize(
    "bs,depth,k,budget,extra",
    [
        (1, 3, 2, 5, 0),
        (3, 3, 2, 2, 2),
        (4, 5, 3, 12, 0),
        (2, 2, 1, 6, 0),
        (3, 4, 4, 9, 3),
    ],
)
def test_verify_step_matches_heap_tree_positions_mask(bs, depth, k, budget, extra):
    gen = torch.Generator().manual_seed(bs * 100 + budget)
    log_probs, ids = _random_draft(gen, bs, depth, k, vocab=40)
    roots = torch.randint(0, 40, (bs,), generator=gen)
    prefix = torch.randint(1, 9, (bs,), generator=gen)
    width = budget + 1 + extra
    bound = int(prefix.sum()) + 3  # a loose host bound must work too
    step = build_verify_step(log_probs, ids, roots, prefix, budget, width, bound)
    assert step.tokens.shape == (bs, width) and step.positions.shape == (bs * width,)
    offset = 0
    for b, tree in enumerate(_reference_tree(log_probs, ids, budget)):
        n = tree.tokens.numel()
        parents = tree.parents.tolist() + [-1] * (width - n - 1)
        want_tokens = [int(roots[b])] + tree.tokens.tolist()
        want_tokens += [int(roots[b])] * (width - n - 1)
        assert step.tokens[b].tolist() == want_tokens
        depths = [0] + tree.depths.tolist() + [0] * (width - n - 1)
        got_pos = step.positions[b * width : (b + 1) * width].tolist()
        assert got_pos == [int(prefix[b]) + d for d in depths]
        cols = int(prefix[b]) + width
        block = step.custom_mask[offset : offset + width * cols].view(width, cols)
        offset += width * cols
        assert bool(block[:, : int(prefix[b])].all())
        for i in range(width):
            allowed = {0, i} | (_ancestors(parents, i) if i <= n else set())
            got = {j for j in range(width) if bool(block[i, int(prefix[b]) + j])}
            assert got == allowed, (b, i)
        r = step.retrieve
        assert r.retrieve_index[b].tolist() == [b * width + i for i in range(width)]
        for i in range(width):
            kids = _children(parents, i)
            assert int(r.retrieve_next_token[b, i]) == (kids[0] if kids else -1)
            sib = _children(parents, parents[i]) if parents[i] >= 0 else []
            nxt = [c for c in sib if c > i]
            assert int(r.retrieve_next_sibling[b, i]) == (nxt[0] if nxt else -1)


def _walk(tokens, parents, follow, max_accept):
    """Reference walk: from the root, the first child whose token is follow[cur]."""
    path = [0]
    while len(path) - 1 < max_accept:
        cur = path[-1]
        nxt = [c for c in _children(parents, cur) if tokens[c] == follow[cur]]
        if not nxt:
            break
        path.append(nxt[0])
    return path


def _random_step(seed, bs=4, depth=4, k=3, budget=10, width=None):
    gen = torch.Generator().manual_seed(seed)
    log_probs, ids = _random_draft(gen, bs, depth, k, vocab=12)
    roots = torch.randint(0, 12, (bs,), generator=gen)
    prefix = torch.randint(1, 6, (bs,), generator=gen)
    width = width or budget + 1
    step = build_verify_step(log_probs, ids, roots, prefix, budget, width)
    parents = [
        t.parents.tolist() + [-1] * (width - t.parents.numel())
        for t in _reference_tree(log_probs, ids, budget)
    ]
    return gen, step, parents


@pytest.mark.parametrize("seed", range(6))
def test_accept_greedy_and_commit_match_reference_walk(seed):
    gen, step, parents = _random_step(seed, width=13 if seed % 2 else None)
    bs, width = step.tokens.shape
    depth = 4
    # Targets that often agree with the tree: a tree child's token, else random.
    target = torch.randint(0, 12, (bs, width), generator=gen)
    for b, i in itertools.product(range(bs), range(width)):
        kids = _children(parents[b], i)
        if kids and torch.rand((), generator=gen) < 0.7:
            target[b, i] = step.tokens[b, kids[-1]]
    accept = accept_greedy(step, target.reshape(-1), depth + 1)
    out_tokens, commit_lens, bonus = commit_outputs(accept, block_size=depth + 1)
    for b in range(bs):
        toks = step.tokens[b].tolist()
        path = _walk(toks, parents[b], target[b].tolist(), depth)
        assert int(accept.accept_len[b]) == len(path) - 1
        assert accept.accept_index[b, : len(path)].tolist() == [
            b * width + p for p in path
        ]
        emitted = [toks[p] for p in path[1:]] + [int(target[b, path[-1]])]
        assert out_tokens[b, : len(path)].tolist() == emitted
        assert int(commit_lens[b]) == len(path) and int(bonus[b]) == emitted[-1]
    assert out_tokens.shape == (bs, depth + 1) and commit_lens.dtype == torch.int32


def test_compact_hidden_and_kv_moves_follow_the_accepted_path():
    gen, step, parents = _random_step(7)
    bs, width = step.tokens.shape
    target = torch.randint(0, 12, (bs, width), generator=gen)
    accept = accept_greedy(step, target.reshape(-1), 5)
    hidden = torch.randn(bs, width, 3, generator=gen)
    compact = compact_hidden(hidden, accept, block_size=5)
    out_cache_loc = torch.randperm(1000, generator=gen)[: bs * width]
    dst, src = accept_kv_moves(accept, out_cache_loc)
    for b in range(bs):
        n = int(accept.accept_len[b])
        slots = [int(s) - b * width for s in accept.accept_index[b, : n + 1]]
        for row, slot in enumerate(slots):
            assert torch.equal(compact[b, row], hidden[b, slot])
            assert int(dst[b, row]) == int(out_cache_loc[b * width + row])
            assert int(src[b, row]) == int(out_cache_loc[b * width + slot])
        assert torch.equal(dst[b, n + 1 :], src[b, n + 1 :])  # harmless self-moves


def test_commit_outputs_rejects_an_accept_wider_than_the_block():
    accept = DDTreeAccept(
        accept_index=torch.zeros(1, 6, dtype=torch.int32),
        accept_len=torch.zeros(1, dtype=torch.int32),
        predicts=torch.zeros(6, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=r"accept_index \[bs, <= 4\]"):
        commit_outputs(accept, block_size=4)


def test_build_verify_step_rejects_a_width_below_the_tree():
    log_probs, ids = _random_draft(torch.Generator().manual_seed(0), 1, 2, 2, 10)
    with pytest.raises(ValueError, match="width >= budget \\+ 1 = 5"):
        build_verify_step(
            log_probs,
            ids,
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            4,
            3,
        )


def test_dense_sampling_threshold_is_bs_times_width_times_vocab():
    assert use_dense_sampling(1, 512, DDTREE_DENSE_SAMPLING_MAX_ELEMENTS // 512)
    assert not use_dense_sampling(2, 512, DDTREE_DENSE_SAMPLING_MAX_ELEMENTS // 512)


# A toy target: a bigram chain over a small vocabulary, p(next | token).
_VOCAB = 5


def _bigram(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(_VOCAB, _VOCAB, generator=gen) * 1.5, -1)


def _two_token_counts(step_fn, trials, seed):
    """Counts of the first two emitted tokens for a fixed tree under step_fn."""
    gen = torch.Generator().manual_seed(seed)
    log_probs, ids = _random_draft(gen, 1, 2, 3, _VOCAB)
    root = torch.tensor([1])
    step = build_verify_step(log_probs, ids, root, torch.tensor([4]), 6, 7)
    bigram = _bigram(seed)
    probs = bigram[step.tokens[0]]  # [W, V]: the target after each slot's token
    counts = torch.zeros(_VOCAB, _VOCAB)
    batch = 2000
    for _ in range(trials // batch):
        tiled = DDTreeStepBatch.tile(step, batch)
        accept = step_fn(tiled, probs.expand(batch, -1, -1).contiguous())
        out, commit, _ = commit_outputs(accept, block_size=3)
        # One token this step: the next step (an exact verify by induction)
        # emits the second, a target sample given the first.
        nxt = torch.multinomial(bigram[out[:, 0]], 1)[:, 0]
        second = torch.where(commit >= 2, out[:, 1], nxt)
        counts.index_put_((out[:, 0], second), torch.ones(batch), accumulate=True)
    exact = bigram[1][:, None] * bigram  # p(a | root) * p(b | a)
    return counts, exact


class DDTreeStepBatch:
    """The same tree repeated over a batch (for distribution tests)."""

    @staticmethod
    def tile(step, bs):
        from sglang.srt.speculative.ddtree_retrieve import DDTreeRetrieve
        from sglang.srt.speculative.ddtree_step import DDTreeVerifyStep

        width = step.width
        r = step.retrieve
        index = torch.arange(bs * width).view(bs, width)
        return DDTreeVerifyStep(
            tokens=step.tokens.expand(bs, -1).contiguous(),
            positions=step.positions.repeat(bs),
            custom_mask=step.custom_mask.repeat(bs),
            retrieve=DDTreeRetrieve(
                index,
                r.retrieve_next_token.expand(bs, -1).contiguous(),
                r.retrieve_next_sibling.expand(bs, -1).contiguous(),
            ),
        )


def _chi_square_p(counts, exact):
    from scipy.stats import chisquare

    n = counts.sum()
    keep = exact.reshape(-1) * n >= 5
    observed = counts.reshape(-1)[keep].double()
    expected = exact.reshape(-1)[keep].double() * n
    expected *= observed.sum() / expected.sum()
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def _sample_then_walk(step, probs):
    samples = torch.multinomial(probs.view(-1, _VOCAB), 1).view(probs.shape[:2])
    return accept_by_target_samples(step, samples, 3)


def _dense(threshold_acc):
    def run(step, probs):
        return accept_sampling(step, probs, 3, threshold_acc=threshold_acc)

    return run


@pytest.mark.parametrize("name", ["sample_then_walk", "dense"])
def test_sampling_paths_emit_the_target_distribution(name):
    torch.manual_seed(11)
    fn = _sample_then_walk if name == "sample_then_walk" else _dense(1.0)
    counts, exact = _two_token_counts(fn, trials=40000, seed=3)
    assert _chi_square_p(counts, exact) > 1e-4


def test_sampling_negative_control_threshold_acc_below_one_is_detected():
    torch.manual_seed(12)
    counts, exact = _two_token_counts(_dense(0.3), trials=40000, seed=3)
    assert _chi_square_p(counts, exact) < 1e-6
    assert math.isfinite(float(counts.sum()))


@pytest.mark.parametrize(
    "width,vocab,rows",
    [
        (17, 8, (2**26 // (17 * 8)) * 17),
        (65, 163_840, 6 * 65),
        (129, 163_840, 3 * 129),
        (1025, 163_840, 1025),
    ],
)
def test_memory_light_chunks_are_whole_requests_of_bounded_size(width, vocab, rows):
    """At Kimi's vocabulary a chunk holds a few requests (at least one), so the
    light path's transient stays near 2^26 elements, not 4,096 rows' worth."""
    from sglang.srt.speculative.ddtree_worker import light_chunk_rows

    got = light_chunk_rows(width, vocab)
    assert got == rows and got % width == 0
    assert got * vocab <= max(2**26, width * vocab)
