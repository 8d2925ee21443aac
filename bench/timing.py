"""Timing helper the benchmark scripts share."""

from __future__ import annotations

import statistics
import time


def median_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median times of fa and fb, run alternately: on a shared machine both see the same
    load, so their ratio is steadier than either time."""
    fa(), fb()  # warm-up (allocator, lru caches)
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((fa, ta), (fb, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)
