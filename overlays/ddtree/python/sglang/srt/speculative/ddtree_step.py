"""One DDTree decode step of the DFlash worker, as pure tensor functions.

Flow per step (bs requests, draft depths L = block_size - 1, top-K per depth,
W = verify width >= budget + 1 slots per request, S = L + 1):

  draft head        log_probs [bs, L, K], token_ids [bs, L, K]
  build_verify_step tree tokens [bs, W] (slot 0 = root = last bonus token),
                    positions prefix + depth, FULL_MASK, retrieve arrays
  target verify     one forward over bs * W tokens with the custom mask
  accept_*          accept_index [bs, S] (global slots b * W + i, root first),
                    accept_len [bs] (accepted draft tokens), predicts [bs * W]
  commit_outputs    out_tokens [bs, block_size], commit_lens = accept_len + 1,
                    bonus (the next root)
  compact_hidden    target hidden states of the accepted path, in order, for
                    the draft-KV append (rows 0..accept_len per request)

Slots past budget + 1 (W > budget + 1 when the budget is below the draft depth)
and slots a small draft cannot fill are padding: parent -1, never a child of
anything, so never accepted; they carry the root token and position so the
verify forward reads valid ids.

Nothing here reads a device value on the host: the step can run under the
overlap scheduler and, on CUDA, inside graphs where the callee allows it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.speculative.ddtree_batched import build_ddtree_batched
from sglang.srt.speculative.ddtree_retrieve import (
    DDTreeRetrieve,
    compile_ddtree_retrieve,
    ddtree_full_mask,
    ddtree_positions,
)
from sglang.srt.speculative.ddtree_utils import prepare_ddtree_verify
from sglang.srt.speculative.ddtree_verify import (
    ddtree_verify_greedy,
    ddtree_verify_sampling,
)

# Above this many target-probability elements (bs * W * vocab) the sampling
# verify draws one target sample per node and walks the tree greedily instead
# of materialising [bs, W, vocab] float32 probabilities (2^26 = 256 MiB).
# $SGLANG_DDTREE_DENSE_SAMPLING_MAX_ELEMENTS overrides it (0: always light).
DDTREE_DENSE_SAMPLING_MAX_ELEMENTS = 1 << 26


@dataclass
class DDTreeVerifyStep:
    """Verify input for one step; W = verify width.

    tokens        int64 [bs, W]   slot 0 the root; padding slots the root token
    positions     int64 [bs * W]  prefix_len + depth (padding: prefix_len)
    custom_mask   bool  [>= sum_b W * (prefix_b + W)]  SGLang FULL_MASK
    retrieve      DDTreeRetrieve, int64 [bs, W] each
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor
    retrieve: DDTreeRetrieve

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DDTreeAccept:
    """Verify outcome in SGLang's layout (see ``ddtree_verify``).

    accept_index int32 [bs, S]  global slots of the accepted path, -1 padded
    accept_len   int32 [bs]     accepted draft tokens (root excluded)
    predicts     int32 [bs * W] at accepted slots: the token that follows
    """

    accept_index: torch.Tensor
    accept_len: torch.Tensor
    predicts: torch.Tensor


def build_verify_step(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    budget: int,
    width: int,
    prefix_lens_bound: Optional[int] = None,
) -> DDTreeVerifyStep:
    """Trees and verify tensors for a batch.

    log_probs float [bs, L, K], token_ids int [bs, L, K] (from the draft head);
    root_tokens int64 [bs]; prefix_lens int [bs] (tokens in the KV cache);
    prefix_lens_bound: a host int >= sum(prefix_lens) that sizes the mask
    without a device read (extra trailing mask entries are never read).
    """
    if width < budget + 1:
        raise ValueError(f"expected width >= budget + 1 = {budget + 1}, got {width}")
    if width == budget + 1:
        tree, verify = prepare_ddtree_verify(
            log_probs,
            token_ids,
            budget,
            root_tokens,
            prefix_lens,
            prefix_lens_sum=prefix_lens_bound,
            validate=False,
        )
        retrieve = DDTreeRetrieve(
            verify.retrieve_index,
            verify.retrieve_next_token,
            verify.retrieve_next_sibling,
        )
        tokens = _fill_padding(tree.tokens, root_tokens)
        return DDTreeVerifyStep(tokens, verify.positions, verify.tree_mask, retrieve)
    tree = build_ddtree_batched(
        log_probs, token_ids, budget, root_tokens, validate=False
    )
    pad = width - (budget + 1)
    parents = torch.nn.functional.pad(tree.parents, (0, pad), value=-1)
    depths = torch.nn.functional.pad(tree.depths, (0, pad), value=-1)
    tokens = torch.nn.functional.pad(tree.tokens, (0, pad), value=-1)
    prefix_lens = prefix_lens.to(device=log_probs.device, dtype=torch.int64)
    return DDTreeVerifyStep(
        tokens=_fill_padding(tokens, root_tokens),
        positions=ddtree_positions(depths, prefix_lens),
        custom_mask=ddtree_full_mask(parents, prefix_lens, prefix_lens_bound, False),
        retrieve=compile_ddtree_retrieve(parents, validate=False),
    )


