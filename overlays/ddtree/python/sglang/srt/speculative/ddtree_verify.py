"""Verify a DDTree against the target: greedy and sampling (SGLang kernel semantics).

Both verifies walk SGLang's retrieve arrays (see ``ddtree_retrieve``) from the root: at
each level they scan the children of the last accepted node in sibling order and accept
at most one. Layout (SGLang's, bs requests, N = budget + 1 slots,
S = num_speculative_tokens = max draft depth + 1):
  candidates            int64   [bs, N]     token per slot (slot 0 = root)
  retrive_index         int64   [bs, N]     b * N + i
  retrive_next_token    int64   [bs, N]     first child, -1 = none
  retrive_next_sibling  int64   [bs, N]     next sibling, -1 = none
  predicts              int32   [bs * N]    written at accepted slots only: the token
                                            that follows that slot (next accepted
                                            draft token, or the bonus token at the
                                            last accepted slot)
  accept_index          int32   [bs, S]     global slots of the accepted path, root
                                            first; unused entries keep their initial
                                            value (-1)
  accept_token_num      int32   [bs]        accepted draft tokens (root excluded)
The tokens a step emits for request b are
predicts[accept_index[b, :accept_token_num[b] + 1]]: the accepted draft tokens followed
by the bonus token.

Sampling follows ``tree_speculative_sampling_target_only`` of SGLang 0.5.23
(``sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh``) step for step, with
the same float32 arithmetic: one coin per accepted slot (uniform_samples[b, slot], the
root's first), a running float32 sum of target probabilities over the siblings tried at
a level, accept sibling c iff p(c) > 0 and (coin < sum / threshold_acc or p(c) >=
threshold_single), copy a rejected sibling's target prob into draft_probs (mutated in
place, as the kernel does), and finally draw the bonus token from relu(target - draft)
of the last accepted slot with uniform_samples_for_final_sampling[b] (draft term zero
when all S - 1 levels were accepted). The accept/reject walk is bit-exact against the
kernel; the final draw uses torch's float32 sum/cumsum where the kernel uses
block-parallel ones, so the two can differ only when u = coin * sum lands within float32
rounding of a cdf boundary. On CUDA, when SGLang's JIT kernel imports,
``ddtree_verify_sampling`` runs the kernel itself.

Per step: the verify functions check shapes only and never read values back on CUDA
(kernel or torch twin; the twins stop their walk early on CPU only, where a read is
free), so they take no ``validate`` flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.speculative.ddtree_retrieve import DDTreeRetrieve


@dataclass
class DDTreeVerifyResult:
    """Outputs of one verify step; SGLang's three tensors plus the emitted tokens.

    predicts int32 [bs*N], accept_index int32 [bs, S], accept_token_num int32 [bs]
    (SGLang layout, see the module docstring); emitted_tokens int64 [bs, S]: accepted
    draft tokens then the bonus token, -1 padded; bonus_token int64 [bs]; accept_slots
    int64 [bs, S]: local slots of the accepted path (root 0 first), -1 padded.
    """

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_token_num: torch.Tensor
    emitted_tokens: torch.Tensor
    bonus_token: torch.Tensor
    accept_slots: torch.Tensor


def _check_verify_inputs(
    candidates: torch.Tensor, retrieve: DDTreeRetrieve, num_speculative_tokens: int
) -> None:
    if not isinstance(candidates, torch.Tensor) or candidates.dim() != 2:
        raise ValueError("expected candidates of shape [bs, N]")
    for name in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        tensor = getattr(retrieve, name)
        if tensor.shape != candidates.shape:
            raise ValueError(
                f"expected {name} of shape {tuple(candidates.shape)} "
                f"(as candidates [bs, N]), got {tuple(tensor.shape)}"
            )
    if num_speculative_tokens < 1:
        raise ValueError(
            "expected num_speculative_tokens >= 1 (max depth + 1), "
            f"got {num_speculative_tokens}"
        )


def _alloc_outputs(bs: int, n: int, s: int, device: torch.device):
    predicts = torch.zeros(bs * n, dtype=torch.int32, device=device)
    accept_index = torch.full((bs, s), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(bs, dtype=torch.int32, device=device)
    return predicts, accept_index, accept_token_num


def _finish(predicts, accept_index, accept_token_num, n: int) -> DDTreeVerifyResult:
    """Emitted tokens, bonus and local slots, read back out of SGLang's layout."""
    bs, s = accept_index.shape
    num = accept_token_num.to(torch.int64)
    used = torch.arange(s, device=accept_index.device)[None, :] <= num[:, None]
    glob = accept_index.to(torch.int64)
    emitted = torch.where(used, predicts.to(torch.int64)[glob.clamp(min=0)], -1)
    bonus = emitted.gather(1, num[:, None])[:, 0]
    slots = torch.where(
        used, glob - torch.arange(bs, device=glob.device)[:, None] * n, -1
    )
    return DDTreeVerifyResult(
        predicts, accept_index, accept_token_num, emitted, bonus, slots
    )


