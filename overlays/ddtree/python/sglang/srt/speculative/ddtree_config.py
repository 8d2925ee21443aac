"""DDTree serving configuration for SGLang's DFlash worker.

Three checkpoints, each with one clear error per unsupported setting:
  * ``resolve_ddtree_server_args``: at server-argument resolution (the
    ``_handle_dflash`` hook). The draft keeps its block size (L = block_size - 1
    draft depths); the verify width W = max(budget + 1, block_size) becomes
    ``speculative_num_draft_tokens``, so KV reservation, CUDA-graph widths and
    verify buffers are sized to W.
  * ``DDTreeConfig.for_worker`` + ``check_ddtree_worker``: when the DFlash
    worker starts and knows the target (vocabulary, attention backend, model
    family) and the draft (its proposal head).
  * ``ddtree_request_error``: per request, for parameters the tree verify
    cannot serve exactly (penalties, logit processors that read the request,
    seeded sampling, sampled sampling masks); the scheduler aborts that
    request and keeps serving the others.

Why W can exceed budget + 1: the draft block writes block_size KV slots from
the prefix on, and those slots must lie inside the verify window the scheduler
reserves. A budget below the draft depth therefore gets padding slots that are
never accepted (see ``ddtree_step``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from sglang.srt.speculative.ddtree_rules import (
    HYBRID_REFUSAL,
    DDTreeLaunch,
    ddtree_launch_refusals,
    ddtree_verify_width,
    dispatch_cap_of,
    draft_head_kind,
    draft_head_refusal,
    topk_refusal,
    verify_backend_class_refusal,
)
from sglang.srt.speculative.ddtree_utils import resolve_tree_topk


def resolve_ddtree_server_args(
    cfg: Any, model_facts: Optional[Callable[[], dict[str, Any]]] = None
) -> dict[str, int]:
    """Field declarations for a DDTree server, or ValueError with the refusals.

    ``cfg`` is the resolving server-args view after DFlash resolved its block
    size into ``speculative_num_draft_tokens`` (the hook runs after the
    attention backends are resolved). The flags (and the MoE dispatcher's token
    cap in the environment, so a verify cannot trip its assert at graph
    capture) are judged first, with no model config read; then, when DDTree is
    on, ``model_facts()`` supplies what the model configs tell (``DDTreeLaunch``
    fields: ``verify_backend``, ``is_mla``, ``vocab_size``, ``hybrid_target``,
    ``draft_head``) and those rules run.
    Each stage reports all its reasons together. Returns the draft block size
    (``speculative_dflash_block_size``) and the verify width
    (``speculative_num_draft_tokens``).
    """
    budget = cfg.speculative_dflash_tree_budget
    launch = DDTreeLaunch(
        budget=budget,
        topk=cfg.speculative_dflash_tree_topk,
        block_size=int(cfg.speculative_num_draft_tokens),
        pp_size=int(cfg.pp_size or 1),
        block_verification=bool(cfg.speculative_use_block_verification),
        moe_a2a_backend=cfg.moe_a2a_backend,
        deepep_mode=cfg.deepep_mode,
        max_running_requests=cfg.max_running_requests,
        attn_dp_size=int(cfg.attn_dp_size or 1),
        tp_size=int(cfg.tp_size or 1),
        dispatch_cap=dispatch_cap_of(cfg.moe_a2a_backend, os.environ),
        accept_threshold_single=float(cfg.speculative_accept_threshold_single),
        accept_threshold_acc=float(cfg.speculative_accept_threshold_acc),
    )
    _raise_refusals(launch)
    if budget is None:
        return {}
    if model_facts is not None:
        _raise_refusals(replace(launch, **model_facts()))
    block_size = int(cfg.speculative_num_draft_tokens)
    return {
        "speculative_dflash_block_size": block_size,
        "speculative_num_draft_tokens": ddtree_verify_width(budget, block_size),
    }


def _raise_refusals(launch: DDTreeLaunch) -> None:
    reasons = ddtree_launch_refusals(launch)
    if reasons:
        raise ValueError(" ".join(reasons))


def ddtree_model_facts(server_args: Any, cfg: Any) -> dict[str, Any]:
    """What the refusals need from the target's and the draft's configs.

    Read at argument resolution (the target's ModelConfig is the one SGLang's
    own hooks memoize; the draft's config as ``_handle_dflash`` reads it for
    the block size), so a launch DDTree cannot serve fails before any weight
    loads. The keys are ``DDTreeLaunch`` fields.
    """
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch

    model_config = model_config_of(server_args)
    return {
        "verify_backend": ddtree_verify_backend(cfg),
        "is_mla": model_config.attention_arch == AttentionArch.MLA,
        "vocab_size": int(model_config.vocab_size),
        "hybrid_target": mambaish_config(model_config) is not None,
        "draft_head": _draft_head(cfg),
    }


def _draft_head(cfg: Any) -> str:
    """The draft checkpoint's head kind (``ddtree_rules.draft_head_kind``)."""
    import json

    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    draft = get_config(
        cfg.speculative_draft_model_path,
        trust_remote_code=cfg.trust_remote_code,
        revision=cfg.speculative_draft_model_revision,
        model_override_args=json.loads(cfg.json_model_override_args),
    )
    architecture = (getattr(draft, "architectures", None) or [None])[0]
    projector = parse_dflash_draft_config(draft_hf_config=draft).projector_type
    return draft_head_kind(architecture, projector)


