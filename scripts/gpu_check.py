#!/usr/bin/env python3
"""GPU check of the DDTree overlay on a CUDA machine (a few minutes; the timing table last).

    python scripts/gpu_check.py --sglang-root /opt/sglang [--batches 2000] [--sampling-trials 300]

Against a patched SGLang checkout (--sglang-root, else $DDTREE_SGLANG_ROOT, else the installed
sglang) it
  1. builds the DDTree CUDA kernel through SGLang's load_jit for this GPU,
  2. compares the kernel with the CPU reference (ddtree_batched builder + ddtree_retrieve
     retrieve arrays, positions and FULL_MASK) on thousands of random batches: exact equality
     of every tensor, ties and padding included, also through build_ddtree_batched's dispatch,
  3. runs the sampling verify (and the greedy one) through SGLang's real kernel and through the
     torch twin with the same coins: exact equality of predicts / accept_index / accept_token_num,
  4. prints a timing table: torch batched builder on the GPU vs the kernel,
     bs in {1, 16, 64} x budget in {16, 64, 256},
  5. checks (h)-(j) of scripts/gpu_bundle/targets.py: the DeepEP dispatch cap as SGLang parses
     it, the sampling target vs flashinfer's renorm kernels, its cost vs linear DFlash's verify
     target at R = 48 x 129, V = 163,840 (PASS / FAIL / SKIPPED (reason) each; --skip-targets),
  6. with --serve, serves the overlay's tiny models in real SGLang servers on this GPU:
     greedy DDTree (CUDA graphs on and off) equals plain decoding, the sampling verify runs
     SGLang's kernel, accept length and step time DDTree vs linear DFlash
     (scripts/gpu_serve_check.py; needs SGLang's runtime packages in this python).
Exit status: 0 all checks passed; 1 a check failed or could not run; 2 no GPU / no patched tree.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

TREE = ("tokens", "depths", "parents", "ranks", "node_logws")
VERIFY = ("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "tree_mask")


def fail(message: str, code: int = 1) -> None:
    print(f"gpu_check: {message}", file=sys.stderr)
    sys.exit(code)


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def import_overlay(root: str | None):
    """The patched tree's DDTree modules (SGLang itself must import: the JIT loader needs it)."""
    if root:
        sys.path.insert(0, str(Path(root).resolve() / "python"))
    try:
        from sglang.srt.speculative import ddtree_batched, ddtree_kernel, ddtree_retrieve, ddtree_verify
    except ImportError as exc:
        fail(f"cannot import the DDTree overlay ({exc}); pass --sglang-root <patched SGLang checkout>", 2)
    return ddtree_batched, ddtree_kernel, ddtree_retrieve, ddtree_verify


def random_batch(torch, gen, large: bool):
    """(log_probs [bs, L, K] float32, token_ids, root_tokens, prefix_lens, budget); ties on half."""
    ri = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    bs, depth, topk = ri(1, 9), ri(1, 17 if large else 7), ri(1, 33 if large else 7)
    budget = ri(0, 300 if large else 40)
    if torch.rand(1, generator=gen) < 0.5:
        lp = -torch.randint(0, 5, (bs, depth, topk), generator=gen).float() * math.log(2.0)
    else:
        lp = torch.log(torch.rand(bs, depth, topk, generator=gen) * 0.999 + 1e-6)
    lp = torch.sort(lp, dim=-1, descending=True).values
    ids = torch.stack([torch.randperm(50000, generator=gen)[:topk] for _ in range(bs * depth)]).view(bs, depth, topk)
    return lp, ids, torch.randint(0, 50000, (bs,), generator=gen), torch.randint(0, 64, (bs,), generator=gen), budget


def reference(mods, lp, ids, roots, prefix, budget) -> dict:
    batched, _, retrieve_mod, _ = mods
    tree = batched.build_ddtree_batched(lp, ids, budget, roots)  # CPU inputs: the torch path
    retrieve = retrieve_mod.compile_ddtree_retrieve(tree.parents)
    out = {name: getattr(tree, name) for name in TREE}
    out.update(positions=retrieve_mod.ddtree_positions(tree.depths, prefix), retrieve_index=retrieve.retrieve_index,
               retrieve_next_token=retrieve.retrieve_next_token, retrieve_next_sibling=retrieve.retrieve_next_sibling,
               tree_mask=retrieve_mod.ddtree_full_mask(tree.parents, prefix))
    return out


