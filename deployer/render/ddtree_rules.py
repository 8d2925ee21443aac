"""DDTree's refusal rules, read from the newest released patch set, applied to render values.

The overlay defines what a DDTree server refuses once, in `ddtree_rules.py` (stdlib only), and
SGLang runs it while it resolves the server arguments. Here the same file is taken out of the
release that `push` deploys (checksums verified, `git apply --include` of that one file) and
run, so a launch script the server would refuse never reaches a host.
"""

from __future__ import annotations

import functools
import runpy
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..errors import PatchSetError, RenderError
from ..patchset.release import load_patch_set

RULES_FILE = "python/sglang/srt/speculative/ddtree_rules.py"


@functools.cache
def load_rules() -> tuple[str, SimpleNamespace]:
    """(version, namespace) of the newest release's `ddtree_rules.py`."""
    patch_set = load_patch_set()
    patch = next((p for p in patch_set.patches if RULES_FILE in p.files), None)
    if patch is None:
        raise PatchSetError(
            f"ddtree {patch_set.version} ships no {RULES_FILE}; release the overlay "
            "(ddeploy patches export) to render DDTree launches"
        )
    with tempfile.TemporaryDirectory(prefix="ddeploy-rules-") as tmp:
        subprocess.run(
            ["git", "apply", f"--include={RULES_FILE}", "-"],
            input=patch.data,
            cwd=tmp,
            check=True,
            capture_output=True,
        )
        # runpy runs the file as its own module (its dataclasses need one while they build)
        # and hands back its namespace, leaving nothing behind in sys.modules.
        namespace = runpy.run_path(str(Path(tmp) / RULES_FILE), run_name="ddtree_rules")
        return patch_set.version, SimpleNamespace(**namespace)


def launch_refusals(v: dict[str, Any]) -> list[str]:
    """What the server would refuse in these render values (empty: DDTree off or servable)."""
    if v["speculative_algorithm"] != "DFLASH" or v["tree_budget"] == 0:
        return []
    _, rules = load_rules()
    launch = rules.DDTreeLaunch(
        budget=v["tree_budget"],
        topk=v["tree_topk"],
        block_size=v["dflash_block_size"],
        verify_backend=v["attention_backend"],
        is_mla=v["model_attention"] == "mla",
    )
    return rules.ddtree_launch_refusals(launch)


def check_ddtree(host_name: str, topology: str, v: dict[str, Any]) -> None:
    """RenderError naming the rule and the topology if the server would refuse the launch."""
    reasons = launch_refusals(v)
    if reasons:
        version, _ = load_rules()
        raise RenderError(
            f"topology {topology}: SGLang would refuse this DDTree launch "
            f"(ddtree {version} rule): {reasons[0]} Set tree_budget=0 for linear DFlash, "
            "or change the value the rule names",
            host=host_name,
        )
