"""The distribution SGLang's plain sampler draws from, for every verify slot.

A lossless sampling verify must test the draft tree against exactly the
distribution plain decoding would sample the next token from. SGLang 0.5.23's
``Sampler`` (``layers/sampler.py``) builds it per request as:

  probs = softmax(logits / temperature)
  joint filter (the "pytorch" backend; "flashinfer" without min_p):
      over probs sorted descending, keep rank r iff
      r < top_k  and  sum(probs of ranks < r) <= top_p  and  p >= min_p * p_max
  top-k first ("flashinfer" when the batch needs min_p: top_k_renorm_prob,
  then top_p_renorm_prob, then min_p_sampling_from_probs):
      keep r < top_k, renormalise; keep the top-p prefix of that; keep
      p >= min_p * p_max
  and draws from what is kept, renormalised.

``plain_sampling_probs`` returns that renormalised distribution. Linear
DFlash's verify target (``dflash_utils.build_speculative_verify_target_probs``)
applies top-k first and never min_p, so it is not plain decoding's distribution
for min_p or for top-k with top-p on the pytorch backend; DDTree uses this one.

Ties: the filters keep a prefix of the row sorted descending; among equal
probabilities this module ranks the lower token id first (a stable sort's
order), so the kept set is defined even when a cut falls inside a tie group.
SGLang's own sampler breaks such ties however its ``sort`` / ``topk`` happens
to; the kept probabilities are the same multiset either way.

Work and memory, never a sort over [R, V]: one softmax; then the cut of each
row (its smallest kept probability and how many tokens equal to it are kept):
when the batch bounds top-k below V (``max_top_k``, a host int) one ``topk``
[R, max_top_k] and the filters on those sorted values; otherwise a bisection
on the float32 bits of the cut, ``_BISECTION_STEPS`` (30) vectorised passes
that count / sum each row's probabilities above a per-row threshold (two
bisections for top-k-first with top-k and top-p). Then one pass builds the
kept mask (ties at the cut ranked by token id with an int32 running count)
and the row is renormalised in place. No host reads of device values.
Alive at the peak beside the logits: the probabilities, one float32 [R, V]
scratch (the bisection's 0/1 masks, then the int32 tie count) and two bool
[R, V] masks, i.e. 2.5 float32 [R, V] buffers (2 during the softmax).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

# Backends whose plain sampler switches to the top-k-first filter when the
# batch needs min_p (``Sampler._sample_from_probs``).
_TOP_K_FIRST_WITH_MIN_P = ("flashinfer", "intel_xpu")


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters of R verify rows (W rows per request).

    temperatures float32 [R, 1]; top_ks int [R]; top_ps, min_ps float32 [R];
    need_*: the batch's flags (``SamplingBatchInfo``); max_top_k: a host bound
    on every top_k of the batch, or None when unknown or no bound.
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: Optional[int] = None

    @classmethod
    def of(
        cls, sampling_info: Any, width: int, max_top_k: Optional[int] = None
    ) -> "SamplingRows":
        """Expand a ``SamplingBatchInfo`` (one row per request) to W rows each."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(t, width, dim=0)

        if max_top_k is None:
            max_top_k = getattr(sampling_info, "max_top_k", None)
        return cls(
            temperatures=rows(sampling_info.temperatures).reshape(-1, 1),
            top_ks=rows(sampling_info.top_ks),
            top_ps=rows(sampling_info.top_ps),
            min_ps=rows(sampling_info.min_ps),
            need_top_k=bool(sampling_info.need_top_k_sampling),
            need_top_p=bool(sampling_info.need_top_p_sampling),
            need_min_p=bool(sampling_info.need_min_p_sampling),
            max_top_k=max_top_k,
        )

    def select(self, rows: slice) -> "SamplingRows":
        """The parameters of verify rows ``rows`` (the batch's flags and bound)."""
        return replace(
            self,
            temperatures=self.temperatures[rows],
            top_ks=self.top_ks[rows],
            top_ps=self.top_ps[rows],
            min_ps=self.min_ps[rows],
        )


def top_k_first(backend: str, need_min_p: bool) -> bool:
    """Whether the plain sampler of ``backend`` filters top-k first (else joint)."""
    return need_min_p and backend in _TOP_K_FIRST_WITH_MIN_P


