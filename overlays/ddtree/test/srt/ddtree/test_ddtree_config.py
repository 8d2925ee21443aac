"""DDTree's server-argument resolution, start-up and per-request refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang.srt.speculative.ddtree_config import (
    DDTreeConfig,
    check_ddtree_attention,
    check_ddtree_worker,
    ddtree_request_error,
    ddtree_verify_backend,
    ddtree_verify_width,
    resolve_ddtree_server_args,
)


def _cfg(**over):
    base = dict(
        speculative_dflash_tree_budget=8,
        speculative_dflash_tree_topk=None,
        speculative_draft_window_size=None,
        speculative_use_block_verification=False,
        speculative_num_draft_tokens=4,
        pp_size=1,
        moe_a2a_backend="none",
        deepep_mode="auto",
        max_running_requests=None,
        attn_dp_size=1,
        tp_size=1,
        speculative_accept_threshold_single=1.0,
        speculative_accept_threshold_acc=1.0,
    )
    base.update(over)
    return SimpleNamespace(**base)


DEEPEP_CAP = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"


def _ep8(**over):
    """Kimi's ep8 at the B300 budget: W = 129, 48 requests over 8 DP ranks."""
    fields = dict(
        speculative_dflash_tree_budget=128,
        speculative_num_draft_tokens=16,
        moe_a2a_backend="deepep",
        max_running_requests=48,
        attn_dp_size=8,
        tp_size=8,
    )
    fields.update(over)
    return _cfg(**fields)


def test_ep8_at_the_default_dispatch_cap_is_refused_naming_the_numbers(monkeypatch):
    monkeypatch.delenv(DEEPEP_CAP, raising=False)
    with pytest.raises(ValueError) as exc:
        resolve_ddtree_server_args(_ep8())
    assert str(exc.value) == (
        "DeepEP low-latency dispatch needs 48/8 x 129 = 774 tokens per rank in a "
        f"DDTree verify, over {DEEPEP_CAP}'s default 128; set {DEEPEP_CAP}=774."
    )


def test_ep8_starts_once_the_dispatch_cap_covers_the_verify(monkeypatch):
    monkeypatch.setenv(DEEPEP_CAP, "774")
    fields = resolve_ddtree_server_args(_ep8())
    assert fields["speculative_num_draft_tokens"] == 129
    monkeypatch.setenv(DEEPEP_CAP, "773")
    with pytest.raises(ValueError, match=f"over {DEEPEP_CAP}'s 773; set"):
        resolve_ddtree_server_args(_ep8())


def test_a_verify_over_deepeps_1024_tokens_names_what_fits(monkeypatch):
    monkeypatch.setenv(DEEPEP_CAP, "1024")
    with pytest.raises(ValueError) as exc:
        resolve_ddtree_server_args(_ep8(max_running_requests=96))
    message = str(exc.value)
    assert message.startswith(
        "DeepEP low-latency dispatch needs 96/8 x 129 = 1548 tokens per rank"
    )
    assert message.endswith(
        "use --max-running-requests 56 or --speculative-dflash-tree-budget 84."
    )
    assert "\n" not in message
    # What it names fits: 56/8 x 129 = 903 and 96/8 x 85 = 1020.
    resolve_ddtree_server_args(_ep8(max_running_requests=56))
    resolve_ddtree_server_args(
        _ep8(max_running_requests=96, speculative_dflash_tree_budget=84)
    )


@pytest.mark.parametrize(
    "env,over,message",
    [
        ("2048", {}, f"{DEEPEP_CAP}=2048 exceeds DeepEP's limit of 1024"),
        # Unset: DFLASH's own default of 48 running requests.
        (None, {"max_running_requests": None}, "needs 48/8 x 129 = 774 tokens"),
        ("abc", {}, f"{DEEPEP_CAP} must be an integer, got 'abc'"),
    ],
)
def test_dispatch_settings_deepep_would_assert_on_are_refused(
    monkeypatch, env, over, message
):
    monkeypatch.delenv(DEEPEP_CAP, raising=False)
    if env is not None:
        monkeypatch.setenv(DEEPEP_CAP, env)
    with pytest.raises(ValueError, match=message):
        resolve_ddtree_server_args(_ep8(**over))


