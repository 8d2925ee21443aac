"""The verify's MoE dispatch budget: render sizes the low-latency all-to-all's token cap from the
overlay's rules (requests per DP rank x W), refuses what no cap can hold, and --explain shows it.

Render reads the rules from the newest release; these tests run the overlay's working copy of
`ddtree_rules.py` in its place (the rule ships with the next release), the way render runs a
release's: the file alone, through runpy.
"""

from __future__ import annotations

import itertools
import runpy
import shlex
from types import SimpleNamespace

import pytest

import deployer.render.ddtree_rules as render_rules
from deployer.errors import RenderError
from deployer.inventory import Inventory
from deployer.locations import HOSTS_DIR, OVERLAYS_DIR
from deployer.render import render_plan
from golden_files import GOLDEN_DIR

OVERLAY_RULES = OVERLAYS_DIR / "ddtree/python/sglang/srt/speculative/ddtree_rules.py"
SHIPPED = Inventory.load(HOSTS_DIR)
PAIRS = Inventory.load(GOLDEN_DIR / "inventory")
CAP = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"


@pytest.fixture(autouse=True)
def overlay_rules(monkeypatch):
    """render's rules = the overlay's working copy (as load_rules runs a release's file)."""
    namespace = SimpleNamespace(**runpy.run_path(str(OVERLAY_RULES), run_name="ddtree_rules"))
    monkeypatch.setattr(render_rules, "load_rules", lambda: ("overlay", namespace))
    return namespace


def _ep8(*sets: str):
    return render_plan([SHIPPED.get("b300")], "ep8", list(sets))


def _env(unit) -> dict[str, str]:
    """The variables the unit's env file exports."""
    lines = [ln[len("export ") :] for ln in unit.env.splitlines() if ln.startswith("export ")]
    return {name: shlex.split(value)[0] if value else "" for name, _, value in (ln.partition("=") for ln in lines)}


def _sources(unit) -> dict[str, tuple[object, str]]:
    return {v.key: (v.value, v.source) for v in unit.values}


def test_ep8_at_the_b300_budget_sets_the_deepep_cap_to_774():
    (unit,) = _ep8()
    assert _env(unit)[CAP] == "774"
    value, source = _sources(unit)[f"env.{CAP}"]
    assert value == "774" and "48/8 x 129 = 774" in source and source.startswith("DDTree verify (computed)")


def test_ep16_2node_sets_387_on_both_nodes():
    units = render_plan([PAIRS.get("b300-a"), PAIRS.get("b300-b")], "ep16-2node")
    assert [_env(u)[CAP] for u in units] == ["387", "387"]
    assert "48/16 x 129 = 387" in _sources(units[0])[f"env.{CAP}"][1]


@pytest.mark.parametrize("topology", ["tp8", "ep4"])
def test_topologies_without_a_low_latency_all_to_all_set_no_cap(topology):
    for unit in render_plan([SHIPPED.get("b300")], topology):
        assert not any("DISPATCH_TOKENS" in name for name in _env(unit)), unit.env
        assert f"env.{CAP}" not in _sources(unit)


@pytest.mark.parametrize(
    "sets,expected",
    [
        (["tree_budget=0"], None),  # linear DFlash: W = 1 per request
        (["deepep_mode=normal"], None),  # no low-latency dispatch
        (["max_running_requests=8"], "129"),  # one request per DP rank is already over 128
        (["max_running_requests=8", "tree_budget=64"], None),  # 8/8 x 65 = 65 fits the default 128
        (["max_running_requests=56"], "903"),  # 56/8 x 129
    ],
)
def test_the_cap_follows_the_requests_per_dp_rank_and_w(sets, expected):
    (unit,) = _ep8(*sets)
    assert _env(unit).get(CAP) == expected


