"""Benchmark: DDTree heap builder (per request, Python heapq) vs batched (tensor ops).

    .venv/bin/python bench/bench_builder.py [--repeats 5] [--threads 1]

CPU only; L = 15 draft depths, K = budget (the overlay's default top-K is min(budget,
vocab)), draft log-probs = sorted log_softmax of random logits (N(0, 1) * scale) over a
4096-token vocabulary. Two tables: flat drafts (scale 2.5, the original table: trees 1-2
deep) and peaked drafts (scale 6: trees 4-9 deep, so the batched builder cannot stop
after two depths). Both builders run with validate=False, so the tables time tree
selection alone. Prints the median time per batch, the heap/batched ratio (> 1: the
batched builder is faster) and the deepest node of the batch's trees.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch
from timing import median_pair

ROOT = Path(__file__).resolve().parents[1]
OVERLAY_PYTHON = ROOT / "overlays" / "ddtree" / "python"


def _import_overlay():
    """Load the overlay modules without SGLang's package __init__ (bare shells)."""
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(OVERLAY_PYTHON / Path(*name.split(".")))]
            sys.modules[name] = module
    from sglang.srt.speculative.ddtree_batched import build_ddtree_batched
    from sglang.srt.speculative.ddtree_tree import build_ddtree_tree_from_topk

    return build_ddtree_tree_from_topk, build_ddtree_batched


def _draft(bs: int, depth: int, k: int, seed: int, scale: float = 2.5):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, 4096, generator=gen) * scale
    top = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)  # sorted descending
    return top.values, top.indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    # One intra-op thread by default: on a shared 2-core box, 2 threads oversubscribe
    # and small tensor ops slow down by orders of magnitude (measured: 0.02 ms -> 15 ms
    # per add).
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heap_build, batched_build = _import_overlay()
    depth = 15
    for label, scale in (("flat drafts", 2.5), ("peaked drafts", 6.0)):
        setup = (
            f"torch {torch.__version__}, {args.threads} threads, L={depth}, K=budget"
        )
        runs = f"median of {args.repeats}, {label} (logit scale {scale})"
        print(f"DDTree builders on CPU, {setup}, {runs}")
        _table(heap_build, batched_build, depth, scale, args.repeats)
        print()


def _table(heap_build, batched_build, depth: int, scale: float, repeats: int) -> None:
    columns = (
        ("bs", 4),
        ("budget", 6),
        ("heap ms/batch", 14),
        ("batched ms/batch", 17),
        ("heap/batched", 13),
        ("depth", 6),
    )
    header = " ".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    print("-" * len(header))
    for bs in (1, 8, 32, 64):
        for budget in (16, 64, 256):
            # The flat table keeps its original seeds (comparable with earlier runs).
            seed = bs * 1000 + budget if scale == 2.5 else bs * 1000 + budget + 1
            lp, ids = _draft(bs, depth, budget, seed=seed, scale=scale)

            def heap() -> None:
                for b in range(bs):
                    heap_build(lp[b], ids[b], budget, validate=False)

            def batched() -> None:
                batched_build(lp, ids, budget, validate=False)

            t_heap, t_batched = median_pair(heap, batched, repeats)
            deepest = int(batched_build(lp, ids, budget, validate=False).depths.max())
            times = f"{t_heap * 1e3:>14.2f} {t_batched * 1e3:>17.2f}"
            ratio = f"{t_heap / t_batched:>12.2f}x"
            print(f"{bs:>4} {budget:>6} {times} {ratio} {deepest:>6}")


if __name__ == "__main__":
    main()
