"""Pure-torch bodies of the sgl-kernel CPU ops that SGLang's CPU engine calls.

Each function has the argument order, dtypes and in-place semantics of the C++ op of
the same name in sgl-kernel's CPU build (``csrc/cpu``), so the stand-in package can
register them as ``torch.ops.sgl_kernel.<name>``. Loops run over requests (a handful
in the tests), never over tokens, except where the C++ op is sequential by design.
No registration happens here: tests load this file on its own to check the bodies.
"""

from __future__ import annotations

import ctypes

import torch


def _row_offsets(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[int]:
    """Exclusive prefix sum of per-request lengths: request i owns [o[i], o[i+1])."""
    lens = (end_offset.to(torch.int64) - start_offset.to(torch.int64)).tolist()
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + int(n))
    return offsets


def _check_offsets(name: str, start_offset, end_offset, req_pool_indices, out_numel):
    if start_offset.dtype != end_offset.dtype:
        raise RuntimeError(f"{name}: start_offset and end_offset dtypes differ")
    bs = req_pool_indices.shape[0]
    if start_offset.numel() != bs or end_offset.numel() != bs:
        raise RuntimeError(f"{name}: offsets must have one entry per request ({bs})")
    offsets = _row_offsets(start_offset, end_offset)
    if offsets[-1] > out_numel:
        raise RuntimeError(
            f"{name}: out_cache_loc has {out_numel} entries but offsets require "
            f"{offsets[-1]}"
        )
    return offsets


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Scatter new KV slots into the request-to-token map, in place.

    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
    out_cache_loc[o[i]:o[i+1]]`` where ``o`` is the prefix sum of the lengths
    (requests consume ``out_cache_loc`` in order).

    req_pool_indices: [bs] int32/int64; req_to_token: [max_reqs, pool_len] int32 (out);
    start_offset/end_offset: [bs] int32/int64 (same dtype); out_cache_loc: int64.
    """
    assert req_to_token.dtype == torch.int32 and req_to_token.dim() == 2
    assert out_cache_loc.dtype == torch.int64
    assert req_to_token.shape[1] == pool_len
    offsets = _check_offsets(
        "assign_req_to_token_pool", start_offset, end_offset, req_pool_indices,
        out_cache_loc.numel(),
    )
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    for i, row in enumerate(rows):
        locs = out_cache_loc[offsets[i]:offsets[i + 1]]
        req_to_token[row, starts[i]:ends[i]] = locs.to(torch.int32)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's KV slots [start, end) into ``out_cache_loc``, in place.

    The inverse of :func:`assign_req_to_token_pool_cpu`; the tail of ``out_cache_loc``
    past the last request is left untouched (callers size it for the worst case).

    req_to_token: [max_reqs, pool_len] int32; out_cache_loc: [>= sum(len)] int64 (out).
    """
    assert req_to_token.dtype == torch.int32 and req_to_token.dim() == 2
    assert out_cache_loc.dtype == torch.int64
    assert req_to_token.shape[1] == pool_len
    offsets = _check_offsets(
        "assign_extend_cache_locs", start_offset, end_offset, req_pool_indices,
        out_cache_loc.numel(),
    )
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    for i, row in enumerate(rows):
        out_cache_loc[offsets[i]:offsets[i + 1]] = req_to_token[row, starts[i]:ends[i]]


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Read back the ``topk * num_steps`` draft slots after each request's prefix.

    ``out_cache_loc[i*W:(i+1)*W] = req_to_token[req_pool_indices[i], s:s+W]`` with
    ``s = seq_lens[i]`` and ``W = topk * num_steps``.

    req_to_token: [max_reqs, pool_len] int32; out_cache_loc: [bs * W] int64 (out).
    """
    assert req_to_token.dtype == torch.int32 and out_cache_loc.dtype == torch.int64
    width = topk * num_steps
    assert out_cache_loc.numel() == req_pool_indices.numel() * width
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        locs = req_to_token[row, start:start + width]
        out_cache_loc[i * width:(i + 1) * width] = locs


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[i * accept_stride + accept_lens[i] - 1]``.

    accept_tokens: [bs, accept_stride] int32; accept_lens: [bs] int32 (bonus
    included); bonus_tokens: [bs] int32 (out).
    """
    bs = accept_lens.shape[0]
    assert accept_tokens.numel() == bs * accept_stride and bonus_tokens.numel() == bs
    idx = torch.arange(bs, dtype=torch.int64) * accept_stride + accept_lens.to(
        torch.int64
    ) - 1
    bonus_tokens.view(-1).copy_(accept_tokens.reshape(-1)[idx])


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the accepted tokens' KV slots, skipping rejected (-1) entries.

    ``accept_out_cache_loc[:n] = out_cache_loc[accept_index[accept_index > -1]]`` in
    flat order; entries from ``n`` on are left untouched.

    accept_index: [bs * steps] (any shape) int32/int64, -1 = rejected;
    out_cache_loc: [bs * num_draft_tokens] int64; accept_out_cache_loc: [>= numel
    of accept_index] int64 (out).
    """
    assert out_cache_loc.dtype == torch.int64
    assert accept_out_cache_loc.dtype == torch.int64
    assert accept_out_cache_loc.numel() >= accept_index.numel()
    flat = accept_index.reshape(-1).to(torch.int64)
    kept = flat[flat > -1]
    if kept.numel() and int(kept.max()) >= out_cache_loc.numel():
        raise RuntimeError(
            f"fill_accept_out_cache_loc: accept_index {int(kept.max())} out of range"
        )
    accept_out_cache_loc.view(-1)[: kept.numel()] = out_cache_loc.reshape(-1)[kept]


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verify: per request, follow the target argmax down the draft tree.

    From the root, move to the first child (then its siblings, in order) whose draft
    token equals the target's prediction at the last accepted node; stop when none
    matches or ``num_spec_step - 1`` drafts are accepted. Outputs, in place:
    ``accept_index[b, 0..n]`` the flat indices of the root and the ``n`` accepted
    nodes (other slots keep the caller's -1), ``accept_token_num[b] = n`` (bonus
    excluded), and ``predicts[flat]`` = the target token at each accepted node and at
    the last one (the bonus token).

    predicts: [bs * N] int32 (out); accept_index: [bs, num_spec_step] int32 (out);
    accept_token_num: [bs] int32 (out); candidates, retrive_index (flat indices
    ``b * N + i``), retrive_next_token, retrive_next_sibling (local, -1 = none),
    target_predict: [bs, N], one index dtype (int32 or int64).
    """
    assert predicts.dtype == accept_index.dtype == accept_token_num.dtype == torch.int32
    assert candidates.dim() == 2 and accept_index.dim() == 2
    bs, num_draft = candidates.shape
    steps = accept_index.shape[1]
    assert predicts.numel() == bs * num_draft
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sib = retrive_next_sibling.tolist()
    # target_predict is read at flat (global) node indices, like the C++ op.
    target = target_predict.reshape(-1).tolist()
    pred_flat = predicts.view(-1)
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, steps):
            cur = r_next[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    pred_flat[last] = target[last]
                    accepted += 1
                    accept_index[b, accepted] = r_index[b][cur]
                    last = r_index[b][cur]
                    break
                cur = r_sib[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = accepted
        pred_flat[last] = target[last]


def _rows_view(base_ptr: int, stride: int, num_rows: int) -> torch.Tensor:
    """A writable uint8 [num_rows, stride] tensor over raw memory (no copy)."""
    buf = (ctypes.c_uint8 * (stride * num_rows)).from_address(base_ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, stride)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """In every layer buffer copy KV row ``src_loc[j]`` to row ``tgt_loc[j]``.

    Buffer ``i`` starts at address ``data_ptrs[i]`` with rows of ``strides[i]`` bytes
    (the row is the slot). All sources are read before any write, so overlapping
    moves (a permutation of slots) are safe.

    data_ptrs: [num_buffers] uint64 addresses; strides: [num_buffers] int64 bytes;
    tgt_loc, src_loc: [num_locs] int64 slot indices.
    """
    assert tgt_loc.numel() == src_loc.numel()
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    src = src_loc.reshape(-1).to(torch.int64)
    # Only rows up to the largest slot touched are mapped; the op never sees the
    # buffer's true length.
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _rows_view(int(ptr), int(stride), num_rows)
        rows[tgt] = rows[src].clone()  # gather first: reads precede writes
