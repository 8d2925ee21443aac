"""Checks (h)-(j) of the GPU bundle: the EP dispatch cap and the sort-free sampling target.

(h) dispatch cap: with the value render sets for ep8 in the environment, SGLang 0.5.23's
    ``sglang.srt.environ`` parses SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK to the
    overlay rules' number (``ddtree_rules.dispatch_budget``), <= 1024 (the assert in
    DeepEP's dispatcher); where the dispatcher module imports, its source reads that variable
    and asserts <= 1024 (DeepEP itself, absent on a one-GPU box, is never initialised).
(i) sampling target: ``ddtree_sampling.plain_sampling_probs`` (top-k first, the flashinfer
    backend's order with min_p) keeps the set flashinfer's ``top_k_renorm_probs`` then
    ``top_p_renorm_probs`` keep (then min_p on the row maximum), except tokens tied with the
    cut or sitting on the top-p boundary within float rounding; probabilities agree within
    ATOL on rows whose sets agree.
(j) cost at R = 48 x 129 rows, V = 163,840: the overlay's target (bounded top-k and
    bisection) vs linear DFlash's ``build_speculative_verify_target_probs``; CUDA events,
    median of reps after warm-up, torch.cuda.max_memory_allocated above the logits.

Each check returns a Check with status PASS, FAIL or SKIPPED and a reason. The comparison
logic takes the kernels as arguments, so the CPU tests run it with ``stand_in_renorm`` (a
sort-based stand-in with flashinfer's interface and documented semantics) and a broken one.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import statistics
from pathlib import Path
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable, Optional

import torch

CAP_VAR = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
CAP_MAX = 1024  # DeepEP's FINISHED_SUM_TAG: deepep.py asserts num_max_dispatch_tokens_per_rank <= 1024
# What render writes for Kimi ep8 (tests/test_render_dispatch.py: "48/8 x 129 = 774").
RENDERED_EP8 = 774
KIMI_VOCAB = 163_840
COST_BS, COST_WIDTH = 48, 129  # --max-running-requests 48, W = budget 128 + 1
ATOL = 1e-5  # float32 probabilities of rows whose kept sets agree
BOUNDARY = 1e-4  # top-p boundary slack: mass above a token within this of top_p


@dataclass
class Check:
    """One check: status PASS | FAIL | SKIPPED, why, what part of it was skipped, its table."""

    title: str
    status: str = "PASS"
    reason: str = ""
    skipped: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> "Check":
        if self.status != "FAIL":
            self.status, self.reason = "FAIL", reason
        return self

    def skip(self, reason: str) -> "Check":
        """The whole check could not run here."""
        if self.status == "PASS":
            self.status, self.reason = "SKIPPED", reason
        return self

    def verdict(self) -> str:
        notes = [self.reason] if self.reason else []
        notes += [f"skipped: {why}" for why in self.skipped]
        return f"{self.status} ({'; '.join(notes)})" if notes else self.status


# ---- (h) the dispatch cap -----------------------------------------------------------------


def rules_ep8_tokens(rules) -> int:
    """The rules' DeepEP dispatch per rank for Kimi ep8: 48 requests / 8 DP ranks x W = 129."""
    launch = rules.DDTreeLaunch(
        budget=128,
        block_size=16,
        moe_a2a_backend="deepep",
        deepep_mode="auto",
        max_running_requests=None,
        attn_dp_size=8,
        tp_size=8,
        dispatch_cap=rules.dispatch_cap_of("deepep", {CAP_VAR: str(RENDERED_EP8)}),
    )
    budget = rules.dispatch_budget(launch)
    if rules.dispatch_refusal(launch) is not None:
        raise AssertionError(f"the rules refuse the rendered ep8 cap: {rules.dispatch_refusal(launch)}")
    return budget.tokens