def first_difference(torch, got: dict, want: dict) -> str | None:
    for name, expected in want.items():
        actual = got[name].cpu()
        if actual.dtype != expected.dtype or actual.shape != expected.shape or not torch.equal(actual, expected):
            return f"{name}: got {actual.dtype} {tuple(actual.shape)} {actual.flatten()[:40].tolist()} want " \
                   f"{expected.dtype} {tuple(expected.shape)} {expected.flatten()[:40].tolist()}"
    return None


def check_exactness(torch, mods, batches: int) -> None:
    batched, kernel, _, _ = mods
    gen = torch.Generator().manual_seed(20260101)
    start = time.monotonic()
    for trial in range(batches):
        lp, ids, roots, prefix, budget = batch = random_batch(torch, gen, large=trial % 10 == 0)
        tree, verify = kernel.build_tree_and_verify_cuda(lp.cuda(), ids.cuda(), budget, roots.cuda(), prefix.cuda())
        got = {**{n: getattr(tree, n) for n in TREE}, **{n: getattr(verify, n) for n in VERIFY}}
        want = reference(mods, *batch)
        diff = first_difference(torch, got, want)
        if diff is None:
            dispatched = batched.build_ddtree_batched(lp.cuda(), ids.cuda(), budget, roots.cuda())
            diff = first_difference(torch, {n: getattr(dispatched, n) for n in TREE}, {n: want[n] for n in TREE})
        if diff:
            fail(f"kernel != CPU reference on batch {trial} (shape {tuple(lp.shape)}, budget {budget}): {diff}")
    log(f"exactness: kernel == CPU reference on {batches} random batches ({time.monotonic() - start:.1f}s)")


def verify_case(torch, mods, gen, vocab: int):
    """A kernel-built tree plus target probs that favour the drafted children (so paths get accepted)."""
    _, kernel, retrieve_mod, _ = mods
    lp, ids, roots, prefix, budget = random_batch(torch, gen, large=False)
    ids, roots = ids % vocab, roots % vocab
    # Distinct sibling tokens after the modulo: re-draw each depth row from a permutation.
    ids = torch.stack([torch.randperm(vocab, generator=gen)[: ids.shape[2]] for _ in range(ids.shape[0] * ids.shape[1])]
                      ).view(ids.shape)
    tree, verify = kernel.build_tree_and_verify_cuda(lp.cuda(), ids.cuda(), budget, roots.cuda(), prefix.cuda())
    candidates = tree.tokens.clamp(min=0)
    retrieve = retrieve_mod.DDTreeRetrieve(verify.retrieve_index, verify.retrieve_next_token,
                                           verify.retrieve_next_sibling)
    bs, n = candidates.shape
    logits = torch.randn(bs, n, vocab, generator=gen).cuda() * 2
    child = verify.retrieve_next_token.clamp(min=0)
    child_tok = candidates.gather(1, child)
    boost = torch.where(verify.retrieve_next_token >= 0, 9.0, 0.0).float()
    logits.scatter_add_(2, child_tok[:, :, None], boost[:, :, None])
    return candidates, retrieve, torch.softmax(logits, dim=-1), lp.shape[1] + 1


def compare_verify(torch, kind: str, trial: int, kernel_result, torch_result) -> None:
    for name in ("predicts", "accept_index", "accept_token_num"):
        got, want = getattr(kernel_result, name), getattr(torch_result, name)
        if not torch.equal(got, want):
            fail(f"{kind} verify: SGLang kernel != torch twin on trial {trial}, {name}: {got.tolist()} vs {want.tolist()}")


