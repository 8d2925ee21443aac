"""ddtree_sampling: plain decoding's sampling distribution, filter by filter.

Worked examples by hand over probabilities [0.4, 0.3, 0.2, 0.1] (logits are
their logs, temperature 1), where the joint and the top-k-first orders differ;
then the sort-based filter this module used to run (kept here only, as the
reference: a stable descending sort, so ties rank the lower token id first) on
random and adversarial inputs (ties at the top-k and top-p cuts, bf16 logits,
mixed rows), with the kept sets compared exactly; the module must never sort.
SGLang's own pytorch-backend sampler is the reference on random inputs in
``cpu_engine/sampler_check.py`` (a child process on the CPU tree), and on real
servers the distribution tests of ``test_ddtree_engine_sampling``.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sglang.srt.speculative.ddtree_sampling import (
    SamplingRows,
    plain_sampling_probs,
    top_k_first,
)

PROBS = [0.4, 0.3, 0.2, 0.1]
ALL = 1 << 30  # SGLang's TOP_K_ALL


def _rows(top_k=ALL, top_p=1.0, min_p=0.0, temperature=1.0, n=1, max_top_k=None):
    return SamplingRows(
        temperatures=torch.full((n, 1), temperature),
        top_ks=torch.full((n,), top_k, dtype=torch.int32),
        top_ps=torch.full((n,), top_p),
        min_ps=torch.full((n,), min_p),
        need_top_k=top_k != ALL,
        need_top_p=top_p != 1.0,
        need_min_p=min_p > 0,
        max_top_k=max_top_k,
    )


def _probs(rows, backend="pytorch", probs=PROBS):
    logits = torch.tensor([probs]).log().expand(rows.top_ks.shape[0], -1)
    return plain_sampling_probs(logits, rows, backend)


def _close(got, want):
    torch.testing.assert_close(
        got, torch.tensor(want, dtype=got.dtype).expand_as(got), atol=1e-6, rtol=0
    )


def test_no_filter_is_the_softmax_at_the_temperature():
    _close(_probs(_rows()), PROBS)
    hot = [p**0.5 for p in PROBS]
    _close(_probs(_rows(temperature=2.0)), [p / sum(hot) for p in hot])


@pytest.mark.parametrize("max_top_k", [None, 2, 3])
def test_top_k_keeps_the_k_largest(max_top_k):
    _close(_probs(_rows(top_k=2, max_top_k=max_top_k)), [4 / 7, 3 / 7, 0, 0])


def test_top_p_keeps_the_prefix_whose_mass_before_is_within_p():
    # Mass before each rank: 0, 0.4, 0.7, 0.9; top_p 0.65 keeps ranks 0 and 1.
    _close(_probs(_rows(top_p=0.65)), [4 / 7, 3 / 7, 0, 0])
    _close(_probs(_rows(top_p=0.3)), [1, 0, 0, 0])


def test_min_p_keeps_what_reaches_min_p_times_the_top():
    # Threshold 0.6 * 0.4 = 0.24: 0.4 and 0.3 stay.
    _close(_probs(_rows(min_p=0.6)), [4 / 7, 3 / 7, 0, 0])
    _close(_probs(_rows(min_p=0.45)), [4 / 9, 3 / 9, 2 / 9, 0])


def test_joint_order_judges_top_p_on_the_unfiltered_mass():
    """top_k 2, top_p 0.5: the mass before rank 1 is 0.4 <= 0.5 (kept) jointly,
    but 4/7 > 0.5 once top-k renormalised (dropped, top-k first)."""
    rows = _rows(top_k=2, top_p=0.5, min_p=0.01)
    _close(_probs(rows, "pytorch"), [4 / 7, 3 / 7, 0, 0])
    _close(_probs(rows, "flashinfer"), [1, 0, 0, 0])


def test_flashinfer_filters_top_k_first_only_when_the_batch_needs_min_p():
    assert top_k_first("flashinfer", need_min_p=True)
    assert not top_k_first("flashinfer", need_min_p=False)
    assert not top_k_first("pytorch", need_min_p=True)
    rows = _rows(top_k=2, top_p=0.5)
    _close(_probs(rows, "flashinfer"), [4 / 7, 3 / 7, 0, 0])


def test_rows_are_filtered_with_their_own_parameters():
    rows = SamplingRows.of(
        type(
            "Info",
            (),
            {
                "temperatures": torch.tensor([[1.0], [1.0]]),
                "top_ks": torch.tensor([1, ALL]),
                "top_ps": torch.tensor([1.0, 0.65]),
                "min_ps": torch.tensor([0.0, 0.0]),
                "need_top_k_sampling": True,
                "need_top_p_sampling": True,
                "need_min_p_sampling": False,
                "max_top_k": None,
            },
        )(),
        width=3,
    )
    assert rows.top_ks.tolist() == [1, 1, 1, ALL, ALL, ALL]
    got = _probs(rows)
    _close(got[:3], [1, 0, 0, 0])
    _close(got[3:], [4 / 7, 3 / 7, 0, 0])
    _close(
        plain_sampling_probs(torch.tensor([PROBS]).log(), rows.select(slice(4, 5))),
        [4 / 7, 3 / 7, 0, 0],
    )


def test_masked_tokens_stay_impossible_and_rows_sum_to_one():
    logits = torch.tensor([[math.log(0.4), -math.inf, math.log(0.2), math.log(0.1)]])
    got = plain_sampling_probs(logits, _rows(top_k=3, top_p=0.9, min_p=0.1))
    assert got[0, 1] == 0
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(1))
    _close(got, [4 / 7, 0, 2 / 7, 1 / 7])


@pytest.mark.slow
def test_equals_sglangs_pytorch_sampler_on_random_inputs(cpu_sglang_python):
    """200 random batches (vocabularies 2-299, per-row top_k / top_p / min_p /
    temperature, some rows unfiltered): the distribution SGLang's sampler draws
    from (its filtered probabilities, renormalised) within 1e-6."""
    from cpu_engine.server import server_env

    script = Path(__file__).parent / "cpu_engine" / "sampler_check.py"
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=server_env(cpu_sglang_python),
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def _sorted_reference(logits, rows, backend="pytorch"):
    """The old sort-based filter over the whole row, float64 prefix sums."""
    probs = torch.softmax(logits.to(torch.float32) / rows.temperatures, dim=-1)
    if not (rows.need_top_k or rows.need_top_p or rows.need_min_p):
        return probs
    values, index = torch.sort(probs, dim=-1, descending=True, stable=True)
    ranks = torch.arange(values.shape[-1])[None, :]
    keep = ranks < rows.top_ks.to(torch.int64)[:, None]
    wide = values.to(torch.float64)
    if top_k_first(backend, rows.need_min_p):
        top = wide * keep
        top = top / top.sum(dim=-1, keepdim=True)
        before = torch.cumsum(top, dim=-1) - top
    else:
        before = torch.cumsum(wide, dim=-1) - wide
    # top_p 1 keeps all: a float prefix sum past 1 by rounding drops nothing.
    keep &= (before <= rows.top_ps.to(torch.float64)[:, None]) | (
        rows.top_ps[:, None] >= 1
    )
    if rows.need_min_p:
        keep &= values >= values[:, :1] * rows.min_ps[:, None]
    out = torch.zeros_like(probs).scatter_(1, index, values * keep)
    return out / out.sum(dim=-1, keepdim=True)


def _same(got, want):
    """Identical kept sets (nonzero entries), probabilities within 1e-6."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got > 0, want > 0), (got > 0) ^ (want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _per_row(top_ks, top_ps=None, min_ps=None, temperatures=None, max_top_k=None):
    n = len(top_ks)
    top_ps = [1.0] * n if top_ps is None else top_ps
    min_ps = [0.0] * n if min_ps is None else min_ps
    temperatures = [1.0] * n if temperatures is None else temperatures
    return SamplingRows(
        temperatures=torch.tensor(temperatures, dtype=torch.float32)[:, None],
        top_ks=torch.tensor(top_ks, dtype=torch.int32),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        min_ps=torch.tensor(min_ps, dtype=torch.float32),
        need_top_k=any(k != ALL for k in top_ks),
        need_top_p=any(p != 1.0 for p in top_ps),
        need_min_p=any(p > 0 for p in min_ps),
        max_top_k=max_top_k,
    )