def _fill_padding(tokens: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
    """Padding slots (token -1) get the root token: a valid id, never accepted."""
    root = root_tokens.to(device=tokens.device, dtype=torch.int64)[:, None]
    return torch.where(tokens < 0, root, tokens)


def accept_greedy(
    step: DDTreeVerifyStep, target_predict: torch.Tensor, num_speculative_tokens: int
) -> DDTreeAccept:
    """Greedy walk: target_predict int64 [bs, W] is the target argmax per slot."""
    result = ddtree_verify_greedy(
        step.tokens,
        step.retrieve,
        target_predict.view(step.tokens.shape),
        num_speculative_tokens,
    )
    return DDTreeAccept(result.accept_index, result.accept_token_num, result.predicts)


def accept_sampling(
    step: DDTreeVerifyStep,
    target_probs: torch.Tensor,
    num_speculative_tokens: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    coins: Optional[torch.Tensor] = None,
    final_coins: Optional[torch.Tensor] = None,
) -> DDTreeAccept:
    """Tree speculative sampling (SGLang's target-only kernel semantics).

    target_probs float32 [bs, W, V]: the target's sampling distribution after
    temperature / top-k / top-p at every slot. Zero draft probabilities and
    thresholds 1.0 make it lossless.
    """
    bs, width = step.tokens.shape
    device = step.tokens.device
    if coins is None:
        coins = torch.rand((bs, width), dtype=torch.float32, device=device)
    if final_coins is None:
        final_coins = torch.rand((bs,), dtype=torch.float32, device=device)
    result = ddtree_verify_sampling(
        step.tokens,
        step.retrieve,
        target_probs,
        coins,
        final_coins,
        num_speculative_tokens,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
    )
    return DDTreeAccept(result.accept_index, result.accept_token_num, result.predicts)


def accept_by_target_samples(
    step: DDTreeVerifyStep, target_samples: torch.Tensor, num_speculative_tokens: int
) -> DDTreeAccept:
    """Memory-light sampling verify: one target sample per slot, then the walk.

    target_samples int64 [bs, W]: a token drawn from the target's distribution
    at each slot. Following a child iff it equals the parent's sample emits, at
    every step, a fresh exact sample of the target given the accepted prefix:
    lossless, and it needs no [bs, W, V] probability tensor.
    """
    return accept_greedy(step, target_samples, num_speculative_tokens)


def sample_per_slot(probs: torch.Tensor) -> torch.Tensor:
    """One exact sample per row of probs float [R, V] (exponential race), [R]."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_()
    return (probs.to(torch.float32) / race).argmax(dim=-1)


def dense_sampling_limit() -> int:
    """The documented threshold, or $SGLANG_DDTREE_DENSE_SAMPLING_MAX_ELEMENTS."""
    limit = os.environ.get("SGLANG_DDTREE_DENSE_SAMPLING_MAX_ELEMENTS")
    return DDTREE_DENSE_SAMPLING_MAX_ELEMENTS if limit is None else int(limit)


def use_dense_sampling(bs: int, width: int, vocab_size: int) -> bool:
    """Whether the [bs, W, V] probabilities fit the documented threshold."""
    return bs * width * vocab_size <= dense_sampling_limit()


def commit_outputs(
    accept: DDTreeAccept, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_tokens int64 [bs, block_size], commit_lens int32 [bs], bonus int64 [bs]).

    out_tokens row b: the accepted draft tokens then the bonus token in columns
    0..accept_len[b]; later columns are padding (the scheduler reads
    commit_lens of them). The bonus is the next step's root.
    """
    bs, s = accept.accept_index.shape
    if s > block_size:
        raise ValueError(
            f"expected accept_index [bs, <= {block_size}], got [{bs}, {s}]"
        )
    slots = accept.accept_index.to(torch.int64).clamp(min=0)
    emitted = accept.predicts.to(torch.int64)[slots]
    num = accept.accept_len.to(torch.int64)
    used = torch.arange(s, device=slots.device)[None, :] <= num[:, None]
    out_tokens = torch.zeros((bs, block_size), dtype=torch.int64, device=slots.device)
    out_tokens[:, :s] = torch.where(used, emitted, 0)
    bonus = emitted.gather(1, num[:, None])[:, 0]
    commit_lens = (accept.accept_len + 1).to(torch.int32)
    return out_tokens, commit_lens, bonus


def compact_hidden(
    hidden: torch.Tensor, accept: DDTreeAccept, block_size: int
) -> torch.Tensor:
    """Hidden states of the accepted path: [bs, W, H] -> [bs, block_size, H].

    Row k of request b is the state of its k-th accepted slot (root first), so
    the draft-KV append can commit rows 0..accept_len[b] at positions prefix +
    k. Rows past the accepted path repeat the root's state (never committed).
    """
    bs, width, _ = hidden.shape
    s = accept.accept_index.shape[1]
    base = torch.arange(bs, device=hidden.device)[:, None] * width
    local = (accept.accept_index.to(torch.int64) - base).clamp(min=0)
    rows = torch.zeros((bs, block_size), dtype=torch.int64, device=hidden.device)
    rows[:, :s] = local
    return hidden.gather(1, rows[:, :, None].expand(-1, -1, hidden.shape[2]))


def accept_kv_moves(
    accept: DDTreeAccept, out_cache_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) KV slots that put the accepted path at the window's front.

    out_cache_loc int64 [bs * W]: the verify window's KV slots. Returns int64
    [bs, S] each; entries past accept_len are (window front, itself), harmless
    self-moves. What ``move_accept_tokens_to_target_kvcache`` computes, kept
    here as the reference its tests compare against.
    """
    bs, s = accept.accept_index.shape
    window = out_cache_loc.view(bs, -1)
    cols = torch.arange(s, device=window.device)[None, :]
    used = cols <= accept.accept_len.to(torch.int64)[:, None]
    dst = window[:, :s]
    src_slot = accept.accept_index.to(torch.int64).clamp(min=0)
    src = torch.where(used, out_cache_loc[src_slot], dst)
    return dst, src
