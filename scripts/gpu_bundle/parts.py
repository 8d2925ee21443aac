"""Parts (a)-(g) of the DDTree GPU check on one CUDA GPU, one table per part.

run.py calls run_all after the imports. The random batches, the CPU reference, the first
difference and the CUDA-event timer come from scripts/gpu_check.py (carried beside this file).
A part that raises is reported as failed; the others still run.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import gpu_check
import torch

from sglang.srt.speculative import (
    ddtree_batched,
    ddtree_head,
    ddtree_kernel,
    ddtree_retrieve,
    ddtree_step,
    ddtree_utils,
    ddtree_verify,
    ddtree_worker,
)

MODS = (ddtree_batched, ddtree_kernel, ddtree_retrieve, ddtree_verify)
TREE_AND_VERIFY = (*gpu_check.TREE, *gpu_check.VERIFY)
KIMI_VOCAB = 163_840
KIMI_HIDDEN = 7168
BLOCK = 16  # DFlash block: the draft head fills BLOCK - 1 depths
ATOL = RTOL = 2e-2  # bf16 attention output vs the float32 dense reference
# Kimi K2's MLA per attention-DP rank (attention TP 1): all 64 query heads (DeepSeek-V3 has 128),
# one latent KV head; qk dim kv_lora_rank 512 + qk_rope_head_dim 64, V the 512 latent columns.
KIMI_HEADS = 64
KIMI_MLA_HEADS = (KIMI_HEADS, 1)
KIMI_MLA_DIMS = (576, 512)
TREE_WIDTHS = (16, 33, 65, 129)  # DDTree verify widths W = budget + 1: budgets 15, 32, 64, 128
VERIFY_BATCHES = (1, 8, 48)
VERIFY_PREFIXES = (4096, 32768)
TIMING_REPEATS, TIMING_ITERS = 5, 3  # median of 5 gpu_check.timed calls, each a mean of 3


@dataclass
class Part:
    title: str
    header: tuple[str, ...]
    rows: list[tuple] = field(default_factory=list)
    exact: bool = True

    def table(self) -> str:
        cells = [self.header, *[tuple(map(str, row)) for row in self.rows]]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.header))]
        lines = [" | ".join(map(str.rjust, row, widths)) for row in cells]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join([self.title, *lines])


def run_all(say: Callable[[str], None]) -> bool:
    """Every part in order; True when every comparison of every part was exact."""
    results = [_run_part(fn, say) for fn in PARTS]
    return all(part.exact for part in results)


def _run_part(fn: Callable[[], Part], say: Callable[[str], None]) -> Part:
    start = time.monotonic()
    try:
        part = fn()
    except Exception as exc:  # one broken part must not hide the others' tables
        title = (fn.__doc__ or fn.__name__).strip().splitlines()[0]
        part = Part(title, ("error",), [(f"{type(exc).__name__}: {exc}",)])
        part.exact = False
    verdict = "ok" if part.exact else "FAILED"
    say(f"{part.title}: {verdict} ({time.monotonic() - start:.1f}s)")
    print(part.table(), flush=True)
    return part


def part_a_build() -> Part:
    """(a) the DDTree kernel built through SGLang's real load_jit"""
    from sglang.kernels.jit.utils.compile import toolchain

    major, minor = torch.cuda.get_device_capability()
    start = time.monotonic()
    module = ddtree_kernel.load_module()
    seconds = time.monotonic() - start
    loaded = hasattr(module, "build_ddtree")
    header = ("GPU", "arch", "CUDA home", "build+load s", "build_ddtree")
    arch = f"sm_{major}{minor}"
    row = (torch.cuda.get_device_name(), arch, toolchain.cuda_home(), f"{seconds:.1f}", loaded)
    return Part("(a) DDTree kernel through load_jit", header, [row], exact=loaded)


