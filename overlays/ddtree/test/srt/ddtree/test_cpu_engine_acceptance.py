"""Acceptance on the CPU engine: linear DFLASH and DDTree on the "alternating" models.

The target alternates X Y X Y ...; the draft predicts X (then Y) at every depth (see
``cpu_engine.models``), so linear DFLASH commits exactly two tokens per verify: a
fixed, known accept length; DDTree with a 14-node tree accepts the whole block.
"""

from __future__ import annotations

import pytest
import torch

from cpu_engine.models import (
    ALT_X,
    ALT_Y,
    alternating_draft_probs,
    cached_tiny_models,
)
from cpu_engine.pool import ServerConfig
from cpu_engine.server import dflash_args

PROMPTS = ([1, 5, 9, 33, 12], [1, 7, 8, 9, 20, 21, 22, 23, 24, 25, 26])
NEW_TOKENS = 64


def _alternation(n: int) -> list[int]:
    return [ALT_X if i % 2 == 0 else ALT_Y for i in range(n)]


@pytest.fixture(scope="module")
def alt_models():
    return cached_tiny_models(kind="alternating")


def test_alternating_models_behave_as_documented(alt_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(alt_models.target, dtype=torch.float32)
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == _alternation(16)
    probs = alternating_draft_probs(alt_models.vocab)
    assert probs.topk(2).indices.tolist() == [ALT_X, ALT_Y]


@pytest.mark.slow
def test_linear_dflash_accepts_one_draft_per_verify(server_pool, alt_models):
    args = dflash_args(alt_models.draft)
    config = ServerConfig.of(alt_models.target, args, name="dflash-alternating")
    responses = server_pool.get(config).generate_batch(PROMPTS, NEW_TOKENS)
    for r in responses:
        meta = r["meta_info"]
        assert r["output_ids"] == _alternation(NEW_TOKENS)
        # The prefill yields X, the first verify (after X) only the bonus Y, every
        # later one X and the bonus Y.
        assert meta["spec_verify_ct"] == NEW_TOKENS // 2
        assert meta["spec_accept_length"] == pytest.approx(2.0)
        hist = meta["spec_correct_drafts_histogram"]
        assert hist[:2] == [1, NEW_TOKENS // 2 - 1] and not any(hist[2:])


@pytest.mark.slow
def test_ddtree_accepts_the_whole_block_where_linear_accepts_one_draft(
    server_pool, alt_models
):
    """The draft's top two tokens at every depth, X then Y: a 14-node tree holds
    the path X Y X (and Y X Y), so every verify accepts all 3 drafts plus the bonus
    (4 tokens), twice linear DFLASH's 2 on the same models."""
    args = dflash_args(alt_models.draft, budget=14)
    config = ServerConfig.of(alt_models.target, args, name="ddtree-alternating")
    responses = server_pool.get(config).generate_batch(PROMPTS, NEW_TOKENS)
    for r in responses:
        meta = r["meta_info"]
        assert r["output_ids"] == _alternation(NEW_TOKENS)
        # The prefill yields X; then 16 verifies of 4 tokens (the last one cut).
        assert meta["spec_verify_ct"] == NEW_TOKENS // 4
        assert meta["spec_accept_length"] == pytest.approx(4.0)
        assert meta["spec_correct_drafts_histogram"] == [0, 0, 0, NEW_TOKENS // 4]
