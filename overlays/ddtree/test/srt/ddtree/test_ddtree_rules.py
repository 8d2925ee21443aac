"""The refusal rules DDTree shares with the deploy tool: stdlib only, one line each."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from sglang.srt.speculative import ddtree_rules
from sglang.srt.speculative.ddtree_rules import (
    DDTreeLaunch,
    ddtree_launch_refusals,
    draft_head_kind,
    verify_backend_class_refusal,
)


def test_rules_import_only_the_standard_library():
    """``ddeploy render`` loads this file outside SGLang, without torch."""
    tree = ast.parse(Path(ddtree_rules.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "dataclasses", "typing"}, imported


def test_a_launch_ddtree_can_serve_has_no_refusal():
    launch = DDTreeLaunch(budget=64, topk=8, block_size=16, verify_backend="triton",
                          is_mla=True)
    assert ddtree_launch_refusals(launch) == []
    assert ddtree_launch_refusals(DDTreeLaunch(budget=None)) == []


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"pp_size": 2}, "only supports --pp-size 1 (got 2)"),
        ({"verify_backend": "trtllm_mla"}, "--attention-backend trtllm_mla does not"),
        ({"budget": 0}, "tree-budget to be positive, got 0"),
        ({"topk": 0}, "tree-topk to be positive, got 0"),
        ({"block_size": 1}, "block size >= 2"),
        ({"block_verification": True}, "block-verification"),
        ({"budget": None, "topk": 4}, "tree-topk requires"),
        ({"accept_threshold_single": 0.9}, "--speculative-accept-threshold-single 0.9"),
        ({"accept_threshold_acc": 0.5}, "--speculative-accept-threshold-acc 0.5 would"),
    ],
)
def test_each_rule_names_the_flag(fields, message):
    base = dict(budget=64, block_size=16, verify_backend="triton", is_mla=True)
    base.update(fields)
    reasons = ddtree_launch_refusals(DDTreeLaunch(**base))
    assert len(reasons) == 1 and message in reasons[0], reasons
    assert "\n" not in reasons[0]


def test_mha_targets_may_verify_with_flashinfer_mla_targets_may_not():
    mha = DDTreeLaunch(budget=8, verify_backend="flashinfer", is_mla=False)
    mla = DDTreeLaunch(budget=8, verify_backend="flashinfer", is_mla=True)
    assert ddtree_launch_refusals(mha) == []
    assert "MLA target" in ddtree_launch_refusals(mla)[0]


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"topk": 65, "vocab_size": 64},
            "tree-topk 65 exceeds the target vocabulary size 64",
        ),
        ({"hybrid_target": True}, "does not support hybrid/Mamba targets"),
        ({"draft_head": "LiLiCorr"}, "this draft uses a LiLiCorr head"),
    ],
)
def test_model_facts_known_at_argument_resolution_are_refused(fields, message):
    launch = DDTreeLaunch(budget=64, topk=8, vocab_size=64, hybrid_target=False,
                          draft_head="dflash", verify_backend="triton", is_mla=True)
    assert ddtree_launch_refusals(launch) == []
    reasons = ddtree_launch_refusals(replace(launch, **fields))
    assert len(reasons) == 1 and message in reasons[0], reasons


@pytest.mark.parametrize(
    "architecture,projector,kind",
    [
        ("DFlashDraftModel", None, "dflash"),
        ("DFlashDraftModel", "domino", "Domino"),
        ("DFlash2DraftModel", None, "candidate-selector"),
        ("LiLiCorrDraftModel", None, "LiLiCorr"),
        (None, None, "dflash"),
    ],
)
def test_draft_head_kind_from_the_draft_config(architecture, projector, kind):
    assert draft_head_kind(architecture, projector) == kind


def test_class_rule_matches_the_flag_rule():
    assert verify_backend_class_refusal("TritonAttnBackend", True) is None
    assert verify_backend_class_refusal("FlashInferAttnBackend", True)
    assert verify_backend_class_refusal("FlashInferAttnBackend", False) is None


def _ep(**fields):
    base = dict(budget=128, block_size=16, moe_a2a_backend="deepep",
                deepep_mode="auto", max_running_requests=48, attn_dp_size=8,
                tp_size=8)
    base.update(fields)
    return DDTreeLaunch(**base)


@pytest.mark.parametrize(
    "fields,arithmetic,env_var",
    [
        ({}, "48/8 x 129 = 774", "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"),
        (  # ep16-2node: 16 DP ranks of one GPU each
            {"attn_dp_size": 16, "tp_size": 16},
            "48/16 x 129 = 387",
            "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
        ),
        (  # attention TP 2: a graph batch is padded to a multiple of 2
            {"tp_size": 16, "max_running_requests": 40},
            "40/8 (= 6 per rank) x 129 = 774",
            "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
        ),
        (  # fewer requests than DP ranks: each rank still runs one
            {"max_running_requests": 4},
            "4/8 (= 1 per rank) x 129 = 129",
            "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
        ),
        (
            {"moe_a2a_backend": "mooncake"},
            "48/8 x 129 = 774",
            "SGLANG_MOONCAKE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
        ),
        (
            {"moe_a2a_backend": "nixl", "deepep_mode": "low_latency"},
            "48/8 x 129 = 774",
            "SGLANG_NIXL_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
        ),
    ],
)
def test_the_verify_dispatch_is_requests_per_dp_rank_times_w(
    fields, arithmetic, env_var
):
    budget = ddtree_rules.dispatch_budget(_ep(**fields))
    assert (budget.arithmetic(), budget.env_var, budget.cap) == (
        arithmetic, env_var, 128)
    reasons = ddtree_launch_refusals(_ep(**fields))
    if budget.tokens > 128:
        assert reasons[0].endswith(f"; set {env_var}={budget.tokens}."), reasons
    else:
        assert reasons == []
    assert ddtree_launch_refusals(_ep(dispatch_cap=budget.tokens, **fields)) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"moe_a2a_backend": None},
        {"moe_a2a_backend": "none"},
        {"moe_a2a_backend": "deepep_v2"},  # SGLang checks its budget itself
        {"moe_a2a_backend": "pplx"},
        {"moe_a2a_backend": "mori"},
        {"deepep_mode": "normal"},
        {"budget": None},
    ],
)
def test_no_capped_low_latency_dispatch_means_no_budget(fields):
    assert ddtree_rules.dispatch_budget(_ep(**fields)) is None
    assert ddtree_launch_refusals(_ep(**fields)) == []


def test_what_fits_under_1024_is_named_and_fits():
    big = ddtree_rules.dispatch_budget(_ep(max_running_requests=96))
    assert (big.tokens, big.max_requests_that_fit(), big.max_budget_that_fits()) == (
        1548, 56, 84)
    for fits in (_ep(max_running_requests=56), _ep(max_running_requests=96,
                                                  budget=84)):
        assert ddtree_rules.dispatch_budget(fits).tokens <= 1024
        assert ddtree_launch_refusals(replace(fits, dispatch_cap=1024)) == []
    (reason,) = ddtree_launch_refusals(_ep(max_running_requests=96,
                                           dispatch_cap=1024))
    assert "needs 96/8 x 129 = 1548 tokens per rank" in reason
    assert "over its limit of 1024" in reason and "\n" not in reason


def test_the_dispatch_cap_is_read_from_the_backends_variable():
    env = {"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "774",
           "SGLANG_MOONCAKE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "900"}
    assert ddtree_rules.dispatch_cap_of("deepep", env) == 774
    assert ddtree_rules.dispatch_cap_of("mooncake", env) == 900
    assert ddtree_rules.dispatch_cap_of("nixl", env) is None
    assert ddtree_rules.dispatch_cap_of("none", env) is None
    assert ddtree_rules.dispatch_cap_of(None, env) is None


def test_lossy_accept_thresholds_are_refused_only_under_ddtree():
    """Below 1.0 the dense tree verify would apply them and the memory-light one
    (larger batches) would not: the distribution would follow the batch size."""
    both = DDTreeLaunch(budget=8, accept_threshold_single=0.9, accept_threshold_acc=0.5)
    (reason,) = ddtree_launch_refusals(both)
    assert (
        "--speculative-accept-threshold-single 0.9 and "
        "--speculative-accept-threshold-acc 0.5 would make it lossy"
    ) in reason
    linear = DDTreeLaunch(budget=None, accept_threshold_single=0.9)
    assert ddtree_launch_refusals(linear) == []
    exact = DDTreeLaunch(budget=8, accept_threshold_single=1.0, accept_threshold_acc=1)
    assert ddtree_launch_refusals(exact) == []