def draft(gen: torch.Generator, bs: int, depth: int, topk: int, budget: int):
    """(log_probs, token_ids, roots, prefix_lens, budget) on CPU; ties in half the batches."""
    shape = (bs, depth, topk)
    if torch.rand(1, generator=gen) < 0.5:
        lp = -torch.randint(0, 5, shape, generator=gen).float() * math.log(2.0)
    else:
        lp = torch.log(torch.rand(shape, generator=gen) * 0.999 + 1e-6)
    lp = torch.sort(lp, dim=-1, descending=True).values
    rows = [torch.randperm(50_000, generator=gen)[:topk] for _ in range(bs * depth)]
    roots = torch.randint(0, 50_000, (bs,), generator=gen)
    prefix = torch.randint(0, 64, (bs,), generator=gen)  # 0 included: no prefix at all
    return lp, torch.stack(rows).view(shape), roots, prefix, budget


def large_draft(gen: torch.Generator, budget: int):
    """Depth 16, budgets 256-1024: wide enough that the budget binds."""
    bs = int(torch.randint(1, 5, (1,), generator=gen))
    topk = int(torch.randint(8, 33, (1,), generator=gen))
    return draft(gen, bs, 16, topk, budget)


def kernel_outputs(lp, ids, roots, prefix, budget) -> dict:
    tree, verify = ddtree_kernel.build_tree_and_verify_cuda(
        lp.cuda(),
        ids.cuda(),
        budget,
        roots.cuda(),
        prefix.cuda(),
    )
    tensors = {n: getattr(tree, n) for n in gpu_check.TREE}
    return {**tensors, **{n: getattr(verify, n) for n in gpu_check.VERIFY}}


def compare_batch(batch) -> str | None:
    """First difference of the kernel (and the CUDA dispatch) from the CPU reference, or None."""
    want = gpu_check.reference(MODS, *batch)
    diff = gpu_check.first_difference(torch, kernel_outputs(*batch), want)
    if diff is not None:
        return diff
    lp, ids, roots, _, budget = batch
    dispatched = ddtree_batched.build_ddtree_batched(lp.cuda(), ids.cuda(), budget, roots.cuda())
    got = {n: getattr(dispatched, n) for n in gpu_check.TREE}
    return gpu_check.first_difference(torch, got, {n: want[n] for n in gpu_check.TREE})


def exactness_row(kind: str, batches: list) -> tuple:
    start = time.monotonic()
    diffs = [(i, d) for i, b in enumerate(batches) if (d := compare_batch(b)) is not None]
    budgets = sorted({b[4] for b in batches})
    depth = max(b[0].shape[1] for b in batches)
    first = f"batch {diffs[0][0]}: {diffs[0][1][:160]}" if diffs else "-"
    span = f"{budgets[0]}-{budgets[-1]}"
    return (kind, len(batches), span, depth, len(diffs), f"{time.monotonic() - start:.1f}", first)


def part_b_exactness(random_batches: int = 240, per_large_budget: int = 15) -> Part:
    """(b) kernel == CPU reference, exact, on random batches"""
    gen = torch.Generator().manual_seed(20260101)
    small = [gpu_check.random_batch(torch, gen, large=i % 10 == 0) for i in range(random_batches)]
    large = [large_draft(gen, b) for b in (256, 512, 768, 1024) for _ in range(per_large_budget)]
    rows = [exactness_row("random (gpu_check)", small), exactness_row("budget 256-1024", large)]
    header = ("batches", "count", "budgets", "max depth", "mismatches", "s", "first mismatch")
    return Part("(b) kernel vs CPU reference", header, rows, exact=all(r[4] == 0 for r in rows))


def torch_tree_and_verify(lp, ids, budget, roots, prefix, prefix_sum):
    """The torch path of the same step: batched builder, retrieve, positions, FULL_MASK."""
    tree = ddtree_batched._build_torch(lp, ids, budget, roots)
    ddtree_retrieve.compile_ddtree_retrieve(tree.parents, validate=False)
    ddtree_retrieve.ddtree_positions(tree.depths, prefix)
    return ddtree_retrieve.ddtree_full_mask(tree.parents, prefix, prefix_sum, False)


