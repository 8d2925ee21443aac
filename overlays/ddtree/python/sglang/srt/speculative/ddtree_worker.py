"""DDTree inside ``DFlashWorkerV2``: what the worker's hunks call, per stage.

The worker keeps its DFlash draft block (block_size tokens: the last bonus
token then mask tokens) and its draft-KV append; DDTree replaces the linear
verify in between:

  draft     top-K log-probs per draft position (``DDTreeDraftHead``; in the
            draft CUDA graph when it is captured, eager otherwise)
  step      trees + verify input: W tokens per request, tree positions and the
            FULL_MASK custom mask (``ddtree_step.build_verify_step``)
  accept    greedy walk, tree speculative sampling (dense), or one target
            sample per slot then the walk (large bs * W * vocab)
  commit    the accepted path's target KV moved to the front of the window
            (SGLang's ``move_accept_tokens_to_target_kvcache``) and the target
            hidden states compacted along it for the draft-KV append

The verifier holds the step in flight between ``build_step`` and ``commit``
(one ``forward_batch_generation`` call); nothing else is kept across steps.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang.srt.speculative.ddtree_config import (
    DDTreeConfig,
    check_ddtree_attention,
    check_ddtree_worker,
)
from sglang.srt.speculative.ddtree_head import DDTreeDraftHead
from sglang.srt.speculative.ddtree_sampling import SamplingRows, plain_sampling_probs
from sglang.srt.speculative.ddtree_step import (
    DDTreeAccept,
    DDTreeVerifyStep,
    accept_by_target_samples,
    accept_greedy,
    accept_sampling,
    build_verify_step,
    commit_outputs,
    compact_hidden,
    dense_sampling_limit,
    sample_per_slot,
    use_dense_sampling,
)

logger = logging.getLogger(__name__)

# Target-probability elements per chunk on the memory-light sampling path
# (whole requests, at least one): its transient (probabilities, their
# renormalisation, the exponential race) stays near 3 x 256 MiB whatever the
# vocabulary. Rows, not elements, made it 7.5 GiB at Kimi's 163,840 tokens.
DDTREE_LIGHT_CHUNK_ELEMENTS = 1 << 26


class DDTreeVerifier:
    """Per-worker DDTree state: the config, the eager head, the step in flight."""

    def __init__(
        self,
        config: DDTreeConfig,
        eager_head: DDTreeDraftHead,
        sampling_backend: str = "pytorch",
    ):
        self.config = config
        self.eager_head = eager_head
        # Under attention DP: the length SGLang gives a request it pads the
        # verify batch with (``check_attention`` reads it); else None.
        self.dp_pad_seq_len: Optional[int] = None
        # The plain sampler's filter order depends on it (ddtree_sampling).
        self.sampling_backend = sampling_backend
        self._step: Optional[DDTreeVerifyStep] = None
        self._accept: Optional[DDTreeAccept] = None
        self._logged_paths: set[str] = set()

    @classmethod
    def for_worker(cls, worker: Any, config: DDTreeConfig) -> "DDTreeVerifier":
        """Validate the worker's target and draft for DDTree and build the head."""
        from sglang.srt.configs.hybrid_arch import mambaish_config
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.speculative.dflash_utils import is_dense_head_weight

        runner = worker.model_runner
        lm_head = getattr(runner.model, "lm_head", None)
        shard = getattr(lm_head, "shard_indices", None)
        weight = getattr(lm_head, "weight", None)
        dense = is_dense_head_weight(weight) and (
            shard is None or int(shard.num_added_elements) == 0
        )
        check_ddtree_worker(
            is_hybrid=mambaish_config(runner.model_config) is not None,
            draft_kind=_draft_kind(worker),
            dense_lm_head=dense,
        )
        tp_group = _head_group(lm_head, get_parallel())
        vocab = int(runner.model_config.vocab_size)
        head = _make_head(config, weight, shard, vocab, _tp_group_or_none(tp_group))
        logger.info(
            "DDTree on: budget=%d topk=%d draft block=%d verify width=%d",
            config.budget,
            config.topk,
            config.block_size,
            config.verify_width,
        )
        from sglang.srt.runtime_context import get_exec

        verifier = cls(config, head, str(get_exec().kernel.sampling_backend))
        if torch.device(runner.device).type == "cuda":
            verifier.build_kernels(torch.device(runner.device), vocab)
        return verifier

    def build_kernels(self, device: torch.device, vocab_size: int) -> None:
        """Build (or load from the JIT cache) every kernel a step runs, now.

        One dummy request goes through the step's real path: the tree builder
        (DDTree's kernel), the greedy verify and the dense sampling verify
        (SGLang's JIT kernels where they import, else their torch twins). A
        missing toolkit or a failed compile then fails the server's start, not
        its first decode; with a prebuilt cache (``ddeploy build``) and
        SGLANG_CRASH_ON_JIT_COMPILE=1, a kernel missing from it does too.
        Called once at start; the synchronize there is the point (errors of
        asynchronous launches surface at start).
        """
        cfg = self.config
        try:
            depth_k = (1, cfg.depth, cfg.topk)
            log_probs = torch.zeros(depth_k, dtype=torch.float32, device=device)
            token_ids = torch.arange(cfg.topk, device=device).expand(depth_k)
            root = torch.zeros((1,), dtype=torch.int64, device=device)
            prefix = torch.ones((1,), dtype=torch.int64, device=device)
            step = build_verify_step(
                log_probs, token_ids, root, prefix, cfg.budget, cfg.verify_width, 1
            )
            s = cfg.num_speculative_tokens
            accept_greedy(step, step.tokens.reshape(-1), s)
            probs = torch.full(
                (1, step.width, vocab_size), 1.0 / vocab_size, device=device
            )
            accept_sampling(step, probs, s)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:
            raise RuntimeError(
                f"DDTree could not build or load its kernels on {device} at start "
                f"({type(exc).__name__}: {exc}); prebuild them for this GPU with "
                "`ddeploy build`, or install the CUDA toolkit (nvcc) SGLang's JIT "
                "needs."
            ) from exc

    def check_attention(self, runner: Any) -> None:
        """Refuse a target attention backend without a TARGET_VERIFY mask and,
        under attention DP, note the length SGLang pads verify batches with.

        Called once the target's backends exist (the worker's
        ``init_attention_backends``).
        """
        from sglang.srt.configs.model_config import AttentionArch
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.speculative.dflash_utils import (
            resolve_dflash_verify_mask_policy,
        )

        backend, _ = resolve_dflash_verify_mask_policy(runner.attn_backend)
        is_mla = runner.model_config.attention_arch == AttentionArch.MLA
        check_ddtree_attention(backend, is_mla)
        logger.info("DDTree tree verify attention: %s", backend)
        if get_parallel().attn_dp_enabled:
            self.dp_pad_seq_len = _dp_pad_seq_len(runner)

    def make_head(self, **kwargs: Any) -> DDTreeDraftHead:
        """A capture-safe head for the draft CUDA graph (worker's sampler slot)."""
        return DDTreeDraftHead(
            block_size=self.config.block_size, topk=self.config.topk, **kwargs
        )

    def draft(
        self, draft_hidden: torch.Tensor, graph_head: Optional[DDTreeDraftHead], bs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_probs [bs, L, K], token_ids [bs, L, K]) for this step's drafts.

        graph_head: the head the draft graph replay already ran, or None (eager).
        """
        if graph_head is not None:
            return graph_head.outputs(bs)
        return self.eager_head.propose(draft_hidden)

    def prefix_lens_bound(self, batch: Any, draft_input: Any) -> int:
        """A host upper bound on sum(prefix_lens), from host state only, which
        sizes the tree mask (``ddtree_full_mask``: W * (prefix + W) per row).

        The scheduler's host lengths may lag the device ones by one step's
        commit (at most block_size tokens per request) under overlap. Under
        attention DP the verify batch may be padded with requests of length
        ``dp_pad_seq_len`` up to the busiest DP rank's request count, and the
        attention backend reads a mask block for each: the bound covers them.
        """
        if batch.seq_lens_cpu is not None:
            lag = len(batch.seq_lens_cpu) * self.config.block_size
            bound = int(batch.seq_lens_cpu.sum()) + lag
        elif draft_input.nxt_kv_lens_cpu is not None:
            bound = int(draft_input.nxt_kv_lens_sum)
        else:
            bound = sum(int(req.kv.kv_allocated_len) for req in batch.reqs)
        return bound + self._dp_padding_len(batch)

    def _dp_padding_len(self, batch: Any) -> int:
        """What to add to the bound for the DP-padded requests: each reads a
        mask block of W * (dp_pad_seq_len + W) entries, and every token added to
        the bound adds W entries to the mask."""
        counts = getattr(batch, "global_num_tokens", None)
        if self.dp_pad_seq_len is None or not counts:
            return 0
        rows = max(int(c) for c in counts) - batch.batch_size()
        return max(rows, 0) * (self.dp_pad_seq_len + self.config.verify_width)

    def build_step(
        self,
        draft: tuple[torch.Tensor, torch.Tensor],
        root_tokens: torch.Tensor,
        prefix_lens: torch.Tensor,
        prefix_lens_bound: Optional[int],
    ) -> DDTreeVerifyStep:
        """The verify input; kept until ``commit`` of the same step."""
        log_probs, token_ids = draft
        self._step = build_verify_step(
            log_probs,
            token_ids,
            root_tokens,
            prefix_lens,
            self.config.budget,
            self.config.verify_width,
            prefix_lens_bound,
        )
        return self._step

    def grammar_tree(self) -> Any:
        """The step's tree for the grammar's vocabulary mask (SGLang GrammarTree).

        Mask row b * W + i is the grammar state after node i's own path, so the
        accept (greedy and sampled) only follows tokens the grammar allows.
        Starts the device-to-host copy: call before the target verify launch.
        """
        from sglang.srt.speculative.spec_utils import GrammarTree

        step = self._step
        return GrammarTree.from_device(
            step.retrieve.retrieve_next_token,
            step.retrieve.retrieve_next_sibling,
            step.tokens,
        )

    def path_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The accepted path's verify rows in chain layout: [bs * S, V].

        logits [bs * W, V] (after the grammar mask and logit adjustments); row
        b * S + k is the row that produced request b's k-th committed token,
        the layout linear DFlash's logprobs and sampling masks read. Rows past
        the accepted path repeat the root's (never read).
        """
        index = self._accept.accept_index.to(torch.int64)
        root = index[:, :1]
        return logits[torch.where(index < 0, root, index).reshape(-1)]

    def accept(
        self,
        next_token_logits: Optional[torch.Tensor],
        sampling_info: Any,
        target_predict: Optional[torch.Tensor],
        draft_input: Any,
        threshold_single: float,
        threshold_acc: float,
        tp_sync: Any = None,
    ):
        """Verify the step: (accept_len, commit_lens, bonus, out_tokens, None).

        The tuple is ``DFlashWorkerV2._accept_block``'s (no new_seq_lens: the
        worker derives them from commit_lens). ``draft_input`` carries the batch's
        host-side top-k bound, so top-k sampling reads nothing back.

        tp_sync: the worker's ``SpecTpSync``. Every TP rank must commit what
        rank 0 commits, so the accept decision is broadcast from rank 0 at
        linear DFlash's sites (``SGLANG_SPEC_TP_SYNC`` selects them): greedy
        broadcasts the target argmax before the walk, sampling the drawn
        outcome (the accepted path, its length and the emitted tokens, or the
        per-slot target samples of the memory-light path). Broadcasts are
        device collectives: no host sync.
        """
        step = self._step
        s = self.config.num_speculative_tokens
        if target_predict is None and not _all_greedy(sampling_info):
            accept = self._accept_sampled(
                step,
                next_token_logits,
                sampling_info,
                getattr(draft_input, "max_top_k", None),
                threshold_single,
                threshold_acc,
                tp_sync,
            )
        else:
            if target_predict is None:
                target_predict = torch.argmax(next_token_logits, dim=-1)
            _sync(tp_sync, "DFLASH_ACCEPT_GREEDY", target_predict)
            accept = accept_greedy(step, target_predict, s)
        self._accept = accept
        out_tokens, commit_lens, bonus = commit_outputs(accept, self.config.block_size)
        return accept.accept_len, commit_lens, bonus, out_tokens, None

    def _accept_sampled(
        self,
        step,
        logits,
        sampling_info,
        max_top_k,
        threshold_single,
        threshold_acc,
        tp_sync,
    ) -> DDTreeAccept:
        """Sampled accept against plain decoding's distribution at every slot.

        max_top_k: the batch's host bound on top_k (``DFlashDraftInputV2``),
        so the top-k filter reads nothing back.
        """
        bs, width = step.tokens.shape
        s = self.config.num_speculative_tokens
        vocab = logits.shape[-1]
        if use_dense_sampling(bs, width, vocab):
            self._log_path_once(f"dense tree speculative sampling ({_impl(logits)})")
            rows = SamplingRows.of(sampling_info, width, max_top_k)
            probs = plain_sampling_probs(logits, rows, self.sampling_backend)
            accept = accept_sampling(
                step, probs.view(bs, width, vocab), s, threshold_single, threshold_acc
            )
            return _sync_accept(tp_sync, accept)
        self._log_path_once("one target sample per slot, then the greedy walk")
        samples = torch.empty((bs * width,), dtype=torch.int64, device=logits.device)
        rows = SamplingRows.of(sampling_info, width, max_top_k)
        step_rows = light_chunk_rows(width, vocab)
        for start in range(0, bs * width, step_rows):
            chunk = slice(start, min(start + step_rows, bs * width))
            probs = plain_sampling_probs(
                logits[chunk], rows.select(chunk), self.sampling_backend
            )
            samples[chunk] = sample_per_slot(probs)
        _sync(tp_sync, "DFLASH_ACCEPT_SAMPLE", samples)
        return accept_by_target_samples(step, samples.view(bs, width), s)

    def log_sampling_verify(self) -> None:
        """Say which sampling verify serves sampled requests (no greedy fallback).

        Linear DFlash warns that it falls back to greedy argmax when sgl-kernel
        lacks its sampling op; DDTree never does, whatever the build.
        """
        limit = dense_sampling_limit()
        logger.info(
            "DDTree sampling verify: lossless tree speculative sampling (%s) up "
            "to %d target-probability elements per step, one exact target "
            "sample per slot then the tree walk above; no greedy fallback.",
            _impl(self.eager_head.weight),
            limit,
        )

    def _log_path_once(self, path: str) -> None:
        if path not in self._logged_paths:
            self._logged_paths.add(path)
            logger.info("DDTree sampling verify: %s", path)

    def commit(
        self, batch: Any, hidden: torch.Tensor, token_to_kv_pool_allocator: Any
    ) -> torch.Tensor:
        """Move the accepted path's target KV into place; compact hidden states.

        hidden [bs, W, H] target states of the verify slots; returns
        [bs * block_size, H], row k of request b = its k-th accepted slot.
        """
        from sglang.srt.speculative.spec_utils import (
            move_accept_tokens_to_target_kvcache,
        )

        accept = self._accept
        move_accept_tokens_to_target_kvcache(
            batch, accept.accept_index, accept.accept_len, token_to_kv_pool_allocator
        )
        compact = compact_hidden(hidden, accept, self.config.block_size)
        self._step = self._accept = None
        return compact.reshape(-1, hidden.shape[-1])