def verify_tree_greedy_torch(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Torch twin of SGLang's ``verify_tree_greedy`` (same signature, outputs in place).

    target_predict: int64 [bs, N], the target's argmax after each slot. Walks one slot
    visit per iteration, N iterations, batched over requests, with no host reads.
    """
    bs, n = candidates.shape
    s = accept_index.shape[1]
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    target_flat = target_predict.reshape(-1).to(torch.int64)
    last = retrive_index[:, 0].to(torch.int64)
    accept_index[:, 0] = last.to(accept_index.dtype)
    num = torch.zeros(bs, dtype=torch.int64, device=dev)
    cur = (
        retrive_next_token[:, 0].to(torch.int64)
        if s > 1
        else torch.full((bs,), -1, dtype=torch.int64, device=dev)
    )
    path = torch.full((bs, s + 1), -1, dtype=torch.int64, device=dev)  # column s: dump
    for _ in range(n):
        active = cur >= 0
        if not cur.is_cuda and not bool(active.any()):
            # CPU: no device to sync, stop early.
            break
        safe = cur.clamp(min=0)
        match = active & (candidates[rows, safe].to(torch.int64) == target_flat[last])
        glob = retrive_index[rows, safe].to(torch.int64)
        path.scatter_(1, torch.where(match, num + 1, s)[:, None], glob[:, None])
        num = num + match.to(torch.int64)
        last = torch.where(match, glob, last)
        descend = torch.where(
            num < s - 1, retrive_next_token[rows, safe].to(torch.int64), -1
        )
        cur = torch.where(
            match,
            descend,
            torch.where(active, retrive_next_sibling[rows, safe].to(torch.int64), -1),
        )
    cols = torch.arange(1, s, device=dev)[None, :]
    accepted = cols <= num[:, None]
    accept_index[:, 1:] = torch.where(
        accepted, path[:, 1:s], accept_index[:, 1:].to(torch.int64)
    ).to(accept_index.dtype)
    # Greedy: the token after an accepted slot is the target argmax there.
    _write_predicts(
        predicts,
        accept_index,
        num,
        target_flat[accept_index.to(torch.int64).clamp(min=0)],
    )
    accept_token_num.copy_(num.to(accept_token_num.dtype))


def _write_predicts(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    num: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """predicts[accept_index[b, k]] = values[b, k] for k <= num[b] (others: a dump)."""
    bs, s = accept_index.shape
    used = torch.arange(s, device=num.device)[None, :] <= num[:, None]
    dump = predicts.numel()
    index = torch.where(used, accept_index.to(torch.int64), dump).reshape(-1)
    extended = torch.cat([predicts, predicts.new_zeros(1)])
    extended.scatter_(0, index, values.reshape(-1).to(predicts.dtype))
    predicts.copy_(extended[:dump])


def tree_speculative_sampling_target_only_torch(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Torch twin of SGLang's ``tree_speculative_sampling_target_only`` (same args).

    uniform_samples float32 [bs, N]; uniform_samples_for_final_sampling float32 [bs];
    target_probs, draft_probs float32 [bs, N, V] (draft_probs is mutated like the
    kernel's). ``deterministic`` is accepted for signature parity; the torch path is
    always deterministic. Thresholds follow the kernel's host wrapper: both must lie in
    [0, 1] (ValueError otherwise), and threshold_acc is clamped to
    max(float32(threshold_acc), 1e-9f) before the division (threshold_acc = 0 acts as
    1e-9: no inf or NaN from 0 / 0).
    """
    _check_thresholds(threshold_single, threshold_acc)
    bs, n = candidates.shape
    s = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    f32 = torch.float32
    # 0-dim device tensors (a Python scalar divisor would become a reciprocal multiply);
    # torch.full fills on the device, no host-to-device copy (a sync on CUDA).
    thr_single = torch.full((), float(threshold_single), dtype=f32, device=dev)
    thr_acc = torch.full(
        (), _clamped_threshold_acc(threshold_acc), dtype=f32, device=dev
    )
    tp = target_probs.reshape(bs * n, vocab)
    dp = draft_probs.view(bs * n, vocab)
    coins = uniform_samples.reshape(bs * n).to(f32)

    last = retrive_index[:, 0].to(torch.int64)
    accept_index[:, 0] = last.to(accept_index.dtype)
    prob_row = rows * n  # flattened row of the slot whose distribution is being tested
    coin = coins[prob_row]
    prob_acc = torch.zeros(bs, dtype=f32, device=dev)
    num = torch.zeros(bs, dtype=torch.int64, device=dev)
    cur = (
        retrive_next_token[:, 0].to(torch.int64)
        if s > 1
        else torch.full((bs,), -1, dtype=torch.int64, device=dev)
    )
    path = torch.full((bs, s + 1), -1, dtype=torch.int64, device=dev)
    tokens_out = torch.full((bs, s + 1), -1, dtype=torch.int64, device=dev)
    for _ in range(n):
        active = cur >= 0
        if not cur.is_cuda and not bool(active.any()):
            # CPU: no device to sync, stop early.
            break
        safe = cur.clamp(min=0)
        token = candidates[rows, safe].to(torch.int64)
        p = tp[prob_row, token].to(f32)
        prob_acc = torch.where(active, prob_acc + p, prob_acc)
        accept = active & (p > 0) & ((coin < prob_acc / thr_acc) | (p >= thr_single))
        reject = active & ~accept
        # A rejected sibling's target prob moves into draft_probs (the kernel's
        # residual).
        dp[prob_row, token] = torch.where(
            reject, tp[prob_row, token], dp[prob_row, token]
        )
        glob = retrive_index[rows, safe].to(torch.int64)
        col = torch.where(accept, num + 1, s)[:, None]
        path.scatter_(1, col, glob[:, None])
        tokens_out.scatter_(1, torch.where(accept, num, s)[:, None], token[:, None])
        num = num + accept.to(torch.int64)
        last = torch.where(accept, glob, last)
        prob_row = torch.where(accept, rows * n + safe, prob_row)
        coin = torch.where(accept, coins[rows * n + safe], coin)
        prob_acc = torch.where(accept, torch.zeros_like(prob_acc), prob_acc)
        descend = torch.where(
            num < s - 1, retrive_next_token[rows, safe].to(torch.int64), -1
        )
        cur = torch.where(
            accept,
            descend,
            torch.where(active, retrive_next_sibling[rows, safe].to(torch.int64), -1),
        )

    bonus = _sample_residual(
        tp[prob_row],
        dp[prob_row],
        num < s - 1,
        uniform_samples_for_final_sampling.to(f32),
    )
    cols = torch.arange(1, s, device=dev)[None, :]
    accepted = cols <= num[:, None]
    accept_index[:, 1:] = torch.where(
        accepted, path[:, 1:s], accept_index[:, 1:].to(torch.int64)
    ).to(accept_index.dtype)
    tokens_out.scatter_(1, num[:, None], bonus[:, None])
    _write_predicts(predicts, accept_index, num, tokens_out[:, :s])
    accept_token_num.copy_(num.to(accept_token_num.dtype))


def _check_thresholds(threshold_single: float, threshold_acc: float) -> None:
    """The kernel host wrapper's range checks (``CHECK_HOST``, csrc sampling.cuh)."""
    for name, value in (
        ("threshold_single", threshold_single),
        ("threshold_acc", threshold_acc),
    ):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"expected {name} in [0, 1], got {value}")


