"""Greedy and sampling verify: kernel semantics, greedy == argmax, losslessness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sglang.srt.speculative.ddtree_batched import build_ddtree_batched
from sglang.srt.speculative.ddtree_retrieve import (
    DDTreeRetrieve,
    compile_ddtree_retrieve,
)
from sglang.srt.speculative.ddtree_verify import (
    ddtree_verify_greedy,
    ddtree_verify_sampling,
    tree_speculative_sampling_target_only_torch,
)


def _random_trees(
    gen: torch.Generator, bs: int, depth: int, k: int, budget: int, vocab: int
):
    """Batched DDTrees with distinct sibling tokens drawn from a small vocabulary."""
    lp = torch.sort(
        -torch.rand(bs, depth, k, generator=gen, dtype=torch.float64) * 3,
        dim=-1,
        descending=True,
    ).values
    ids = torch.stack(
        [torch.randperm(vocab, generator=gen)[:k] for _ in range(bs * depth)]
    ).reshape(bs, depth, k)
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    batch = build_ddtree_batched(lp, ids, budget, root_tokens=roots)
    return batch, compile_ddtree_retrieve(batch.parents, batch.node_logws)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The 100k-draw tests run ~8x faster on one thread when a shared 2-core box is busy
    (intra-op threads oversubscribe); the previous setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- scalar references: one request at a time, line by line after SGLang's kernels --


def _greedy_reference(cand, ridx, nxt, sib, target, s):
    """verify_tree_greedy for one request (lists): (predicts dict, accept, num)."""
    n = len(cand)
    last = ridx[0]
    accept, predicts, num, cur = [last], {}, 0, 0
    for _ in range(1, s):
        cur = nxt[cur]
        tgt = target[last % n]
        while cur != -1 and cand[cur] != tgt:
            cur = sib[cur]
        if cur == -1:
            break
        predicts[last] = tgt
        num += 1
        accept.append(ridx[cur])
        last = ridx[cur]
    predicts[last] = target[last % n]
    return predicts, accept, num


def _sampling_reference(
    cand, ridx, nxt, sib, coins, final_coin, tp, dp, s, thr_single, thr_acc
):
    """tree_speculative_sampling_target_only, one request in float32 (dp mutated)."""
    f32 = np.float32
    # The kernel's host wrapper passes
    # std::max(static_cast<float>(threshold_acc), 1e-9f).
    thr_single, thr_acc = f32(thr_single), max(f32(thr_acc), f32(1e-9))
    prob_acc, row, coin = f32(0), 0, f32(coins[0])
    last = ridx[0]
    accept, predicts, num, cur = [last], {}, 0, 0
    for _ in range(1, s):
        cur = nxt[cur]
        while cur != -1:
            tok = cand[cur]
            p = f32(tp[row, tok])
            prob_acc = f32(prob_acc + p)
            if p > 0 and (coin < f32(prob_acc / thr_acc) or p >= thr_single):
                prob_acc, row, coin = f32(0), cur, f32(coins[cur])
                predicts[last] = tok
                num += 1
                accept.append(ridx[cur])
                last = ridx[cur]
                break
            dp[row, tok] = tp[row, tok]
            cur = sib[cur]
        if cur == -1:
            break
    q = tp[row].astype(f32)
    p = dp[row].astype(f32) if num != s - 1 else np.zeros_like(q)
    relu = np.maximum(q - p, f32(0))
    u = f32(final_coin) * relu.sum(dtype=f32)
    cdf = np.cumsum(relu, dtype=f32)
    hits = np.nonzero((relu > 0) & (cdf > u))[0]
    positive = np.nonzero(relu > 0)[0]
    predicts[last] = (
        int(hits[0])
        if hits.size
        else (int(positive[-1]) if positive.size else len(q) - 1)
    )
    return predicts, accept, num


def _check_against_reference(result, refs, n, s):
    for b, (predicts, accept, num) in enumerate(refs):
        assert int(result.accept_token_num[b]) == num
        assert result.accept_index[b].tolist() == accept + [-1] * (s - len(accept))
        for glob, token in predicts.items():
            assert int(result.predicts[glob]) == token
        assert result.emitted_tokens[b, : num + 1].tolist() == [
            predicts[g] for g in accept
        ]
        assert int(result.bonus_token[b]) == predicts[accept[-1]]
        assert result.accept_slots[b, : num + 1].tolist() == [g - b * n for g in accept]


def test_greedy_verify_matches_the_kernel_walk() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab, depth = 6, 4
    batch, r = _random_trees(gen, 64, depth, 3, 20, vocab)
    n, s = batch.num_slots, depth + 1
    # A target that often agrees with the draft: the best child's token, else random.
    target = torch.randint(0, vocab, (64, n), generator=gen)
    first_child = torch.where(
        r.retrieve_next_token >= 0,
        batch.tokens.gather(1, r.retrieve_next_token.clamp(min=0)),
        target,
    )
    target = torch.where(torch.rand(64, n, generator=gen) < 0.7, first_child, target)
    result = ddtree_verify_greedy(batch.tokens, r, target, s)
    assert (
        result.predicts.dtype
        == result.accept_index.dtype
        == result.accept_token_num.dtype
        == torch.int32
    )
    refs = [
        _greedy_reference(
            batch.tokens[b].tolist(),
            r.retrieve_index[b].tolist(),
            r.retrieve_next_token[b].tolist(),
            r.retrieve_next_sibling[b].tolist(),
            target[b].tolist(),
            s,
        )
        for b in range(64)
    ]
    _check_against_reference(result, refs, n, s)
    assert (
        max(num for _, _, num in refs) == depth and min(num for _, _, num in refs) == 0
    )


@pytest.mark.parametrize(
    ("thr_single", "thr_acc", "draft_nonzero"),
    [(1.0, 1.0, False), (0.3, 0.6, True), (1.0, 0.9, False)],
)
def test_sampling_verify_matches_the_kernel_walk(
    thr_single, thr_acc, draft_nonzero
) -> None:
    gen = torch.Generator().manual_seed(21)
    vocab, depth, bs = 7, 3, 96
    batch, r = _random_trees(gen, bs, depth, 3, 12, vocab)
    n, s = batch.num_slots, depth + 1
    logits = torch.randn(bs, n, vocab, generator=gen) * 2
    logits[:, :, 0] = -float("inf")  # zero-mass tokens exercise the p > 0 rule
    tp = torch.softmax(logits, dim=-1)
    dp = (
        torch.rand(bs, n, vocab, generator=gen) * 0.05
        if draft_nonzero
        else torch.zeros(bs, n, vocab)
    )
    coins, final = torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen)
    dp_ref = dp.clone().numpy()
    result = ddtree_verify_sampling(
        batch.tokens,
        r,
        tp,
        coins,
        final,
        s,
        draft_probs=dp,
        threshold_single=thr_single,
        threshold_acc=thr_acc,
    )
    refs = [
        _sampling_reference(
            batch.tokens[b].tolist(),
            r.retrieve_index[b].tolist(),
            r.retrieve_next_token[b].tolist(),
            r.retrieve_next_sibling[b].tolist(),
            coins[b].numpy(),
            final[b].item(),
            tp[b].numpy(),
            dp_ref[b],
            s,
            thr_single,
            thr_acc,
        )
        for b in range(bs)
    ]
    _check_against_reference(result, refs, n, s)
    assert np.array_equal(dp.numpy(), dp_ref)  # the same rejected probs were copied


def test_sampling_bonus_after_full_acceptance_ignores_draft_probs() -> None:
    # A chain accepted to the end (S - 1 drafts): the bonus comes from the target alone.
    tokens = torch.tensor([[0, 1, 2]])
    r = compile_ddtree_retrieve(torch.tensor([[-1, 0, 1]]))
    tp = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.25, 0.25]]])
    dp = torch.zeros_like(tp)
    dp[0, 2] = torch.tensor([0.5, 0.0, 0.0])
    out = tree_speculative_sampling_target_only_torch(
        torch.zeros(3, dtype=torch.int32),
        torch.full((1, 3), -1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        tokens,
        r.retrieve_index,
        r.retrieve_next_token,
        r.retrieve_next_sibling,
        torch.full((1, 3), 0.5),
        torch.tensor([0.1]),
        tp,
        dp,
    )
    assert out is None  # in place, like the kernel
    result = ddtree_verify_sampling(
        tokens, r, tp, torch.full((1, 3), 0.5), torch.tensor([0.1]), 3, draft_probs=dp
    )
    # Token 0 despite draft_probs[2, 0] = 0.5.
    assert result.emitted_tokens.tolist() == [[1, 2, 0]]


def _chain_sampling(target_prob: float, threshold_acc: float):
    """Root -> token 1 -> token 2; the root's target puts ``target_prob`` on token 1."""
    tokens = torch.tensor([[0, 1, 2]])
    r = compile_ddtree_retrieve(torch.tensor([[-1, 0, 1]]))
    tp = torch.full((1, 3, 3), 1.0 / 3)
    tp[0, 0] = torch.tensor([1.0 - target_prob, target_prob, 0.0])
    coins = torch.full((1, 3), 0.5)
    return ddtree_verify_sampling(
        tokens, r, tp, coins, torch.tensor([0.25]), 3, threshold_acc=threshold_acc
    )


