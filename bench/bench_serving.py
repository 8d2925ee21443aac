#!/usr/bin/env python3
"""Serving benchmark on the CPU engine: linear DFlash vs DDTree at several budgets.

    .venv/bin/python bench/bench_serving.py [--root CHECKOUT] [--budgets 4,16,64,192]
                                            [--requests 8] [--new-tokens 64] [--show]

Starts a real ``sglang.launch_server`` (SGLang 0.5.23 with the DDTree overlay, on CPU
through the overlay's test harness) once per configuration, on the same tiny models
(random 2-layer Llama target, random 1-layer DFlash draft, vocabulary 64, block size 4)
and the same prompts, and prints one table:

  accept length    SGLang's spec_accept_length: tokens emitted per verify step
  drafts/step      accepted draft tokens per step (accept length - 1)
  step ms          decode time per verify step (request latency / verify count)
  tree ms          the tree path alone (build + retrieve compile + mask) for the same
                   shapes, timed in this process with the overlay's functions
  tree share       tree ms / step ms

--root: a patched SGLang checkout (default: the overlay, built on the pristine base
from ``ddeploy base fetch``). --show: print the generated tokens of each request.
Absolute times are this machine's (2 CPU cores); the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    list(range(5, 20)),
    [30, 31, 32],
    [7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41],
    [50, 12, 50, 12, 50, 12, 8],
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="a patched SGLang checkout")
    parser.add_argument("--budgets", default="4,16,64,192")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--show", action="store_true", help="print the answers")
    return parser.parse_args()


def harness_root(root: Path | None) -> Path:
    """The test tree holding ``cpu_engine`` (the checkout's, else the overlay's)."""
    base = root if root is not None else REPO / "overlays" / "ddtree"
    return base / "test" / "srt" / "ddtree"


def spec_args(draft: Path, budget: int | None) -> list[str]:
    args = [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-draft-attention-backend",
        "torch_native",
    ]
    if budget is not None:
        args += ["--speculative-dflash-tree-budget", str(budget)]
    return args


def measure(server, requests: int, new_tokens: int, show: bool, label: str) -> dict:
    """Requests in batches of four concurrent ones; SGLang's per-request metrics."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    results = []
    for start in range(0, requests, 4):
        batch = prompts[start : start + 4]
        results += server.generate_batch(batch, max_new_tokens=new_tokens)
    metas = [r["meta_info"] for r in results]
    if show:
        for prompt, result in zip(prompts, results, strict=True):
            print(f"[{label}] prompt {prompt[:6]}... -> {result['output_ids'][:16]}...")
    accept = statistics.mean(m["spec_accept_length"] for m in metas)
    step_s = statistics.mean(m["e2e_latency"] / m["spec_verify_ct"] for m in metas)
    return {"accept": accept, "step_ms": 1e3 * step_s}


def tree_path_ms(budget: int, vocab: int, block_size: int, bs: int = 4) -> float:
    """Median time of build_verify_step for random drafts of the served shapes."""
    import torch

    from sglang.srt.speculative.ddtree_step import build_verify_step
    from sglang.srt.speculative.ddtree_utils import resolve_tree_topk

    k = resolve_tree_topk(budget, None, vocab)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(bs, block_size - 1, vocab, generator=gen)
    log_probs, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    roots = torch.zeros(bs, dtype=torch.int64)
    prefix = torch.full((bs,), 40, dtype=torch.int64)
    width = max(budget + 1, block_size)
    times = []
    for _ in range(25):
        start = time.perf_counter()
        build_verify_step(log_probs, ids, roots, prefix, budget, width, 40 * bs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> int:
    args = parse_args()
    test_dir = harness_root(args.root)
    sys.path.insert(0, str(test_dir))
    import conftest  # noqa: F401  (imports the tree's ddtree modules, no SGLang init)
    from cpu_engine.cpu_tree import prepare_cpu_tree
    from cpu_engine.fixtures import sglang_source_python
    from cpu_engine.models import make_tiny_models
    from cpu_engine.server import launch_server

    budgets = [int(b) for b in args.budgets.split(",") if b]
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    source = sglang_source_python(args.root or test_dir.parents[2], work)
    python_dir = prepare_cpu_tree(source, work / "cpu-tree")
    models = make_tiny_models(work / "models", vocab=64)
    rows = []
    for budget in [None, *budgets]:
        label = "linear DFlash" if budget is None else f"DDTree B={budget}"
        print(f"bench_serving: {label}: starting the server", file=sys.stderr)
        log = work / f"server-{budget or 'linear'}.log"
        with launch_server(python_dir, models.target, spec_args(models.draft, budget), log) as server:
            stats = measure(server, args.requests, args.new_tokens, args.show, label)
        width = models.block_size if budget is None else max(budget + 1, 4)
        tree = None if budget is None else tree_path_ms(budget, 64, models.block_size)
        rows.append((label, width, stats, tree))
    print_table(rows)
    return 0


def print_table(rows) -> None:
    header = "| config | verify width | accept length | drafts/step | step ms | tree ms | tree share |"
    print(header)
    print("|" + "---|" * 7)
    base = rows[0][2]["accept"]
    for label, width, stats, tree in rows:
        share = "-" if tree is None else f"{tree / stats['step_ms']:.1%}"
        tree_ms = "-" if tree is None else f"{tree:.2f}"
        ratio = f" ({stats['accept'] / base:.2f}x)" if tree is not None else ""
        print(
            f"| {label} | {width} | {stats['accept']:.2f}{ratio} | "
            f"{stats['accept'] - 1:.2f} | {stats['step_ms']:.1f} | {tree_ms} | "
            f"{share} |"
        )


if __name__ == "__main__":
    sys.exit(main())
