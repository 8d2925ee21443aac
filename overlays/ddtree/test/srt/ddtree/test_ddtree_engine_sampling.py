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
"""

from __future__ import annotations

import json
import urllib.request
import pytest
import torch

from cpu_engine.models import make_tiny_models
from cpu_engine.server import dflash_args, launch_server

pytestmark = pytest.mark.slow

VOCAB = 8
PROMPT = [4, 6, 5, 7, 4, 5]
TEMPERATURE = 0.9
REQUESTS = 3000
PER_CALL = 100  # requests per /generate call (a batch request)
BUDGET = 16
P_LOSSLESS = 1e-4  # a correct server fails this once in 10,000 runs
P_LOSSY = 1e-8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("sampling-models"), vocab=VOCAB)


@pytest.fixture(scope="module")
def exact(models) -> torch.Tensor:
    """p(t1, t2, t3 | PROMPT) at TEMPERATURE, float64 [V, V, V], from HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    prompt = torch.tensor(PROMPT).expand(len(pairs), -1)
    with torch.no_grad():
        logits = model(torch.cat([prompt, pairs], dim=1)).logits.double()
    n = len(PROMPT)
    probs = torch.softmax(logits[:, n - 1 :, :] / TEMPERATURE, dim=-1)
    p1 = probs[0, 0]  # [V]
    p2 = probs[::VOCAB, 1]  # [V] rows of t1 -> p(t2 | t1)
    p3 = probs[:, 2].view(VOCAB, VOCAB, VOCAB)  # p(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


def _spec_args(models, *extra):
    return dflash_args(models.draft, *extra, budget=BUDGET)


# name -> (extra server args, or None for no speculation; server env)
SERVERS = {
    "plain": (None, None),
    "ddtree-dense": ((), None),
    "ddtree-light": ((), {"SGLANG_DDTREE_DENSE_SAMPLING_MAX_ELEMENTS": "0"}),
    "ddtree-threshold-acc-0.5": (("--speculative-accept-threshold-acc", "0.5"), None),
}


def _first_three(url: str) -> torch.Tensor:
    """REQUESTS samples of the first three generated tokens, int64 [REQUESTS, 3]."""
    rows = []
    for _ in range(REQUESTS // PER_CALL):
        body = {
            "input_ids": [PROMPT] * PER_CALL,
            "sampling_params": {
                "max_new_tokens": 3,
                "temperature": TEMPERATURE,
                "ignore_eos": True,
            },
        }
        request = urllib.request.Request(
            url + "/generate",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            rows += [r["output_ids"][:3] for r in json.load(response)]
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def samples(cpu_sglang_python, models, server_log_dir):
    results = {}
    for name, (extra, env) in SERVERS.items():
        args = [] if extra is None else _spec_args(models, *extra)
        args += ["--max-running-requests", "32"]
        log = server_log_dir / f"sampling-{name}.log"
        with launch_server(cpu_sglang_python, models.target, args, log, env) as srv:
            results[name] = (_first_three(srv.url), log.read_text())
    return results


def _chi_square_p(tokens: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square p-value; cells expecting fewer than 5 are pooled into one."""
    from scipy.stats import chisquare

    flat = tokens[:, 0] * VOCAB * VOCAB + tokens[:, 1] * VOCAB + tokens[:, 2]
    observed = torch.bincount(flat, minlength=VOCAB**3).double()
    expected = exact.reshape(-1) * len(tokens)
    rare = expected < 5
    observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("name", ["plain", "ddtree-dense", "ddtree-light"])
def test_first_three_tokens_follow_the_target(samples, exact, name):
    tokens, _ = samples[name]
    assert tokens.shape == (REQUESTS, 3)
    assert _chi_square_p(tokens, exact) > P_LOSSLESS


def test_each_ddtree_server_ran_the_sampling_path_it_names(samples):
    assert "dense tree speculative sampling (torch twin)" in samples["ddtree-dense"][1]
    assert "one target sample per slot" in samples["ddtree-light"][1]
    assert "DDTree on: budget=16" in samples["ddtree-dense"][1]


def test_negative_control_threshold_acc_half_is_detected(samples, exact):
    tokens, log = samples["ddtree-threshold-acc-0.5"]
    assert "DDTree sampling verify: dense" in log
    assert _chi_square_p(tokens, exact) < P_LOSSY
