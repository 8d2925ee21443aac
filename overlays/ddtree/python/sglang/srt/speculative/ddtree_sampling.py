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

Work and memory: one softmax over [R, V]; when the batch bounds top-k below V
(``max_top_k``, a host int), one ``topk`` over it; otherwise a full sort only if
top-p is on. No host reads of device values.
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
    top token always survives, so no row is empty.
    """
    scaled = logits.to(torch.float32) / params.temperatures
    probs = torch.softmax(scaled, dim=-1)
    if not (params.need_top_k or params.need_top_p or params.need_min_p):
        return probs
    vocab = probs.shape[-1]
    if not (params.need_top_k or params.need_top_p):
        # min_p alone: a threshold on the row maximum, no ordering needed.
        keep = probs >= probs.amax(dim=-1, keepdim=True) * params.min_ps[:, None]
        return _renormalised(probs * keep)
    bound = vocab
    if params.need_top_k and params.max_top_k is not None:
        bound = max(1, min(int(params.max_top_k), vocab))
    if bound < vocab:
        values, index = torch.topk(probs, bound, dim=-1, sorted=True)
    else:
        values, index = torch.sort(probs, dim=-1, descending=True)
    kept = _filter_sorted(values, params, top_k_first(backend, params.need_min_p))
    out = torch.zeros_like(probs)
    out.scatter_(1, index, kept)
    return _renormalised(out)


def _filter_sorted(
    values: torch.Tensor, params: SamplingRows, top_k_first_order: bool
) -> torch.Tensor:
    """Zero the entries of descending-sorted values [R, k] the filters drop."""
    ranks = torch.arange(values.shape[-1], device=values.device)[None, :]
    keep = ranks < params.top_ks.to(torch.int64)[:, None]
    if top_k_first_order:
        top = values * keep
        top = top / top.sum(dim=-1, keepdim=True)
        before = torch.cumsum(top, dim=-1) - top
    else:
        before = torch.cumsum(values, dim=-1) - values
    keep &= before <= params.top_ps[:, None]
    if params.need_min_p:
        keep &= values >= values[:, :1] * params.min_ps[:, None]
    return values * keep


def _renormalised(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)
