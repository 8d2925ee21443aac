"""DDTree's acceptance metrics: what SGLang's spec metrics mean for a tree.

SGLang 0.5.23 divides the accepted drafts by ``verify_ct x (num_draft_tokens -
1)`` (``managers/tokenizer_manager.py``, ``metrics_reporter.py``). For DDTree
``num_draft_tokens`` is the verify width W = max(budget + 1, block size), the
tree's node count, while one verify accepts at most one root-to-leaf path: at
most L = block_size - 1 drafts (the draft block's depths). So for a DDTree
server:

* ``spec_accept_rate`` = accepted drafts / (verify_ct x L): the mean accepted
  depth over the deepest possible, in [0, 1] (1: every verify accepted a full
  depth-L path).
* ``spec_accept_depth_rate`` = [a_1, ..., a_L], a_d = the fraction of verifies
  whose accepted path reached depth d (accepted at least d drafts). It is
  non-increasing in d, sum_d a_d = accepted drafts / verify_ct and
  mean_d a_d = ``spec_accept_rate``.

Per request these come from SGLang's own ``spec_correct_drafts_histogram``
(``meta_info``); per server from ``AcceptDepthCounter``, the scheduler's
lifetime counters (``/server_info``'s internal state and, with
``--enable-metrics``, the ``sglang:spec_accept_depth_rate{depth=...}`` gauge).
Linear speculation (no tree budget) keeps SGLang's definitions.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

DEPTH_RATE_KEY = "spec_accept_depth_rate"
DEPTH_GAUGE_NAME = "sglang:spec_accept_depth_rate"


def tree_max_depth(spec: Any) -> Optional[int]:
    """L = block_size - 1 for a DDTree server, None otherwise (linear or no spec)."""
    if getattr(spec, "speculative_dflash_tree_budget", None) is None:
        return None
    block_size = getattr(spec, "speculative_dflash_block_size", None)
    if not block_size:
        return None
    return max(int(block_size) - 1, 0)


def draft_slots_per_verify(spec: Any) -> Optional[int]:
    """The accept rate's drafts-per-verify denominator: L for DDTree, else
    SGLang's ``num_draft_tokens - 1`` (None when SGLang has none either)."""
    depth = tree_max_depth(spec)
    if depth is not None:
        return depth
    width = getattr(spec, "speculative_num_draft_tokens", None)
    return int(width) - 1 if width else None


def depth_rates_from_histogram(
    histogram: Sequence[int], verify_ct: int, max_depth: int
) -> List[float]:
    """[a_1..a_L] from a histogram of accepted drafts per verify (index k: the
    verifies that accepted k drafts), as SGLang's ``Req`` keeps it."""
    if verify_ct <= 0 or max_depth <= 0:
        return []
    rates = []
    reached = sum(histogram)  # verifies with at least 0 drafts
    for d in range(1, max_depth + 1):
        reached -= histogram[d - 1] if d - 1 < len(histogram) else 0
        rates.append(reached / verify_ct)
    return rates


class AcceptDepthCounter:
    """Lifetime per-depth counters of one scheduler (one DP rank's TP rank 0
    answers ``/server_info``, as SGLang's accept length does)."""

    def __init__(self, max_depth: Optional[int]):
        self.max_depth = max_depth
        self.verify_ct = 0
        self.reached = [0] * (max_depth or 0)  # reached[d - 1]: verifies at depth >= d
        self._gauge = None

    @classmethod
    def for_spec(cls, spec: Any) -> "AcceptDepthCounter":
        return cls(tree_max_depth(spec))

    @property
    def enabled(self) -> bool:
        return bool(self.max_depth)

    def add(self, num_correct_drafts_per_req: Sequence[int]) -> None:
        """One verify per request; entry = its accepted drafts (bonus excluded)."""
        if not self.enabled:
            return
        for n in num_correct_drafts_per_req:
            self.verify_ct += 1
            for d in range(min(int(n), self.max_depth)):
                self.reached[d] += 1

    def reset(self) -> None:
        """``/flush_cache`` (SGLang's ``reset_metrics``): start over."""
        self.verify_ct = 0
        self.reached = [0] * (self.max_depth or 0)

    def rates(self) -> List[float]:
        if self.verify_ct <= 0:
            return []
        return [r / self.verify_ct for r in self.reached]

    def state(self) -> Dict[str, Any]:
        """``/server_info`` internal-state entries (none before a verify)."""
        if not self.enabled or self.verify_ct <= 0:
            return {}
        return {DEPTH_RATE_KEY: self.rates()}

    def export(self, metrics_collector: Any) -> None:
        """Set ``sglang:spec_accept_depth_rate{depth=d}`` (SGLang's labels too)."""
        if not self.enabled or self.verify_ct <= 0 or metrics_collector is None:
            return
        labels = dict(getattr(metrics_collector, "labels", None) or {})
        if self._gauge is None:
            from prometheus_client import Gauge

            self._gauge = Gauge(
                name=DEPTH_GAUGE_NAME,
                documentation="DDTree: fraction of verifies whose accepted path reached each depth (lifetime).",
                labelnames=list(labels) + ["depth"],
                multiprocess_mode="mostrecent",
            )
        for d, rate in enumerate(self.rates(), start=1):
            self._gauge.labels(**labels, depth=str(d)).set(rate)
