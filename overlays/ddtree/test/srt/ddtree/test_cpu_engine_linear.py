"""The CPU engine harness on a real SGLang server: plain and linear DFLASH, greedy.

A plain server and a DFLASH server (the session's pool: the same two serve
``test_ddtree_engine_greedy``): the plain server's greedy output must equal Hugging
Face ``generate`` token for token, and the DFLASH server's must equal the plain
server's for 1-4 concurrent requests. Besides: the CPU tree's TARGET_VERIFY
attention equals dense attention, and the stand-in sgl_kernel ops are checked
against reference loops without a server. Refused arguments are
``test_ddtree_engine_refusals``'s.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_engine.cpu_tree import STUB_DIR, Change, CpuTreeError, apply_change
from cpu_engine.pool import ServerConfig
from cpu_engine.server import (
    DP_PORT_OFFSETS,
    SERVER_PORT_RANGE,
    dflash_args,
    free_server_port,
    server_env,
)

HF_PROMPTS = (
    [1, 5, 9, 33, 12],
    [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41, 42, 43, 17],
)
HF_NEW_TOKENS = 40
# Different prompt lengths, so verify sees different prefixes in one batch.
BATCH_PROMPTS = (
    [1, 20, 30, 40],
    [1, 5, 9, 33, 12, 44, 45, 46, 47],
    [1, 60, 61, 62, 63, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [1, 50, 51],
)
BATCH_NEW_TOKENS = 64


def _outputs(responses) -> list[list[int]]:
    return [r["output_ids"] for r in responses]


@pytest.fixture(scope="module")
def plain_outputs(server_pool, tiny_models):
    """Greedy outputs of the plain server:
    {"hf": one response per HF prompt, "batch": {k: the first k BATCH_PROMPTS}}."""
    server = server_pool.get(ServerConfig.of(tiny_models.target, name="plain"))
    hf = [server.generate(p, HF_NEW_TOKENS) for p in HF_PROMPTS]
    batch = {k: _outputs(server.generate_batch(BATCH_PROMPTS[:k], BATCH_NEW_TOKENS))
             for k in range(1, len(BATCH_PROMPTS) + 1)}
    return {"hf": hf, "batch": batch}


@pytest.fixture(scope="module")
def dflash_server(plain_outputs, server_pool, tiny_models):
    args = dflash_args(tiny_models.draft)
    return server_pool.get(ServerConfig.of(tiny_models.target, args, name="linear"))


@pytest.mark.slow
def test_torch_native_target_verify_attention(cpu_sglang_python):
    """The test-only TARGET_VERIFY attention of the CPU tree against dense attention,
    with FULL_MASK tree masks, causal and ENCODER_ONLY layers (a child process: the
    tree's sglang is imported there, not in this one)."""
    script = Path(__file__).parent / "cpu_engine" / "verify_attention_check.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=server_env(cpu_sglang_python), timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


@pytest.mark.slow
def test_plain_server_greedy_equals_hugging_face(plain_outputs, tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_models.target, dtype=torch.float32
    )
    model.eval()
    for prompt, response in zip(HF_PROMPTS, plain_outputs["hf"]):
        with torch.no_grad():
            # eos_token_id=None: never stop early, like the server's ignore_eos.
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=HF_NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        expected = out[0, len(prompt):].tolist()
        assert len(expected) == HF_NEW_TOKENS
        assert response["output_ids"] == expected, f"prompt {prompt}"
        assert response["meta_info"]["completion_tokens"] == HF_NEW_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_dflash_greedy_equals_plain(dflash_server, plain_outputs, batch, tiny_models):
    responses = dflash_server.generate_batch(BATCH_PROMPTS[:batch], BATCH_NEW_TOKENS)
    assert _outputs(responses) == plain_outputs["batch"][batch], (
        f"DFLASH output differs from plain (log: {dflash_server.log_path})")
    for r in responses:
        meta = r["meta_info"]
        assert meta["completion_tokens"] == BATCH_NEW_TOKENS
        assert meta["spec_verify_ct"] > 0
        # Accept length counts the bonus token: between 1 and the block size.
        assert 1.0 <= meta["spec_accept_length"] <= tiny_models.block_size


@pytest.mark.slow
def test_dflash_server_info_reports_speculation(dflash_server, tiny_models):
    info = dflash_server.server_info()
    assert info["speculative_algorithm"] == "DFLASH"
    state = info["internal_states"][0]
    assert state["speculative_num_draft_tokens"] == tiny_models.block_size


# --- the CPU tree's snippet changes ---------------------------------------------------


def test_a_server_port_is_out_of_the_ephemeral_range_and_never_given_twice():
    """A server binds its --port long after the harness chose it; an ephemeral port
    could meanwhile become the local port of any outgoing connection."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range")
                 .read_text().split())
    plain = [free_server_port(["--tp-size", "2"]) for _ in range(20)]
    dp = free_server_port(["--attn-dp-size", "2"])
    dp_block = {dp + offset for offset in DP_PORT_OFFSETS}
    assert all(p in SERVER_PORT_RANGE and not low <= p <= high for p in [*plain, dp])
    assert len(set(plain)) == len(plain) and dp_block.isdisjoint(plain)
    assert not any(low <= p <= high for p in dp_block)


def test_a_change_must_match_exactly_once(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\na = 1\n")
    twice = Change("twice", "m.py", "a = 1\n", "a = 2\n")
    with pytest.raises(CpuTreeError, match=r"m.py: change 'twice' .* found 2 times"):
        apply_change(tmp_path, twice)
    with pytest.raises(CpuTreeError, match="found 0 times"):
        apply_change(tmp_path, Change("absent", "m.py", "b = 1\n", "b = 2\n"))
    with pytest.raises(CpuTreeError, match="n.py: missing"):
        apply_change(tmp_path, Change("no file", "n.py", "a", "b"))
    # Optional: skipped without the file, strict with it.
    apply_change(tmp_path, Change("opt", "n.py", "a", "b", optional=True))
    with pytest.raises(CpuTreeError, match="found 2 times"):
        apply_change(tmp_path, Change("opt", "m.py", "a = 1\n", "", optional=True))
    (tmp_path / "m.py").write_text("a = 1\n")
    apply_change(tmp_path, Change("once", "m.py", "a = 1\n", "a = 2\n"))
    assert (tmp_path / "m.py").read_text() == "a = 2\n"


# --- the sgl_kernel stand-in, without a server ---------------------------------------


def _load_impl():
    """The op bodies, loaded on their own (no torch.ops registration here)."""
    path = STUB_DIR / "sgl_kernel" / "_impl.py"
    spec = importlib.util.spec_from_file_location("_ddtree_sgl_kernel_stub_impl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def impl():
    return _load_impl()


def _random_ranges(rng: random.Random, bs: int, pool_len: int):
    starts, ends = [], []
    for _ in range(bs):
        s = rng.randrange(0, pool_len - 1)
        starts.append(s)
        ends.append(rng.randrange(s, pool_len))  # empty ranges included
    return starts, ends


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool_and_back(impl, seed, offset_dtype):
    rng = random.Random(seed)
    bs, max_reqs, pool_len = rng.randint(1, 5), 8, 40
    rows = rng.sample(range(max_reqs), bs)
    starts, ends = _random_ranges(rng, bs, pool_len)
    total = sum(e - s for s, e in zip(starts, ends))
    locs = torch.randperm(10_000, generator=torch.Generator().manual_seed(seed))[:total]
    req_to_token = torch.randint(0, 99, (max_reqs, pool_len), dtype=torch.int32)
    expected = req_to_token.clone()
    pos = 0
    for r, s, e in zip(rows, starts, ends):
        for j in range(s, e):
            expected[r, j] = int(locs[pos])
            pos += 1
    args = (torch.tensor(rows), req_to_token, torch.tensor(starts, dtype=offset_dtype),
            torch.tensor(ends, dtype=offset_dtype))
    impl.assign_req_to_token_pool_cpu(*args, locs, pool_len)
    assert torch.equal(req_to_token, expected)

    out = torch.full((total + 3,), -5, dtype=torch.int64)
    impl.assign_extend_cache_locs_cpu(*args, out, pool_len)
    assert torch.equal(out[:total], locs) and (out[total:] == -5).all()


def test_assign_draft_cache_locs_contiguous(impl):
    req_to_token = torch.arange(4 * 30, dtype=torch.int32).view(4, 30)
    rows, seq_lens, topk, steps = [3, 1], [5, 11], 1, 4
    out = torch.empty(2 * topk * steps, dtype=torch.int64)
    impl.assign_draft_cache_locs_contiguous_cpu(
        torch.tensor(rows), req_to_token, torch.tensor(seq_lens), out, 30, topk, steps)
    expected = [int(req_to_token[r, s + j]) for r, s in zip(rows, seq_lens)
                for j in range(topk * steps)]
    assert out.tolist() == expected


@pytest.mark.parametrize("seed", range(5))
def test_fill_accept_out_cache_loc(impl, seed):
    g = torch.Generator().manual_seed(seed)
    bs, steps, n = 3, 4, 5
    accept_index = torch.randint(0, bs * n, (bs, steps), generator=g, dtype=torch.int32)
    accept_index[torch.rand(bs, steps, generator=g) < 0.4] = -1
    out_cache_loc = torch.randint(0, 1000, (bs * n,), generator=g)
    out = torch.full((bs * steps,), -9, dtype=torch.int64)
    impl.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, out)
    kept = [int(out_cache_loc[i]) for i in accept_index.flatten().tolist() if i != -1]
    assert out[:len(kept)].tolist() == kept
    assert (out[len(kept):] == -9).all()


def test_fill_bonus_tokens(impl):
    accept_tokens = torch.arange(12, dtype=torch.int32).view(3, 4)
    accept_lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    bonus = torch.empty(3, dtype=torch.int32)
    impl.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == [0, 7, 9]


def _random_tree(rng: random.Random, n: int):
    """A random tree over nodes 0..n-1 (0 = root) in EAGLE retrieve form."""
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    next_token, next_sibling = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):  # prepend: children end up in index order
        p = parents[i]
        next_sibling[i] = next_token[p]
        next_token[p] = i
    return parents, next_token, next_sibling


def _verify_reference(cand, r_index, r_next, r_sib, target, steps):
    """Straight reading of the greedy walk, per request; flat target indices."""
    accept, predicts = [r_index[0]], {}
    cur, last = 0, r_index[0]
    while len(accept) < steps:
        child, found = r_next[cur], None
        while child != -1:
            if cand[child] == target[last]:
                found = child
                break
            child = r_sib[child]
        if found is None:
            break
        predicts[last] = target[last]
        cur, last = found, r_index[found]
        accept.append(last)
    predicts[last] = target[last]
    return accept, predicts


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_verify_tree_greedy(impl, seed, index_dtype):
    rng = random.Random(seed)
    bs, n, steps, vocab = 3, 7, 4, 3  # a small vocab makes matches likely
    cand, r_index, r_next, r_sib = [], [], [], []
    for b in range(bs):
        _, nt, ns = _random_tree(rng, n)
        cand.append([rng.randrange(vocab) for _ in range(n)])
        r_index.append([b * n + i for i in range(n)])
        r_next.append(nt)
        r_sib.append(ns)
    target = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
    predicts = torch.full((bs * n,), -3, dtype=torch.int32)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    t = lambda x: torch.tensor(x, dtype=index_dtype)  # noqa: E731
    impl.verify_tree_greedy_cpu(predicts, accept_index, accept_num, t(cand), t(r_index),
                                t(r_next), t(r_sib), t(target))
    flat_target = [x for row in target for x in row]
    expected_predicts = [-3] * (bs * n)
    for b in range(bs):
        accept, preds = _verify_reference(cand[b], r_index[b], r_next[b], r_sib[b],
                                          flat_target, steps)
        assert accept_index[b].tolist() == accept + [-1] * (steps - len(accept))
        assert int(accept_num[b]) == len(accept) - 1
        for k, v in preds.items():
            expected_predicts[k] = v
    assert predicts.tolist() == expected_predicts


def test_copy_all_layer_kv_cache(impl):
    g = torch.Generator().manual_seed(0)
    layers = [
        torch.randn(16, 2, 8, generator=g),
        torch.randn(16, 3, generator=g).half(),
    ]
    before = [x.clone() for x in layers]
    # Overlapping moves (a swap and a chain): every source is read before any write.
    src, tgt = torch.tensor([1, 2, 5, 6]), torch.tensor([2, 1, 6, 9])
    ptrs = torch.tensor([x.data_ptr() for x in layers], dtype=torch.uint64)
    strides = torch.tensor([x.stride(0) * x.element_size() for x in layers])
    impl.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for x, old in zip(layers, before):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(x, expected)


def test_stub_package_interface():
    """``import sgl_kernel`` registers torch.ops.sgl_kernel.*, exposes wrappers and
    names any missing attribute (run in a child: no registration in this process)."""
    code = (
        "import torch, sgl_kernel\n"
        "names = sgl_kernel.__all__\n"
        "assert all(hasattr(torch.ops.sgl_kernel, n) for n in names), names\n"
        "assert not hasattr(torch.ops.sgl_kernel, 'fused_qk_norm_cpu')\n"
        "rt = torch.zeros(2, 6, dtype=torch.int32)\n"
        "sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([1]), rt,\n"
        "    torch.tensor([2]), torch.tensor([4]), torch.tensor([7, 8]), 6)\n"
        "assert rt[1].tolist() == [0, 0, 7, 8, 0, 0], rt\n"
        # Keyword arguments, as spec_tree.py passes them (schema names, retrive_*).
        "p = torch.zeros(2, dtype=torch.int32)\n"
        "a = torch.full((1, 2), -1, dtype=torch.int32)\n"
        "n = torch.zeros(1, dtype=torch.int32)\n"
        "sgl_kernel.verify_tree_greedy_cpu(predicts=p, accept_index=a,\n"
        "    accept_token_num=n, candidates=torch.tensor([[5, 7]]),\n"
        "    retrive_index=torch.tensor([[0, 1]]),\n"
        "    retrive_next_token=torch.tensor([[1, -1]]),\n"
        "    retrive_next_sibling=torch.tensor([[-1, -1]]),\n"
        "    target_predict=torch.tensor([[7, 9]]))\n"
        "assert a.tolist() == [[0, 1]] and n.tolist() == [1] and p.tolist() == [7, 9]\n"
        "from sgl_kernel import build_tree_kernel_efficient_cpu as f\n"
        "try:\n"
        "    f()\n"
        "except NotImplementedError as e:\n"
        "    assert 'build_tree_kernel_efficient_cpu' in str(e)\n"
        "else:\n"
        "    raise SystemExit('the import-only op ran')\n"
        "try:\n"
        "    sgl_kernel.rmsnorm_cpu\n"
        "except AttributeError as e:\n"
        "    assert 'rmsnorm_cpu' in str(e)\n"
        "else:\n"
        "    raise SystemExit('rmsnorm_cpu resolved')\n"
    )
    env = {"PYTHONPATH": str(STUB_DIR)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**_base_env(), **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _base_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