def light_chunk_rows(width: int, vocab: int) -> int:
    """Verify rows per memory-light chunk: whole requests of ``width`` rows."""
    return max(1, DDTREE_LIGHT_CHUNK_ELEMENTS // (width * vocab)) * width


def _sync(tp_sync: Any, site: str, values: torch.Tensor) -> torch.Tensor:
    """Broadcast ``values`` in place from TP rank 0 at ``SpecTpSyncSite[site]``."""
    if tp_sync is None:
        return values
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

    return tp_sync.sync(SpecTpSyncSite[site], values)


def _sync_accept(tp_sync: Any, accept: DDTreeAccept) -> DDTreeAccept:
    """Rank 0's sampled accept on every rank, in one broadcast.

    accept_index int32 [bs, S], accept_len int32 [bs] and predicts int32
    [bs * W] travel packed in one int32 tensor (one collective, not three).
    """
    if tp_sync is None:
        return accept
    bs, s = accept.accept_index.shape
    packed = torch.cat(
        [
            accept.accept_index.reshape(-1).to(torch.int32),
            accept.accept_len.to(torch.int32),
            accept.predicts.to(torch.int32),
        ]
    )
    _sync(tp_sync, "DFLASH_ACCEPT_SAMPLE", packed)
    index, length, predicts = packed.split([bs * s, bs, accept.predicts.numel()])
    return DDTreeAccept(index.view(bs, s), length, predicts)


def _head_group(lm_head: Any, parallel: Any) -> Any:
    """The group the target lm_head's vocabulary is split over, which the draft
    head's top-K merge must gather over: the attention-TP group under
    ``--enable-dp-lm-head`` (each attention-DP replica holds the whole head,
    split over its own attention-TP ranks), else the whole TP group.

    Under attention DP the replicas run different requests, or none (an idle
    replica runs only the target's idle verify), so a collective over the whole
    TP group here would pair one replica's head merge with another's model
    collectives.
    """
    if getattr(lm_head, "use_attn_tp_group", False):
        return parallel.attn_tp_group
    return parallel.tp_group


def _dp_pad_seq_len(runner: Any) -> int:
    """The sequence length SGLang's DP padding gives a padded request: the
    attention backend's fill value, read as ``prepare_mlp_sync_batch`` reads it."""
    backend = runner.attn_backend
    if torch.device(runner.device).type == "cpu":
        return int(backend.get_cpu_graph_seq_len_fill_value())
    return int(backend.get_cuda_graph_seq_len_fill_value())


def _tp_group_or_none(tp_group: Any) -> Any:
    return tp_group if int(tp_group.world_size) > 1 else None


def _make_head(
    config: DDTreeConfig,
    weight: torch.Tensor,
    shard: Any,
    vocab_size: int,
    tp_group: Any,
) -> DDTreeDraftHead:
    if shard is None:
        num_org, start = min(int(weight.shape[0]), vocab_size), 0
    else:
        num_org, start = int(shard.num_org_elements), int(shard.org_vocab_start_index)
    return DDTreeDraftHead(
        weight=weight,
        block_size=config.block_size,
        topk=config.topk,
        num_org=num_org,
        org_vocab_start=start,
        tp_group=tp_group,
    )


def _draft_kind(worker: Any) -> str:
    if getattr(worker, "_is_domino", False):
        return "Domino"
    if getattr(worker, "selector", None) is not None:
        return "candidate-selector"
    if getattr(worker, "lilicorr", None) is not None:
        return "LiLiCorr"
    return "dflash"


def _impl(like: torch.Tensor) -> str:
    """Which sampling verify runs for tensors like ``like`` (ddtree_verify's pick)."""
    from sglang.srt.speculative.ddtree_verify import _sglang_kernel

    if like.is_cuda and _sglang_kernel("sampling") is not None:
        return "SGLang kernel"
    return "torch twin"


def _all_greedy(sampling_info: Any) -> bool:
    return sampling_info is None or bool(sampling_info.is_all_greedy)