# How close a top-p cut may come to a prefix sum and still be rounding's call:
# the target sums in float32 (as plain decoding's cumsum does), the reference in
# float64, so the two may put a token whose prefix mass is within rounding of
# top_p on either side of the cut.
TOP_P_ROUNDING = 1e-6


def _both(logits, rows, backend="pytorch"):
    """The target equals the sort-based reference: the same kept sets, except
    where a row's top_p lies within TOP_P_ROUNDING of a prefix sum (then any
    set between the references at top_p -/+ that margin), and its
    probabilities are the row's softmax over the set it kept, renormalised."""
    got = plain_sampling_probs(logits, rows, backend)
    want = _sorted_reference(logits, rows, backend)
    if torch.equal(got > 0, want > 0):
        _same(got, want)
        return got
    lo = _sorted_reference(logits, _top_p_scaled(rows, 1 - TOP_P_ROUNDING), backend)
    hi = _sorted_reference(logits, _top_p_scaled(rows, 1 + TOP_P_ROUNDING), backend)
    kept = got > 0
    assert not (lo > 0).logical_and(~kept).any(), "dropped a token inside the cut"
    assert not kept.logical_and(hi <= 0).any(), "kept a token outside the cut"
    probs = torch.softmax(logits.to(torch.float32) / rows.temperatures, dim=-1)
    own = probs * kept
    _same(got, own / own.sum(dim=-1, keepdim=True))
    return got


