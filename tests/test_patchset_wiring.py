"""The wiring hunk really adds SGLang 0.5.23 server args and their validation (real SGLang import)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from deployer.patchset.sglang_base import clone_base
from deployer.patchset.local_git import git
from patchset_fixtures import REAL_WIRING_HUNK, pristine_base  # noqa: F401

PROBE = """
import argparse
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups import speculative_hook

parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
base = ["--model-path", "m", "--device", "cuda", "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", "d"]
a = parser.parse_args(base)
print("defaults", a.speculative_dflash_tree_budget, a.speculative_dflash_tree_topk)
a = parser.parse_args(base + ["--speculative-dflash-tree-budget", "8", "--speculative-dflash-tree-topk", "4"])
print("parsed", a.speculative_dflash_tree_budget, a.speculative_dflash_tree_topk)
for extra in (["--speculative-dflash-tree-budget", "0"], ["--speculative-dflash-tree-topk", "4"],
              ["--speculative-dflash-tree-budget", "8", "--speculative-dflash-tree-topk", "-1"]):
    try:
        speculative_hook._handle_dflash(ServerArgs.from_cli_args(parser.parse_args(base + extra)))
        print("accepted", extra)
    except ValueError as exc:
        print("refused", exc)
"""


@pytest.mark.slow
def test_wiring_hunk_adds_the_tree_args_with_validation(tmp_path, pristine_base):
    work = clone_base(tmp_path / "sglang", source=pristine_base.path)
    git(work, "apply", "--check", str(REAL_WIRING_HUNK))
    git(work, "apply", str(REAL_WIRING_HUNK))
    # The hunks call the wiring concern's modules (ddtree_config and friends).
    overlay_modules = REAL_WIRING_HUNK.parents[1] / "python/sglang/srt/speculative"
    for module in overlay_modules.glob("ddtree_*.py"):
        shutil.copy(module, work / "python/sglang/srt/speculative" / module.name)
    # Offline: ServerArgs looks the draft "d" up on the Hugging Face Hub (its DFLASH block size);
    # online that lookup waits on each of its retries (90 s of this test's 100 on a machine
    # without a network), offline it fails at once and SGLang takes its default.
    env = {
        **os.environ,
        "PYTHONPATH": str(work / "python"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "defaults None None",
        "parsed 8 4",
        "refused DDTree requires --speculative-dflash-tree-budget to be positive, got 0.",
        "refused --speculative-dflash-tree-topk requires --speculative-dflash-tree-budget "
        "(DDTree is off without a budget).",
        "refused DDTree requires --speculative-dflash-tree-topk to be positive, got -1.",
    ]
