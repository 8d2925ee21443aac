"""DDTree's acceptance metrics on a real SGLang 0.5.23 server (CPU).

The widest tree of ``test_ddtree_engine_greedy`` (``greedy-vocab-k-default``:
budget 192, top-K default, draft block 4 so depth L = 3, verify width 193), the
very server config that module and ``test_ddtree_engine_greedy_requests`` ask
the pool for, so no new server starts in a full session. Four concurrent greedy
requests of 64 tokens; on each response's ``meta_info``:

* ``spec_accept_depth_rate`` has L entries, in [0, 1], non-increasing in depth;
* their sum is the mean accepted drafts per verify
  (``spec_num_correct_drafts / spec_verify_ct``), and one plus it is SGLang's
  ``spec_accept_length`` up to the prefill's token and the last verify's cut;
* ``spec_accept_rate`` = accepted drafts / (verify_ct x L), not SGLang's
  / (verify_ct x (W - 1)) = / (verify_ct x 192).

And ``/server_info``'s internal state carries the server's lifetime
``spec_accept_depth_rate`` (L entries, non-increasing, depth 1 reached).
"""

from __future__ import annotations

import pytest

from cpu_engine.pool import ServerConfig
from cpu_engine.server import dflash_args

pytestmark = pytest.mark.slow

BUDGET, TOPK = 192, None  # test_ddtree_engine_greedy's "vocab-k-default"
BLOCK_SIZE = 4
DEPTH = BLOCK_SIZE - 1
WIDTH = BUDGET + 1
NEW_TOKENS = 64
PROMPTS = [
    list(range(5, 20)),
    [30, 31, 32],
    [7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41],
    [50, 12, 50, 12, 50, 12, 8],
]


@pytest.fixture(scope="module")
def served(server_pool, tiny_models):
    config = ServerConfig.of(
        tiny_models.target,
        dflash_args(tiny_models.draft, budget=BUDGET, topk=TOPK),
        name="greedy-vocab-k-default",
    )
    server = server_pool.get(config)
    results = server.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
    states = server.server_info().get("internal_states") or [{}]
    return [r["meta_info"] for r in results], states


def test_per_depth_acceptance_per_request(served):
    metas, _ = served
    for meta in metas:
        rates = meta["spec_accept_depth_rate"]
        assert len(rates) == DEPTH, meta
        assert all(0.0 <= a <= 1.0 for a in rates), rates
        assert all(a >= b for a, b in zip(rates, rates[1:])), rates
        verify_ct = meta["spec_verify_ct"]
        drafts = meta["spec_num_correct_drafts"]
        assert sum(rates) == pytest.approx(drafts / verify_ct, abs=1e-9), meta
        # accept length counts the bonus and the prefill's token; the last
        # verify may emit more tokens than max_new_tokens keeps.
        assert meta["spec_accept_length"] == pytest.approx(
            1 + sum(rates), abs=(DEPTH + 2) / verify_ct
        ), meta
    # The wide tree accepts at depth 1 most of the time on these prompts.
    assert max(meta["spec_accept_depth_rate"][0] for meta in metas) > 0.5


def test_spec_accept_rate_divides_by_the_tree_depth(served):
    metas, _ = served
    for meta in metas:
        verify_ct = meta["spec_verify_ct"]
        drafts = meta["spec_num_correct_drafts"]
        assert meta["spec_num_proposed_drafts"] == verify_ct * DEPTH, meta
        assert meta["spec_accept_rate"] == pytest.approx(
            drafts / (verify_ct * DEPTH), abs=1e-12
        ), meta
        # = the mean per-depth acceptance; SGLang's W - 1 would be 64x smaller.
        assert meta["spec_accept_rate"] == pytest.approx(
            sum(meta["spec_accept_depth_rate"]) / DEPTH, abs=1e-9
        )
        assert meta["spec_accept_rate"] > drafts / (verify_ct * (WIDTH - 1))


def test_server_info_exports_lifetime_per_depth_acceptance(served):
    _, states = served
    rates = states[0]["spec_accept_depth_rate"]
    assert len(rates) == DEPTH
    assert all(a >= b for a, b in zip(rates, rates[1:])), rates
    assert 0.0 < rates[0] <= 1.0, rates
