"""Test-only hooks the CPU tree's ``ddtree_worker`` calls (never in a release).

:func:`cpu_tree.prepare_cpu_tree` copies this module into the scratch tree as
``sglang/srt/speculative/ddtree_test_hooks.py`` and inserts one call per hook
into its ``ddtree_worker.py``. Each hook does nothing unless the server's
environment asks for it:

``DDTREE_TEST_RECORD_DIR``
    every TP rank appends, per verify step, what it commits (the emitted
    tokens and their count per request) to ``rank<R>.jsonl`` there, so a test
    can check that all ranks commit the same tokens.
``DDTREE_TEST_RANK_COINS=1``
    before each sampled accept, seed the RNG per rank, so every rank draws
    different coins: only the accept sync can keep the ranks together.
``DDTREE_TEST_MASK=shift``
    shift the tree's FULL_MASK by one element (a mask in the wrong layout),
    a control that greedy equality must catch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

_STEPS = {"sampled": 0}


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def record_commit(out_tokens: torch.Tensor, commit_lens: torch.Tensor) -> None:
    """Append this rank's committed tokens (out_tokens[b, :commit_lens[b]])."""
    directory = os.environ.get("DDTREE_TEST_RECORD_DIR")
    if not directory:
        return
    lens = commit_lens.tolist()
    rows = out_tokens.tolist()
    line = json.dumps([row[:n] for row, n in zip(rows, lens)])
    with open(Path(directory) / f"rank{_rank()}.jsonl", "a") as out:
        out.write(line + "\n")


def before_sampling() -> None:
    """Make each rank draw its own coins (DDTREE_TEST_RANK_COINS=1)."""
    if os.environ.get("DDTREE_TEST_RANK_COINS") != "1":
        return
    _STEPS["sampled"] += 1
    torch.manual_seed(1_000_003 * (_rank() + 1) + _STEPS["sampled"])


def corrupt_mask(step) -> None:
    """Shift the step's FULL_MASK by one element (DDTREE_TEST_MASK=shift)."""
    if os.environ.get("DDTREE_TEST_MASK") != "shift":
        return
    step.custom_mask.copy_(torch.roll(step.custom_mask, 1))
