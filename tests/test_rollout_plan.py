"""`ddeploy rollout`'s plan and gates as pure functions: units (a multi-node launch is one unit),
the canary and the ramp, --min-available, --max-fail, the rollout file's errors, and each gate's
verdict (pass, fail, and inconclusive inside the runs' spread). No host is contacted."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployer.errors import UsageError
from deployer.inventory import Host, Inventory
from deployer.rollout.gates import evaluate, noisy_gate, verdict
from deployer.rollout.plan import Serving, batch_sizes, make_plan, make_units
from deployer.rollout.spec import RolloutSpec, load_spec
from deployer.transport.protocol_serving import BenchRun, LaunchRecord, Measurement, Probe
from deployer.transport.protocol_serving import Serving as Served


def host(name: str, groups: tuple[str, ...] = ()) -> Host:
    return Host(
        name=name,
        ssh={"host": f"{name}.example", "user": "u"},
        gpu={"model": "NVIDIA B300 SXM6", "count": 8, "arch": "sm_103"},
        interconnect="nvlink",
        checkout="/opt/sglang",
        groups=groups,
    )


def fleet(n: int) -> tuple[list[Host], Inventory]:
    hosts = [host(f"h{i}") for i in range(1, n + 1)]
    return hosts, Inventory(hosts)


TP8 = Serving("tp8")


def test_the_ramp_repeats_its_last_step_and_percentages_round_up():
    spec = RolloutSpec(batch=["1", "2", "25%"])
    assert batch_sizes(spec, 10) == [1, 2, 3, 3]  # 9 after the canary; 25% of 10 is 3 (rounded up)
    assert batch_sizes(RolloutSpec(batch="5"), 3) == [2]
    assert batch_sizes(RolloutSpec(batch="1%"), 4) == [1, 1, 1]
    assert batch_sizes(RolloutSpec(), 1) == []


def test_the_plan_puts_the_canary_first_then_the_batches():
    hosts, inv = fleet(5)
    units = make_units(hosts, {h.name: TP8 for h in hosts}, {h.name: "0.2.18" for h in hosts}, inv)
    plan = make_plan("0.2.19", units, RolloutSpec(batch=["1", "50%"]), canary="h3")
    assert plan.batches == (("h3",), ("h1",), ("h2", "h4", "h5"))
    assert plan.unit("h3").version == "0.2.18"
    with pytest.raises(UsageError, match="--canary h9: not one of the selected hosts"):
        make_plan("0.2.19", units, RolloutSpec(), canary="h9")


def test_a_multi_node_launch_is_one_unit_and_is_never_split():
    a, b, c = host("n1", ("pair",)), host("n2", ("pair",)), host("solo")
    inv = Inventory([a, b, c])
    two = Serving("tp16-2node", nnodes=2)
    serving = {"n1": two, "n2": two, "solo": TP8}
    units = make_units([a, b, c], serving, {}, inv)
    assert [u.name for u in units] == ["n1+n2", "solo"]
    assert units[0].serving == two
    with pytest.raises(UsageError, match="rolls as one unit: select n2 too"):
        make_units([a, c], serving, {}, inv)
    lonely = Inventory([a, b, c, host("n3", ("trio",))])
    with pytest.raises(UsageError, match="no inventory group of 2 hosts serving it holds n1"):
        make_units([a], {"n1": two}, {}, lonely)


def test_min_available_refuses_a_batch_that_leaves_too_few_serving():
    hosts, inv = fleet(4)
    serving = {h.name: TP8 for h in hosts} | {"h4": None}  # h4 serves nothing: it never counts
    units = make_units(hosts, serving, {}, inv)
    make_plan("0.2.19", units, RolloutSpec(batch="2", min_available=1))
    left = r"batch 1 \(h2, h3\) would leave 1 of 3 serving units up, under --min-available 2"
    with pytest.raises(UsageError, match=left):
        make_plan("0.2.19", units, RolloutSpec(batch="2", min_available=2))


def test_max_fail_counts_or_percentages():
    assert RolloutSpec(max_fail="2").max_failures(10) == 2
    assert RolloutSpec(max_fail="25%").max_failures(10) == 2
    assert RolloutSpec().max_failures(10) == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch: [1, 0]\n", "batch: batch step '0' must be at least 1"),
        ("batch: 150%\n", "batch: '150%' must be a count (1, 5) or a percentage"),
        ("gates: {throughput_drop_pct: -1}\n", "gates.throughput_drop_pct: Input should be greater than or equal to 0"),
        ("gatez: {}\n", "gatez: Extra inputs are not permitted"),
        ("- 1\n", "a rollout file is a mapping"),
        ("batch: [1\n", "not valid YAML"),
    ],
)
def test_a_bad_rollout_file_is_one_line_naming_the_file_and_field(tmp_path: Path, text, message):
    path = tmp_path / "rollout.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as err:
        load_spec(path, {})
    assert str(err.value).startswith(str(path)) or "not valid YAML" in str(err.value)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_cli_options_override_the_file(tmp_path: Path):
    path = tmp_path / "rollout.yaml"
    path.write_text("batch: [1, 5]\nmax_fail: 1\nmeasure: {repeats: 5}\n")
    spec = load_spec(path, {"batch": "2,3", "max_fail": None})
    assert spec.batch == ("2", "3") and spec.max_fail == "1" and spec.measure.repeats == 5
    with pytest.raises(UsageError, match="the rollout options: max_fail: 'x' must be a count"):
        load_spec(None, {"max_fail": "x"})


def measurement(tokens_per_s: list[float], itl: list[float], outputs: list[list[int]], accept: float) -> Measurement:
    record = LaunchRecord(topology="tp8", dir="/x", state="running")
    runs = [
        BenchRun(concurrency=4, completed=16, output_tokens_per_s=t, itl_ms_p99=i)
        for t, i in zip(tokens_per_s, itl, strict=True)
    ]
    probes = [Probe(output_ids=o, completion_tokens=len(o), verify_count=round(len(o) / accept)) for o in outputs]
    return Measurement(record=record, serving=Served(config="ddtree"), runs=runs, probes=probes)


OUT = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2]]


def test_gates_pass_when_nothing_got_worse():
    th = RolloutSpec().gates
    ref = measurement([100, 104, 98], [20, 21, 19], OUT, 4.0)
    cand = measurement([103, 99, 101], [20, 20, 21], OUT, 4.0)
    results = evaluate(ref, cand, th, 16)
    assert [r.verdict for r in results] == ["pass"] * 5 and verdict(results) == "pass"


def test_a_changed_greedy_token_fails_and_names_where():
    ref = measurement([100], [20], OUT, 4.0)
    changed = [OUT[0], [9, 8, 7, 6, 5, 4, 3, 1]]
    results = evaluate(ref, measurement([100], [20], changed, 4.0), RolloutSpec().gates, 16)
    assert results[0].gate == "greedy" and results[0].verdict == "fail"
    assert results[0].measured == "probe 1 differs at token 7: 2 -> 1"
    assert verdict(results) == "fail"


def test_a_lower_accept_length_fails_past_its_threshold():
    ref = measurement([100], [20], OUT, 4.0)
    results = evaluate(ref, measurement([100], [20], OUT, 2.0), RolloutSpec().gates, 16)
    accept = next(r for r in results if r.gate == "accept_length")
    assert accept.verdict == "fail" and accept.measured.startswith("2.000 (-50.0%)")


def test_a_slowdown_inside_the_noise_is_inconclusive_outside_it_fails():
    # 15% slower, threshold 10%: the runs spread 10% -> inconclusive; spread 2% -> fail
    assert noisy_gate("throughput", [95, 100, 105], [85, 85, 85], 10, True).verdict == "inconclusive"
    assert noisy_gate("throughput", [99, 100, 101], [85, 85, 85], 10, True).verdict == "fail"
    assert noisy_gate("itl_p99", [20, 20, 20], [21, 21, 21], 10, False).verdict == "pass"
    assert noisy_gate("itl_p99", [20, 20, 20], [30, 30, 30], 10, False).verdict == "fail"


def test_failed_requests_fail_the_errors_gate():
    ref = measurement([100], [20], OUT, 4.0)
    cand = measurement([100], [20], OUT, 4.0)
    cand = cand.model_copy(update={"runs": [cand.runs[0].model_copy(update={"completed": 15})]})
    errors = evaluate(ref, cand, RolloutSpec().gates, 16)[-1]
    assert errors.gate == "errors" and errors.verdict == "fail" and errors.measured == "15 of 16 requests completed"


@pytest.mark.parametrize(
    "args, code, message",
    [
        ((), 2, "name the release to roll out"),
        (("0.2.19",), 2, "choose hosts with --host NAME, --group G or --all"),
        (("--resume", "0.2.19"), 2, "--resume goes on with the last rollout as planned; drop the other arguments"),
        (("0.2.19", "--host", "local", "--batch", "0"), 2, "batch: batch step '0' must be at least 1"),
        (("9.9.9", "--host", "local"), 4, "9.9.9"),
        (("0.2.19", "--host", "nowhere"), 3, "nowhere"),
    ],
)
def test_bad_rollout_arguments_are_one_line_before_any_host_is_contacted(cli, args, code, message):
    r = cli("rollout", *args)
    assert r.code == code, r.stderr
    assert message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_resume_with_no_rollout_on_this_machine_is_refused(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path))  # no other test's rollouts
    r = cli("rollout", "--resume")
    assert r.code == 7 and "no rollout to resume on this machine" in r.stderr, r.stderr


def test_a_host_is_held_by_its_own_last_rollout_only(monkeypatch, tmp_path):
    """h1's last rollout failed (held); h2's last one came after and succeeded (free)."""
    from deployer.rollout import journal

    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path))
    for rollout_id, hosts, state in [
        ("20261201T000000Z-aaaa", ["h1", "h2"], "failed"),
        ("20261202T000000Z-bbbb", ["h2"], "done"),
    ]:
        log = journal.Journal(rollout_id)
        units = [{"name": h, "hosts": [h], "versions": [None], "serving": None} for h in hosts]
        log.write("plan", plan={"units": units}, spec={}, source={})
        log.write("rollout", state=state)
    assert journal.last_failed({"h1", "h2"}) == ("20261201T000000Z-aaaa", {"h1"})
    assert journal.last_failed({"h2", "h3"}) is None
