"""The gates a changed unit must pass: its measurement after the change against its own before it
(the reference, measured on the same unit, same prompts, same client settings).

- greedy: the completions of the fixed probe prompts at temperature 0 equal the reference's,
  token for token (a lossless tree changes none);
- accept_length: completion tokens per verify step over the greedy probes (per request, from
  SGLang's meta_info, every DP rank's requests alike; deterministic, so no noise), at most
  `accept_length_drop_pct` lower;
- throughput and itl_p99: medians of the client's repeated runs. A change worse than its
  threshold fails only when it is also outside the runs' spread (the larger relative max-min
  range of the two arms); worse than the threshold but inside the spread is "inconclusive";
- errors: every request of every run completed.

    results = evaluate(reference, candidate, spec.gates, spec.measure.requests)
    verdict(results)  # "pass", "fail" or "inconclusive"
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from ..transport.protocol_serving import Measurement
from .spec import Thresholds

Verdict = Literal["pass", "fail", "inconclusive", "n/a"]


@dataclass(frozen=True)
class GateResult:
    gate: str
    verdict: Verdict
    measured: str  # what was measured, for the log and the table
    threshold: str

    def to_data(self) -> dict[str, str]:
        return {"gate": self.gate, "verdict": self.verdict, "measured": self.measured, "threshold": self.threshold}


def verdict(results: list[GateResult]) -> Verdict:
    kinds = {r.verdict for r in results}
    return "fail" if "fail" in kinds else "inconclusive" if "inconclusive" in kinds else "pass"


def accept_length(m: Measurement) -> float | None:
    """Completion tokens per verify step over the greedy probes; None without speculation."""
    probes = m.probes or []
    steps = sum(p.verify_count or 0 for p in probes)
    tokens = sum(p.completion_tokens or 0 for p in probes)
    return tokens / steps if steps else None


def greedy_gate(ref: Measurement, cand: Measurement) -> GateResult:
    want = [p.output_ids for p in ref.probes or []]
    got = [p.output_ids for p in cand.probes or []]
    threshold = "equal token for token"
    if len(want) != len(got) or not want:
        return GateResult("greedy", "fail", f"{len(got)} probe completions against {len(want)}", threshold)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        for j in range(max(len(a), len(b))):
            if j >= len(a) or j >= len(b) or a[j] != b[j]:
                before = a[j] if j < len(a) else "end"
                after = b[j] if j < len(b) else "end"
                return GateResult("greedy", "fail", f"probe {i} differs at token {j}: {before} -> {after}", threshold)
    return GateResult("greedy", "pass", f"{len(want)} probes x {len(want[0])} tokens equal", threshold)


def accept_gate(ref: Measurement, cand: Measurement, drop_pct: float) -> GateResult:
    before, after = accept_length(ref), accept_length(cand)
    threshold = f"at most {drop_pct:g}% below {before:.3f}" if before else "n/a"
    if before is None:
        return GateResult("accept_length", "n/a", "no speculation before the change", threshold)
    if after is None:
        return GateResult("accept_length", "fail", "no verify steps after the change", threshold)
    change = (after - before) / before * 100
    ok = after >= before * (1 - drop_pct / 100)
    return GateResult("accept_length", "pass" if ok else "fail", f"{after:.3f} ({change:+.1f}%)", threshold)


def _spread(values: list[float]) -> float:
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def noisy_gate(
    name: str, before: list[float], after: list[float], limit_pct: float, higher_is_better: bool
) -> GateResult:
    """Median against median; a change past the limit fails only outside the runs' spread."""
    if not before or not after:
        return GateResult(name, "n/a", "not reported by the client", f"{limit_pct:g}%")
    b, a = statistics.median(before), statistics.median(after)
    if b == 0:
        return GateResult(name, "n/a", f"{a:.3g} (reference 0)", f"{limit_pct:g}%")
    change = (a - b) / b * 100
    worse = -change if higher_is_better else change
    noise = max(_spread(before), _spread(after)) * 100
    measured = f"{a:.3g} against {b:.3g} ({change:+.1f}%, runs spread {noise:.1f}%)"
    threshold = f"at most {limit_pct:g}% {'lower' if higher_is_better else 'higher'}"
    if worse <= limit_pct:
        return GateResult(name, "pass", measured, threshold)
    return GateResult(name, "fail" if worse > limit_pct + noise else "inconclusive", measured, threshold)


def errors_gate(cand: Measurement, requests: int) -> GateResult:
    short = [r for r in cand.runs if (r.completed or 0) < requests]
    measured = f"{sum(r.completed or 0 for r in cand.runs)} of {requests * len(cand.runs)} requests completed"
    return GateResult("errors", "fail" if short else "pass", measured, "none failed")


def evaluate(ref: Measurement, cand: Measurement, th: Thresholds, requests: int) -> list[GateResult]:
    def series(m: Measurement, field: str) -> list[float]:
        return [float(v) for r in m.runs if (v := getattr(r, field)) is not None]

    return [
        greedy_gate(ref, cand),
        accept_gate(ref, cand, th.accept_length_drop_pct),
        noisy_gate(
            "throughput",
            series(ref, "output_tokens_per_s"),
            series(cand, "output_tokens_per_s"),
            th.throughput_drop_pct,
            True,
        ),
        noisy_gate("itl_p99", series(ref, "itl_ms_p99"), series(cand, "itl_ms_p99"), th.itl_p99_rise_pct, False),
        errors_gate(cand, requests),
    ]
