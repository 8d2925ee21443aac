"""Sampling target at Kimi's sizes, on the CPU: DDTree's new target vs linear DFlash's vs the old sort.

For R = requests x width verify rows over a vocabulary V (default 48 x 129 rows, V = 163,840: Kimi K2 with a
129-slot tree), builds the distribution every verify row is tested against, three ways, in the same process kind:

- ``new``: ``plain_sampling_probs`` of the overlay (``overlays/ddtree/.../ddtree_sampling.py``): a bounded ``topk``
  where the batch has a top-k bound, else a 30-step bisection on the cut; never a sort over [R, V];
- ``dflash``: SGLang 0.5.23's own ``dflash_utils.build_speculative_verify_target_probs`` (linear DFlash's verify
  target, imported from the pristine base tree; on the CPU it runs SGLang's torch fallbacks);
- ``sort``: the sort-based target DDTree used before (a copy of the old ``plain_sampling_probs``, below).

Scenarios (temperature 0.7 everywhere): ``top_p`` (top_p 0.9, no top-k), ``top_k_top_p`` (top_k 50 with the host
bound ``max_top_k`` 50, top_p 0.9), ``mixed`` (as ``top_k_top_p`` but one request has no top-k, so no bound).

Each (scenario, arm) runs in a fresh child process: it makes float32 logits [R, V], then times ``--reps`` calls
(the best is reported) and reads its peak RSS (``ru_maxrss``); "peak MB" is that peak minus the RSS high-water
after the logits were made, i.e. what the call itself allocated at its peak. An arm whose estimated peak exceeds
the memory available less ``--spare-gb`` is skipped and said so. Usage::

    .venv/bin/python bench/bench_sampling_target.py                    # Kimi's sizes (minutes, ~15 GB)
    .venv/bin/python bench/bench_sampling_target.py --requests 4       # 4 x 129 rows
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
OVERLAY_MODULE = ROOT / "overlays/ddtree/python/sglang/srt/speculative/ddtree_sampling.py"
BASE_SGLANG = Path("/root/.cache/ddeploy/base/sglang-0.5.23/python")
TOP_K_ALL = 1 << 30
SCENARIOS = ("top_p", "top_k_top_p", "mixed")
ARMS = ("new", "dflash", "sort")
# Float32 [R, V] buffers alive at an arm's peak beyond the logits, (with a host top-k bound, without): estimates
# for the skip test only, half a buffer above what this bench measured (new 2.5; dflash 2.0 / 7.3; sort 3.0 / 7.3).
PEAK_BUFFERS = {"new": (3.0, 3.0), "dflash": (2.5, 8.0), "sort": (3.5, 8.0)}


def _load_overlay():
    spec = importlib.util.spec_from_file_location("ddtree_sampling", OVERLAY_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddtree_sampling"] = module
    spec.loader.exec_module(module)
    return module


def _old_sort_target(torch, logits, rows):
    """The sort-based ``plain_sampling_probs`` of commit 13de7e3 (pytorch backend, joint order)."""
    probs = torch.softmax(logits.to(torch.float32) / rows.temperatures, dim=-1)
    vocab = probs.shape[-1]
    bound = vocab
    if rows.need_top_k and rows.max_top_k is not None:
        bound = max(1, min(int(rows.max_top_k), vocab))
    if bound < vocab:
        values, index = torch.topk(probs, bound, dim=-1, sorted=True)
    else:
        values, index = torch.sort(probs, dim=-1, descending=True)
    ranks = torch.arange(values.shape[-1])[None, :]
    keep = ranks < rows.top_ks.to(torch.int64)[:, None]
    keep &= (torch.cumsum(values, dim=-1) - values) <= rows.top_ps[:, None]
    out = torch.zeros_like(probs)
    out.scatter_(1, index, values * keep)
    return out / out.sum(dim=-1, keepdim=True)


def _params(torch, scenario: str, requests: int):
    top_ks = torch.full((requests,), TOP_K_ALL if scenario == "top_p" else 50, dtype=torch.int32)
    if scenario == "mixed":
        top_ks[0] = TOP_K_ALL
    max_top_k = 50 if scenario == "top_k_top_p" else None
    return SimpleNamespace(
        temperatures=torch.full((requests, 1), 0.7),
        top_ks=top_ks,
        top_ps=torch.full((requests,), 0.9),
        min_ps=torch.zeros(requests),
        need_top_k_sampling=scenario != "top_p",
        need_top_p_sampling=True,
        need_min_p_sampling=False,
        max_top_k=max_top_k,
    )


def child(arm: str, scenario: str, requests: int, width: int, vocab: int, reps: int) -> dict:
    import torch

    if arm == "dflash":
        sys.path.insert(0, str(BASE_SGLANG))
        import warnings

        warnings.simplefilter("ignore")
        from sglang.srt.speculative.dflash_utils import build_speculative_verify_target_probs
    overlay = _load_overlay()
    info = _params(torch, scenario, requests)
    rows = overlay.SamplingRows.of(info, width, info.max_top_k)
    logits = torch.randn(requests * width, vocab, generator=torch.Generator().manual_seed(0)).mul_(2.0)
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def call():
        if arm == "new":
            return overlay.plain_sampling_probs(logits, rows, "pytorch")
        if arm == "sort":
            return _old_sort_target(torch, logits, rows)
        return build_speculative_verify_target_probs(
            next_token_logits=logits,
            sampling_info=info,
            draft_token_num=width,
            bs=requests,
            max_top_k=info.max_top_k,
        )

    best = float("inf")
    for _ in range(reps):
        out = None  # the previous output is not alive during the call
        start = time.perf_counter()
        out = call()
        best = min(best, time.perf_counter() - start)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before the statistics below allocate
    kept = float((out > 0).sum(dim=-1, dtype=torch.int32).float().mean())
    return {"time_s": best, "peak_mb": (peak_kb - base_kb) / 1024, "kept": kept}


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--width", type=int, default=129)
    parser.add_argument("--vocab", type=int, default=163_840)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--spare-gb", type=float, default=4.0, help="memory to leave to others (skip test)")
    parser.add_argument("--child", nargs=2, metavar=("ARM", "SCENARIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.requests, args.width, args.vocab, args.reps)))
        return

    rows = args.requests * args.width
    buffer_mb = rows * args.vocab * 4 / 2**20
    print(f"R = {args.requests} x {args.width} = {rows} rows, V = {args.vocab}, float32 [R, V] = {buffer_mb:.0f} MB")
    print(f"CPU, best of {args.reps}; each arm in a fresh process; peak = RSS high-water above the logits")
    header = f"{'scenario':<12} {'arm':<7} {'time s':>9} {'peak MB':>9} {'kept/row':>9} {'time/new':>9} {'peak/new':>9}"
    print(header)
    print("-" * len(header))
    for scenario in args.scenarios.split(","):
        results = {}
        for arm in args.arms.split(","):
            need_mb = (PEAK_BUFFERS[arm][scenario != "top_k_top_p"] + 1) * buffer_mb
            if need_mb > _available_mb() - args.spare_gb * 1024:
                available_gb = _available_mb() / 1024
                results[arm] = f"skipped: needs ~{need_mb / 1024:.0f} GB of {available_gb:.0f} GB available"
                continue
            command = [sys.executable, __file__, "--child", arm, scenario]
            command += ["--requests", str(args.requests), "--width", str(args.width)]
            command += ["--vocab", str(args.vocab), "--reps", str(args.reps)]
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                results[arm] = f"timed out after {args.timeout:.0f} s"
                continue
            if proc.returncode != 0:
                results[arm] = f"failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
                continue
            results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        new = results.get("new")
        for arm, result in results.items():
            if isinstance(result, str):
                print(f"{scenario:<12} {arm:<7} {result}")
                continue
            ratios = ""
            if isinstance(new, dict):
                ratios = f" {result['time_s'] / new['time_s']:>9.2f} {result['peak_mb'] / max(new['peak_mb'], 1):>9.2f}"
            print(
                f"{scenario:<12} {arm:<7} {result['time_s']:>9.2f} {result['peak_mb']:>9.0f} {result['kept']:>9.1f}"
                + ratios
            )


if __name__ == "__main__":
    main()
