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


def plain_filter(probs: torch.Tensor, top_k=None, top_p=1.0, min_p=0.0):
    """What SGLang's plain sampler (``--sampling-backend pytorch``, CPU) draws
    from, given the softmax probs [..., V]: over the probabilities sorted
    descending it keeps rank r iff r < top_k, the mass before r is <= top_p and
    p >= min_p * p_max; the kept ones renormalised."""
    values, index = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1])
    keep = (torch.cumsum(values, -1) - values) <= top_p
    if top_k is not None:
        keep &= rank < top_k
    keep &= values >= values[..., :1] * min_p
    kept = torch.zeros_like(probs).scatter(-1, index, values * keep)
    return kept / kept.sum(dim=-1, keepdim=True)


def exact_first_three(model_dir: Path, temperature: float = TEMPERATURE, **filters):
    """p(t1, t2, t3 | PROMPT), float64 [V, V, V], from HF: at ``temperature``
    with the plain sampler's ``filters`` (top_k, top_p, min_p) at every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    prompt = torch.tensor(PROMPT).expand(len(pairs), -1)
    with torch.no_grad():
        logits = model(torch.cat([prompt, pairs], dim=1)).logits.double()
    n = len(PROMPT)
    probs = torch.softmax(logits[:, n - 1 :, :] / temperature, dim=-1)
    probs = plain_filter(probs, **filters)
    p1 = probs[0, 0]  # [V]
    p2 = probs[::VOCAB, 1]  # [V] rows of t1 -> p(t2 | t1)
    p3 = probs[:, 2].view(VOCAB, VOCAB, VOCAB)  # p(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_first_three(url: str, requests: int, **sampling) -> torch.Tensor:
    """``requests`` samples of the first three generated tokens, int64 [n, 3],
    at TEMPERATURE unless ``sampling`` (sampling params) says otherwise."""
    replies = sample_replies(url, requests, **sampling)
    return torch.tensor([r["output_ids"][:3] for r in replies])


def sample_replies(url: str, requests: int, **sampling) -> list[dict]:
    """The server's replies to ``requests`` 3-token requests for PROMPT, in
    batch calls of PER_CALL, sampled as :func:`sample_first_three` says."""
    params = {"max_new_tokens": 3, "temperature": TEMPERATURE, "ignore_eos": True}
    params.update(sampling)
    replies = []
    for _ in range(requests // PER_CALL):
        body = {"input_ids": [PROMPT] * PER_CALL, "sampling_params": params}
        request = urllib.request.Request(
            url + "/generate",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            replies += json.load(response)
    return replies


def outside_support(tokens: torch.Tensor, exact: torch.Tensor) -> int:
    """How many samples fall where ``exact`` has no mass (a filter broken)."""
    return int((exact[tokens[:, 0], tokens[:, 1], tokens[:, 2]] == 0).sum())


def _pooled(tokens: torch.Tensor, exact: torch.Tensor):
    """Observed and expected counts per cell of the first three tokens; cells
    expecting fewer than 5 are pooled into one (the chi-square rule of thumb)."""
    flat = tokens[:, 0] * VOCAB * VOCAB + tokens[:, 1] * VOCAB + tokens[:, 2]
    observed = torch.bincount(flat, minlength=VOCAB**3).double()
    expected = exact.reshape(-1) * len(tokens)
    rare = expected < 5
    observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    if expected[-1] == 0 and observed[-1] == 0:  # a filter left no rare cell
        observed, expected = observed[:-1], expected[:-1]
    return observed, expected


def chi_square_p(tokens: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square p-value; cells expecting fewer than 5 are pooled into one."""
    from scipy.stats import chisquare

    observed, expected = _pooled(tokens, exact)
    if len(observed) < 2:
        raise ValueError("one possible outcome: nothing for a chi-square to test")
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


def two_sample_p(a, b) -> float:
    """Chi-square p-value that two samples of outputs (sequences of token ids)
    come from one distribution; outputs expected fewer than 5 times in either
    sample are pooled into one category."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    count_a, count_b = Counter(map(tuple, a)), Counter(map(tuple, b))
    cells = sorted(set(count_a) | set(count_b))
    table = torch.tensor(
        [[count_a[c] for c in cells], [count_b[c] for c in cells]], dtype=torch.float64
    )
    total = table.sum()
    expected = table.sum(dim=1, keepdim=True) * table.sum(dim=0) / total
    rare = (expected < 5).any(dim=0)
    pooled = torch.cat([table[:, ~rare], table[:, rare].sum(dim=1, keepdim=True)], 1)
    pooled = pooled[:, pooled.sum(dim=0) > 0]
    if pooled.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(pooled.numpy(), correction=False).pvalue)
