"""Launch-script rendering: golden files, shell validity, SGLang flag spellings, validation errors,
multi-node layout, value precedence and --explain, StrictUndefined."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployer.errors import RenderError, UsageError
from deployer.inventory import Inventory
from deployer.locations import HOSTS_DIR, TEMPLATES_DIR
from deployer.patchset.release import list_versions
from deployer.render import load_profiles, render_plan
from deployer.render.ddtree_rules import load_rules
from golden_files import GOLDEN_DIR, SETS, golden_files

from conftest import run_cli

SHIPPED = Inventory.load(HOSTS_DIR)
PAIRS = Inventory.load(GOLDEN_DIR / "inventory")
OVERLAY_FLAGS = {"--speculative-dflash-tree-budget", "--speculative-dflash-tree-topk"}
NEWEST = list_versions()[-1]


def _render(host: str, topology: str, *sets: str, inventory: Inventory = SHIPPED):
    return render_plan([inventory.get(host)], topology, list(sets))


def _error(host: str, topology: str, *sets: str) -> str:
    with pytest.raises(RenderError) as exc:
        _render(host, topology, *sets)
    return str(exc.value)


def _argv(script: str) -> list[str]:
    """The words after `exec`, as bash would split them (continuations joined)."""
    body = script[script.index("\nexec ") + 6 :].replace("\\\n", " ")
    return shlex.split(body)


# --- golden files ---------------------------------------------------------------------------


def test_every_shipped_pair_renders_byte_identical_to_its_golden_file():
    expected = golden_files()
    on_disk = {f"{sub}/{p.name}": p.read_text() for sub, _, _ in SETS for p in (GOLDEN_DIR / sub).iterdir()}
    assert sorted(on_disk) == sorted(expected), (
        "stale or missing golden files: run python tests/golden_files.py --update-golden"
    )
    for rel, text in expected.items():
        assert on_disk[rel] == text, f"{rel} differs from the template output (review, then --update-golden)"
    assert {
        "shipped/rtx6000-tp8.sh",
        "shipped/b300-ep8.sh",
        "shipped/b300-ep4-r1.sh",
        "multinode/b300-b-ep16-2node.sh",
    } <= set(expected)


def test_golden_scripts_are_executable_and_skipped_pairs_say_why():
    for script in GOLDEN_DIR.glob("*/*.sh"):
        assert script.stat().st_mode & 0o777 == 0o755, script
    skipped = (GOLDEN_DIR / "shipped" / "SKIPPED.txt").read_text()
    assert "rtx6000 ep4: [rtx6000] topology ep4 does not fit" in skipped
    assert "rtx6000 ep8: [rtx6000] moe_a2a_backend 'deepep' cannot run here" in skipped


def test_every_rendered_file_passes_bash_n_and_shellcheck():
    files = sorted(GOLDEN_DIR.glob("*/*.sh")) + sorted(GOLDEN_DIR.glob("*/*.env"))
    assert len(files) >= 20
    for path in files:
        subprocess.run(["bash", "-n", str(path)], check=True)
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed (scripts/test.sh installs it)")
    proc = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=style", *map(str, files)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


@pytest.fixture(scope="session")
def sglang_parse(tmp_path_factory):
    """Parse argv lists with SGLang 0.5.23's own server-args parser (in a subprocess, ~10 s)."""
    from deployer.patchset.sglang_base import ensure_base

    base = ensure_base().path / "python"
    code = (
        "import argparse, json, sys\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)\n"
        "ServerArgs.add_cli_args(p)\n"
        "out = []\n"
        "for argv in json.load(sys.stdin):\n"
        "    try:\n"
        "        ns, rest = p.parse_known_args(argv)\n"
        "        args = {k: v for k, v in vars(ns).items() if isinstance(v, (int, float, str, bool))}\n"
        "        out.append({'rest': rest, 'args': args})\n"
        "    except (argparse.ArgumentError, SystemExit) as e:\n"
        "        out.append({'error': str(e)})\n"
        "print(json.dumps(out))\n"
    )

    def parse(argvs: list[list[str]]) -> list[dict]:
        env = {**os.environ, "PYTHONPATH": str(base)}
        proc = subprocess.run(
            [sys.executable, "-c", code], input=json.dumps(argvs), env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return parse


@pytest.mark.slow
def test_every_flag_is_a_real_sglang_0_5_23_flag_except_the_two_overlay_flags(sglang_parse):
    scripts = {p.name: p.read_text() for p in sorted(GOLDEN_DIR.glob("*/*.sh"))}
    argvs = []
    for name, script in scripts.items():
        argv = _argv(script)
        assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[-1] == "$@", name
        argvs.append(argv[3:-1])
    results = sglang_parse(argvs)
    for (name, _), res in zip(scripts.items(), results, strict=True):
        assert "error" not in res, f"{name}: {res}"
        unknown = {w for w in res["rest"] if w.startswith("--")}
        # Every shipped topology serves DDTree (attention DP too): the two overlay flags, nothing else.
        assert unknown == OVERLAY_FLAGS, f"{name}: flags SGLang 0.5.23 does not know: {unknown - OVERLAY_FLAGS}"
    ep8 = results[list(scripts).index("b300-ep8.sh")]["args"]
    assert (ep8["tp_size"], ep8["attn_dp_size"], ep8["ep_size"], ep8["enable_dp_lm_head"]) == (8, 8, 8, True)
    assert (ep8["moe_a2a_backend"], ep8["deepep_mode"], ep8["attention_backend"]) == ("deepep", "auto", "triton")
    assert ep8["speculative_algorithm"] == "DFLASH" and ep8["speculative_accept_threshold_acc"] == 1.0


def test_the_wiring_patch_defines_the_overlay_flags_the_template_uses():
    wiring = Path(__file__).resolve().parent.parent / "overlays/ddtree/hunks/wiring.patch"
    if not wiring.exists():
        pytest.skip("overlay wiring hunk not present")
    text = wiring.read_text()
    for flag in OVERLAY_FLAGS:
        assert f"+    {flag[2:].replace('-', '_')}: A[" in text, flag


# --- validation -----------------------------------------------------------------------------


def test_gpu_counts_that_do_not_divide_are_refused_naming_the_value():
    assert "[b300] tp_size 3 / nnodes 1 = 3 GPUs per node does not divide gpu.count 8" in _error(
        "b300", "tp8", "tp_size=3"
    )
    assert "[b300] tp_size 16 / nnodes 1 x replicas 1 needs 16 GPUs per node, but gpu.count is 8" in _error(
        "b300", "tp8", "tp_size=16"
    )
    assert "ep_size 4 must be 1 or equal tp_size 8" in _error("b300", "tp8", "ep_size=4")
    assert "tp_size 16 does not divide over nnodes 3" in str(
        pytest.raises(RenderError, render_plan, [PAIRS.get("b300-a")] * 3, "tp16-2node", ["nnodes=3"]).value
    )
    assert "replicas 3" in _error("b300", "ep4", "replicas=3")


def test_a_topology_that_does_not_fit_in_gpu_memory_states_the_estimate():
    msg = _error("rtx6000", "ep4")
    assert "[rtx6000] topology ep4 does not fit" in msg
    assert "~601 GB of weights (model_weights_gb 595 + draft_weights_gb 6)" in msg
    assert "4 x 96 GiB x mem_fraction_static 0.88 = 363 GB" in msg
    assert _render("rtx6000", "ep4", "model_weights_gb=300")  # a smaller checkpoint fits


def test_an_attention_backend_that_cannot_apply_the_tree_mask_is_refused():
    msg = _error("b300", "tp8", "attention_backend=flashinfer")
    assert f"[b300] topology tp8: SGLang would refuse this DDTree launch (ddtree {NEWEST} rule)" in msg
    assert "--attention-backend flashinfer does not for an MLA target (Kimi K2.x, DeepSeek) (use: triton)" in msg
    assert "\n" not in msg
    assert _render("b300", "tp8", "attention_backend=flashinfer", "tree_budget=0")  # linear DFlash is fine
    # An MHA target may verify with flashinfer: the rule reads model_attention.
    assert _render("b300", "tp8", "attention_backend=flashinfer", "model_attention=mha")
    assert "attention_backend 'trtllm_mla' cannot run on sm_120" in _error(
        "rtx6000", "tp8", "attention_backend=trtllm_mla"
    )
    assert "moe_a2a_backend 'deepep' cannot run here" in _error("rtx6000", "ep8")
    assert "draft_attention_backend 'flashmla'" in _error("b300", "tp8", "draft_attention_backend=flashmla")
    assert "accept_threshold_acc must be in (0, 1]" in _error("b300", "tp8", "accept_threshold_acc=0")


# --- DDTree's own refusal rules (read from the newest release, not copied) -------------------


def _known(rules, **fields):
    """A DDTreeLaunch of the fields these rules know (the dispatch fields: ddtree 0.2.18 on)."""
    names = {f.name for f in dataclasses.fields(rules.DDTreeLaunch)}
    return rules.DDTreeLaunch(**{k: v for k, v in fields.items() if k in names})


def _exported(env_file: str) -> dict[str, str]:
    lines = [ln[len("export ") :].partition("=") for ln in env_file.splitlines() if ln.startswith("export ")]
    return {name: (shlex.split(value) or [""])[0] for name, _, value in lines}


def _launch_from_argv(rules, argv: list[str], env: dict[str, str]):
    """The DDTree settings a rendered script really passes to the server (Kimi: MLA), its MoE
    dispatch cap read from the env file as the server reads its environment."""
    flags = {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}
    budget = flags.get("--speculative-dflash-tree-budget")
    a2a = flags.get("--moe-a2a-backend", "none")
    return _known(
        rules,
        budget=None if budget is None else int(budget),
        topk=int(flags["--speculative-dflash-tree-topk"]) if budget else None,
        block_size=int(flags["--speculative-dflash-block-size"]),
        verify_backend=flags["--attention-backend"],
        is_mla=True,
        moe_a2a_backend=a2a,
        deepep_mode=flags.get("--deepep-mode", "auto"),
        max_running_requests=int(flags["--max-running-requests"]),
        attn_dp_size=int(flags.get("--attn-dp-size", 1)),
        tp_size=int(flags["--tp-size"]),
        dispatch_cap=rules.dispatch_cap_of(a2a, env) if hasattr(rules, "dispatch_cap_of") else None,
    )


def test_every_shipped_script_is_one_the_ddtree_server_would_start():
    """Each rendered (host, topology) of the shipped inventory and the multi-node pairs,
    checked as argv + environment against the released rules: none would be refused at start."""
    _, rules = load_rules()
    files = golden_files()
    scripts = {rel: text for rel, text in files.items() if rel.endswith(".sh")}
    assert len(scripts) >= 10
    with_tree = 0
    for rel, script in scripts.items():
        launch = _launch_from_argv(rules, _argv(script), _exported(files[rel[:-3] + ".env"]))
        with_tree += launch.budget is not None
        assert rules.ddtree_launch_refusals(launch) == [], rel
    assert with_tree == len(scripts)  # every topology renders DDTree, attention DP (ep8, ep16-2node) too


def _ep_hosts(topology: str):
    return [SHIPPED.get("b300")] if topology == "ep8" else [PAIRS.get("b300-a"), PAIRS.get("b300-b")]


@pytest.mark.parametrize("topology,dp", [("ep8", 8), ("ep16-2node", 16)])
def test_attention_dp_topologies_render_ddtree_with_the_hardware_profiles_budget(topology, dp):
    hw = load_profiles().hardware["b300-nvlink"].values
    units = render_plan(_ep_hosts(topology), topology)
    assert len(units) == dp // 8
    for unit in units:
        argv = _argv(unit.script)
        flags = dict(itertools.pairwise(argv))
        assert flags["--speculative-dflash-tree-budget"] == str(hw["tree_budget"]) == "128"
        assert flags["--speculative-dflash-tree-topk"] == str(hw["tree_topk"]) == "8"
        assert (flags["--tp-size"], flags["--attn-dp-size"], flags["--ep-size"]) == (str(dp),) * 3
        assert "--enable-dp-lm-head" in argv and flags["--moe-a2a-backend"] == "deepep"
        src = {v.key: v.source for v in unit.values}
        assert src["tree_budget"] == src["tree_topk"] == "hardware profile b300-nvlink"
    # Linear DFlash stays one --set away, and the server takes it.
    for unit in render_plan(_ep_hosts(topology), topology, ["tree_budget=0"]):
        argv = _argv(unit.script)
        assert not OVERLAY_FLAGS & set(argv) and "--enable-dp-lm-head" in argv
        assert unit.memory is None


def test_the_newest_release_takes_attention_dp():
    """ep8 and ep16-2node render DDTree because the released rules no longer refuse attention DP
    (ddtree 0.2.12 on; from 0.2.18 they read attn_dp_size again, for the MoE dispatch budget
    only). Were an older release the newest, this attention-DP launch would be refused."""
    _, rules = load_rules()
    launch = _known(
        rules,
        budget=128,
        topk=8,
        block_size=16,
        verify_backend="triton",
        is_mla=True,
        moe_a2a_backend="none",
        max_running_requests=48,
        attn_dp_size=8,
        tp_size=8,
    )
    assert rules.ddtree_launch_refusals(launch) == []


def test_the_rules_come_from_the_newest_release():
    version, rules = load_rules()
    assert version == list_versions()[-1]
    source = Path(rules.__file__).name
    assert source == "ddtree_rules.py" and hasattr(rules, "ddtree_launch_refusals")


def test_render_and_launch_refuse_an_over_budget_dp_launch_before_touching_a_host(cli):
    """As for TP (exit 9, one line): launch renders before it connects (b300's address is a
    placeholder, so getting past the render would be a connection error, not this one). DeepEP's
    normal mode has no low-latency dispatch cap (tests/test_render_dispatch.py), so the memory
    rule is the one that refuses."""
    sets = ("--set", "max_running_requests=384", "--set", "tree_budget=512", "--set", "deepep_mode=normal")
    for command in ("render", "launch"):
        result = cli(command, "--host", "b300", "--topology", "ep8", *sets)
        assert result.code == 9, result
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("ddeploy: error: [b300] topology ep8: DDTree's verify buffers need ~22.15 GiB")
        assert "per DP rank, for its max_running_requests 384 / attn_dp_size 8 = 48 requests" in result.stderr
    # The same TP launch is refused the same way, its estimate per GPU.
    result = cli("launch", "--host", "b300", "--topology", "tp8", "--set", "tree_budget=512")
    assert result.code == 9 and "need ~22.15 GiB per GPU (the verify logits" in result.stderr, result


@pytest.mark.parametrize(
    "sets,server_words",
    [
        # SGLang 0.5.23, arg_groups/speculative_hook.py (_handle_dflash): its ValueError.
        (["enable_dp_lm_head=false"], '"DFLASH with dp attention requires --enable-dp-lm-head."'),
        # arg_groups/parallel_hook.py (_handle_data_parallelism): a bare assert, no message of its own.
        (["attn_dp_size=3"], '"assert cfg.tp_size % cfg.attn_dp_size == 0" fails, an AssertionError without a message'),
    ],
)
def test_dp_launches_sglang_refuses_are_refused_in_its_words_at_render_and_launch(cli, sets, server_words):
    msg = _error("b300", "ep8", *sets)
    assert msg.startswith("[b300] topology ep8: SGLang 0.5.23 would refuse this launch: " + server_words)
    assert "\n" not in msg
    for command in ("render", "launch"):
        result = cli(command, "--host", "b300", "--topology", "ep8", *(a for s in sets for a in ("--set", s)))
        assert result.code == 9 and result.stderr == f"ddeploy: error: {msg}\n", result
    # Both are server refusals of attention DP, not of DDTree: linear DFlash is refused alike.
    assert server_words in _error("b300", "ep8", *sets, "tree_budget=0")


def test_unknown_topology_lists_the_valid_ones():
    assert _error("b300", "tp7") == "unknown topology 'tp7' (valid: tp8, ep8, ep4, tp16-2node, ep16-2node, cpu-tiny)"


def test_unknown_and_malformed_set_keys_are_refused():
    assert "unknown key 'tree_budgte' (did you mean: tree_budget" in _error("b300", "tp8", "tree_budgte=3")
    assert "--set: tp_size='eight': expected an integer" in _error("b300", "tp8", "tp_size=eight")
    assert "'env.1BAD' is not a valid environment variable name" in _error("b300", "tp8", "env.1BAD=x")
    with pytest.raises(UsageError, match=r"malformed --set 'tree_budget': expected key=value"):
        _render("b300", "tp8", "tree_budget")


# --- multi-node -----------------------------------------------------------------------------


def test_multi_node_renders_one_script_per_node_with_ranks_and_rank0_init_address():
    units = render_plan([PAIRS.get("b300-a"), PAIRS.get("b300-b")], "ep16-2node")
    assert [(u.host, u.node_rank) for u in units] == [("b300-a", 0), ("b300-b", 1)]
    argvs = [_argv(u.script) for u in units]
    for rank, argv in enumerate(argvs):
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--dist-init-addr") + 1] == "192.0.2.11:20000"
    # rank 0's address comes from vars.node_addr when the ssh target is an alias
    rtx = render_plan([PAIRS.get("rtx-b"), PAIRS.get("rtx-a")], "tp16-2node")
    assert [u.host for u in rtx] == ["rtx-b", "rtx-a"]
    assert all("--dist-init-addr 198.51.100.22:20000" in u.script for u in rtx)


def test_multi_node_needs_one_identical_host_per_node():
    with pytest.raises(RenderError, match=r"topology tp16-2node has nnodes 2 but 1 host\(s\) were given \(b300\)"):
        _render("b300", "tp16-2node")
    with pytest.raises(RenderError, match="differ in gpu.arch/gpu.count/interconnect"):
        render_plan([PAIRS.get("b300-a"), PAIRS.get("rtx-a")], "tp16-2node")


def test_ep4_renders_two_replicas_on_disjoint_gpus_and_ports():
    r0, r1 = _render("b300", "ep4")
    assert (r0.name, r1.name) == ("b300-ep4-r0", "b300-ep4-r1")
    assert "export CUDA_VISIBLE_DEVICES=0,1,2,3\n" in r0.env and "export CUDA_VISIBLE_DEVICES=4,5,6,7\n" in r1.env
    assert "--port 30000 " in r0.script and "--port 30001 " in r1.script


# --- precedence and --explain ---------------------------------------------------------------


@pytest.fixture
def vars_inventory(tmp_path):
    doc = yaml.safe_load((HOSTS_DIR / "rtx6000.yaml").read_text())
    doc["vars"] = {"tree_budget": 32, "draft_model_path": "/data/drafter", "env": {"NCCL_DEBUG": "INFO"}}
    (tmp_path / "rtx6000.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path


def test_values_resolve_set_over_host_vars_over_topology_over_hardware_over_defaults(vars_inventory):
    inv = Inventory.load(vars_inventory)
    (unit,) = render_plan([inv.get("rtx6000")], "tp8", ["tree_topk=4"])
    src = {v.key: (v.value, v.source) for v in unit.values}
    assert src["tree_topk"] == (4, "--set")
    assert src["tree_budget"][0] == 32 and src["tree_budget"][1].startswith("host rtx6000 vars")
    assert src["tp_size"] == (8, "topology tp8")
    assert src["mem_fraction_static"] == (0.88, "hardware profile rtx-pro-6000-pcie")
    assert src["dflash_block_size"] == (16, "defaults (templates/defaults.yaml)")
    assert src["checkout"][1].startswith("host rtx6000 inventory")
    assert "--speculative-dflash-tree-budget 32 \\\n  --speculative-dflash-tree-topk 4 \\" in unit.script
    assert "export NCCL_DEBUG=INFO\n" in unit.env
    (over,) = render_plan([inv.get("rtx6000")], "tp8", ["tree_budget=16", "env.NCCL_P2P_DISABLE="])
    assert "--speculative-dflash-tree-budget 16 " in over.script and "NCCL_P2P_DISABLE" not in over.env


def test_unknown_host_var_is_refused_naming_the_file(tmp_path):
    doc = yaml.safe_load((HOSTS_DIR / "b300.yaml").read_text())
    doc["vars"] = {"tp_sise": 4}
    (tmp_path / "b300.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(
        RenderError, match=r"host b300 vars \(.*b300.yaml\): unknown key 'tp_sise' \(did you mean: tp_size"
    ):
        render_plan([Inventory.load(tmp_path).get("b300")], "tp8")


def test_explain_cli_prints_each_value_with_its_source(vars_inventory):
    r = run_cli(
        "render", "--host", "rtx6000", "-t", "tp8", "--set", "port=31000", "--explain", inventory=vars_inventory
    )
    assert r.code == 0, r.stderr
    rows = {tuple(line.split()[:2]): line for line in r.stdout.splitlines()[2:]}
    assert rows[("rtx6000-tp8", "port")].endswith("--set")
    assert "hardware profile rtx-pro-6000-pcie" in rows[("rtx6000-tp8", "env.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE")]
    assert "host rtx6000 vars" in rows[("rtx6000-tp8", "tree_budget")]
    assert "layout (computed)" in rows[("rtx6000-tp8", "unit_port")] and " 31000 " in rows[("rtx6000-tp8", "unit_port")]


# --- templates ------------------------------------------------------------------------------


def test_strict_undefined_names_the_missing_value(tmp_path):
    shutil.copytree(TEMPLATES_DIR, tmp_path / "templates")
    tpl = tmp_path / "templates" / "launch.sh.j2"
    tpl.write_text(
        tpl.read_text().replace('  "$@"\n', '  --context-length {{ context_length | shquote }} \\\n  "$@"\n')
    )
    profiles = load_profiles(tmp_path / "templates")
    with pytest.raises(RenderError, match=r"templates/launch.sh.j2: value 'context_length' is undefined"):
        render_plan([SHIPPED.get("b300")], "tp8", profiles=profiles)


def test_values_are_shell_quoted_in_the_script(tmp_path):
    (unit,) = _render("b300", "tp8", "draft_model_path=/models/my drafter's dir", "extra_args=--log-level 'debug x'")
    argv = _argv(unit.script)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "/models/my drafter's dir"
    assert argv[-3:] == ["--log-level", "debug x", "$@"]


# --- CLI ------------------------------------------------------------------------------------


def test_render_cli_writes_script_0755_and_env_and_a_stand_in_runs_with_them(tmp_path):
    code = "import json, os, sys; print(json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], sys.argv[1:]]))"
    r = run_cli(
        "render",
        "--host",
        "b300",
        "-t",
        "ep4",
        "-o",
        str(tmp_path),
        "--set",
        f"server_command={shlex.join([sys.executable, '-c', code])}",
    )
    assert r.code == 0, r.stderr
    script = tmp_path / "b300-ep4-r1.sh"
    assert stat.S_IMODE(script.stat().st_mode) == 0o755 and (tmp_path / "b300-ep4-r1.env").is_file()
    out = subprocess.run([str(script), "--extra"], capture_output=True, text=True, check=True).stdout
    devices, argv = json.loads(out)
    assert devices == "4,5,6,7" and argv[:2] == ["--model-path", "moonshotai/Kimi-K2.6"] and argv[-1] == "--extra"


def test_render_cli_errors_exit_with_the_render_code():
    r = run_cli("render", "--host", "rtx6000", "-t", "ep4")
    assert r.code == 9 and r.stderr.startswith("ddeploy: error: [rtx6000] topology ep4 does not fit")
    r = run_cli("render", "--host", "rtx6000")
    assert r.code == 2 and "render needs --topology" in r.stderr


def test_render_all_writes_every_valid_pair_and_reports_skipped(tmp_path):
    r = run_cli("render", "--all", "-o", str(tmp_path))
    assert r.code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.sh")) == sorted(
        rel.split("/")[1] for rel in golden_files() if rel.startswith("shipped/") and rel.endswith(".sh")
    )
    assert "skipped rtx6000 ep4: [rtx6000] topology ep4 does not fit" in r.stderr


def test_jit_compiles_are_forbidden_only_when_a_kernel_cache_is_known():
    (offline,) = _render("b300", "tp8")
    assert "SGLANG_JIT_CACHE_DIR" not in offline.env and "SGLANG_CRASH_ON_JIT_COMPILE" not in offline.env
    (built,) = _render("b300", "tp8", "jit_cache_dir=/c/0f1e")
    assert "export SGLANG_JIT_CACHE_DIR=/c/0f1e\nexport SGLANG_CRASH_ON_JIT_COMPILE=1\n" in built.env
    (lenient,) = _render("b300", "tp8", "jit_cache_dir=/c/0f1e", "crash_on_jit_compile=false")
    assert "SGLANG_JIT_CACHE_DIR=/c/0f1e" in lenient.env and "SGLANG_CRASH_ON_JIT_COMPILE" not in lenient.env


def test_a_single_node_topology_over_a_group_renders_each_host_on_its_own(tmp_path):
    r = run_cli("render", "--group", "b300-pair", "-t", "tp8", "-o", str(tmp_path), inventory=GOLDEN_DIR / "inventory")
    assert r.code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.sh")) == ["b300-a-tp8.sh", "b300-b-tp8.sh"]
    assert "--nnodes" not in (tmp_path / "b300-b-tp8.sh").read_text()


def test_a_topology_name_that_is_not_a_plain_file_name_is_refused(tmp_path):
    shutil.copytree(TEMPLATES_DIR, tmp_path / "templates")
    with open(tmp_path / "templates" / "topologies.yaml", "a") as f:
        f.write("\n../evil:\n  values: {tp_size: 8}\n")
    with pytest.raises(RenderError, match=r"topology name '../evil' must be letters"):
        load_profiles(tmp_path / "templates")


# --- DDTree's verify memory, before launch --------------------------------------------------


@pytest.mark.parametrize(
    "host,width,total_gib,headroom_gib",
    [("rtx6000", 65, 3.50, 11.52), ("b300", 129, 6.12, 43.20)],
)
def test_tree_memory_estimate_of_the_shipped_profiles(host, width, total_gib, headroom_gib):
    (unit,) = _render(host, "tp8")
    m = unit.memory
    assert m.width == width and m.fits
    # verify logits: 48 requests x W x 163,840 x 4 B; mask: 48 x W x (262,144 + W) B.
    logits, mask, sampling = (t.bytes for t in m.terms)
    assert logits == 48 * width * 163_840 * 4 and mask == 48 * width * (262_144 + width)
    # memory-light, two full chunks (the previous chunk's probabilities beside the next target): 3.5 buffers
    assert sampling == (2**26 // (width * 163_840)) * width * 163_840 * 4 * 7 // 2
    assert round(m.total / 2**30, 2) == total_gib and round(m.headroom / 2**30, 2) == headroom_gib


def test_tree_memory_under_attention_dp_is_per_dp_rank():
    """ep8 on a B300: each of the 8 DP ranks (one GPU) verifies 48 // 8 = 6 requests, W = 129,
    with the whole 163,840-token vocabulary (attention-TP size 1; gathered over it in general)."""
    (unit,) = _render("b300", "ep8")
    m = unit.memory
    assert (m.width, m.requests, m.attn_dp_size, m.per_dp_rank) == (129, 6, 8, True)
    logits, mask, sampling = (t.bytes for t in m.terms)
    assert logits == 6 * 129 * 163_840 * 4 == 507_248_640  # 0.47 GiB
    assert mask == 6 * 129 * (262_144 + 129) == 202_999_302  # 0.19 GiB
    # 6 x 129 x 163,840 = 126,812,160 elements > 2^26: memory-light, 2^26 // (129 x 163,840) = 3 requests.
    assert m.terms[2].name == "sampling (memory-light)" and sampling == 3 * 129 * 163_840 * 4 * 7 // 2 == 887_685_120
    assert m.total == 1_597_933_062 and m.fits  # 1.49 GiB of 21.60
    # ep16-2node: 48 // 16 = 3 requests per DP rank, dense sampling (63,406,080 elements).
    for node in render_plan([PAIRS.get("b300-a"), PAIRS.get("b300-b")], "ep16-2node"):
        assert node.memory.requests == 3 and node.memory.terms[2].name == "sampling (dense)"
    # SGLang's split floors, and gives every DP rank at least one request.
    assert _render("b300", "ep8", "max_running_requests=4")[0].memory.requests == 1
    assert _render("b300", "ep8", "max_running_requests=20")[0].memory.requests == 2
    # Attention-TP 2 (tp 8, attn_dp 4): 12 requests, the logits still over the whole vocabulary
    # (DeepEP's normal mode: 12 x 129 tokens per rank are over the low-latency dispatch cap).
    (half,) = _render("b300", "ep8", "attn_dp_size=4", "deepep_mode=normal")
    assert half.memory.requests == 12 and half.memory.terms[0].bytes == 12 * 129 * 163_840 * 4


def test_a_budget_the_tp_layout_refuses_fits_per_dp_rank():
    """tree_budget 512 on a B300: TP 8 verifies all 48 requests per GPU (refused), EP 8's DP ranks 6."""
    assert "need ~22.15 GiB per GPU" in _error("b300", "tp8", "tree_budget=512")
    # DeepEP's normal mode: 6 x 513 tokens per rank are over the low-latency dispatch cap.
    (unit,) = _render("b300", "ep8", "tree_budget=512", "deepep_mode=normal")
    assert round(unit.memory.total / 2**30, 2) == 3.73


def test_explain_labels_the_dp_estimate_per_dp_rank(cli):
    result = cli("render", "--host", "b300", "--topology", "ep8", "--explain")
    assert result.code == 0, result
    lines = [ln.split() for ln in result.stdout.splitlines()]
    assert ["unit", "DDTree", "verify", "memory", "per", "DP", "rank", "estimate", "of", "headroom"] in lines
    assert ["b300-ep8", "verify", "logits", "0.47", "GiB", "1%"] in lines
    assert ["b300-ep8", "tree", "mask", "0.19", "GiB", "0%"] in lines
    assert ["b300-ep8", "sampling", "(memory-light)", "0.83", "GiB", "2%"] in lines
    total = "b300-ep8 total per DP rank (W = 129, 6 requests = 48 / attn_dp_size 8) 1.49 GiB 3%".split()
    assert total in lines
    assert any(ln[:3] == ["b300-ep8", "headroom", "(1"] and "43.20" in ln for ln in lines)
    tp = cli("render", "--host", "b300", "--topology", "tp8", "--explain").stdout
    assert "DDTree verify memory per GPU" in tp and "per DP rank" not in tp


def test_a_tree_that_does_not_fit_is_refused_naming_the_dominant_term():
    msg = _error("rtx6000", "tp8", "tree_budget=512")
    assert "DDTree's verify buffers need ~22.15 GiB per GPU (the verify logits, 15.03 GiB, dominates)" in msg
    assert "half of the 11.52 GiB SGLang leaves outside mem_fraction_static 0.88" in msg
    assert msg.endswith("lower max_running_requests or tree_budget, or mem_fraction_static")
    # The same budget fits with fewer concurrent requests, and on a B300.
    assert _render("rtx6000", "tp8", "tree_budget=512", "max_running_requests=8")
    assert _render("b300", "tp8", "tree_budget=384")


def test_a_long_context_makes_the_mask_dominate():
    msg = _error("rtx6000", "tp8", "model_context_length=2000000")
    assert "(the tree mask, " in msg


def test_explain_prints_the_memory_estimate_beside_the_headroom(cli):
    result = cli("render", "--host", "b300", "--topology", "tp8", "--explain")
    assert result.code == 0, result
    lines = [ln.split() for ln in result.stdout.splitlines()]
    assert ["b300-tp8", "verify", "logits", "3.78", "GiB", "9%"] in lines
    assert ["b300-tp8", "total", "(W", "=", "129)", "6.12", "GiB", "14%"] in lines
    assert any(ln[:3] == ["b300-tp8", "headroom", "(1"] and "43.20" in ln for ln in lines)
