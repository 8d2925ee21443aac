"""Check ``ddtree_sampling`` against SGLang's own plain sampler, exactly.

Run as a script in a child process whose ``PYTHONPATH`` holds a tree made by
``prepare_cpu_tree`` (``test_ddtree_sampling``): it imports SGLang's
``top_k_top_p_min_p_sampling_from_probs_torch`` (the ``--sampling-backend
pytorch`` sampler) and asks it for the filtered probabilities it draws from
(``return_filtered_probs=True``), renormalised, for random logits and random
per-row top_k, top_p, min_p and temperatures (some rows unfiltered), and
compares them with ``plain_sampling_probs``. Prints ``ok <cases>``; a
difference above 1e-6 raises.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
from sglang.srt.sampling.sampling_params import TOP_K_ALL
from sglang.srt.speculative.ddtree_sampling import SamplingRows, plain_sampling_probs

CASES = 200


def sglang_distribution(logits, rows: SamplingRows) -> torch.Tensor:
    probs = torch.softmax(logits / rows.temperatures, dim=-1)
    _, filtered, index, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(),
        rows.top_ks,
        rows.top_ps,
        rows.min_ps,
        rows.need_min_p,
        None,
        None,
        return_filtered_probs=True,
    )
    out = torch.zeros_like(probs).scatter(1, index.long(), filtered)
    return out / out.sum(dim=-1, keepdim=True)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for case in range(CASES):
        r = int(torch.randint(1, 9, (1,), generator=gen))
        vocab = int(torch.randint(2, 300, (1,), generator=gen))
        logits = torch.randn(r, vocab, generator=gen) * 3
        top_k = torch.randint(1, vocab + 1, (r,), generator=gen)
        top_k[torch.rand(r, generator=gen) < 0.3] = TOP_K_ALL
        top_p = torch.rand(r, generator=gen) * 0.9 + 0.1
        top_p[torch.rand(r, generator=gen) < 0.3] = 1.0
        min_p = torch.rand(r, generator=gen) * 0.5
        min_p[torch.rand(r, generator=gen) < 0.3] = 0.0
        rows = SamplingRows(
            temperatures=(torch.rand(r, 1, generator=gen) + 0.3),
            top_ks=top_k.to(torch.int32),
            top_ps=top_p,
            min_ps=min_p,
            need_top_k=bool((top_k != TOP_K_ALL).any()),
            need_top_p=bool((top_p != 1.0).any()),
            need_min_p=bool((min_p > 0).any()),
            max_top_k=None if case % 2 else int(top_k.max()),
        )
        want = sglang_distribution(logits, rows)
        got = plain_sampling_probs(logits, rows, "pytorch")
        diff = float((want - got).abs().max())
        if diff > 1e-6:
            raise AssertionError(f"case {case}: max |difference| {diff}, {rows}")
    print(f"ok {CASES}")


if __name__ == "__main__":
    main()
