"""render's sampling-memory estimate against one real sampling verify step of the overlay (issue 43).

`deployer/render/tree_memory.sampling_bytes` counts, from the overlay's code, what one DDTree
sampling verify step allocates over [rows, V] beside the verify logits. These tests run the
overlay's working copy of that step (`ddtree_worker.DDTreeVerifier._accept_sampled`: the sort-free
target `plain_sampling_probs`, then the dense accept or the memory-light chunks' exponential race)
on CPU at a reduced size, measure its peak memory above the inputs and hold the estimate within
10% of it.

How it is measured: in a fresh subprocess (one torch thread), with glibc's mmap threshold pinned
at 64 KiB (MALLOC_MMAP_THRESHOLD_), so that every [rows, V] buffer is its own mmap, returned to the
kernel when freed, and the resident set follows torch's live CPU allocations. The step runs twice
at a small vocabulary first (every op's code and thread-local state touched), then the peak
resident set is reset (`/proc/self/clear_refs` "5", Linux >= 4.0), the step runs at the test's
size, and the peak (VmHWM) minus the resident set just before it is the step's peak above its
inputs. torch.profiler's memory events were the alternative; the resident set needs no event
bookkeeping and counts every allocation, the allocator's included.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployer.locations import OVERLAYS_DIR

# The module (deployer.render's own `tree_memory` attribute is the function of that name).
tree_memory = importlib.import_module("deployer.render.tree_memory")

OVERLAY_PYTHON = OVERLAYS_DIR / "ddtree" / "python"
TOLERANCE = 0.10
WIDTH, REQUESTS, VOCAB = 17, 4, 32_768  # R = 4 x 17 = 68 rows; one float32 [R, V] buffer is 8.5 MiB


def _measure(requests: int, width: int, vocab: int, top_k: int, chunk_elements: int) -> int:
    """Peak bytes above the inputs of one sampled accept (top_p 0.9; top_k 0: no top-k)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    args = [str(requests), str(width), str(vocab), str(top_k), str(chunk_elements)]
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not _can_reset_peak(), reason="needs Linux's resettable peak RSS"
)

# (name, top_k, chunk elements on the memory-light path or 0 for dense)
CASES = [
    ("dense, per-row top_p, no top_k (bisection)", 0, 0),
    ("dense, top_k 40 bound with top_p (topk path)", 40, 0),
    ("memory-light, one request per chunk, 4 chunks", 0, WIDTH * VOCAB),
]


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    return {name: _measure(REQUESTS, WIDTH, VOCAB, top_k, chunk) for name, top_k, chunk in CASES}


def _estimate(chunk: int) -> tuple[str, int]:
    if chunk:
        return tree_memory.sampling_bytes(REQUESTS, WIDTH, VOCAB, dense_max_elements=0, chunk_elements=chunk)
    return tree_memory.sampling_bytes(REQUESTS, WIDTH, VOCAB)


@pytest.mark.parametrize("name,top_k,chunk", CASES, ids=[c[0] for c in CASES])
def test_estimate_within_10_percent_of_the_measured_step(measured, name, top_k, chunk):
    path, estimate = _estimate(chunk)
    assert path == ("memory-light" if chunk else "dense")
    peak = measured[name]
    buffer = REQUESTS * WIDTH * VOCAB * 4
    assert abs(estimate - peak) <= TOLERANCE * peak, (
        f"{name}: estimate {estimate} B ({estimate / buffer:.2f} [R, V] float32) vs measured {peak} B "
        f"({peak / buffer:.2f})"
    )


def test_half_a_buffer_less_is_outside_the_tolerance(measured, monkeypatch):
    """The 10% margin tells the counts apart: half a float32 [rows, V] buffer less (dense: the
    2 buffers of the softmax alone; memory-light: the race's 3 without the previous chunk) fails."""
    monkeypatch.setattr(tree_memory, "TARGET_BUFFERS", tree_memory.TARGET_BUFFERS - 0.5)
    for name, _, chunk in CASES:
        _, estimate = _estimate(chunk)
        assert abs(estimate - measured[name]) > TOLERANCE * measured[name], name


def test_render_constants_are_the_overlays():
    """The thresholds the estimate uses are the overlay working copy's."""
    step = (OVERLAY_PYTHON / "sglang/srt/speculative/ddtree_step.py").read_text()
    worker = (OVERLAY_PYTHON / "sglang/srt/speculative/ddtree_worker.py").read_text()
    assert "DDTREE_DENSE_SAMPLING_MAX_ELEMENTS = 1 << 26" in step
    assert "DDTREE_LIGHT_CHUNK_ELEMENTS = 1 << 26" in worker
    assert tree_memory.DENSE_SAMPLING_MAX_ELEMENTS == tree_memory.LIGHT_CHUNK_ELEMENTS == 1 << 26


def _run_step(requests: int, width: int, vocab: int, top_k: int, chunk_elements: int) -> int:
    """In the subprocess: the overlay's sampled accept; returns its peak bytes above the inputs."""
    import types
    from types import SimpleNamespace

    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        module = types.ModuleType(name)
        module.__path__ = [str(OVERLAY_PYTHON / Path(*name.split(".")))]
        sys.modules[name] = module
    import torch

    torch.set_num_threads(1)
    from sglang.srt.speculative import ddtree_worker
    from sglang.srt.speculative.ddtree_step import build_verify_step

    if chunk_elements:
        os.environ["SGLANG_DDTREE_DENSE_SAMPLING_MAX_ELEMENTS"] = "0"
        ddtree_worker.DDTREE_LIGHT_CHUNK_ELEMENTS = chunk_elements

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    def once(vocab: int) -> int:
        g = torch.Generator().manual_seed(0)
        depth, topk = 15, 4
        log_probs = torch.randn(requests, depth, topk, generator=g).log_softmax(-1)
        ids = torch.randint(0, vocab, (requests, depth, topk), generator=g)
        roots = torch.randint(0, vocab, (requests,), generator=g)
        prefix = torch.full((requests,), 100)
        step = build_verify_step(log_probs, ids, roots, prefix, width - 1, width, 100 * requests + 10)
        logits = torch.randn(requests * width, vocab, generator=g) * 3
        info = SimpleNamespace(
            temperatures=torch.full((requests, 1), 0.8),
            top_ks=torch.full((requests,), top_k or vocab, dtype=torch.int32),
            top_ps=torch.full((requests,), 0.9),
            min_ps=torch.zeros(requests),
            need_top_k_sampling=bool(top_k),
            need_top_p_sampling=True,
            need_min_p_sampling=False,
        )
        worker = SimpleNamespace(
            config=SimpleNamespace(num_speculative_tokens=16),
            sampling_backend="pytorch",
            _log_path_once=lambda path: None,
        )
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ddtree_worker.DDTreeVerifier._accept_sampled(worker, step, logits, info, top_k or None, 1.0, 1.0, None)
        return status("VmHWM") - before

    once(vocab // 64)
    once(vocab // 64)
    return once(vocab)


if __name__ == "__main__":
    print(json.dumps({"peak": _run_step(*(int(a) for a in sys.argv[1:]))}))