def test_sampling_threshold_acc_is_clamped_like_the_kernel_host_wrapper() -> None:
    """threshold_acc = 0 divides by 1e-9f (no inf/NaN): a 1e-12 target prob with coin
    0.5 is rejected (1e-3 < 0.5 fails), a 1e-8 one accepted (10 > 0.5); 0 behaves as
    1e-9.
    """
    rejected = _chain_sampling(1e-12, 0.0)
    assert rejected.accept_token_num.tolist() == [0]
    assert rejected.emitted_tokens[0, 0].item() in (0, 1)  # the bonus: a real token
    accepted = _chain_sampling(1e-8, 0.0)
    assert accepted.accept_token_num.tolist() == [2]
    for prob in (1e-12, 1e-10, 1e-8, 0.3):
        zero, floor = _chain_sampling(prob, 0.0), _chain_sampling(prob, 1e-9)
        assert zero.emitted_tokens.tolist() == floor.emitted_tokens.tolist()
        assert zero.accept_index.tolist() == floor.accept_index.tolist()


@pytest.mark.parametrize(
    ("name", "value"), [("threshold_acc", 1.5), ("threshold_single", -0.1)]
)
def test_sampling_thresholds_outside_unit_interval_are_rejected(name, value) -> None:
    """The kernel's host wrapper checks 0 <= threshold <= 1; the torch twin does too."""
    tokens = torch.tensor([[0, 1]])
    r = compile_ddtree_retrieve(torch.tensor([[-1, 0]]))
    tp = torch.full((1, 2, 2), 0.5)
    with pytest.raises(ValueError, match=name):
        ddtree_verify_sampling(
            tokens,
            r,
            tp,
            torch.full((1, 2), 0.5),
            torch.tensor([0.5]),
            2,
            **{name: value},
        )