def _clamped_threshold_acc(threshold_acc: float) -> float:
    """max(threshold_acc, 1e-9): the divisor the kernel gets, once rounded to float32.

    SGLang's host wrapper passes ``std::max(static_cast<float>(threshold_acc), 1e-9f)``;
    rounding to float32 is monotone, so float32(max(x, 1e-9)) is the same value.
    """
    return max(float(threshold_acc), 1e-9)


def _sample_residual(
    q: torch.Tensor, p: torch.Tensor, use_draft: torch.Tensor, coin: torch.Tensor
) -> torch.Tensor:
    """Kernel's final draw, batched: first index with relu(q - p) > 0, cdf > coin * sum.

    q, p float32 [bs, V]; use_draft bool [bs] (False: the draft term is zero); coin
    [bs]. Fallbacks as in the kernel: the last index with positive mass, else V - 1.
    """
    vocab = q.shape[1]
    p = torch.where(use_draft[:, None], p, torch.zeros_like(p))
    relu = torch.clamp(q - p, min=0.0)
    u = coin * relu.sum(dim=1)
    cdf = torch.cumsum(relu, dim=1)
    positive = relu > 0
    idx = torch.arange(vocab, device=q.device).expand_as(relu)
    hit = positive & (cdf > u[:, None])
    first_hit = torch.where(hit, idx, vocab).amin(dim=1)
    last_valid = torch.where(positive, idx, -1).amax(dim=1)
    fallback = torch.where(last_valid >= 0, last_valid, vocab - 1)
    return torch.where(first_hit < vocab, first_hit, fallback)


