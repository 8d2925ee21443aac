"""DDTree's refusal rules, read from the newest released patch set, applied to render values.

The overlay defines what a DDTree server refuses once, in `ddtree_rules.py` (stdlib only), and
SGLang runs it while it resolves the server arguments. Here the same file is taken out of the
release that `push` deploys (checksums verified, `git apply --include` of that one file) and
run, so a launch script the server would refuse never reaches a host.

The same file sizes the verify's MoE dispatch: with a low-latency all-to-all (DeepEP, Mooncake,
NIXL) a verify sends requests per DP rank x W tokens per rank, over the dispatcher's default cap
of 128 at Kimi's sizes. Render sets the cap variable to that product when it fits the dispatcher's
limit of 1024, and refuses the launch with the numbers when it does not (a release without the
dispatch rule, before ddtree 0.2.18, sets nothing: its server checks nothing either).
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
from .values import ENV_PREFIX, Value

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
    return rules.ddtree_launch_refusals(_launch(rules, v))


def _launch(rules: SimpleNamespace, v: dict[str, Any]) -> Any:
    """The rules' DDTreeLaunch for these render values (DDTree on)."""
    return rules.DDTreeLaunch(
        budget=v["tree_budget"],
        topk=v["tree_topk"],
        block_size=v["dflash_block_size"],
        verify_backend=v["attention_backend"],
        is_mla=v["model_attention"] == "mla",
        **_dispatch_fields(rules, v),
        **_threshold_fields(rules, v),
    )


def _threshold_fields(rules: SimpleNamespace, v: dict[str, Any]) -> dict[str, Any]:
    """The accept thresholds (none for a release without the lossy-threshold rule)."""
    if not hasattr(rules, "accept_threshold_refusal"):
        return {}
    return {key: v[key] for key in ("accept_threshold_single", "accept_threshold_acc")}


def _dispatch_fields(rules: SimpleNamespace, v: dict[str, Any]) -> dict[str, Any]:
    """What the dispatch rule reads (none for a release that has no such rule)."""
    if not hasattr(rules, "dispatch_budget"):
        return {}
    backend = v["moe_a2a_backend"]
    try:
        cap = rules.dispatch_cap_of(backend, v["env"])
    except ValueError as exc:
        raise RenderError(f"{exc}; --set env.NAME=<tokens per rank>") from None
    return {
        "moe_a2a_backend": backend,
        "deepep_mode": v["deepep_mode"],
        "max_running_requests": v["max_running_requests"],
        "attn_dp_size": v["attn_dp_size"],
        "tp_size": v["tp_size"],
        "dispatch_cap": cap,
    }


def dispatch_budget(v: dict[str, Any]) -> Any | None:
    """The rules' DispatchBudget of a DDTree verify (None: DDTree off, no capped low-latency
    all-to-all, or a release without the rule)."""
    if v["speculative_algorithm"] != "DFLASH" or v["tree_budget"] == 0:
        return None
    _, rules = load_rules()
    if not hasattr(rules, "dispatch_budget"):
        return None
    return rules.dispatch_budget(_launch(rules, v))


def dispatch_env(v: dict[str, Any]) -> dict[str, Value]:
    """env.<cap variable> = the verify's tokens per rank, where the default cap is too small and
    the product fits the dispatcher's limit (a value the user set is theirs to keep)."""
    budget = dispatch_budget(v)
    if budget is None or budget.env_var in v["env"] or not budget.cap < budget.tokens <= _limit():
        return {}
    source = (
        f"DDTree verify (computed): {budget.name} low-latency dispatch per rank = max_running_requests/"
        f"attn_dp_size x W = {budget.arithmetic()} (SGLang default {budget.cap}, at most {_limit()})"
    )
    key = ENV_PREFIX + budget.env_var
    return {key: Value(key, str(budget.tokens), source)}


def check_dispatch(host_name: str, topology: str, v: dict[str, Any]) -> None:
    """RenderError with the numbers if a verify's tokens per rank do not fit the dispatcher."""
    budget = dispatch_budget(v)
    if budget is None or budget.tokens <= min(budget.cap, _limit()) or budget.cap > _limit():
        return  # a cap set above the limit: the rules name it (check_ddtree)
    head = (
        f"topology {topology}: {budget.name} low-latency dispatch needs {budget.arithmetic()} "
        "tokens per rank (max_running_requests/attn_dp_size x W) in a DDTree verify"
    )
    if budget.tokens <= _limit():
        raise RenderError(
            f"{head}, over env.{budget.env_var}={budget.cap}; --set env.{budget.env_var}={budget.tokens} "
            "(or drop it: render sets it)",
            host=host_name,
        )
    raise RenderError(f"{head}, over its limit of {_limit()} ({budget.env_var}); {_fits(budget)}", host=host_name)


def _fits(budget: Any) -> str:
    """The --set values that bring the verify's dispatch under the limit."""
    fits = []
    if budget.max_requests_that_fit() > 0:
        fits.append(f"--set max_running_requests={budget.max_requests_that_fit()}")
    if budget.max_budget_that_fits() > 0:
        fits.append(f"--set tree_budget={budget.max_budget_that_fits()}")
    return " or ".join([*fits, "--set tree_budget=0 (linear DFlash)"]) + " fits"


def _limit() -> int:
    return load_rules()[1].DISPATCH_CAP_MAX


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
