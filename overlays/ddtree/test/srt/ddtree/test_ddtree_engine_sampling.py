"""DDTree sampling on a real SGLang 0.5.23 server (CPU) is lossless.

For a fixed prompt, the joint distribution of the first three generated tokens
(the first sampled at prefill, the next ones through the tree verify) over
thousands of requests must match the target's exact distribution, computed with
Hugging Face from the same checkpoint. Small vocabulary (8); the tiny target's
next-token distributions are far from uniform (top token about 0.45), so the
test has power. Servers, one
after another: plain SGLang (validates the reference itself), DDTree with the
dense sampling verify (SGLang's kernel semantics, the torch twin on CPU), DDTree
forced onto the memory-light path (one target sample per slot, then the walk),
and a negative control (``--speculative-accept-threshold-acc 0.5``, lossy by
construction) that the same test must reject.

Sample sizes (``cpu_engine.sampling.detectable_effect``, 99% power): n = 1000 per
lossless server detects a distortion of Cohen's w >= 0.28 at the test's level
p < 1e-4, under two fifths of the control's; the control's distortion is w ~ 0.75
(measured), which n = 500 rejects at p < 1e-8 (detectable there: w >= 0.46). The
control also checks that the lossless servers' n would have caught a distortion
of its size. Each server runs one call's requests (``PER_CALL``) as one batch.
"""

from __future__ import annotations

import pytest
import torch

from cpu_engine.models import cached_tiny_models
from cpu_engine.pool import ServerConfig
from cpu_engine.sampling import (
    P_LOSSLESS,
    P_LOSSY,
    PER_CALL,
    VOCAB,
    chi_square_p,
    detectable_effect,
    effect_size,
    exact_first_three,
    sample_first_three,
)
from cpu_engine.server import dflash_args

pytestmark = pytest.mark.slow

REQUESTS = 1000
CONTROL_REQUESTS = 500
BUDGET = 16


@pytest.fixture(scope="module")
def models():
    return cached_tiny_models(vocab=VOCAB)


@pytest.fixture(scope="module")
def exact(models) -> torch.Tensor:
    """p(t1, t2, t3 | PROMPT) at TEMPERATURE, float64 [V, V, V], from HF."""
    return exact_first_three(models.target)


def _spec_args(models, *extra):
    return dflash_args(models.draft, *extra, budget=BUDGET)


# name -> (extra server args, or None for no speculation; server env; requests)
SERVERS = {
    "plain": (None, None, REQUESTS),
    "ddtree-dense": ((), None, REQUESTS),
    "ddtree-light": ((), {"SGLANG_DDTREE_DENSE_SAMPLING_MAX_ELEMENTS": "0"}, REQUESTS),
    "ddtree-threshold-acc-0.5": (
        ("--speculative-accept-threshold-acc", "0.5"), None, CONTROL_REQUESTS
    ),
}


@pytest.fixture(scope="module")
def samples(server_pool, models):
    configs = []
    for name, (extra, env, _) in SERVERS.items():
        args = [] if extra is None else _spec_args(models, *extra)
        args += ["--max-running-requests", str(PER_CALL)]
        config = ServerConfig.of(models.target, args, env, name=f"sampling-{name}")
        configs.append(config)
    servers = server_pool.each(configs)
    return {
        name: (sample_first_three(server.url, requests), server.log_path.read_text())
        for (name, (*_, requests)), server in zip(SERVERS.items(), servers)
    }


@pytest.mark.parametrize("name", ["plain", "ddtree-dense", "ddtree-light"])
def test_first_three_tokens_follow_the_target(samples, exact, name):
    tokens, _ = samples[name]
    assert tokens.shape == (REQUESTS, 3)
    assert chi_square_p(tokens, exact) > P_LOSSLESS


def test_each_ddtree_server_ran_the_sampling_path_it_names(samples):
    assert "dense tree speculative sampling (torch twin)" in samples["ddtree-dense"][1]
    assert "one target sample per slot" in samples["ddtree-light"][1]
    assert "DDTree on: budget=16" in samples["ddtree-dense"][1]


@pytest.mark.parametrize("name", ["ddtree-dense", "ddtree-light"])
def test_no_false_greedy_fallback_warning(samples, name):
    """This build has no sgl-kernel sampling op: linear DFlash would fall back to
    greedy and says so; DDTree samples exactly and says which verify it runs."""
    log = samples[name][1]
    assert "falling back to greedy argmax verification" not in log
    assert "DDTree sampling verify: lossless tree speculative sampling" in log
    assert "no greedy fallback" in log


def test_negative_control_threshold_acc_half_is_detected(samples, exact):
    tokens, log = samples["ddtree-threshold-acc-0.5"]
    assert "DDTree sampling verify: dense" in log
    assert chi_square_p(tokens, exact) < P_LOSSY
    # The lossless servers' sample size catches a distortion of this size.
    assert effect_size(tokens, exact) > detectable_effect(REQUESTS, exact, P_LOSSLESS)