def _sglang_kernel(name: str):
    """SGLang's JIT op ``name`` on CUDA, or None where it does not import (lazily)."""
    try:
        if name == "sampling":
            from sglang.kernels.ops.speculative.sampling import (
                tree_speculative_sampling_target_only as op,
            )
        else:
            from sglang.kernels.ops.speculative.tree import verify_tree_greedy as op
    except Exception:  # no SGLang, no JIT toolchain: the torch twin runs instead
        return None
    return op


def ddtree_verify_greedy(
    candidates: torch.Tensor,
    retrieve: DDTreeRetrieve,
    target_predict: torch.Tensor,
    num_speculative_tokens: int,
    use_kernel: Optional[bool] = None,
) -> DDTreeVerifyResult:
    """Greedy verify: candidates int64 [bs, N], target_predict int64 [bs, N] (argmax).

    num_speculative_tokens = max draft depth + 1 (accept_index width). use_kernel: None
    = SGLang's kernel on CUDA when it imports, False = torch twin, True = kernel or
    raise.
    """
    _check_verify_inputs(candidates, retrieve, num_speculative_tokens)
    if target_predict.shape != candidates.shape:
        raise ValueError(
            f"expected target_predict of shape {tuple(candidates.shape)} ([bs, N]), "
            f"got {tuple(target_predict.shape)}"
        )
    bs, n = candidates.shape
    outs = _alloc_outputs(bs, n, num_speculative_tokens, candidates.device)
    op = _pick(use_kernel, candidates, "greedy")
    args = (
        candidates.to(torch.int64),
        retrieve.retrieve_index,
        retrieve.retrieve_next_token,
        retrieve.retrieve_next_sibling,
        target_predict.to(torch.int64),
    )
    if op is not None:
        op(*outs, *args)
    else:
        verify_tree_greedy_torch(*outs, *args)
    return _finish(*outs, n)


def ddtree_verify_sampling(
    candidates: torch.Tensor,
    retrieve: DDTreeRetrieve,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    num_speculative_tokens: int,
    draft_probs: Optional[torch.Tensor] = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    use_kernel: Optional[bool] = None,
) -> DDTreeVerifyResult:
    """Sampling verify. target_probs float32 [bs, N, V]; coins float32 [bs, N] and [bs].

    draft_probs float32 [bs, N, V] defaults to zeros (SGLang's tree path); it is
    mutated. Thresholds 1.0 with zero draft_probs make the emitted tokens distributed
    exactly as sampling from the target (requires distinct sibling tokens). Thresholds
    outside [0, 1] raise ValueError on either path (the kernel's host wrapper would
    raise its own error); threshold_acc below 1e-9 acts as 1e-9, as in the wrapper.
    """
    _check_verify_inputs(candidates, retrieve, num_speculative_tokens)
    _check_thresholds(threshold_single, threshold_acc)  # kernel or twin: ValueError
    bs, n = candidates.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (bs, n):
        raise ValueError(
            f"expected target_probs of shape [{bs}, {n}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    if uniform_samples.shape != (bs, n) or uniform_samples_for_final_sampling.shape != (
        bs,
    ):
        raise ValueError(
            f"expected uniform_samples [{bs}, {n}] and "
            f"uniform_samples_for_final_sampling [{bs}]"
        )
    target_probs = target_probs.to(torch.float32).contiguous()
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs)
    elif (
        draft_probs.shape != target_probs.shape
        or draft_probs.dtype != torch.float32
        or not draft_probs.is_contiguous()
    ):
        raise ValueError(
            "expected draft_probs contiguous float32 of shape "
            f"{tuple(target_probs.shape)} (it is written in place)"
        )
    outs = _alloc_outputs(bs, n, num_speculative_tokens, candidates.device)
    op = _pick(use_kernel, candidates, "sampling")
    fn = op if op is not None else tree_speculative_sampling_target_only_torch
    fn(
        *outs,
        candidates.to(torch.int64),
        retrieve.retrieve_index,
        retrieve.retrieve_next_token,
        retrieve.retrieve_next_sibling,
        uniform_samples.to(torch.float32).contiguous(),
        uniform_samples_for_final_sampling.to(torch.float32).contiguous(),
        target_probs,
        draft_probs,
        threshold_single,
        threshold_acc,
        True,
    )
    return _finish(*outs, n)


def _pick(use_kernel: Optional[bool], like: torch.Tensor, name: str):
    if use_kernel is False or (use_kernel is None and not like.is_cuda):
        return None
    op = _sglang_kernel(name) if like.is_cuda else None
    if op is None and use_kernel:
        raise ValueError(
            f"use_kernel=True needs CUDA tensors and SGLang's {name} verify kernel"
        )
    return op
