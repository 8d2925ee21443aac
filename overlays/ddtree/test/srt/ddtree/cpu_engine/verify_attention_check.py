"""Check the CPU tree's torch_native TARGET_VERIFY attention against dense attention.

Run as a script in a child process whose ``PYTHONPATH`` holds a tree made by
``prepare_cpu_tree`` (and the sgl_kernel stand-in), with ``SGLANG_USE_CPU_ENGINE=1``:
it imports SGLang's real ``TorchNativeAttnBackend`` from that tree and calls its
``_forward_target_verify`` on stand-in pools and batches, for random prefixes with

* a FULL_MASK custom mask of random draft trees (row: prefix + ancestors + itself),
* no mask on a causal layer (row j: prefix + block rows 0..j),
* no mask on an ENCODER_ONLY layer (every row sees everything: the DFlash draft),

with the block's KV read from the pool or passed in (``save_kv_cache=False``). The
reference is a per-row softmax over the allowed keys. Prints ``ok <cases>``; any
mismatch raises.
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class _Pool:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v


def _tree_allowed(rng: random.Random, n: int) -> torch.Tensor:
    """[n, n] bool: node j sees its ancestors and itself (node 0 is the root)."""
    parents = [-1] + [rng.randrange(0, j) for j in range(1, n)]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        a = j
        while a != -1:
            allowed[j, a] = True
            a = parents[a]
    return allowed


def _reference(q, key, value, allowed, scale):
    """q: [n, H, D]; key/value: [L, KV, D]; allowed: [n, L] bool -> [n, H, D]."""
    group = HEADS // KV_HEADS
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, key) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), value)


def run_case(seed: int, mode: str, save_kv_cache: bool) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, n, slots, max_reqs, pool_len = rng.randint(1, 4), rng.randint(1, 6), 256, 6, 64
    prefix = [rng.randint(0, 20) for _ in range(bs)]
    rows = rng.sample(range(max_reqs), bs)
    k_buf = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
    v_buf = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
    perm = torch.randperm(slots, generator=gen)
    req_to_token = torch.zeros(max_reqs, pool_len, dtype=torch.int32)
    used = 0
    for r, p in zip(rows, prefix):
        req_to_token[r, :p] = perm[used:used + p].to(torch.int32)
        used += p
    cache_loc = perm[used:used + bs * n]
    k_new = torch.randn(bs * n, KV_HEADS, HEAD_DIM, generator=gen)
    v_new = torch.randn(bs * n, KV_HEADS, HEAD_DIM, generator=gen)
    if save_kv_cache:  # as set_kv_buffer would have done before the attention
        k_buf[cache_loc], v_buf[cache_loc] = k_new, v_new
    q = torch.randn(bs * n, HEADS, HEAD_DIM, generator=gen)

    allowed, masks = [], []
    for p in prefix:
        if mode == "tree":
            block = _tree_allowed(rng, n)
        elif mode == "causal":
            block = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            block = torch.ones(n, n, dtype=torch.bool)
        full = torch.cat([torch.ones(n, p, dtype=torch.bool), block], dim=1)
        allowed.append(full)
        masks.append(full.flatten())
    custom_mask = torch.cat(masks) if mode == "tree" else None

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend.token_to_kv_pool = _Pool(k_buf, v_buf)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    attn_type = AttentionType.DECODER
    if mode == "encoder":
        attn_type = AttentionType.ENCODER_ONLY
    layer = SimpleNamespace(
        layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
        scaling=HEAD_DIM**-0.5, attn_type=attn_type, sliding_window_size=-1,
    )
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(prefix),
        spec_info=SimpleNamespace(custom_mask=custom_mask),
    )
    out = torch.zeros_like(q)
    k_arg = k_new.reshape(bs * n, -1) if not save_kv_cache else None
    v_arg = v_new.reshape(bs * n, -1) if not save_kv_cache else None
    backend._forward_target_verify(
        q, out, k_arg, v_arg, layer, batch, cache_loc, save_kv_cache
    )

    for i, (r, p) in enumerate(zip(rows, prefix)):
        blk = slice(i * n, (i + 1) * n)
        prefix_loc = req_to_token[r, :p].long()
        key = torch.cat([k_buf[prefix_loc], k_new[blk]])
        value = torch.cat([v_buf[prefix_loc], v_new[blk]])
        expected = _reference(q[blk], key, value, allowed[i], layer.scaling)
        if not torch.allclose(out[blk], expected, atol=1e-5, rtol=1e-5):
            err = (out[blk] - expected).abs().max().item()
            raise AssertionError(
                f"seed {seed} mode {mode} save_kv_cache {save_kv_cache} request {i} "
                f"(prefix {p}, n {n}): max error {err}"
            )


def main() -> int:
    cases = 0
    for seed in range(12):
        for mode in ("tree", "causal", "encoder"):
            for save in (True, False):
                run_case(seed, mode, save)
                cases += 1
    print(f"ok {cases}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
