"""The numbers `bench` reports from repeated client runs: per concurrency, the median of the runs
and their spread; the speedup as the ratio of the two configurations' medians, with an interval
over every pair of runs (pure functions, no I/O)."""

from __future__ import annotations

import math
import statistics
from typing import Any

# Whole numbers keep their lower median (the middle run's with an odd count), so they stay whole.
COUNTS = ("completed", "output_tokens", "verify_count")
RATES = ("duration_s", "output_tokens_per_s", "ttft_ms_median", "ttft_ms_p99", "itl_ms_median",
         "itl_ms_p99", "accept_length")  # fmt: skip
INTERVAL = (2.5, 97.5)  # percentiles of the pairwise ratios


def _median(values: list[Any], whole: bool) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.median_low(present) if whole else statistics.median(present)


def throughputs(runs: list[dict[str, Any]]) -> list[float]:
    """The runs' output tokens/s, where the client reported it."""
    return [r["output_tokens_per_s"] for r in runs if r.get("output_tokens_per_s") is not None]


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's numbers from its runs: each field's median over the runs that report it
    (None where none does), and the runs' lowest and highest output tokens/s."""
    row = {key: _median([r.get(key) for r in runs], key in COUNTS) for key in (*COUNTS, *RATES)}
    tps = throughputs(runs)
    row["output_tokens_per_s_min"] = min(tps, default=None)
    row["output_tokens_per_s_max"] = max(tps, default=None)
    return row


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default method)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    below = math.floor(at)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (at - below)


def speedup(measured: list[float], baseline: list[float]) -> dict[str, Any] | None:
    """Output tokens/s of `measured` over `baseline`: the ratio of their medians, and the 2.5th to
    97.5th percentile of the ratios of every pair (run i / baseline run j). No interval without at
    least two runs on each side (one pair says nothing of the noise); None without a baseline."""
    base = [b for b in baseline if b > 0]
    if not measured or not base:
        return None
    ratio = statistics.median(measured) / statistics.median(base)
    if len(measured) < 2 or len(base) < 2:
        return {"ratio": ratio, "interval": None}
    return {"ratio": ratio, "interval": pair_interval(measured, base)}


def pair_interval(measured: list[float], base: list[float]) -> dict[str, Any]:
    """The 2.5th-97.5th percentiles of run i / baseline run j over all pairs; whether 1.0 is outside."""
    ratios = [m / b for m in measured for b in base]
    low, high = (percentile(ratios, q) for q in INTERVAL)
    runs = [len(measured), len(base)]
    return {"low": low, "high": high, "runs": runs, "excludes_one": not low <= 1.0 <= high}
