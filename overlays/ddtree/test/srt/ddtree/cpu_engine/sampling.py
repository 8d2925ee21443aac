"""The sampling-distribution check the engine tests share.

For a fixed prompt, the joint distribution of the first three generated tokens
(the first sampled at prefill, the next ones through the speculative verify) over
many requests must match the target's exact distribution, computed with Hugging
Face from the same checkpoint. Small vocabulary (8): 512 cells, far from uniform,
so a chi-square test has power against a lossy verify.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import torch

VOCAB = 8
PROMPT = [4, 6, 5, 7, 4, 5]
TEMPERATURE = 0.9
PER_CALL = 100  # requests per /generate call (a batch request)
P_LOSSLESS = 1e-4  # a correct server fails this once in 10,000 runs
P_LOSSY = 1e-8


def exact_first_three(model_dir: Path) -> torch.Tensor:
    """p(t1, t2, t3 | PROMPT) at TEMPERATURE, float64 [V, V, V], from HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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


def sample_first_three(url: str, requests: int) -> torch.Tensor:
    """``requests`` samples of the first three generated tokens, int64 [n, 3]."""
    rows = []
    for _ in range(requests // PER_CALL):
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


def _pooled(tokens: torch.Tensor, exact: torch.Tensor):
    """Observed and expected counts per cell of the first three tokens; cells
    expecting fewer than 5 are pooled into one (the chi-square rule of thumb)."""
    flat = tokens[:, 0] * VOCAB * VOCAB + tokens[:, 1] * VOCAB + tokens[:, 2]
    observed = torch.bincount(flat, minlength=VOCAB**3).double()
    expected = exact.reshape(-1) * len(tokens)
    rare = expected < 5
    observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    return observed, expected


def chi_square_p(tokens: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square p-value; cells expecting fewer than 5 are pooled into one."""
    from scipy.stats import chisquare

    observed, expected = _pooled(tokens, exact)
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def effect_size(tokens: torch.Tensor, exact: torch.Tensor) -> float:
    """Cohen's w of the sample's distribution against ``exact``, estimated as
    sqrt(max(chi2 - df, 0) / n) (chi2's mean is df + n w^2)."""
    observed, expected = _pooled(tokens, exact)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    return (max(chi2 - (len(observed) - 1), 0.0) / len(tokens)) ** 0.5


def detectable_effect(
    n: int, exact: torch.Tensor, alpha: float, power: float = 0.99
) -> float:
    """The smallest Cohen's w that the chi-square test over ``n`` samples rejects
    at level ``alpha`` with probability ``power`` (noncentral chi-square with
    noncentrality n w^2, the pooled cells' degrees of freedom)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    df = int((exact.reshape(-1) * n >= 5).sum())  # kept cells + 1 pooled, - 1
    critical = chi2.isf(alpha, df)
    lam = brentq(lambda x: ncx2.sf(critical, df, x) - power, 1e-9, 1e7)
    return (lam / n) ** 0.5