def plain_sampling_probs(
    logits: torch.Tensor, params: SamplingRows, backend: str = "pytorch"
) -> torch.Tensor:
    """float32 [R, V]: plain decoding's sampling distribution for logits [R, V].

    ``backend``: the server's ``--sampling-backend`` (its filter order, see the
    module docstring). Rows are renormalised over what the filters keep; the
    top token always survives, so no row is empty. Never sorts [R, V]: see
    "Work and memory" in the module docstring.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(logits.shape)}")
    if params.temperatures.shape != (logits.shape[0], 1):
        raise ValueError(
            f"temperatures {tuple(params.temperatures.shape)} do not match "
            f"logits {tuple(logits.shape)} (want [R, 1])"
        )
    scaled = logits.to(torch.float32) / params.temperatures
    probs = torch.softmax(scaled, dim=-1)
    del scaled
    if not (params.need_top_k or params.need_top_p or params.need_min_p):
        return probs
    vocab = probs.shape[-1]
    min_p_floor = None
    if params.need_min_p:
        min_p_floor = probs.amax(dim=-1) * params.min_ps
    if not (params.need_top_k or params.need_top_p):
        # min_p alone: a threshold on the row maximum, no ordering needed.
        return _renormalised(probs.mul_(probs >= min_p_floor[:, None]))
    order = top_k_first(backend, params.need_min_p)
    top_ks = params.top_ks.to(torch.int64).clamp(1, vocab)
    bound = vocab
    if params.need_top_k and params.max_top_k is not None:
        bound = max(1, min(int(params.max_top_k), vocab))
    # The one float32 [R, V] scratch buffer: the bisection's masks, then the
    # int32 running count of ties at the cut.
    work = torch.empty_like(probs)
    if bound < vocab:
        cut = _cut_from_top_k(probs, bound, top_ks, params, order)
    else:
        cut = _cut_by_bisection(probs, top_ks, params, order, work)
    keep = _kept(probs, cut, work.view(torch.int32))
    del work
    if min_p_floor is not None:
        keep &= probs >= min_p_floor[:, None]
    return _renormalised(probs.mul_(keep))


@dataclass(frozen=True)
class _Cut:
    """Where the top-k / top-p prefix of each row ends, in the stable order.

    value float32 [R]: the smallest kept probability (ties included);
    take int64 [R]: how many of the tokens equal to ``value`` are kept (the
    lowest token ids first, as a stable descending sort ranks them).
    """

    value: torch.Tensor
    take: torch.Tensor


def _cut_from_top_k(
    probs: torch.Tensor,
    bound: int,
    top_ks: torch.Tensor,
    params: SamplingRows,
    order: bool,
) -> _Cut:
    """The cut when every row's top_k <= ``bound`` < V: one ``topk`` [R, bound].

    Only the sorted values are used, and those do not depend on how ``topk``
    orders ties, so the kept set is the stable order's whatever ``topk`` picks.
    """
    values = torch.topk(probs, bound, dim=-1, sorted=True).values
    ranks = torch.arange(bound, device=probs.device)[None, :]
    keep = ranks < top_ks[:, None]
    if params.need_top_p:
        wide = values.to(torch.float64)
        if order:
            top = wide * keep
            top = top / top.sum(dim=-1, keepdim=True)
            before = torch.cumsum(top, dim=-1) - top
        else:
            before = torch.cumsum(wide, dim=-1) - wide
        keep &= before <= _top_p_budget(params.top_ps)[:, None]
    # The filters keep a prefix of the ranks; the top rank always.
    count = keep.sum(dim=-1).clamp(min=1)
    value = values.gather(1, (count - 1)[:, None]).squeeze(1)
    above = (values > value[:, None]).sum(dim=-1)
    return _Cut(value=value, take=count - above)


# Probabilities are in [0, 1]; float32 1.0 is 0x3F800000 < 2**30, so 30
# halvings of the bit range [-1, bits(p_max)] pin the cut to one float.
_BISECTION_STEPS = 30


def _cut_by_bisection(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    params: SamplingRows,
    order: bool,
    work: torch.Tensor,
) -> _Cut:
    """The cut without a top-k bound: bisection on the float32 bits of the cut.

    For a threshold t, G(t) / S(t) are the count / mass of a row's
    probabilities > t. The first token of the tie group of value v is kept iff
    G(v) < top_k and S(v) <= top_p (times the top-k mass when top-k goes
    first); that predicate only grows with t, so the smallest float for which
    it holds is the smallest kept value. Each step is a few vectorised passes
    over [R, V] for all rows at once; ``_BISECTION_STEPS`` steps, no host reads.
    work: float32 [R, V] scratch.
    """
    budget = None
    if params.need_top_p:
        budget = _top_p_budget(params.top_ps)
        if order and params.need_top_k:
            # Top-k first: top-p is judged on the top-k-renormalised row, i.e.
            # on the raw mass against top_p times the mass of the top k.
            no_budget = torch.full_like(budget, float("inf"))  # mass, no test
            k_cut, k_count, k_mass = _bisect(probs, top_ks, no_budget, True, work)
            k_ties = (top_ks - k_count).to(torch.float64)
            budget = budget * (k_mass + k_ties * k_cut.to(torch.float64))
    value, count, mass = _bisect(probs, top_ks, budget, params.need_top_k, work)
    # take may exceed the number of ties: then all of them are kept.
    take = top_ks - count
    if budget is not None:
        # Tie j (0-based) of the cut's group has mass before it mass + j * v.
        vocab = probs.shape[-1]
        wide = value.to(torch.float64)
        room = torch.floor((budget - mass) / wide.clamp(min=1e-300)) + 1
        room = torch.where(wide > 0, room.clamp(1, vocab), float(vocab))
        take = torch.minimum(take, room.long())
    return _Cut(value=value, take=take.clamp(min=1))


def _top_p_budget(top_ps: torch.Tensor) -> torch.Tensor:
    """float64 [R]: top_p, or inf where top_p >= 1 (keep everything).

    With top_p 1 the mass before any token is at most 1 exactly; a float sum
    of the row may pass 1 by rounding and drop the last tokens, which plain
    decoding does not mean to do.
    """
    wide = top_ps.to(torch.float64)
    return torch.where(wide >= 1, float("inf"), wide)


def _bisect(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    budget: Optional[torch.Tensor],
    need_top_k: bool,
    work: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smallest float32 t per row with G(t) < top_k and S(t) <= budget.

    Returns (t float32 [R], G(t) int64 [R], S(t) float64 [R]); t is one of the
    row's probabilities (the predicate is constant between two of them).
    work: float32 [R, V] scratch, overwritten. Each step writes the 0/1 mask
    ``probs > t`` into it as float32 (a count is then an exact float sum below
    2**24), multiplies it by probs in place and sums: no allocation per step,
    and pairwise float32 sums (plain decoding's cumsum is float32 too).
    """
    rows = probs.shape[0]
    device = probs.device
    # Without a top-k below V in any row the count test always holds: one
    # count pass at the end instead of one per step.
    need_count = need_top_k
    hi = probs.amax(dim=-1).view(torch.int32).to(torch.int64)
    lo = torch.full((rows,), -1, dtype=torch.int64, device=device)
    count_hi = torch.zeros((rows,), dtype=torch.float32, device=device)
    mass_hi = torch.zeros((rows,), dtype=torch.float64, device=device)
    for _ in range(_BISECTION_STEPS):
        mid = hi - (hi - lo) // 2  # > lo while hi > lo, so never -1
        t = mid.to(torch.int32).view(torch.float32)[:, None]
        torch.gt(probs, t, out=work)
        ok = torch.ones((rows,), dtype=torch.bool, device=device)
        if need_count:
            count = work.sum(dim=-1)
            ok &= count < top_ks
        if budget is not None:
            mass = work.mul_(probs).sum(dim=-1).to(torch.float64)
            ok &= mass <= budget
            mass_hi = torch.where(ok, mass, mass_hi)
        if need_count:
            count_hi = torch.where(ok, count, count_hi)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    value = hi.to(torch.int32).view(torch.float32)
    if not need_count:
        count_hi = torch.gt(probs, value[:, None], out=work).sum(dim=-1)
    return value, count_hi.to(torch.int64), mass_hi


def _kept(probs: torch.Tensor, cut: _Cut, rank: torch.Tensor) -> torch.Tensor:
    """bool [R, V]: probabilities above the cut, and its first ``take`` ties.

    Ties at the cut are ranked by token id, as a stable descending sort does,
    with a running count written into ``rank`` (int32 [R, V] scratch). Alive
    at once: probs, rank and two bool masks.
    """
    value = cut.value[:, None]
    # In place in rank: a cumsum of the bool mask, or an int32 ``eq``, would
    # allocate an int32 [R, V] of its own.
    tie = probs == value
    rank.copy_(tie)
    rank.cumsum_(dim=-1)
    keep = torch.le(rank, cut.take.to(torch.int32)[:, None])
    keep &= tie
    torch.gt(probs, value, out=tie)
    keep |= tie
    return keep


def _renormalised(probs: torch.Tensor) -> torch.Tensor:
    return probs.div_(probs.sum(dim=-1, keepdim=True))