@pytest.mark.parametrize(
    "over",
    [
        {"moe_a2a_backend": "none", "attn_dp_size": 1},  # tp8: no all-to-all
        {"deepep_mode": "normal"},  # no low-latency dispatch
        {"speculative_dflash_tree_budget": None},  # linear DFlash
    ],
)
def test_launches_without_a_low_latency_verify_dispatch_need_no_cap(
    monkeypatch, over
):
    monkeypatch.delenv(DEEPEP_CAP, raising=False)
    resolve_ddtree_server_args(_ep8(**over))


@pytest.mark.parametrize(
    "budget,block,width", [(2, 4, 4), (3, 4, 4), (8, 4, 9), (255, 16, 256)]
)
def test_verify_width_is_budget_plus_one_at_least_the_block(budget, block, width):
    assert ddtree_verify_width(budget, block) == width
    fields = resolve_ddtree_server_args(
        _cfg(speculative_dflash_tree_budget=budget, speculative_num_draft_tokens=block)
    )
    assert fields == {
        "speculative_dflash_block_size": block,
        "speculative_num_draft_tokens": width,
    }


def test_no_budget_declares_nothing():
    assert resolve_ddtree_server_args(_cfg(speculative_dflash_tree_budget=None)) == {}


@pytest.mark.parametrize(
    "over,message",
    [
        ({"speculative_dflash_tree_budget": 0}, "tree-budget to be positive, got 0"),
        ({"speculative_dflash_tree_topk": -1}, "tree-topk to be positive, got -1"),
        (
            {"speculative_dflash_tree_budget": None, "speculative_dflash_tree_topk": 2},
            "tree-topk requires --speculative-dflash-tree-budget",
        ),
        ({"speculative_use_block_verification": True}, "block-verification"),
        ({"speculative_num_draft_tokens": 1}, "block size >= 2"),
        ({"pp_size": 2}, "only supports --pp-size 1 \\(got 2\\)"),
        (
            {"speculative_accept_threshold_single": 0.9},
            "--speculative-accept-threshold-single 0.9 would make it lossy",
        ),
        (
            {"speculative_accept_threshold_acc": 0.5},
            "--speculative-accept-threshold-acc 0.5 would make it lossy",
        ),
    ],
)
def test_each_refused_server_setting_has_its_message(over, message):
    with pytest.raises(ValueError, match=message):
        resolve_ddtree_server_args(_cfg(**over))


@pytest.mark.parametrize(
    "backend,is_mla,refused",
    [
        ("triton", True, False),
        ("trtllm_mla", True, True),
        ("flashinfer", True, True),
        ("flashmla", True, True),
        ("triton", False, False),
        ("flashinfer", False, False),
        ("fa3", False, True),
        ("torch_native", False, True),
    ],
)
def test_verify_backend_is_refused_at_argument_resolution(backend, is_mla, refused):
    """The TARGET_VERIFY backend is known once the attention hook ran: an MLA
    target (Kimi) verifies with triton only, before any weight loads."""
    cfg = _cfg()
    def facts():
        return {"verify_backend": backend, "is_mla": is_mla}

    if not refused:
        assert resolve_ddtree_server_args(cfg, facts)
        return
    with pytest.raises(ValueError, match=f"--attention-backend {backend} does not"):
        resolve_ddtree_server_args(cfg, facts)


