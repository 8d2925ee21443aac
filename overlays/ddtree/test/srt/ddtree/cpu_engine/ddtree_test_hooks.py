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
``DDTREE_TEST_ACCEPT_SYNC=off``
    DDTree's own accept broadcast is skipped (SGLang's other sync sites stay
    as ``SGLANG_SPEC_TP_SYNC`` sets them), a control that per-rank coins must
    make the ranks diverge.
``DDTREE_TEST_THRESHOLD_ACC=<t>``
    the sampled accept runs with threshold_acc t (lossy below 1), a control
    the sampling tests must reject; a server no longer takes a threshold
    below 1 under DDTree (``ddtree_rules.accept_threshold_refusal``).
``DDTREE_TEST_GRAMMAR=swap-siblings``
    the grammar's mask is built over the tree with sibling tokens swapped in
    pairs (each node masked by its sibling's path: a mask over the wrong node
    order), a control that greedy equality under a grammar must catch.
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


def grammar_tokens(step) -> torch.Tensor:
    """The tokens the grammar tree is built over: the step's, or with sibling
    pairs swapped (DDTREE_TEST_GRAMMAR=swap-siblings)."""
    if os.environ.get("DDTREE_TEST_GRAMMAR") != "swap-siblings":
        return step.tokens
    tokens = step.tokens.clone()
    siblings = step.retrieve.retrieve_next_sibling.tolist()
    for b, row in enumerate(siblings):
        swapped = set()
        for i, j in enumerate(row):
            if j >= 0 and i not in swapped and j not in swapped:
                tokens[b, i], tokens[b, j] = step.tokens[b, j], step.tokens[b, i]
                swapped.update((i, j))
    return tokens


def accept_sync(tp_sync):
    """The worker's SpecTpSync for DDTree's accept, or None when
    DDTREE_TEST_ACCEPT_SYNC=off (the control)."""
    return None if os.environ.get("DDTREE_TEST_ACCEPT_SYNC") == "off" else tp_sync


def threshold_acc(value: float) -> float:
    """The sampled accept's threshold_acc: the server's, or t when
    DDTREE_TEST_THRESHOLD_ACC=t (the lossy control)."""
    forced = os.environ.get("DDTREE_TEST_THRESHOLD_ACC")
    return value if not forced else max(float(forced), 1e-9)
