"""`ddeploy bench`'s warm-up and repeats on an OpenSSH test host, with the SGLang stand-ins of
tests/standin_sglang: each configuration's warm-up runs come first and count for nothing; then
--repeats runs per concurrency, whose medians the table shows and every one of which the saved
result keeps; with --compare, a verdict per concurrency (here a clear speedup at one, inside the
noise at the other). The stand-in client reports the throughputs `STANDIN_CLIENT_TPS` lists, one
per run in order, so each number shows which run it came from (the warm-up's is 1000 or 1)."""

from __future__ import annotations

import json

import pytest

from processes import free_port
from test_bench_interrupt import _launch_args, _stand_in_pids, marks  # noqa: F401

pytestmark = pytest.mark.sshd

SIZES = ("--requests", "1", "--input-len", "4", "--output-len", "4")
# run 0 is the warm-up; then concurrency 1's three runs, then concurrency 2's
TPS = "ddtree=1000,100,120,110,200,180,190 linear=1,50,55,60,190,200,195"


def _client_runs(marks, config: str) -> int:
    return sum(1 for f in marks.iterdir() if f.name.startswith(f"client-{config}-"))


def _launch(cli, hosts, marks) -> None:
    args = [*_launch_args("h1", marks, "", free_port()), "--set", f"env.STANDIN_CLIENT_TPS={TPS}"]
    r = cli(*args, inventory=hosts.inventory_dir)
    assert r.code == 0, r.stderr


def _stored_bench(cli, hosts) -> dict:
    r = cli("status", "--host", "h1", "--json", inventory=hosts.inventory_dir)
    return json.loads(r.stdout)[0]["data"]["bench"]


def _table_row(stdout: str, config: str, concurrency: int) -> list[str]:
    """The table's cells of one (config, concurrency) row."""
    for line in stdout.splitlines():
        cells = [c for c in line.split("  ") if c.strip()]
        if line.startswith(config) and cells[1].strip() == str(concurrency):
            return [c.strip() for c in cells]
    raise AssertionError(f"no {config} row at concurrency {concurrency} in:\n{stdout}")


def test_warm_up_runs_are_discarded_and_the_table_shows_the_median_of_the_repeats(hosts, cli, marks):
    _launch(cli, hosts, marks)
    r = cli("bench", "--host", "h1", "--compare", "linear", "--yes", "-c", "1", "-c", "2", *SIZES,
            inventory=hosts.inventory_dir)  # fmt: skip
    assert r.code == 0, r.stderr
    # per config: 1 warm-up run, then 3 runs at each of the 2 concurrencies
    assert (_client_runs(marks, "ddtree"), _client_runs(marks, "linear")) == (7, 7)
    assert "h1-tp8: sglang.benchmark.serving, concurrency 1, warm-up run 1 of 1 (not counted)" in r.stderr
    assert "h1-tp8: sglang.benchmark.serving, concurrency 2, run 3 of 3" in r.stderr

    bench = _stored_bench(cli, hosts)
    assert (bench["params"]["warmup"], bench["params"]["repeats"]) == (1, 3)
    rows = {(row["config"], row["concurrency"]): row for row in bench["configs"]}
    assert list(rows) == [("ddtree", 1), ("ddtree", 2), ("linear", 1), ("linear", 2)]
    runs = {key: [run["output_tokens_per_s"] for run in row["runs"]] for key, row in rows.items()}
    assert runs == {("ddtree", 1): [100, 120, 110], ("ddtree", 2): [200, 180, 190],
                    ("linear", 1): [50, 55, 60], ("linear", 2): [190, 200, 195]}  # fmt: skip
    assert all(row["warmup_runs"] == 1 and row["repeats"] == 3 for row in rows.values())
    tree = rows[("ddtree", 1)]
    assert tree["output_tokens_per_s"] == 110 and tree["itl_ms_median"] == pytest.approx(1000 / 110)
    assert (tree["output_tokens_per_s_min"], tree["output_tokens_per_s_max"]) == (100, 120)
    assert tree["speedup"] == pytest.approx(110 / 55) and tree["speedup_interval"]["excludes_one"] is True
    assert rows[("ddtree", 2)]["speedup_interval"]["excludes_one"] is False
    assert rows[("linear", 1)]["speedup"] is None and rows[("linear", 1)]["speedup_interval"] is None

    # the table: medians, the runs' spread, the ratio of medians; a verdict per concurrency
    assert _table_row(r.stdout, "ddtree", 1)[4:7] == ["110.0", "100.0-120.0", "2.00x"]
    assert _table_row(r.stdout, "linear", 2)[4:7] == ["195.0", "190.0-200.0", "-"]
    assert "speedup at concurrency 1: DDTree 2.00x linear (1.70-2.36 over 3x3 runs)\n" in r.stdout
    assert "speedup at concurrency 2: inside the noise (0.90-1.05 over 3x3 runs): no difference shown\n" in r.stdout
    assert r.stdout.rstrip().endswith("ddtree equals linear token for token")  # the greedy check as before


def test_without_a_baseline_the_warm_up_and_repeats_are_as_asked(hosts, cli, marks):
    _launch(cli, hosts, marks)
    r = cli("bench", "--host", "h1", "-c", "1", "--warmup", "2", "--repeats", "2", *SIZES,
            inventory=hosts.inventory_dir)  # fmt: skip
    assert r.code == 0, r.stderr
    assert _client_runs(marks, "ddtree") == 2 + 2
    (row,) = _stored_bench(cli, hosts)["configs"]
    # runs 0 and 1 (1000, 100) were the warm-up; the median of 120 and 110 is their mean
    assert [run["output_tokens_per_s"] for run in row["runs"]] == [120, 110]
    assert row["output_tokens_per_s"] == 115 and row["warmup_runs"] == 2 and row["speedup"] is None
    assert (
        "speedup at" not in r.stdout and "medians of 2 runs per concurrency after 2 warm-up runs per config" in r.stdout
    )
