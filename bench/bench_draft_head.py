"""Benchmark: the draft head's per-shard top-K, full-row stable sort (ddtree <= 0.2.5) vs
torch.topk plus the tie rule (0.2.6, `ddtree_topk.topk_lower_id_first`).

    .venv/bin/python bench/bench_draft_head.py [--repeats 3]

CPU only. Rows = bs x 15 draft positions (DFlash block 16), K = 8, a shard of Kimi K2.6's
163,840-token vocabulary at TP 8 (20,480 rows) and at TP 1, float32 logits with ties.
Both sides return the same indices (checked before timing). Prints the median time per
call and the speedup (sort / topk).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from timing import median_pair

TOPK_FILE = Path(__file__).resolve().parents[1] / ("overlays/ddtree/python/sglang/srt/speculative/ddtree_topk.py")
SHAPES = [  # (bs, shard vocabulary)
    (1, 20_480),
    (8, 20_480),
    (48, 20_480),
    (1, 163_840),
    (8, 163_840),
]
DEPTHS, K = 15, 8


def _topk_module():
    """ddtree_topk.py imports only torch: load the file itself, no SGLang package."""
    spec = importlib.util.spec_from_file_location("ddtree_topk", TOPK_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sort_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """The baseline: a stable descending sort of the whole row, first k columns."""
    return torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    topk_lower_id_first = _topk_module().topk_lower_id_first
    gen = torch.Generator().manual_seed(0)
    print("| bs | rows | shard vocab | sort ms | topk ms | speedup |")
    print("|---|---|---|---|---|---|")
    for bs, vocab in SHAPES:
        rows = bs * DEPTHS
        values = torch.round(torch.randn(rows, vocab, generator=gen) * 8) / 8  # ties
        assert torch.equal(sort_topk(values, K), topk_lower_id_first(values, K))
        t_sort, t_topk = median_pair(
            lambda v=values: sort_topk(v, K),
            lambda v=values: topk_lower_id_first(v, K),
            args.repeats,
        )
        print(f"| {bs} | {rows} | {vocab} | {t_sort * 1e3:.1f} | {t_topk * 1e3:.1f} | {t_sort / t_topk:.1f}x |")


if __name__ == "__main__":
    main()