def ddtree_verify_backend(cfg: Any) -> Optional[str]:
    """The --attention-backend value that runs the target's TARGET_VERIFY.

    A split prefill/decode setup verifies with the prefill backend unless
    --speculative-attention-mode is "decode" (SGLang's HybridAttnBackend).
    """
    if cfg.speculative_attention_mode == "decode":
        split = cfg.decode_attention_backend
    else:
        split = cfg.prefill_attention_backend
    return split or cfg.attention_backend


@dataclass(frozen=True)
class DDTreeConfig:
    """What one DDTree decode step needs to know.

    budget:       draft nodes per request, root excluded (B).
    topk:         draft candidates per depth (K <= vocab).
    block_size:   DFlash draft block; depths L = block_size - 1.
    verify_width: W = max(B + 1, block_size) verify slots per request.
    """

    budget: int
    topk: int
    block_size: int
    verify_width: int

    @property
    def depth(self) -> int:
        return self.block_size - 1

    @property
    def num_speculative_tokens(self) -> int:
        """accept_index width: the root plus up to L accepted draft tokens."""
        return self.block_size

    @classmethod
    def for_worker(cls, spec: Any, vocab_size: int) -> Optional["DDTreeConfig"]:
        """The config from the resolved spec bag, or None when DDTree is off."""
        budget = spec.speculative_dflash_tree_budget
        if budget is None:
            return None
        topk = spec.speculative_dflash_tree_topk
        if topk is not None and topk_refusal(topk, vocab_size):
            raise ValueError(topk_refusal(topk, vocab_size))
        block_size = int(spec.speculative_dflash_block_size)
        return cls(
            budget=int(budget),
            topk=resolve_tree_topk(int(budget), topk, int(vocab_size)),
            block_size=block_size,
            verify_width=ddtree_verify_width(budget, block_size),
        )


def check_ddtree_attention(attention_backend: str, is_mla: bool) -> None:
    """Refuse a target TARGET_VERIFY backend (class name) that ignores the mask."""
    reason = verify_backend_class_refusal(attention_backend, is_mla)
    if reason is not None:
        raise ValueError(reason)


def check_ddtree_worker(
    *,
    is_hybrid: bool,
    draft_kind: str,
    dense_lm_head: bool,
) -> None:
    """Start-up refusal of what the DDTree wiring cannot serve (ValueError).

    draft_kind: "dflash" for a plain DFlash draft, else its head's name.
    """
    if is_hybrid:
        raise ValueError(HYBRID_REFUSAL)
    if draft_kind != "dflash":
        raise ValueError(draft_head_refusal(draft_kind))
    if not dense_lm_head:
        raise ValueError(
            "DDTree needs a dense (unquantized) target lm_head without added "
            "vocabulary for its top-K draft head."
        )


# Sampling parameters whose plain-decoding effect depends on the tokens
# generated so far: (name, its no-op value).
PATH_DEPENDENT_PARAMS = (
    ("frequency_penalty", 0.0),
    ("presence_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_new_tokens", 0),
)