# --- greedy speculative decoding on a toy target equals plain argmax decoding ------


def test_greedy_speculative_decoding_equals_argmax_decoding() -> None:
    gen = torch.Generator().manual_seed(31)
    vocab, depth, k, budget, steps_out, bs = 12, 5, 3, 24, 60, 6
    # next = table[prev, cur]
    table = torch.randint(0, vocab, (vocab, vocab), generator=gen)

    def argmax_decode(prev: int, cur: int) -> list[int]:
        out = []
        for _ in range(steps_out):
            prev, cur = cur, int(table[prev, cur])
            out.append(cur)
        return out

    starts = [
        (int(a), int(b)) for a, b in torch.randint(0, vocab, (bs, 2), generator=gen)
    ]
    expected = [argmax_decode(p, c) for p, c in starts]
    history = [[p, c] for p, c in starts]
    accepted_total = 0
    while min(len(h) for h in history) < steps_out + 2:
        lp, ids = _toy_draft(gen, history, table, vocab, depth, k)
        roots = torch.tensor([h[-1] for h in history])
        batch = build_ddtree_batched(lp, ids, budget, root_tokens=roots)
        r = compile_ddtree_retrieve(batch.parents)
        prev_tok = torch.where(
            batch.parents >= 0,
            batch.tokens.gather(1, batch.parents.clamp(min=0)),
            torch.tensor([h[-2] for h in history])[:, None],
        )
        # The target's argmax after each slot.
        target = table[prev_tok.clamp(min=0), batch.tokens.clamp(min=0)]
        result = ddtree_verify_greedy(batch.tokens, r, target, depth + 1)
        for b in range(bs):
            num = int(result.accept_token_num[b])
            accepted_total += num
            history[b].extend(result.emitted_tokens[b, : num + 1].tolist())
    assert [h[2 : 2 + steps_out] for h in history] == expected
    assert accepted_total > 0  # the tree really accepted drafts, not only bonus tokens