def check_verify(torch, mods, trials: int, vocab: int = 1000) -> bool:
    """Greedy always; sampling where SGLang's sampling kernel can be built (flashinfer headers)."""
    import importlib.util

    _, _, _, verify_mod = mods
    sampling = importlib.util.find_spec("flashinfer") is not None and verify_mod._sglang_kernel("sampling") is not None
    if not sampling:
        log("verify: sampling comparison SKIPPED: flashinfer (needed by SGLang's sampling kernel) is not installed")
    gen = torch.Generator().manual_seed(7)
    start, accepted = time.monotonic(), 0
    for trial in range(trials):
        candidates, retrieve, probs, spec = verify_case(torch, mods, gen, vocab)
        bs, n = candidates.shape
        coins = torch.rand(bs, n, generator=gen).cuda()
        final = torch.rand(bs, generator=gen).cuda()
        greedy = [verify_mod.ddtree_verify_greedy(candidates, retrieve, probs.argmax(dim=-1), spec, use_kernel=k)
                  for k in (True, False)]
        compare_verify(torch, "greedy", trial, *greedy)
        if sampling:
            runs = [verify_mod.ddtree_verify_sampling(candidates, retrieve, probs, coins, final, spec,
                                                      draft_probs=torch.zeros_like(probs), use_kernel=k)
                    for k in (True, False)]
            compare_verify(torch, "sampling", trial, *runs)
            accepted += int(runs[0].accept_token_num.sum())
    kinds = "sampling and greedy" if sampling else "greedy"
    log(f"verify: {kinds}, SGLang kernel == torch twin on {trials} trials "
        f"({accepted} draft tokens accepted by sampling, {time.monotonic() - start:.1f}s)")
    return sampling


def timed(torch, fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1000.0  # microseconds


def timing_table(torch, mods) -> str:
    batched, kernel, _, _ = mods
    depth = 16  # DFlash block size
    rows = []
    for bs in (1, 16, 64):
        for budget in (16, 64, 256):
            topk = min(budget, 32)
            lp = torch.sort(torch.log_softmax(torch.randn(bs, depth, topk, device="cuda"), -1), -1, descending=True).values
            ids = torch.randint(0, 160000, (bs, depth, topk), device="cuda")
            roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
            torch_us = timed(torch, lambda: batched._build_torch(lp, ids, budget, roots))
            kernel_us = timed(torch, lambda: kernel.build_tree_cuda(lp, ids, budget, roots))
            rows.append((bs, budget, topk, torch_us, kernel_us))
    lines = [f"{'bs':>4} {'budget':>6} {'L':>3} {'K':>3} {'torch GPU us':>13} {'kernel us':>10} {'speedup':>8}"]
    for bs, budget, topk, t_us, k_us in rows:
        lines.append(f"{bs:>4} {budget:>6} {depth:>3} {topk:>3} {t_us:>13.1f} {k_us:>10.1f} {t_us / k_us:>7.1f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-root", default=os.environ.get("DDTREE_SGLANG_ROOT"),
                        help="patched SGLang checkout (its python/ is imported)")
    parser.add_argument("--batches", type=int, default=2000, help="random batches for the exactness check")
    parser.add_argument("--sampling-trials", type=int, default=300, help="verify trials (kernel vs torch)")
    parser.add_argument("--serve", action="store_true",
                        help="also serve tiny models with DDTree in a real SGLang server (gpu_serve_check.py)")
    parser.add_argument("--serve-logs", type=Path, default=Path("gpu-serve-logs"))
    parser.add_argument("--skip-targets", action="store_true", help="skip checks (h)-(j) (targets.py)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        fail("torch is not installed", 2)
    if not torch.cuda.is_available():
        fail("no CUDA GPU here (torch.cuda.is_available() is False); run this on a GPU host, e.g. "
             "`ddeploy` a patch set, then `python scripts/gpu_check.py --sglang-root <checkout>` there", 2)
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    mods = import_overlay(args.sglang_root)
    log(f"GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    start = time.monotonic()
    mods[1].load_module()
    log(f"built/loaded the DDTree kernel in {time.monotonic() - start:.1f}s")
    check_exactness(torch, mods, args.batches)
    verified = check_verify(torch, mods, args.sampling_trials)
    print(timing_table(torch, mods))
    if not args.skip_targets:
        here = Path(__file__).resolve().parent
        sys.path.insert(0, str(here / "gpu_bundle" if (here / "gpu_bundle").is_dir() else here))
        import targets

        if not targets.run_checks(log):
            fail("a check of (h)-(j) FAILED (see above)")
    if args.serve:
        from gpu_serve_check import serving_check

        served, table = serving_check(Path(args.sglang_root), args.serve_logs, log)
        print(table)
        if not served:
            fail("the serving check failed (see above and the logs in --serve-logs)")
    if not verified:
        fail("incomplete: the sampling verify comparison did not run (see above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