def timing_row(bs: int, budget: int, prefix_len: int) -> tuple:
    topk = ddtree_utils.resolve_tree_topk(budget, None, KIMI_VOCAB)
    gen = torch.Generator().manual_seed(bs + budget)
    lp, ids, roots, _, _ = draft(gen, bs, BLOCK - 1, topk, budget)
    lp, ids, roots = lp.cuda(), ids.cuda(), roots.cuda()
    prefix = torch.full((bs,), prefix_len, dtype=torch.int64, device="cuda")
    total = bs * prefix_len
    kernel = lambda: ddtree_kernel.build_tree_and_verify_cuda(
        lp,
        ids,
        budget,
        roots,
        prefix,
        prefix_lens_sum=total,
    )
    torch_path = lambda: torch_tree_and_verify(lp, ids, budget, roots, prefix, total)
    torch_us = gpu_check.timed(torch, torch_path, 10)
    kernel_us = gpu_check.timed(torch, kernel, 10)
    speedup = f"{torch_us / kernel_us:.1f}x"
    return (bs, budget, topk, prefix_len, f"{torch_us:.1f}", f"{kernel_us:.1f}", speedup)


def part_c_timing() -> Part:
    """(c) tree build + mask + retrieve: kernel vs torch batched builder on this GPU"""
    header = ("bs", "budget", "K", "prefix", "torch us", "kernel us", "speedup")
    grid = itertools.product((1, 48), (64, 128, 512), (4096, 32768))
    rows = [timing_row(bs, budget, prefix) for bs, budget, prefix in grid]
    return Part(f"(c) tree + mask + retrieve, depth {BLOCK - 1}", header, rows)


@dataclass
class AttentionCase:
    """One extend (verify) batch in SGLang's Triton layout; masks are FULL_MASK bool."""

    q: torch.Tensor  # [bs * N, H, Dk] bf16
    k: torch.Tensor  # [bs * N, Hkv, Dk]
    v: torch.Tensor  # [bs * N, Hkv, Dv]
    k_buffer: torch.Tensor  # [pool, Hkv, Dk]: prefix keys, scattered
    v_buffer: torch.Tensor  # [pool, Hkv, Dv]
    qo_indptr: torch.Tensor  # int32 [bs + 1]
    kv_indptr: torch.Tensor  # int32 [bs + 1]
    kv_indices: torch.Tensor  # int32 [sum prefix]
    mask_indptr: torch.Tensor  # int64 [bs + 1]
    n: int


def tree_mask(gen, prefix: torch.Tensor, budget: int) -> torch.Tensor:
    lp, ids, roots, _, _ = draft(gen, prefix.shape[0], BLOCK - 1, 8, budget)
    return kernel_outputs(lp, ids, roots, prefix, budget)["tree_mask"]


