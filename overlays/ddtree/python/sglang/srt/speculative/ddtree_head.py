"""DDTree draft head: per-position top-K log-probs over the target's LM head.

DFlash drafts borrow the target ``lm_head``. Linear DFlash takes the argmax of
each draft position; DDTree needs, per position, the K best tokens and their
log-probs normalised over the whole vocabulary. With the head split over TP
ranks, each rank reduces its shard to (top-K logits, global ids, logsumexp over
its real rows), the triples are all-gathered and merged (``ddtree_topk``), so no
rank ever materialises or gathers full logit rows.

``DDTreeDraftHead`` has the interface of the DFlash worker's in-graph draft
sampler: called with the draft's hidden states ``[bs * block_size, H]``, it
writes static output buffers, so the draft CUDA graph can capture it; the
eager path calls ``propose`` with the same code.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang.srt.speculative.ddtree_topk import ddtree_shard_topk, merge_ddtree_topk


class DDTreeDraftHead:
    """Top-K draft head over a (possibly vocab-sharded) dense LM head weight.

    weight:          [V_local_padded, H] the target lm_head shard.
    num_org:         real rows of this shard (padding rows excluded).
    org_vocab_start: global id of the shard's first row.
    Outputs (static, ``max_tokens = max_bs * (block_size - 1)`` rows):
      log_probs float32 [max_tokens, K], token_ids int64 [max_tokens, K].
    """

    def __init__(
        self,
        *,
        weight: torch.Tensor,
        block_size: int,
        topk: int,
        num_org: int,
        org_vocab_start: int = 0,
        max_bs: int = 1,
        tp_group: Optional[Any] = None,
    ):
        self.weight = weight
        self.block_size = int(block_size)
        self.topk = int(topk)
        self.num_org = int(num_org)
        self.org_vocab_start = int(org_vocab_start)
        self.tp_group = tp_group
        self.tp_size = int(tp_group.world_size) if tp_group is not None else 1
        if self.tp_size == 1 and self.topk > self.num_org:
            raise ValueError(
                f"expected topk <= the head's {self.num_org} vocabulary rows, "
                f"got {self.topk}"
            )
        self._allocate(int(max_bs) * (self.block_size - 1))

    def _allocate(self, max_tokens: int) -> None:
        device, k = self.weight.device, self.topk
        self.log_probs = torch.empty(
            (max_tokens, k), dtype=torch.float32, device=device
        )
        self.token_ids = torch.empty((max_tokens, k), dtype=torch.int64, device=device)
        if self.tp_size > 1:
            world = self.tp_size * max_tokens
            self._gathered_logits = torch.empty(
                (world, k), dtype=torch.float32, device=device
            )
            self._gathered_ids = torch.empty(
                (world, k), dtype=torch.int64, device=device
            )
            self._gathered_lse = torch.empty(
                (world,), dtype=torch.float32, device=device
            )

    def __call__(self, hidden_states: torch.Tensor, input_ids=None) -> None:
        """Fill the output buffers from draft hidden states [bs * block_size, H]."""
        bs = hidden_states.shape[0] // self.block_size
        hidden = hidden_states.view(bs, self.block_size, -1)[:, 1:, :]
        hidden = hidden.reshape(-1, hidden_states.shape[-1])
        if hidden.dtype != self.weight.dtype:
            hidden = hidden.to(self.weight.dtype)
        n = hidden.shape[0]
        logits = torch.matmul(hidden, self.weight[: self.num_org].T)
        top, ids, lse = ddtree_shard_topk(
            logits, self.topk, self.org_vocab_start, self.num_org
        )
        if self.tp_size == 1:
            torch.sub(top, lse[:, None], out=self.log_probs[:n])
            self.token_ids[:n].copy_(ids)
            return
        log_probs, token_ids = self._merge_shards(top, ids, lse, n)
        self.log_probs[:n].copy_(log_probs)
        self.token_ids[:n].copy_(token_ids)

    def _merge_shards(self, top, ids, lse, n: int):
        """All-gather every rank's triple into static buffers, then merge."""
        world = self.tp_size * n
        logits_all = self._gathered_logits[:world]
        ids_all = self._gathered_ids[:world]
        lse_all = self._gathered_lse[:world]
        self.tp_group.all_gather_into_tensor(logits_all, top.contiguous())
        self.tp_group.all_gather_into_tensor(ids_all, ids.contiguous())
        self.tp_group.all_gather_into_tensor(lse_all, lse.contiguous())
        per_rank = (
            logits_all.view(self.tp_size, n, -1),
            ids_all.view(self.tp_size, n, -1),
            lse_all.view(self.tp_size, n),
        )
        shards = (list(t.unbind(0)) for t in per_rank)
        # No host read: K <= vocab is checked once at start-up.
        return merge_ddtree_topk(*shards, self.topk, validate=False)

    def propose(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager path: (log_probs float32 [bs, L, K], token_ids int64 [bs, L, K])."""
        bs = hidden_states.shape[0] // self.block_size
        n = bs * (self.block_size - 1)
        if n > self.log_probs.shape[0]:
            self._allocate(n)
        self(hidden_states)
        return self.outputs(bs)

    def outputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last call's outputs for ``bs`` requests, shaped [bs, L, K]."""
        n = bs * (self.block_size - 1)
        shape = (bs, self.block_size - 1, self.topk)
        return self.log_probs[:n].view(shape), self.token_ids[:n].view(shape)