def test_other_capped_all_to_alls_get_their_own_variable():
    (unit,) = _ep8("moe_a2a_backend=mooncake")
    env = _env(unit)
    assert env["SGLANG_MOONCAKE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] == "774" and CAP not in env


def test_a_verify_over_1024_tokens_per_rank_is_refused_in_one_line_naming_what_fits(cli):
    for command in ("render", "launch"):
        result = cli(command, "--host", "b300", "--topology", "ep8", "--set", "max_running_requests=96")
        assert result.code == 9, result
        assert result.stderr == (
            "ddeploy: error: [b300] topology ep8: DeepEP low-latency dispatch needs 96/8 x 129 = 1548 tokens per "
            "rank (max_running_requests/attn_dp_size x W) in a DDTree verify, over its limit of 1024 "
            f"({CAP}); --set max_running_requests=56 or --set tree_budget=84 or --set tree_budget=0 "
            "(linear DFlash) fits\n"
        ), result.stderr
    # What it names does fit: 56/8 x 129 = 903, 96/8 x 85 = 1020.
    assert _env(_ep8("max_running_requests=56")[0])[CAP] == "903"
    assert _env(_ep8("max_running_requests=96", "tree_budget=84")[0])[CAP] == "1020"


def test_a_cap_the_user_set_is_kept_or_refused_with_the_number_it_needs():
    (unit,) = _ep8(f"env.{CAP}=1024")
    assert _env(unit)[CAP] == "1024" and _sources(unit)[f"env.{CAP}"][1] == "--set"
    with pytest.raises(RenderError) as exc:
        _ep8(f"env.{CAP}=300")
    assert str(exc.value) == (
        "[b300] topology ep8: DeepEP low-latency dispatch needs 48/8 x 129 = 774 tokens per rank "
        f"(max_running_requests/attn_dp_size x W) in a DDTree verify, over env.{CAP}=300; "
        f"--set env.{CAP}=774 (or drop it: render sets it)"
    )
    with pytest.raises(RenderError, match=f"{CAP}=2048 exceeds DeepEP's limit of 1024"):
        _ep8(f"env.{CAP}=2048")


def test_explain_shows_the_dispatch_arithmetic(cli):
    result = cli("render", "--host", "b300", "--topology", "ep8", "--explain")
    assert result.code == 0, result.stderr
    (row,) = [ln for ln in result.stdout.splitlines() if f"env.{CAP}" in ln]
    assert row.split()[:3] == ["b300-ep8", f"env.{CAP}", "774"]
    assert "DeepEP low-latency dispatch per rank = max_running_requests/attn_dp_size x W = 48/8 x 129 = 774" in row
    tp8 = cli("render", "--host", "b300", "--topology", "tp8", "--explain")
    assert tp8.code == 0 and "DISPATCH_TOKENS" not in tp8.stdout


def test_the_rendered_ep_launches_pass_the_servers_start_check(overlay_rules):
    """The server judges argv + environment with the same rules: what render writes starts,
    and the same argv without the cap is refused with the number render set."""
    units = [*_ep8(), *render_plan([PAIRS.get("b300-a"), PAIRS.get("b300-b")], "ep16-2node")]
    for unit in units:
        argv = shlex.split(unit.script[unit.script.index("\nexec ") + 6 :].replace("\\\n", " "))
        flags = {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}
        launch = overlay_rules.DDTreeLaunch(
            budget=int(flags["--speculative-dflash-tree-budget"]),
            block_size=int(flags["--speculative-dflash-block-size"]),
            verify_backend=flags["--attention-backend"],
            is_mla=True,
            moe_a2a_backend=flags["--moe-a2a-backend"],
            deepep_mode=flags["--deepep-mode"],
            max_running_requests=int(flags["--max-running-requests"]),
            attn_dp_size=int(flags["--attn-dp-size"]),
            tp_size=int(flags["--tp-size"]),
            dispatch_cap=overlay_rules.dispatch_cap_of(flags["--moe-a2a-backend"], _env(unit)),
        )
        assert overlay_rules.ddtree_launch_refusals(launch) == [], unit.name
        (refusal,) = overlay_rules.ddtree_launch_refusals(launch.__class__(**{**vars(launch), "dispatch_cap": None}))
        assert refusal.endswith(f"; set {CAP}={_env(unit)[CAP]}."), refusal


@pytest.mark.parametrize("key", ["accept_threshold_single", "accept_threshold_acc"])
def test_a_lossy_accept_threshold_is_refused_with_ddtree_and_rendered_without(key):
    """The server would refuse it at start (its memory-light verify cannot apply a
    threshold, so the distribution would follow the batch size); linear DFlash takes it."""
    flag = "--speculative-" + key.replace("_", "-")
    with pytest.raises(RenderError, match=f"{flag} 0.9 would make it lossy"):
        _ep8(f"{key}=0.9")
    (unit,) = _ep8(f"{key}=0.9", "tree_budget=0")
    assert f"{flag} 0.9" in unit.script