def test_flags_are_judged_before_the_model_configs_are_read():
    """Bad flags are reported together, without reading the model (no download,
    no config parse); the model's own refusals come once the flags are fine."""
    read = []

    def facts():
        read.append(True)
        return {"verify_backend": "trtllm_mla", "is_mla": True, "vocab_size": 64}

    cfg = _cfg(pp_size=2, speculative_use_block_verification=True)
    with pytest.raises(ValueError) as info:
        resolve_ddtree_server_args(cfg, facts)
    text = str(info.value)
    assert "block-verification" in text and "--pp-size" in text
    assert read == []
    with pytest.raises(ValueError) as info:
        resolve_ddtree_server_args(_cfg(speculative_dflash_tree_topk=65), facts)
    text = str(info.value)
    assert "--attention-backend trtllm_mla" in text
    assert "tree-topk 65 exceeds the target vocabulary size 64" in text
    assert read == [True]
    off = _cfg(speculative_dflash_tree_budget=None)
    assert resolve_ddtree_server_args(off, facts) == {}
    assert read == [True]  # DDTree off: the model is not read


@pytest.mark.parametrize(
    "mode,split,expected",
    [
        ("prefill", {}, "triton"),
        ("prefill", {"prefill_attention_backend": "fa3"}, "fa3"),
        ("decode", {"prefill_attention_backend": "fa3"}, "triton"),
        ("decode", {"decode_attention_backend": "trtllm_mla"}, "trtllm_mla"),
    ],
)
def test_verify_backend_follows_the_speculative_attention_mode(mode, split, expected):
    cfg = SimpleNamespace(
        speculative_attention_mode=mode,
        attention_backend="triton",
        prefill_attention_backend=split.get("prefill_attention_backend"),
        decode_attention_backend=split.get("decode_attention_backend"),
    )
    assert ddtree_verify_backend(cfg) == expected


def _spec(budget=8, topk=None, block=4):
    return SimpleNamespace(
        speculative_dflash_tree_budget=budget,
        speculative_dflash_tree_topk=topk,
        speculative_dflash_block_size=block,
    )


def test_worker_config_defaults_topk_to_min_budget_vocab():
    assert DDTreeConfig.for_worker(_spec(budget=8), vocab_size=64).topk == 8
    config = DDTreeConfig.for_worker(_spec(budget=100), vocab_size=64)
    assert (config.topk, config.verify_width, config.depth) == (64, 101, 3)
    assert config.num_speculative_tokens == 4
    assert DDTreeConfig.for_worker(_spec(budget=None), vocab_size=64) is None


def test_worker_config_refuses_topk_above_the_vocabulary():
    with pytest.raises(ValueError, match="tree-topk 65 exceeds the target vocabulary"):
        DDTreeConfig.for_worker(_spec(topk=65), vocab_size=64)


_OK = dict(is_hybrid=False, draft_kind="dflash", dense_lm_head=True)


@pytest.mark.parametrize(
    "over,message",
    [
        ({"is_hybrid": True}, "hybrid/Mamba"),
        ({"draft_kind": "Domino"}, "uses a Domino head"),
        ({"dense_lm_head": False}, "dense \\(unquantized\\)"),
    ],
)
def test_each_refused_worker_setting_has_its_message(over, message):
    check_ddtree_worker(**_OK)  # the accepted baseline
    with pytest.raises(ValueError, match=message):
        check_ddtree_worker(**{**_OK, **over})


def test_attention_backends_must_apply_the_verify_mask():
    check_ddtree_attention("TritonAttnBackend", is_mla=True)
    check_ddtree_attention("FlashInferAttnBackend", is_mla=False)
    with pytest.raises(ValueError, match="FlashAttentionBackend does not for this"):
        check_ddtree_attention("FlashAttentionBackend", is_mla=False)
    message = "does not for an MLA target .* TritonAttnBackend"
    with pytest.raises(ValueError, match=message):
        check_ddtree_attention("FlashInferAttnBackend", is_mla=True)


def _req(**params):
    sampling = SimpleNamespace(
        json_schema=None,
        regex=None,
        ebnf=None,
        structural_tag=None,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        min_new_tokens=0,
        top_k=1,
    )
    for key, value in params.items():
        setattr(sampling, key, value)
    return SimpleNamespace(
        sampling_params=sampling,
        return_logprob=False,
        custom_logit_processor=None,
        return_sampling_mask=False,
    )