def check_dispatch_cap(
    rules=None, environ_module=None, dispatcher_module: Optional[str] = None, dispatcher_file: Optional[Path] = None
) -> Check:
    """(h) SGLang's environ parses the rendered cap to the rules' number, <= 1024."""
    check = Check("(h) DeepEP dispatch cap as SGLang 0.5.23 reads it")
    if rules is None:
        rules = importlib.import_module("sglang.srt.speculative.ddtree_rules")
    try:
        want = rules_ep8_tokens(rules)
    except Exception as exc:
        return check.fail(f"the rules' ep8 number: {type(exc).__name__}: {exc}")
    check.lines.append(f"rules: dispatch_budget(ep8) = {want}; render sets {CAP_VAR}={RENDERED_EP8}")
    if want != RENDERED_EP8:
        return check.fail(f"the rules give {want}, render sets {RENDERED_EP8}")
    if environ_module is None:
        try:
            environ_module = importlib.import_module("sglang.srt.environ")
        except ImportError as exc:
            return check.skip(f"sglang.srt.environ does not import: {exc}")
    old = os.environ.get(CAP_VAR)
    os.environ[CAP_VAR] = str(RENDERED_EP8)
    try:
        got = getattr(environ_module.envs, CAP_VAR).get()
    finally:
        if old is None:
            os.environ.pop(CAP_VAR, None)
        else:
            os.environ[CAP_VAR] = old
    check.lines.append(f"sglang.srt.environ: envs.{CAP_VAR}.get() = {got!r}")
    if got != want or not isinstance(got, int):
        return check.fail(f"SGLang parses {CAP_VAR}={RENDERED_EP8} as {got!r}, the rules assume {want}")
    if got > CAP_MAX:
        return check.fail(f"{got} > {CAP_MAX}: DeepEP's dispatcher asserts it")
    name = dispatcher_module or "sglang.srt.layers.moe.token_dispatcher.deepep"
    source, how = dispatcher_source(name, dispatcher_file)
    if source is None:
        check.skipped.append(f"the dispatcher's own read: {how}")
        check.skipped.append("DeepEP's low-latency buffer is never built here (one GPU, no EP group)")
        return check
    reads = f"envs.{CAP_VAR}.get()" in source
    asserts = f"num_max_dispatch_tokens_per_rank <= {CAP_MAX}" in source
    check.lines.append(f"{name} ({how}): reads envs.{CAP_VAR}.get(): {reads}; asserts <= {CAP_MAX}: {asserts}")
    if not (reads and asserts):
        return check.fail(f"{name} no longer reads the cap through envs or asserts <= {CAP_MAX}")
    check.skipped.append("DeepEP's low-latency buffer is never built here (one GPU, no EP group)")
    return check


def dispatcher_source(name: str, path: Optional[Path] = None) -> tuple[Optional[str], str]:
    """The dispatcher module's source: imported, else its file under sglang.srt (the bundle
    carries it unimported: it pulls in SGLang's runtime)."""
    try:
        return inspect.getsource(importlib.import_module(name)), "imported"
    except Exception as exc:  # ImportError, or a runtime package the module pulls in
        why = f"{type(exc).__name__}: {exc}"
    if path is not None and path.is_file():
        return path.read_text(), f"source read from {path}; the module does not import: {why}"
    rel = name.split(".")[2:] if name.startswith("sglang.srt.") else []
    if not rel:  # not a module of sglang.srt: nowhere else to look
        return None, f"{name} neither imports nor is on disk ({why})"
    try:
        srt = importlib.import_module("sglang.srt")
        for root in srt.__path__:
            path = Path(root).joinpath(*rel[:-1], rel[-1] + ".py")
            if path.is_file():
                return path.read_text(), f"source read from {path}; the module does not import: {why}"
    except ImportError:
        pass
    return None, f"{name} neither imports nor is on disk ({why})"


# ---- (i) the sampling target vs flashinfer's renorm kernels ----------------------------------


def _as_rows(value, rows: int, dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1)
    return torch.full((rows,), value, dtype=dtype, device=device)