def tree_masks(gen, prefix: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two kernel-built FULL_MASKs of the same size (same prefixes, different trees)."""
    mask_a = tree_mask(gen, prefix, budget)
    for _ in range(10):  # tie-heavy drafts can repeat a tree shape; draw until it differs
        mask_b = tree_mask(gen, prefix, budget)
        if not torch.equal(mask_a, mask_b):
            break
    return mask_a, mask_b


def attention_case(gen, prefix: torch.Tensor, n: int, heads: tuple, dims: tuple) -> AttentionCase:
    """prefix int64 [bs] on CPU; gen a CPU or CUDA generator (CUDA: the large KV pools draw fast)."""
    return AttentionCase(**extend_inputs(gen, prefix, n, heads, dims), **prefix_inputs(gen, prefix, heads[1], dims))


def bf16_randn(gen, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device).to("cuda", torch.bfloat16)


def extend_inputs(gen, prefix: torch.Tensor, n: int, heads: tuple, dims: tuple) -> dict:
    """The N verify tokens per request: q, k, v, qo_indptr, mask_indptr (see AttentionCase)."""
    (h, hkv), (dk, dv), bs = heads, dims, prefix.shape[0]
    zero = torch.zeros(1, dtype=torch.int64)
    return dict(
        q=bf16_randn(gen, bs * n, h, dk),
        k=bf16_randn(gen, bs * n, hkv, dk),
        v=bf16_randn(gen, bs * n, hkv, dv),
        qo_indptr=(torch.arange(bs + 1) * n).to("cuda", torch.int32),
        mask_indptr=torch.cat([zero, (n * (prefix + n)).cumsum(0)]).to("cuda", torch.int64),
        n=n,
    )


def prefix_inputs(gen, prefix: torch.Tensor, hkv: int, dims: tuple) -> dict:
    """The prefix KV, scattered over a pool: k_buffer, v_buffer, kv_indptr, kv_indices."""
    (dk, dv), total = dims, int(prefix.sum())
    pool = total + 64
    zero = torch.zeros(1, dtype=torch.int64)
    return dict(
        k_buffer=bf16_randn(gen, pool, hkv, dk),
        v_buffer=bf16_randn(gen, pool, hkv, dv),
        kv_indptr=torch.cat([zero, prefix.cumsum(0)]).to("cuda", torch.int32),
        kv_indices=torch.randperm(pool, generator=gen, device=gen.device)[:total].to("cuda", torch.int32),
    )


def output_buffer(case: AttentionCase) -> torch.Tensor:
    """o_extend [bs * N, H, Dv] bf16, contiguous."""
    shape = (case.q.shape[0], case.q.shape[1], case.v.shape[-1])
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda")


def triton_attention(
    case: AttentionCase, mask: torch.Tensor | None, out: torch.Tensor, target_verify: bool = False
) -> None:
    """out [bs * N, H, Dv] = SGLang's extend attention over the case, reading mask (None: no custom mask).

    target_verify=False (part d): no causal bound and every mask column read, so the whole mask is checked.
    target_verify=True: the flags SGLang's TritonAttnBackend passes on TARGET_VERIFY: is_causal=True and
    the kernel's default skip_prefix_custom_mask=True (the mask's prefix columns are not read).
    """
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    extend_attention_fwd(
        case.q, case.k, case.v, out, case.k_buffer, case.v_buffer,
        case.qo_indptr, case.kv_indptr, case.kv_indices, mask, target_verify, case.mask_indptr,
        case.n, 1.0, 1.0, skip_prefix_custom_mask=target_verify,
    )  # fmt: skip


def dense_reference(case: AttentionCase, mask: torch.Tensor) -> torch.Tensor:
    """float32 softmax(q k^T * scale, masked) v per request, from the same tensors."""
    outs, bs = [], case.qo_indptr.shape[0] - 1
    group = case.q.shape[1] // case.k.shape[1]
    for b in range(bs):
        rows = slice(b * case.n, (b + 1) * case.n)
        idx = case.kv_indices[case.kv_indptr[b] : case.kv_indptr[b + 1]].long()
        k = torch.cat([case.k_buffer[idx], case.k[rows]]).float().repeat_interleave(group, 1)
        v = torch.cat([case.v_buffer[idx], case.v[rows]]).float().repeat_interleave(group, 1)
        scores = torch.einsum("nhd,shd->hns", case.q[rows].float(), k) / math.sqrt(case.q.shape[-1])
        block = mask[case.mask_indptr[b] : case.mask_indptr[b + 1]].view(case.n, -1)
        scores = scores.masked_fill(~block[None], float("-inf"))
        outs.append(torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), v))
    return torch.cat(outs)


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    got = got.float()
    close = torch.isclose(got, want, atol=ATOL, rtol=RTOL)
    return float((got - want).abs().max()), bool(close.all())


def graph_replay(case: AttentionCase, mask_a, mask_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Capture with mask A in a static buffer, copy mask B in, replay: (graph out, eager out B)."""
    static_mask, out = mask_a.clone(), output_buffer(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_attention(case, static_mask, out)  # warm up (Triton compiles) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention(case, static_mask, out)
    static_mask.copy_(mask_b)
    graph.replay()
    eager = torch.empty_like(out)
    triton_attention(case, mask_b, eager)
    torch.cuda.synchronize()
    return out.clone(), eager


def attention_rows(name: str, heads, dims) -> list[tuple]:
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(16, 700, (4,), generator=gen)
    budget = 64
    mask_a, mask_b = tree_masks(gen, prefix, budget)
    case = attention_case(gen, prefix, budget + 1, heads, dims)
    eager = output_buffer(case)
    triton_attention(case, mask_a, eager)
    err_a, ok_a = max_error(eager, dense_reference(case, mask_a))
    graph, eager_b = graph_replay(case, mask_a, mask_b)
    err_b, ok_b = max_error(graph, dense_reference(case, mask_b))
    same = bool(torch.equal(graph, eager_b))
    moved = not torch.equal(graph, eager)  # the copied mask was read by the replay
    shape = f"H{heads[0]}/{heads[1]} D{dims[0]}/{dims[1]}"
    return [
        (name, shape, "eager, mask A", f"{err_a:.2e}", ok_a, "-"),
        (name, shape, "graph replay, mask B copied in", f"{err_b:.2e}", ok_b and moved, same),
    ]


def part_d_attention() -> Part:
    """(d) SGLang's Triton extend_attention_fwd with the kernel's mask vs dense torch"""
    rows = [
        *attention_rows("MHA-GQA", (32, 8), (128, 128)),
        *attention_rows("MLA", (16, 1), (576, 512)),
    ]
    header = ("attention", "shape", "run", "max |err|", f"within {ATOL}", "graph == eager")
    exact = all(r[4] is True and r[5] in (True, "-") for r in rows)
    return Part("(d) Triton tree attention (4 requests, budget 64, bf16)", header, rows, exact)


def kimi_head(max_bs: int = 48) -> ddtree_head.DDTreeDraftHead:
    gen = torch.Generator(device="cuda").manual_seed(5)
    shape = (KIMI_VOCAB, KIMI_HIDDEN)
    weight = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    return ddtree_head.DDTreeDraftHead(
        weight=weight * 0.02, block_size=BLOCK, topk=8, num_org=KIMI_VOCAB, max_bs=max_bs
    )


def hidden_states(bs: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(bs)
    return torch.randn(bs * BLOCK, KIMI_HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)


def head_matches_stable_sort(head, hidden: torch.Tensor) -> bool:
    """The head's top-8 ids equal a full stable descending sort of the same logits."""
    rows = hidden.view(-1, BLOCK, KIMI_HIDDEN)[:, 1:].reshape(-1, KIMI_HIDDEN)
    logits = torch.matmul(rows, head.weight[: head.num_org].T)
    want = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :8]
    return bool(torch.equal(head.token_ids[: rows.shape[0]], want))


def part_e_head() -> Part:
    """(e) top-K draft head at Kimi's vocabulary, K = 8"""
    head, rows = kimi_head(), []
    for bs in (1, 48):
        hidden = hidden_states(bs)
        us = gpu_check.timed(torch, lambda h=hidden: head(h), 20)
        rows.append((bs, KIMI_VOCAB, 8, f"{us:.1f}", head_matches_stable_sort(head, hidden)))
    header = ("bs", "vocab", "K", "head us", "ids == stable sort")
    return Part("(e) draft head (matmul + top-K)", header, rows, exact=all(r[4] for r in rows))


def peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def light_sampling(step, logits: torch.Tensor, width: int) -> None:
    """The worker's memory-light path: chunked probabilities, one sample per slot, the walk."""
    rows, total = ddtree_worker.light_chunk_rows(width, KIMI_VOCAB), logits.shape[0]
    samples = torch.empty((total,), dtype=torch.int64, device="cuda")
    for start in range(0, total, rows):
        chunk = slice(start, min(start + rows, total))
        samples[chunk] = ddtree_step.sample_per_slot(torch.softmax(logits[chunk], -1))
    ddtree_step.accept_by_target_samples(step, samples.view(-1, width), BLOCK)


def part_f_memory(bs: int = 48, budget: int = 64) -> Part:
    """(f) torch.cuda.max_memory_allocated: the head and both sampling paths"""
    head, hidden, width = kimi_head(bs), hidden_states(bs), budget + 1
    head_mib = peak_mib(lambda: head(hidden))
    lp = head.log_probs[: bs * (BLOCK - 1)].view(bs, BLOCK - 1, 8)
    ids = head.token_ids[: bs * (BLOCK - 1)].view(bs, BLOCK - 1, 8)
    roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    prefix = torch.full((bs,), 4096, dtype=torch.int64, device="cuda")
    step = ddtree_step.build_verify_step(lp, ids, roots, prefix, budget, width, bs * 4096)
    logits = torch.randn(bs * width, KIMI_VOCAB, device="cuda")
    probs = lambda: torch.softmax(logits.view(bs, width, -1), -1)
    dense = lambda: ddtree_step.accept_sampling(step, probs(), BLOCK)
    dense_mib = peak_mib(dense)
    light_mib = peak_mib(lambda: light_sampling(step, logits, width))
    logits_mib = logits.numel() * 4 / 2**20
    chunk = ddtree_worker.light_chunk_rows(width, KIMI_VOCAB)
    dense_what = f"probs [bs, W={width}, V]; logits {logits_mib:.0f} MiB"
    rows = [
        ("draft head", f"{head_mib:.0f}", f"bs {bs} x {BLOCK - 1} rows, V {KIMI_VOCAB}"),
        ("dense sampling", f"{dense_mib:.0f}", dense_what),
        ("memory-light sampling", f"{light_mib:.0f}", f"{chunk} verify rows per chunk"),
    ]
    return Part(f"(f) peak memory above the inputs, bs {bs}", ("path", "MiB", "what"), rows)


@dataclass(frozen=True)
class VerifyShape:
    """One verify launch: bs requests with prefix cached tokens each, verifying width tokens each."""

    bs: int
    prefix: int
    width: int
    tree: bool  # True: DDTree with its FULL_MASK; False: linear DFlash's causal block, no mask

    @property
    def kind(self) -> str:
        return f"DDTree B={self.width - 1}" if self.tree else "linear DFlash"

    @property
    def mask_bytes(self) -> int:
        """FULL_MASK bytes the DDTree kernel writes per step: bool, bs * W * (prefix + W); linear none."""
        return self.bs * self.width * (self.prefix + self.width) if self.tree else 0


@dataclass
class VerifyTiming:
    shape: VerifyShape
    us: float | None  # None: the row did not run, why says so
    why: str = ""
    failed: bool = False  # it raised (not merely out of memory)


def verify_shapes(bs: int, prefix: int) -> list[VerifyShape]:
    linear = VerifyShape(bs, prefix, BLOCK, tree=False)
    return [linear, *(VerifyShape(bs, prefix, width, tree=True) for width in TREE_WIDTHS)]


def latent_kv(case: AttentionCase) -> AttentionCase:
    """MLA as SGLang caches it: V is a view of the latent K's first Dv columns (one buffer)."""
    dv = case.v.shape[-1]
    return replace(case, v=case.k[..., :dv].contiguous(), v_buffer=case.k_buffer[..., :dv])


def tree_verify_mask(shape: VerifyShape, prefix_lens: torch.Tensor) -> torch.Tensor:
    """The row's FULL_MASK from the DDTree kernel, bool [bs * W * (prefix + W)] (depth 15, K = 8)."""
    gen = torch.Generator().manual_seed(shape.bs + shape.width)
    mask = tree_mask(gen, prefix_lens, shape.width - 1)
    if mask.dtype != torch.bool or mask.numel() != shape.mask_bytes:
        raise ValueError(f"expected a bool FULL_MASK of {shape.mask_bytes} elements, got {mask.dtype} x {mask.numel()}")
    return mask


def time_verify(prefix_case: AttentionCase, gen, shape: VerifyShape, prefix_lens: torch.Tensor) -> float:
    """Microseconds per extend_attention_fwd call (one layer) for the shape, on the shared prefix KV."""
    extend = extend_inputs(gen, prefix_lens, shape.width, KIMI_MLA_HEADS, KIMI_MLA_DIMS)
    case = latent_kv(replace(prefix_case, **extend))
    mask = tree_verify_mask(shape, prefix_lens) if shape.tree else None
    out = output_buffer(case)
    call = lambda: triton_attention(case, mask, out, target_verify=True)
    return statistics.median(gpu_check.timed(torch, call, TIMING_ITERS) for _ in range(TIMING_REPEATS))


def verify_timing(prefix_case: AttentionCase, gen, shape: VerifyShape, prefix_lens: torch.Tensor) -> VerifyTiming:
    """One row; a row that does not fit or fails says so, and the next row still runs."""
    try:
        return VerifyTiming(shape, time_verify(prefix_case, gen, shape, prefix_lens))
    except torch.cuda.OutOfMemoryError:
        return VerifyTiming(shape, None, "does not fit in GPU memory")
    except Exception as exc:  # one broken row must not hide the others
        return VerifyTiming(shape, None, f"{type(exc).__name__}: {exc}"[:160], failed=True)


def verify_group(bs: int, prefix: int) -> list[VerifyTiming]:
    """Linear DFlash, then every tree width, on one prefix KV (same lengths, same cache), then freed."""
    shapes = verify_shapes(bs, prefix)
    prefix_lens = torch.full((bs,), prefix, dtype=torch.int64)
    gen = torch.Generator(device="cuda").manual_seed(bs * 100_000 + prefix)
    try:
        prefix_case = latent_kv(attention_case(gen, prefix_lens, BLOCK, KIMI_MLA_HEADS, KIMI_MLA_DIMS))
    except torch.cuda.OutOfMemoryError:
        return [VerifyTiming(shape, None, "prefix KV does not fit in GPU memory") for shape in shapes]
    timings = [verify_timing(prefix_case, gen, shape, prefix_lens) for shape in shapes]
    del prefix_case
    torch.cuda.empty_cache()
    return timings


def verify_row(timing: VerifyTiming, linear_us: float | None) -> tuple:
    shape, us = timing.shape, timing.us
    ratio = f"{us / linear_us:.2f}x" if us is not None and linear_us else "-"
    us_cell = f"{us:.1f}" if us is not None else timing.why
    return (shape.kind, shape.width, shape.bs, shape.prefix, us_cell, ratio, f"{shape.mask_bytes:,}")


def verify_rows(timings: list[VerifyTiming]) -> list[tuple]:
    """Each row against linear DFlash's row at the same bs and prefix."""
    linear = {(t.shape.bs, t.shape.prefix): t.us for t in timings if not t.shape.tree}
    return [verify_row(t, linear[t.shape.bs, t.shape.prefix]) for t in timings]


def part_g_verify_width() -> Part:
    """(g) verify attention width: Kimi MLA under attention DP, DDTree widths vs linear DFlash

    Decides which DDTree budgets pay for their verify attention on this GPU (B300, RTX PRO 6000)
    when Kimi K2.6 runs attention DP (EP8 topologies: attention TP 1, so all 64 query heads and
    the one latent KV head on each GPU). Per row, SGLang's Triton extend_attention_fwd called as
    its TritonAttnBackend calls it on TARGET_VERIFY (one layer; a step runs it once per layer):
    linear DFlash verifies its block of BLOCK tokens causally without a custom mask; DDTree
    verifies W = budget + 1 tokens through the kernel-built FULL_MASK. "vs linear" divides by
    linear DFlash's time at the same bs and prefix; "mask bytes/step" is the bool FULL_MASK the
    DDTree kernel writes once per step (bs * W * (prefix + W)). A row that does not fit in GPU
    memory says so; a row that raises fails the part, the other rows still run.
    """
    grid = itertools.product(VERIFY_BATCHES, VERIFY_PREFIXES)
    timings = [timing for bs, prefix in grid for timing in verify_group(bs, prefix)]
    mla = f"H {KIMI_MLA_HEADS[0]}/{KIMI_MLA_HEADS[1]}, D {KIMI_MLA_DIMS[0]}/{KIMI_MLA_DIMS[1]}, bf16"
    title = (
        f"(g) verify attention per layer, Kimi K2 MLA under attention DP ({mla}): "
        f"linear DFlash W = {BLOCK} causal (dflash_block_size {BLOCK}) vs DDTree W = budget + 1 with its "
        f"bool FULL_MASK; us = median of {TIMING_REPEATS} x mean of {TIMING_ITERS} calls"
    )
    header = ("verify", "W", "bs", "prefix", "us", "vs linear", "mask bytes/step")
    return Part(title, header, verify_rows(timings), exact=not any(t.failed for t in timings))


PARTS = (
    part_a_build,
    part_b_exactness,
    part_c_timing,
    part_d_attention,
    part_e_head,
    part_f_memory,
    part_g_verify_width,
)