def test_grammars_logprobs_and_stateless_logit_processors_are_served():
    assert ddtree_request_error(_req()) is None
    assert ddtree_request_error(_req(regex="a+", json_schema="{}")) is None
    req = _req(top_k=TOP_K_ALL)
    req.return_logprob = True
    req.custom_logit_processor = _serialized(DisallowedTokensLogitsProcessor)
    assert ddtree_request_error(req, deterministic=False) is None


TOP_K_ALL = 1 << 30


class ThinkingBudgetLogitProcessor:
    """Stands in for SGLang's: it counts the request's output_ids."""

    def __call__(self, logits, custom_param_list=None):
        return logits


class DisallowedTokensLogitsProcessor:
    """Stands in for SGLang's stateless processor (its module and name)."""


DisallowedTokensLogitsProcessor.__module__ = "sglang.srt.sampling.custom_logit_processor"


class DeclaredStateless:
    stateless = True


def _serialized(cls) -> str:
    """As SGLang's CustomLogitProcessor.to_str writes it (json around dill)."""
    import dill

    return json.dumps({"callable": dill.dumps(cls).hex()})


def _with_processor(cls):
    req = _req()
    req.custom_logit_processor = _serialized(cls)
    return req


def test_a_logit_processor_reading_the_request_is_refused_by_name():
    """A verify hands every tree row the request as it stood before the step,
    so a processor counting output_ids would be wrong below the root."""
    error = ddtree_request_error(_with_processor(ThinkingBudgetLogitProcessor))
    assert error.startswith(
        "DDTree speculative decoding does not support the custom logit processor "
        "ThinkingBudgetLogitProcessor:"
    ), error


def test_a_logit_processor_that_declares_itself_stateless_is_served():
    assert ddtree_request_error(_with_processor(DeclaredStateless)) is None
    assert ddtree_request_error(_with_processor(DisallowedTokensLogitsProcessor)) is None


def test_an_unloadable_logit_processor_is_refused_with_the_reason():
    req = _req()
    req.custom_logit_processor = json.dumps({"callable": "00"})
    assert "could not load the request's custom logit processor" in (
        ddtree_request_error(req)
    )


def test_sampled_requests_under_deterministic_inference_are_refused():
    """Plain decoding draws them from sampling_seed; the tree verify cannot."""
    sampled = _req(top_k=TOP_K_ALL, sampling_seed=7)
    error = ddtree_request_error(sampled, deterministic=True)
    assert "does not support sampled requests with --enable-deterministic" in error
    assert "sampling_seed" in error
    assert ddtree_request_error(sampled, deterministic=False) is None
    assert ddtree_request_error(_req(), deterministic=True) is None  # greedy


def test_a_sampling_mask_is_refused_for_sampled_requests_only():
    """SGLang would capture linear DFlash's top-k-first target, not DDTree's."""
    req = _req(top_k=4)
    req.return_sampling_mask = True
    error = ddtree_request_error(req, deterministic=False)
    assert "does not support return_sampling_mask for sampled requests" in error
    greedy = _req()
    greedy.return_sampling_mask = True
    assert ddtree_request_error(greedy) is None


@pytest.mark.parametrize(
    "param, value",
    [
        ("frequency_penalty", 0.5),
        ("presence_penalty", -0.1),
        ("repetition_penalty", 1.2),
        ("min_new_tokens", 4),
    ],
)
def test_penalties_are_refused_by_name(param, value):
    error = ddtree_request_error(_req(**{param: value}))
    assert error.startswith(f"DDTree speculative decoding does not support {param}:")


def test_every_penalty_in_use_is_named_once():
    error = ddtree_request_error(_req(presence_penalty=1.0, min_new_tokens=2))
    assert "support presence_penalty, min_new_tokens:" in error