def stand_in_top_k_renorm_probs(probs: torch.Tensor, top_k) -> torch.Tensor:
    """Stand-in for flashinfer.sampling.top_k_renorm_probs(probs, top_k) (CPU tests only).

    flashinfer: keep the probabilities >= the k-th largest (its pivot: ties at the pivot are
    all kept), zero the rest, renormalise. probs float32 [B, V]; top_k int or int tensor [B].
    """
    ks = _as_rows(top_k, probs.shape[0], torch.int64, probs.device).clamp(1, probs.shape[1])
    pivot = torch.sort(probs, dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
    kept = probs * (probs >= pivot)
    return kept / kept.sum(-1, keepdim=True)


def stand_in_top_p_renorm_probs(probs: torch.Tensor, top_p) -> torch.Tensor:
    """Stand-in for flashinfer.sampling.top_p_renorm_probs(probs, top_p) (CPU tests only).

    flashinfer: keep the smallest top set whose mass reaches top_p (a pivot: ties at the
    pivot all kept), zero the rest, renormalise. top_p float or float tensor [B].
    """
    ps = _as_rows(top_p, probs.shape[0], torch.float32, probs.device)
    values = torch.sort(probs, dim=-1, descending=True).values
    before = values.cumsum(-1) - values  # mass strictly above each sorted position
    last = ((before < ps[:, None]).sum(-1) - 1).clamp(min=0)
    pivot = values.gather(1, last[:, None])
    kept = probs * (probs >= pivot)
    return kept / kept.sum(-1, keepdim=True)


STAND_IN = SimpleNamespace(
    top_k_renorm_probs=stand_in_top_k_renorm_probs, top_p_renorm_probs=stand_in_top_p_renorm_probs
)


def renorm_reference(kernels, logits, temperatures, top_ks, top_ps, min_ps) -> torch.Tensor:
    """SGLang's top-k-first filter as its sampler calls the kernels (flashinfer backend, min_p)."""
    probs = torch.softmax(logits.float() / temperatures, -1)
    probs = kernels.top_k_renorm_probs(probs, top_ks)
    probs = kernels.top_p_renorm_probs(probs, top_ps)
    # min_p_sampling_from_probs: keep p >= min_p * (row maximum), a ratio renormalising keeps.
    kept = probs * (probs >= probs.amax(-1, keepdim=True) * min_ps[:, None])
    return kept / kept.sum(-1, keepdim=True)


def sampling_rows(sampling, temperatures, top_ks, top_ps, min_ps):
    return sampling.SamplingRows(
        temperatures=temperatures,
        top_ks=top_ks,
        top_ps=top_ps,
        min_ps=min_ps,
        need_top_k=True,
        need_top_p=True,
        need_min_p=True,
    )


def compare_kept(probs, got, want, top_ks, top_ps) -> tuple[int, int, int, float, str]:
    """(rows equal, rows with allowed tie/boundary differences, bad rows, max |dp|, first bad)."""
    got_kept, want_kept = got > 0, want > 0
    differ = (got_kept != want_kept).any(-1)
    same_err = (got - want).abs()[~differ].max().item() if (~differ).any() else 0.0
    topk_probs = torch.softmax(probs.log().masked_fill(~_top_k_mask(probs, top_ks), float("-inf")), -1)
    allowed, bad, first = 0, 0, ""
    for row in differ.nonzero().flatten().tolist():
        tokens = (got_kept[row] != want_kept[row]).nonzero().flatten()
        # A tie: the token equals the smallest probability the side lacking it kept.
        cut_got, cut_want = probs[row][got_kept[row]].min(), probs[row][want_kept[row]].min()
        cut = torch.where(got_kept[row][tokens], cut_want, cut_got)
        tie = torch.isclose(probs[row][tokens], cut, rtol=1e-6, atol=0.0)
        ascending = torch.sort(topk_probs[row]).values
        upto = torch.cumsum(ascending, 0)
        below = torch.searchsorted(ascending, topk_probs[row][tokens], right=True)  # values <= p_t
        above = upto[-1] - torch.where(below > 0, upto[(below - 1).clamp(min=0)], torch.zeros_like(upto[0]))
        # On the top-p boundary: inside the top-k set, the mass above it within float rounding of top_p.
        edge = ((above - top_ps[row]).abs() <= BOUNDARY) & (topk_probs[row][tokens] > 0)
        both = got_kept[row] & want_kept[row]
        ratio = got[row][both] / want[row][both]  # renormalisation only: one constant per row
        flat = bool(both.any()) and float((ratio.max() - ratio.min()) / ratio.mean()) <= 1e-4
        if bool((tie | edge).all()) and flat:
            allowed += 1
        else:
            bad += 1
            first = (
                first
                or f"row {row}: tokens {tokens[:8].tolist()} kept by one side only, or common tokens not in proportion"
            )
    return int((~differ).sum()), allowed, bad, same_err, first


def _top_k_mask(probs, top_ks) -> torch.Tensor:
    ks = top_ks.to(torch.int64).clamp(1, probs.shape[1])
    pivot = torch.topk(probs, int(ks.max()), -1).values.gather(1, (ks - 1)[:, None])
    return probs >= pivot


def sampling_case(kind: str, rows: int, vocab: int, gen: torch.Generator, device) -> tuple:
    if kind == "tie-heavy":
        logits = torch.randint(0, 6, (rows, vocab), generator=gen).float() * 0.75
    else:
        logits = torch.randn(rows, vocab, generator=gen) * 3
    temperatures = torch.rand(rows, 1, generator=gen) * 1.2 + 0.3
    top_ks = torch.randint(1, 200, (rows,), generator=gen)
    top_ks[::5] = vocab  # some rows without top-k
    top_ps = torch.rand(rows, generator=gen) * 0.9 + 0.1
    top_ps[1::5] = 1.0
    min_ps = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.rand(rows, generator=gen) * 0.2, 0.0)
    return tuple(t.to(device) for t in (logits, temperatures, top_ks, top_ps, min_ps))


