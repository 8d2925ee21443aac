"""DDTree's acceptance metrics: accept rate over the tree depth, per-depth acceptance.

Counting only (no server): ``test_ddtree_engine_metrics`` checks what a real
server exports.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.speculative.ddtree_config import ddtree_verify_width
from sglang.srt.speculative.ddtree_metrics import (
    DEPTH_GAUGE_NAME,
    DEPTH_RATE_KEY,
    AcceptDepthCounter,
    depth_rates_from_histogram,
    draft_slots_per_verify,
    tree_max_depth,
)


def _spec(budget=None, block_size=4):
    """``get_spec()`` after ``_handle_dflash`` (DDTree: W = max(B + 1, block))."""
    width = block_size if budget is None else ddtree_verify_width(budget, block_size)
    return SimpleNamespace(
        speculative_dflash_tree_budget=budget,
        speculative_dflash_block_size=block_size,
        speculative_num_draft_tokens=width,
    )


def test_tree_accept_rate_divides_by_the_depth_not_the_node_count():
    spec = _spec(budget=192, block_size=4)
    assert spec.speculative_num_draft_tokens == 193
    assert tree_max_depth(spec) == 3
    assert draft_slots_per_verify(spec) == 3  # SGLang's W - 1 would be 192


def test_linear_dflash_and_other_algorithms_keep_sglangs_denominator():
    assert tree_max_depth(_spec(budget=None, block_size=4)) is None
    assert draft_slots_per_verify(_spec(budget=None, block_size=4)) == 3
    eagle = SimpleNamespace(speculative_num_draft_tokens=8)
    assert tree_max_depth(eagle) is None
    assert draft_slots_per_verify(eagle) == 7
    assert AcceptDepthCounter.for_spec(eagle).state() == {}


def test_depth_rates_are_tail_fractions_of_the_histogram():
    # 10 verifies: 2 accepted 0 drafts, 3 accepted 1, 4 accepted 2, 1 accepted 3.
    hist = [2, 3, 4, 1]
    rates = depth_rates_from_histogram(hist, 10, 3)
    assert rates == pytest.approx([0.8, 0.5, 0.1])
    assert sum(rates) == pytest.approx((3 * 1 + 4 * 2 + 1 * 3) / 10)
    # A histogram shorter than L (nothing reached the deeper depths): zeros.
    assert depth_rates_from_histogram([1, 1], 2, 3) == pytest.approx([0.5, 0.0, 0.0])
    assert depth_rates_from_histogram([], 0, 3) == []


def test_counter_counts_verifies_reaching_each_depth():
    counter = AcceptDepthCounter.for_spec(_spec(budget=8, block_size=4))
    assert counter.state() == {}  # nothing before the first verify
    counter.add([0, 1, 3])
    counter.add([2])
    assert counter.verify_ct == 4
    assert counter.reached == [3, 2, 1]
    rates = counter.rates()
    assert rates == pytest.approx([0.75, 0.5, 0.25])
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert sum(rates) == pytest.approx((0 + 1 + 3 + 2) / 4)
    # Mean over depths = accepted / (verifies x L): the tree's spec_accept_rate.
    assert sum(rates) / 3 == pytest.approx(6 / (4 * 3))
    assert counter.state() == {DEPTH_RATE_KEY: rates}
    counter.reset()
    assert counter.verify_ct == 0 and counter.reached == [0, 0, 0]
    assert counter.state() == {}


def test_counter_is_a_no_op_without_a_tree():
    counter = AcceptDepthCounter.for_spec(_spec(budget=None))
    counter.add([1, 2, 3])
    assert counter.verify_ct == 0 and counter.state() == {}


def test_counter_agrees_with_the_per_request_histogram():
    accepted = [0, 3, 1, 1, 2, 3, 0, 2, 2, 1]
    counter = AcceptDepthCounter(3)
    counter.add(accepted)
    hist = [accepted.count(k) for k in range(4)]
    assert counter.rates() == pytest.approx(
        depth_rates_from_histogram(hist, len(accepted), 3)
    )


def test_export_sets_one_gauge_per_depth_with_sglangs_labels():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.REGISTRY
    counter = AcceptDepthCounter(3)
    counter.add([3, 1])
    collector = SimpleNamespace(labels={"model_name": "tiny", "engine_type": "unified"})
    counter.export(collector)
    counter.add([0, 0])  # later verifies update the same gauge
    counter.export(collector)
    got = [
        registry.get_sample_value(
            DEPTH_GAUGE_NAME,
            {**collector.labels, "depth": str(d)},
        )
        for d in (1, 2, 3)
    ]
    assert got == pytest.approx([0.5, 0.25, 0.25])
