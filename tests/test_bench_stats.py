"""`bench`'s numbers from repeated runs, without a server: the median row, the speedup's interval
over every pair of runs and its two verdicts (a difference shown, inside the noise), and the
deadline and argument checks of --warmup and --repeats."""

from __future__ import annotations

import pytest

from deployer.cli.views import speedup_verdict
from deployer.errors import UsageError
from deployer.ops.bench import BenchParams
from deployer.ops.bench_stats import median_row, percentile, speedup


def _runs(tps: list[float], **fields) -> list[dict]:
    return [{"output_tokens_per_s": t, "itl_ms_median": 1000 / t, **fields} for t in tps]


def test_the_percentile_interpolates_between_the_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([1, 2, 3, 4], 0) == 1
    assert percentile([1, 2, 3, 4], 100) == 4 and percentile([7.0], 2.5) == 7.0
    # 9 values: the 2.5th percentile lies 0.2 of the way from the lowest to the next
    assert percentile([0, 10, 20, 30, 40, 50, 60, 70, 80], 2.5) == pytest.approx(2.0)
    assert percentile([0, 10, 20, 30, 40, 50, 60, 70, 80], 97.5) == pytest.approx(78.0)


def test_a_row_is_each_fields_median_over_its_runs_and_the_spread_of_throughput():
    runs = _runs([100.0, 120.0, 110.0], completed=8, verify_count=70, accept_length=4.0)
    runs[1]["verify_count"], runs[2]["verify_count"] = 74, 71
    row = median_row(runs)
    assert row["output_tokens_per_s"] == 110.0 and row["itl_ms_median"] == pytest.approx(1000 / 110)
    assert (row["output_tokens_per_s_min"], row["output_tokens_per_s_max"]) == (100.0, 120.0)
    assert row["verify_count"] == 71 and row["completed"] == 8 and row["accept_length"] == 4.0
    assert row["ttft_ms_p99"] is None  # no run reported it
    # four runs: a rate's median is the mean of the middle two; a count stays whole (the lower one)
    even = median_row(_runs([10.0, 40.0, 20.0, 30.0]) + [])
    assert even["output_tokens_per_s"] == 25.0
    counts = median_row([{"verify_count": v} for v in (10, 40, 20, 30)])
    assert counts["verify_count"] == 20


def test_a_clear_speedup_is_the_ratio_of_medians_with_the_pairwise_interval():
    s = speedup([100.0, 120.0, 110.0], [50.0, 55.0, 60.0])
    assert s["ratio"] == 2.0
    # the 9 ratios, sorted, begin 100/60, 100/55 and end 110/50, 120/50: 0.2 of the way in from each end
    low = 100 / 60 + 0.2 * (100 / 55 - 100 / 60)
    high = 120 / 50 - 0.2 * (120 / 50 - 110 / 50)
    iv = s["interval"]
    assert iv["low"] == pytest.approx(low) and iv["high"] == pytest.approx(high)
    assert iv["runs"] == [3, 3] and iv["excludes_one"] is True
    row = {"config": "ddtree", "concurrency": 4, "speedup": s["ratio"], "speedup_interval": iv}
    assert speedup_verdict(row, "linear") == "speedup at concurrency 4: DDTree 2.00x linear (1.70-2.36 over 3x3 runs)"


def test_an_interval_containing_one_is_inside_the_noise():
    s = speedup([200.0, 180.0, 190.0], [190.0, 200.0, 195.0])
    iv = s["interval"]
    assert s["ratio"] == pytest.approx(190 / 195) and iv["low"] < 1.0 < iv["high"]
    assert iv["excludes_one"] is False
    row = {"config": "ddtree", "concurrency": 16, "speedup": s["ratio"], "speedup_interval": iv}
    assert speedup_verdict(row, "plain") == (
        "speedup at concurrency 16: inside the noise (0.90-1.05 over 3x3 runs): no difference shown"
    )


def test_a_clear_slowdown_reads_as_a_ratio_under_one():
    s = speedup([50.0, 52.0, 51.0], [100.0, 104.0, 98.0])
    assert s["interval"]["high"] < 1.0 and s["interval"]["excludes_one"] is True
    row = {"config": "linear", "concurrency": 1, "speedup": s["ratio"], "speedup_interval": s["interval"]}
    assert speedup_verdict(row, "plain").startswith("speedup at concurrency 1: linear 0.51x plain (0.48-0.53 over")


def test_one_run_a_side_gives_a_ratio_but_no_interval():
    assert speedup([100.0], [50.0]) == {"ratio": 2.0, "interval": None}
    assert speedup([100.0, 110.0], [50.0])["interval"] is None
    assert speedup([100.0], []) is None and speedup([], [50.0]) is None and speedup([1.0], [0.0]) is None
    row = {"config": "ddtree", "concurrency": 4, "speedup": 2.0, "speedup_interval": None}
    assert speedup_verdict(row, "linear") == (
        "speedup at concurrency 4: DDTree 2.00x linear (under 2 runs a side: no interval; "
        "--repeats 2 or more gives one)"
    )


def test_the_deadline_counts_the_warm_up_and_every_repeat():
    params = BenchParams(8, (1, 16), 16, 32, 0.0, wait_timeout=5, run_timeout=10, warmup=1, repeats=3)
    assert params.client_runs() == 1 + 3 * 2
    assert params.deadline("linear") == 2 * (7 * 10 + 600) + 5
    assert params.deadline(None) == 7 * 10 + 600
    assert BenchParams(8, (4,), 16, 32, 0.0, run_timeout=10, warmup=2, repeats=5).deadline(None) == 7 * 10 + 600
    # without them (a caller that repeats on its own): one run per concurrency, as before
    assert BenchParams(8, (1, 16), 16, 32, 0.0, run_timeout=10).deadline(None) == 2 * 10 + 600
    assert BenchParams(8, (4,), 16, 32, 0.0, timeout=30, warmup=3, repeats=9).deadline("plain") == 30


def test_warmup_and_repeats_are_checked_before_any_host_is_contacted(cli):
    with pytest.raises(UsageError, match="--repeats 0: must be at least 1"):
        BenchParams(8, (4,), 16, 32, 0.0, repeats=0).check()
    with pytest.raises(UsageError, match="--warmup -1: must be 0 or more"):
        BenchParams(8, (4,), 16, 32, 0.0, warmup=-1).check()
    BenchParams(8, (4,), 16, 32, 0.0, warmup=0, repeats=1).check()
    r = cli("bench", "--host", "local", "--repeats", "0")
    assert r.code == 2 and "--repeats 0: must be at least 1" in r.stderr
    r = cli("bench", "--host", "local", "--warmup", "-1")
    assert r.code == 2 and "--warmup -1: must be 0 or more" in r.stderr
