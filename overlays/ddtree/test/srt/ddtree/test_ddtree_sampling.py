"""ddtree_sampling: plain decoding's sampling distribution, filter by filter.

Worked examples by hand over probabilities [0.4, 0.3, 0.2, 0.1] (logits are
their logs, temperature 1), where the joint and the top-k-first orders differ;
then SGLang's own pytorch-backend sampler as the reference on random inputs
(``cpu_engine/sampler_check.py`` in a child process on the CPU tree), and on
real servers the distribution tests of ``test_ddtree_engine_sampling``.
"""

from __future__ import annotations

import math
import subprocess
import sys
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