def ddtree_request_error(
    req: Any,
    *,
    deterministic: Optional[bool] = None,
    load_processor: Optional[Callable[[str], type]] = None,
) -> Optional[str]:
    """Why the tree verify cannot serve ``req`` (a scheduler Req), or None.

    Grammars, logprobs and logit bias are served. Not served, each because a
    verify applies one state to every tree row while plain decoding moves it
    after every token, or because the tree verify has no way to reproduce it:
      * penalties (linear DFlash applies them stale; DDTree refuses);
      * a custom logit processor, unless it declares itself stateless
        (``custom_processor_error``);
      * a sampled request under --enable-deterministic-inference: plain
        decoding draws it from its ``sampling_seed`` (42 when unset), the tree
        verify's coins are not seeded;
      * ``return_sampling_mask`` on a sampled request: SGLang captures linear
        DFlash's top-k-first target, not the one DDTree samples from, and
        aborts a request whose token falls outside it (greedy: served).

    deterministic: --enable-deterministic-inference (None: read it from
    SGLang's runtime context, only for a sampled request).
    load_processor: serialized processor -> its class (None: as SGLang's
    ``CustomLogitProcessor.from_str`` loads it).
    """
    params = req.sampling_params
    used = [
        name
        for name, default in PATH_DEPENDENT_PARAMS
        if getattr(params, name, default) != default
    ]
    if used:
        return (
            f"DDTree speculative decoding does not support {', '.join(used)}: "
            "its verify would apply the penalties before the step to every "
            "draft token, not plain decoding's; send it without them or to a "
            "server without --speculative-dflash-tree-budget."
        )
    serialized = getattr(req, "custom_logit_processor", None)
    if serialized:
        error = custom_processor_error(serialized, load_processor or _processor_class)
        if error is not None:
            return error
    sampled = getattr(params, "top_k", 1) != 1
    if sampled and (_deterministic() if deterministic is None else deterministic):
        return (
            "DDTree speculative decoding does not support sampled requests with "
            "--enable-deterministic-inference: plain decoding draws them from "
            "their sampling_seed (42 when unset), the tree verify's coins are "
            "not seeded; send it with temperature 0 or to a server without "
            "--speculative-dflash-tree-budget."
        )
    if sampled and getattr(req, "return_sampling_mask", False):
        return (
            "DDTree speculative decoding does not support return_sampling_mask "
            "for sampled requests: the captured mask is linear DFlash's "
            "top-k-first target, not the distribution DDTree samples from; "
            "send it with temperature 0 or to a server without "
            "--speculative-dflash-tree-budget."
        )
    return None


# SGLang's own processors whose output depends only on the logits row and the
# request's custom_params: (module, class name).
STATELESS_PROCESSORS = frozenset(
    {
        (
            "sglang.srt.sampling.custom_logit_processor",
            "DisallowedTokensLogitsProcessor",
        )
    }
)


def custom_processor_error(
    serialized: str, load_processor: Callable[[str], type]
) -> Optional[str]:
    """Why DDTree refuses this custom logit processor, or None.

    A verify calls the processor once for all tree rows with the request as it
    stood before the step (its ``__req__``: ``output_ids`` and the rest), so a
    processor reading that state (SGLang's ThinkingBudgetLogitProcessor counts
    ``output_ids``) would see the wrong tokens on every row below the root.
    Served: SGLang's DisallowedTokensLogitsProcessor and any class that
    declares ``stateless = True`` (it reads only the logits and its
    custom_params).
    """
    try:
        cls = load_processor(serialized)
    except Exception as exc:  # what SGLang's from_str would raise later
        return (
            "DDTree speculative decoding could not load the request's custom "
            f"logit processor to check it is stateless: {exc!r}."
        )
    if (cls.__module__, cls.__qualname__) in STATELESS_PROCESSORS:
        return None
    if getattr(cls, "stateless", False) is True:
        return None
    return (
        f"DDTree speculative decoding does not support the custom logit "
        f"processor {cls.__qualname__}: its verify calls it with the request's "
        "state before the step for every draft token; declare `stateless = "
        "True` on a processor that reads only the logits and its custom_params, "
        "or send it to a server without --speculative-dflash-tree-budget."
    )


def _processor_class(serialized: str) -> type:
    """The class a serialized processor names, loaded as SGLang's
    ``CustomLogitProcessor.from_str`` loads it (json, then dill)."""
    import json

    import dill

    return dill.loads(bytes.fromhex(json.loads(serialized)["callable"]))


def _deterministic() -> bool:
    from sglang.srt.runtime_context import get_exec

    return bool(get_exec().deterministic.enable_deterministic_inference)
