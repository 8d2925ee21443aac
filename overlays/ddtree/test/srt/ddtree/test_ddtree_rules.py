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