def renorm_kernels() -> tuple[Optional[SimpleNamespace], str]:
    """flashinfer.sampling's renorm kernels (what SGLang 0.5.23 calls on CUDA), else SGLang's
    Triton twin (kernels/ops/sampling/renorm_triton.py, its ROCm path, documented to match
    flashinfer's threshold semantics), loaded from its file."""
    try:
        fi = importlib.import_module("flashinfer.sampling")
        kernels = SimpleNamespace(top_k_renorm_probs=fi.top_k_renorm_probs, top_p_renorm_probs=fi.top_p_renorm_probs)
        return kernels, f"flashinfer.sampling ({fi.__file__})"
    except Exception as exc:
        why = f"flashinfer does not import ({type(exc).__name__}: {exc})"
    try:
        ops = importlib.import_module("sglang.kernels.ops")
        path = next(p for p in (Path(r) / "sampling/renorm_triton.py" for r in ops.__path__) if p.is_file())
        spec = importlib.util.spec_from_file_location("ddtree_check_renorm_triton", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:
        return None, f"{why}; SGLang's Triton renorm kernels do not load either ({type(exc).__name__}: {exc})"
    kernels = SimpleNamespace(
        top_k_renorm_probs=module.top_k_renorm_probs_triton, top_p_renorm_probs=module.top_p_renorm_probs_triton
    )
    return kernels, f"SGLang's Triton renorm kernels ({path}); {why}"


def check_sampling_target(
    kernels=None,
    sampling=None,
    device: str = "cuda",
    cases=(
        ("random", 256, 32768),
        ("tie-heavy", 256, 32768),
        ("random", 48, KIMI_VOCAB),
        ("tie-heavy", 48, KIMI_VOCAB),
    ),
) -> Check:
    """(i) the overlay's kept set and probabilities vs flashinfer's top_k/top_p renorm kernels."""
    check = Check("(i) sampling target vs flashinfer top_k_renorm_probs / top_p_renorm_probs")
    if kernels is None:
        kernels, which = renorm_kernels()
        if kernels is None:
            return check.skip(which)
        check.lines.append(f"reference: {which}")
        if not which.startswith("flashinfer"):
            check.skipped.append(
                "flashinfer itself: not installed here (the bundle does not carry it); "
                "compared with SGLang's Triton twin of its renorm kernels instead"
            )
    if sampling is None:
        sampling = importlib.import_module("sglang.srt.speculative.ddtree_sampling")
    gen = torch.Generator().manual_seed(4301)
    check.lines.append(
        "case | rows x V | overlay path | equal rows | tie/boundary rows | bad rows | max |dp| equal rows"
    )
    for kind, rows, vocab in cases:
        logits, temps, top_ks, top_ps, min_ps = sampling_case(kind, rows, vocab, gen, device)
        probs = torch.softmax(logits.float() / temps, -1)
        # The bisection (some rows without top-k), then the bounded topk path (max_top_k known).
        for path, ks, bound in (("bisection", top_ks, None), ("top-k bound", top_ks.clamp(max=199), 199)):
            want = renorm_reference(kernels, logits, temps, ks.to(torch.int32), top_ps, min_ps)
            params = replace(sampling_rows(sampling, temps, ks, top_ps, min_ps), max_top_k=bound)
            got = sampling.plain_sampling_probs(logits, params, backend="flashinfer")
            equal, allowed, bad, err, first = compare_kept(probs, got, want, ks, top_ps)
            where = f"{kind} {rows} x {vocab} ({path})"
            check.lines.append(f"{kind} | {rows} x {vocab} | {path} | {equal} | {allowed} | {bad} | {err:.2e}")
            if bad:
                check.fail(f"{where}: {first}")
            elif err > ATOL:
                check.fail(f"{where}: probabilities differ by {err:.2e} > {ATOL:g}")
    return check


# ---- (j) cost at Kimi's sizes ------------------------------------------------------------


def cuda_ms(fn: Callable[[], object], warmup: int = 2, reps: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def cost_rows(
    sampling,
    dflash_target,
    bs: int = COST_BS,
    width: int = COST_WIDTH,
    vocab: int = KIMI_VOCAB,
    device: str = "cuda",
    measure=None,
) -> list[tuple]:
    """(case, path, ms, MiB) for top-k 50 + top-p 0.9 (bounded) and top-p 0.9 alone (bisection)."""
    measure = measure or (lambda fn: (cuda_ms(fn), peak_mib(fn)))
    rows_n = bs * width
    logits = torch.randn(rows_n, vocab, device=device)
    out = []
    for case, top_k in (("top-k 50, top-p 0.9", 50), ("top-p 0.9 only", vocab)):
        info = SimpleNamespace(
            temperatures=torch.full((bs, 1), 0.7, device=device),
            top_ks=torch.full((bs,), top_k, dtype=torch.int32, device=device),
            top_ps=torch.full((bs,), 0.9, device=device),
            min_ps=torch.zeros(bs, device=device),
            need_top_k_sampling=top_k < vocab,
            need_top_p_sampling=True,
            need_min_p_sampling=False,
        )
        max_top_k = top_k if top_k < vocab else None
        params = sampling.SamplingRows.of(info, width, max_top_k=max_top_k)
        overlay = lambda p=params: sampling.plain_sampling_probs(logits, p, backend="flashinfer")  # noqa: E731
        out.append((case, "DDTree plain_sampling_probs", *measure(overlay)))
        if dflash_target is not None:
            dflash = lambda i=info, k=max_top_k: dflash_target(  # noqa: E731
                next_token_logits=logits, sampling_info=i, draft_token_num=width, bs=bs, max_top_k=k
            )
            out.append((case, "DFlash build_speculative_verify_target_probs", *measure(dflash)))
    return out


def check_sampling_cost(sampling=None, dflash_target=None, **kwargs) -> Check:
    """(j) time and peak memory of the overlay's target vs DFlash's, as a table with ratios."""
    check = Check(f"(j) sampling target cost, R = {COST_BS} x {COST_WIDTH}, V = {KIMI_VOCAB}")
    if sampling is None:
        sampling = importlib.import_module("sglang.srt.speculative.ddtree_sampling")
    why = ""
    if dflash_target is None:
        try:
            dflash_target = importlib.import_module(
                "sglang.srt.speculative.dflash_utils"
            ).build_speculative_verify_target_probs
        except Exception as exc:
            why = (
                f"sglang.srt.speculative.dflash_utils does not import here ({type(exc).__name__}: {exc}); "
                "DDTree's side timed alone"
            )
    rows = cost_rows(sampling, dflash_target, **kwargs)
    check.lines.append("case | path | ms (median) | peak MiB above logits | vs DFlash ms | vs DFlash MiB")
    for case, path, ms, mib in rows:
        ref = next((r for r in rows if r[0] == case and r[1].startswith("DFlash")), None)
        ratio = f"{ms / ref[2]:.2f}x | {mib / max(ref[3], 1e-9):.2f}x" if ref else "- | -"
        check.lines.append(f"{case} | {path} | {ms:.2f} | {mib:.0f} | {ratio}")
    return check.skip(why) if why else check


CHECKS = (check_dispatch_cap, check_sampling_target, check_sampling_cost)


def run_checks(say: Callable[[str], None], checks=CHECKS) -> bool:
    """Each check's table and its PASS/FAIL/SKIPPED line; False when one FAILed (or raised)."""
    ok = True
    for fn in checks:
        try:
            check = fn()
        except Exception as exc:
            check = Check((fn.__doc__ or fn.__name__).strip().splitlines()[0]).fail(f"{type(exc).__name__}: {exc}")
        for line in check.lines:
            print(f"  {line}", flush=True)
        say(f"{check.title}: {check.verdict()}")
        ok &= check.status != "FAIL"
    return ok
