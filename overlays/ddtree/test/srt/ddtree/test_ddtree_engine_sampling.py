"""DDTree sampling on a real SGLang 0.5.23 server (CPU) is lossless.

For a fixed prompt, the joint distribution of the first three generated tokens
(the first sampled at prefill, the next ones through the tree verify) over
thousands of requests must match the target's exact distribution, computed with
Hugging Face from the same checkpoint. Small vocabulary (8); the tiny target's
next-token distributions are far from uniform (top token about 0.45), so the
test has power. Servers, one after another: plain SGLang (validates the
reference itself), DDTree with the dense sampling verify (SGLang's kernel
semantics, the torch twin on CPU) on a large and a small tree, and a negative
control (threshold_acc 0.5, lossy by construction; forced by the test hook
``DDTREE_TEST_THRESHOLD_ACC``, since a DDTree server refuses
``--speculative-accept-threshold-acc`` below 1) that the same test must reject.

Sample sizes (``cpu_engine.sampling.detectable_effect``, 99% power): n = 1000 per
lossless server detects a distortion of Cohen's w >= 0.28 at the test's level
p < 1e-4, under two fifths of the control's; the control's distortion is w ~ 0.75
(measured), which n = 500 rejects at p < 1e-8 (detectable there: w >= 0.46). The
control also checks that the lossless servers' n would have caught a distortion
of its size. Each server runs one call's requests (``PER_CALL``) as one batch.

Sampling parameters (``PARAMS``): top_k 3, top_p 0.8, min_p 0.3, and
temperature 0.7 with top_k 4, top_p 0.9 and min_p 0.1, n = 1000 each on plain
SGLang, DDTree dense (budget 16, every token a child) and budget 4 with top-K 2
against the exact distribution of SGLang's plain sampler
(``sampling.plain_filter``; the plain server validates it), no sample outside
what the filters keep, and a two-sample test against the plain server's own
samples. Detectable at p < 1e-4 with 99% power: w >= 0.26, 0.25, 0.23, 0.25.
The control: the distribution that ignores min_p (what linear DFlash's verify
target serves) is rejected.

The memory-light sampling verify (one target sample per slot, then the walk:
what Kimi's vocabulary takes above a few requests) is proven at TP 2 on the MLA
target, at the temperature and with min_p and the combined set
(``test_ddtree_engine_tp2_sampling``), so it has no TP 1 server here.
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
    outside_support,
    sample_first_three,
    two_sample_p,
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
    "ddtree-small-k2": (
        ("--speculative-dflash-tree-budget", "4", "--speculative-dflash-tree-topk",
         "2"), None, REQUESTS
    ),
    # The server refuses the flag under DDTree: the test hook forces it.
    "ddtree-threshold-acc-0.5": (
        (), {"DDTREE_TEST_THRESHOLD_ACC": "0.5"}, CONTROL_REQUESTS
    ),
}
# The sampling parameters on both tree sizes.
WITH_PARAMS = ["plain", "ddtree-dense", "ddtree-small-k2"]
# Sampling parameters beyond the temperature (TEMPERATURE unless given), each
# applied by plain decoding's sampler at every token (``sampling.plain_filter``).
PARAMS = {
    "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.3},
    "combined": {"temperature": 0.7, "top_k": 4, "top_p": 0.9, "min_p": 0.1},
}


@pytest.fixture(scope="module")
def samples(server_pool, models):
    """name -> (temperature-only samples, server log, {param set: samples})."""
    configs = []
    for name, (extra, env, _) in SERVERS.items():
        args = [] if extra is None else _spec_args(models, *extra)
        args += ["--max-running-requests", str(PER_CALL)]
        config = ServerConfig.of(models.target, args, env, name=f"sampling-{name}")
        configs.append(config)
    servers = server_pool.each(configs)
    out = {}
    for (name, (*_, requests)), server in zip(SERVERS.items(), servers):
        tokens = sample_first_three(server.url, requests)
        by_params = {}
        if name in WITH_PARAMS:
            by_params = {
                key: sample_first_three(server.url, REQUESTS, **params)
                for key, params in PARAMS.items()
            }
        out[name] = (tokens, server.log_path.read_text(), by_params)
    return out


@pytest.fixture(scope="module")
def exact_filtered(models) -> dict[str, torch.Tensor]:
    return {
        key: exact_first_three(models.target, **params)
        for key, params in PARAMS.items()
    }


@pytest.mark.parametrize("name", ["plain", "ddtree-dense", "ddtree-small-k2"])
def test_first_three_tokens_follow_the_target(samples, exact, name):
    tokens, *_ = samples[name]
    assert tokens.shape == (REQUESTS, 3)
    assert chi_square_p(tokens, exact) > P_LOSSLESS


def test_each_ddtree_server_ran_the_sampling_path_it_names(samples):
    assert "dense tree speculative sampling (torch twin)" in samples["ddtree-dense"][1]
    assert "DDTree on: budget=16" in samples["ddtree-dense"][1]


@pytest.mark.parametrize("name", ["ddtree-dense", "ddtree-small-k2"])
def test_no_false_greedy_fallback_warning(samples, name):
    """This build has no sgl-kernel sampling op: linear DFlash would fall back to
    greedy and says so; DDTree samples exactly and says which verify it runs."""
    log = samples[name][1]
    assert "falling back to greedy argmax verification" not in log
    assert "DDTree sampling verify: lossless tree speculative sampling" in log
    assert "no greedy fallback" in log


def test_negative_control_threshold_acc_half_is_detected(samples, exact):
    tokens, log, _ = samples["ddtree-threshold-acc-0.5"]
    assert "DDTree sampling verify: dense" in log
    assert chi_square_p(tokens, exact) < P_LOSSY
    # The lossless servers' sample size catches a distortion of this size.
    assert effect_size(tokens, exact) > detectable_effect(REQUESTS, exact, P_LOSSLESS)


@pytest.mark.parametrize("params", sorted(PARAMS))
@pytest.mark.parametrize("name", WITH_PARAMS)
def test_sampling_parameters_follow_plain_decodings_distribution(
    samples, exact_filtered, name, params
):
    """top_k, top_p, min_p and all of them together: the samples follow the
    exact filtered distribution, and never fall outside what the filters keep."""
    tokens = samples[name][2][params]
    exact = exact_filtered[params]
    assert tokens.shape == (REQUESTS, 3)
    assert outside_support(tokens, exact) == 0
    assert chi_square_p(tokens, exact) > P_LOSSLESS


@pytest.mark.parametrize("params", sorted(PARAMS))
@pytest.mark.parametrize("name", [n for n in WITH_PARAMS if n != "plain"])
def test_sampling_parameters_match_the_plain_servers_samples(samples, name, params):
    """The two-sample test against the plain server itself (no model of the
    sampler in between)."""
    plain = samples["plain"][2][params].tolist()
    assert two_sample_p(plain, samples[name][2][params].tolist()) > P_LOSSLESS


def test_control_ignoring_min_p_is_detected(samples, exact_filtered, models):
    """Linear DFlash's verify target never applies min_p: the test rejects the
    distribution that ignores it, at the sample size the lossless tests use."""
    wrong = exact_first_three(models.target)  # the temperature alone
    tokens = samples["plain"][2]["min_p"]
    assert chi_square_p(tokens, wrong) < P_LOSSY
    exact = exact_filtered["min_p"]
    assert effect_size(tokens, wrong) > detectable_effect(REQUESTS, exact, P_LOSSLESS)