def _top_p_scaled(rows, factor):
    """rows with every top_p below 1 scaled by factor (top_p 1 keeps all)."""
    scaled = torch.where(rows.top_ps < 1, rows.top_ps * factor, rows.top_ps)
    return replace(rows, top_ps=scaled)


def _kept_ids(got):
    return [torch.nonzero(row).flatten().tolist() for row in got]


@pytest.mark.parametrize("max_top_k", [None, 2, 3])
def test_a_top_k_cut_inside_a_tie_group_keeps_the_lowest_token_ids(max_top_k):
    # ids 1, 2, 3 tie at the top; top_k 2 keeps ids 1 and 2 whatever topk picks.
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    got = _both(logits, _per_row([2], max_top_k=max_top_k))
    assert _kept_ids(got) == [[1, 2]]
    # The tie group runs past the topk bound: still the lowest ids.
    logits = torch.tensor([[0.0] + [2.0] * 6 + [1.0]]).flip(-1)
    got = _both(logits, _per_row([2], max_top_k=max_top_k))
    assert _kept_ids(got) == [[1, 2]]


@pytest.mark.parametrize(("max_top_k", "top_k"), [(None, ALL), (None, 8), (8, 8)])
def test_a_top_p_cut_inside_a_tie_group_keeps_the_lowest_token_ids(max_top_k, top_k):
    # Probabilities [4, 2, 2, 2, 1, 1, 1, 1] / 14, top_p 0.5: mass before the
    # three 2/14 ties is 4/14, 6/14, 8/14, so two of them stay (ids 1, 2).
    weights = [4, 2, 2, 2, 1, 1, 1, 1]
    logits = torch.tensor([weights], dtype=torch.float32).log()
    got = _both(logits, _per_row([top_k], top_ps=[0.5], max_top_k=max_top_k))
    assert _kept_ids(got) == [[0, 1, 2]]
    # Permuted ids: the kept ties are still the lowest ids of the group.
    perm = [7, 3, 5, 1, 0, 2, 4, 6]
    logits = torch.tensor([[weights[perm.index(i)] for i in range(8)]]).float().log()
    got = _both(logits, _per_row([top_k], top_ps=[0.5], max_top_k=max_top_k))
    assert _kept_ids(got) == [[1, 3, 7]]


@pytest.mark.parametrize("backend", ["pytorch", "flashinfer"])
@pytest.mark.parametrize("vocab", [1, 2, 7, 64])
def test_edge_parameters_top_p_one_top_k_one_and_top_k_at_least_v(backend, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-2, 3, (6, vocab), generator=gen).float()
    top_ks = [1, vocab, vocab + 1, ALL, ALL, 1]
    top_ps = [1.0, 1.0, 1.0, 1.0, 0.999, 0.0]
    min_ps = [0.0, 0.0, 0.5, 0.0, 0.0, 1.0]
    for max_top_k in (None, vocab, vocab + 3, ALL):
        rows = _per_row(top_ks, top_ps, min_ps, max_top_k=max_top_k)
        got = _both(logits, rows, backend)
        assert (got[0] > 0).sum() == 1 and (got[5] > 0).sum() == 1
        unfiltered = torch.softmax(logits[[1, 3]], -1)
        torch.testing.assert_close(got[[1, 3]], unfiltered)