def _toy_draft(gen, history, table, vocab, depth, k):
    """A draft that contains the true continuation at a random rank 70% of the time."""
    lps, idss = [], []
    for h in history:
        prev, cur = h[-2], h[-1]
        rows_lp, rows_id = [], []
        for _ in range(depth):
            prev, cur = cur, int(table[prev, cur])
            others = [
                t for t in torch.randperm(vocab, generator=gen).tolist() if t != cur
            ][:k]
            if torch.rand(1, generator=gen).item() < 0.7:
                others.insert(int(torch.randint(0, k, (1,), generator=gen)), cur)
            rows_id.append(others[:k])
            rows_lp.append(
                sorted((-torch.rand(k, generator=gen) * 4).tolist(), reverse=True)
            )
        lps.append(rows_lp)
        idss.append(rows_id)
    return torch.tensor(lps, dtype=torch.float64), torch.tensor(idss)


# --- losslessness: emitted tokens are distributed as sampling from the target ------

VOCAB, EMIT, DRAWS = 4, 3, 100_000


def _markov(seed: int, floor: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.rand(VOCAB, VOCAB, generator=gen, dtype=torch.float64) + floor
    return m / m.sum(dim=1, keepdim=True)


TARGET = _markov(41, 0.4).to(torch.float32)  # every transition has probability >= ~0.1
DRAFT = _markov(42, 0.05)  # a different chain, so drafts are often rejected


def _speculative_samples(
    depth: int,
    k: int,
    budget: int,
    seed: int,
    threshold_acc: float = 1.0,
    duplicate_siblings: bool = False,
) -> torch.Tensor:
    """DRAWS sequences of EMIT tokens from x0 = 0 by DDTree + sampling verify."""
    gen = torch.Generator().manual_seed(seed)
    lp_by_root, ids_by_root = _factorised_draft(depth, k, duplicate_siblings)
    # The draft depends on the root token only: one tree per vocabulary entry, gathered
    # per draw.
    trees = build_ddtree_batched(
        lp_by_root,
        ids_by_root,
        budget,
        root_tokens=torch.arange(VOCAB),
        validate=not duplicate_siblings,
    )
    links = compile_ddtree_retrieve(trees.parents, trees.node_logws)
    n = trees.num_slots
    retrieve_index = torch.arange(DRAWS)[:, None] * n + torch.arange(n)[None, :]
    out = torch.full((DRAWS, EMIT), -1, dtype=torch.int64)
    filled = torch.zeros(DRAWS, dtype=torch.int64)
    last = torch.zeros(DRAWS, dtype=torch.int64)
    while int(filled.min()) < EMIT:
        tokens = trees.tokens[last]
        r = DDTreeRetrieve(
            retrieve_index,
            links.retrieve_next_token[last],
            links.retrieve_next_sibling[last],
        )
        # [DRAWS, N, V]: next-token probs after each slot.
        tp = TARGET[tokens.clamp(min=0)]
        result = ddtree_verify_sampling(
            tokens,
            r,
            tp,
            torch.rand(DRAWS, n, generator=gen),
            torch.rand(DRAWS, generator=gen),
            depth + 1,
            threshold_acc=threshold_acc,
        )
        emitted, count = (
            result.emitted_tokens,
            result.accept_token_num.to(torch.int64) + 1,
        )
        for j in range(emitted.shape[1]):
            take = (j < count) & (filled < EMIT)
            out[take, filled[take]] = emitted[take, j]
            filled = filled + take.to(torch.int64)
        last = emitted.gather(1, (count - 1)[:, None])[:, 0]
    return out


def _factorised_draft(depth: int, k: int, duplicate_siblings: bool):
    """Per root token: depth-d marginals of the draft chain, top-K (DFlash-like)."""
    lps, idss = [], []
    for root in range(VOCAB):
        dist = torch.zeros(VOCAB, dtype=torch.float64)
        dist[root] = 1.0
        rows_lp, rows_id = [], []
        for _ in range(depth):
            dist = dist @ DRAFT
            top = torch.sort(dist, descending=True)
            rows_lp.append(torch.log(top.values[:k]))
            ids = top.indices[:k].clone()
            if duplicate_siblings:
                # Every sibling carries the best token: forced past validation.
                ids[1:] = ids[0]
            rows_id.append(ids)
        lps.append(torch.stack(rows_lp))
        idss.append(torch.stack(rows_id))
    return torch.stack(lps), torch.stack(idss)


def _chi_square_pvalue(samples: torch.Tensor) -> float:
    codes = (samples * torch.tensor([VOCAB * VOCAB, VOCAB, 1])).sum(dim=1)
    observed = torch.bincount(codes, minlength=VOCAB**EMIT).double()
    seq = torch.cartesian_prod(*[torch.arange(VOCAB)] * EMIT)
    prev = torch.cat(
        [torch.zeros(seq.shape[0], 1, dtype=torch.int64), seq[:, :-1]], dim=1
    )
    expected = TARGET.double()[prev, seq].prod(dim=1) * samples.shape[0]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


LOSSLESS_SHAPES = [  # (depth, k, budget): chain, star, bushy, all nodes + padding
    (1, 1, 1),
    (3, 1, 3),
    (1, 4, 4),
    (3, 2, 6),
    (2, 3, 16),
]


@pytest.mark.parametrize(("depth", "k", "budget"), LOSSLESS_SHAPES)
def test_sampling_verify_is_lossless(depth: int, k: int, budget: int) -> None:
    samples = _speculative_samples(depth, k, budget, seed=depth * 100 + k * 10 + budget)
    assert _chi_square_pvalue(samples) > 1e-3


def test_lossless_test_detects_threshold_acc_below_one() -> None:
    samples = _speculative_samples(3, 2, 6, seed=7, threshold_acc=0.5)
    assert _chi_square_pvalue(samples) < 1e-6


def test_lossless_test_detects_duplicate_siblings() -> None:
    samples = _speculative_samples(2, 3, 8, seed=8, duplicate_siblings=True)
    assert _chi_square_pvalue(samples) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"candidates": torch.zeros(6, dtype=torch.int64)},
            r"candidates of shape \[bs, N\]",
        ),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens >= 1"),
        ({"target_probs": torch.zeros(1, 6)}, r"target_probs of shape \[1, 6, V\]"),
        ({"uniform_samples": torch.zeros(1, 5)}, r"uniform_samples \[1, 6\]"),
        (
            {"draft_probs": torch.zeros(1, 6, 3, dtype=torch.float64)},
            "draft_probs contiguous float32",
        ),
        (
            {"draft_probs": torch.zeros(1, 3, 6).transpose(1, 2)},
            "draft_probs contiguous float32",
        ),
        ({"use_kernel": True}, "use_kernel=True needs CUDA"),
    ],
)
def test_sampling_verify_rejects_bad_inputs(kwargs, match) -> None:
    r = compile_ddtree_retrieve(torch.tensor([[-1, 0, 1, 2, 0, 1]]))
    args = {
        "candidates": torch.tensor([[0, 1, 2, 1, 2, 0]]),
        "retrieve": r,
        "target_probs": torch.full((1, 6, 3), 1 / 3),
        "uniform_samples": torch.rand(1, 6),
        "uniform_samples_for_final_sampling": torch.rand(1),
        "num_speculative_tokens": 4,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ddtree_verify_sampling(**args)


def test_greedy_verify_rejects_bad_inputs() -> None:
    r = compile_ddtree_retrieve(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match=r"target_predict of shape \(1, 2\)"):
        ddtree_verify_greedy(torch.tensor([[0, 1]]), r, torch.tensor([[1]]), 2)
    bad = DDTreeRetrieve(
        r.retrieve_index, r.retrieve_next_token[:, :1], r.retrieve_next_sibling
    )
    with pytest.raises(ValueError, match=r"retrieve_next_token of shape \(1, 2\)"):
        ddtree_verify_greedy(torch.tensor([[0, 1]]), bad, torch.tensor([[1, 1]]), 2)