def _random_rows(gen, n, vocab, greedy=0.2):
    top_ks = torch.randint(1, vocab + 3, (n,), generator=gen)
    top_ks[torch.rand(n, generator=gen) < 0.3] = ALL
    top_ps = torch.rand(n, generator=gen) * 0.95 + 0.05
    top_ps[torch.rand(n, generator=gen) < 0.3] = 1.0
    min_ps = torch.rand(n, generator=gen) * 0.3
    min_ps[torch.rand(n, generator=gen) < 0.5] = 0.0
    temperatures = torch.rand(n, generator=gen) + 0.3
    greedy_rows = torch.rand(n, generator=gen) < greedy
    top_ks[greedy_rows] = 1  # SGLang's greedy request: top_k 1, temperature 1
    temperatures[greedy_rows] = 1.0
    return top_ks, top_ps, min_ps, temperatures


@pytest.mark.parametrize("backend", ["pytorch", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_equals_the_sort_based_filter_on_random_batches(backend, dtype, ties):
    """Mixed rows in one batch (greedy, sampled, each its own filters and
    temperature), all four combinations of the batch flags, with and without a
    host top-k bound; integer logits (``ties``) and bf16 make many ties."""
    # A seed of its own per case, the same in every process (hash() of a str is
    # salted per process: a failure could not be replayed).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{backend} {dtype} {ties}".encode()))
    for case in range(40):
        n = int(torch.randint(1, 10, (1,), generator=gen))
        vocab = int(torch.randint(2, 400, (1,), generator=gen))
        if ties:
            logits = torch.randint(-4, 4, (n, vocab), generator=gen).float()
        else:
            logits = torch.randn(n, vocab, generator=gen) * 3
        logits = logits.to(dtype)
        top_ks, top_ps, min_ps, temperatures = _random_rows(gen, n, vocab)
        for use_k, use_p, use_min_p in itertools.product([False, True], repeat=3):
            rows = _per_row(
                top_ks.tolist() if use_k else [ALL] * n,
                top_ps.tolist() if use_p else None,
                min_ps.tolist() if use_min_p else None,
                temperatures.tolist(),
            )
            _both(logits, rows, backend)
            if use_k and bool((top_ks != ALL).all()):
                bound = int(top_ks.max()) + case % 3
                _both(logits, replace(rows, max_top_k=bound), backend)


def test_equals_the_sort_based_filter_at_a_large_vocabulary():
    """V = 65,536, bf16 logits (ties everywhere below the top): counts and
    masses over long rows, with and without the host bound, both orders."""
    gen = torch.Generator().manual_seed(65536)
    logits = (torch.randn(6, 65536, generator=gen) * 4).to(torch.bfloat16)
    rows = _per_row(
        [ALL, 40, 1000, ALL, 5, ALL],
        [0.9, 0.5, 0.99, 1.0, 0.95, 0.3],
        [0.0, 0.0, 0.0, 0.05, 0.0, 0.0],
        [0.7, 1.0, 1.3, 1.0, 0.5, 2.0],
    )
    for backend in ("pytorch", "flashinfer"):
        _both(logits, rows, backend)
        _both(logits[1:3], replace(rows.select(slice(1, 3)), max_top_k=1000), backend)


def test_never_sorts_the_rows(monkeypatch):
    """No sort of any kind, and the only topk is the bounded [R, max_top_k]."""

    def forbidden(*args, **kwargs):
        raise AssertionError("plain_sampling_probs must not sort [R, V]")

    real_topk = torch.topk
    widths = []

    def topk(tensor, k, *args, **kwargs):
        widths.append(k)
        return real_topk(tensor, k, *args, **kwargs)

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 500, generator=gen)
    top_ks, top_ps, min_ps, temperatures = _random_rows(gen, 12, 500)
    top_ks[0] = ALL
    mixed = _per_row(top_ks.tolist(), top_ps.tolist(), min_ps.tolist())
    bounded = _per_row([5] * 12, top_ps.tolist(), min_ps.tolist(), max_top_k=9)
    backends = ("pytorch", "flashinfer")
    want = [_sorted_reference(logits, r, b) for r in (mixed, bounded) for b in backends]
    for name in ("sort", "argsort", "msort"):
        monkeypatch.setattr(torch, name, forbidden)
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "topk", topk)
    got = [
        plain_sampling_probs(logits, r, b) for r in (mixed, bounded) for b in backends
    ]
    for g, w in zip(got, want):
        _same(g, w)
    assert widths == [9, 9]


def test_bad_shapes_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        plain_sampling_probs(torch.zeros(2, 3, 4), _rows(n=2))
    with pytest.raises(ValueError, match=r"temperatures \(3, 1\)"):
        plain_sampling_probs(torch.zeros(2, 4), _rows(n=3))
