"""The pieces of `launch --wait` / `bench` that need no server: the cpu-tiny profile's rendering and
refusals, the greedy probes and their comparison, the summary of /server_info, the tables, and
bad arguments refused before any host is contacted (tests/test_serving.py runs the real thing)."""

from __future__ import annotations

import pytest

from deployer.agent.serving import serving_summary
from deployer.cli.views import bench_table, bench_text
from deployer.errors import RenderError, UsageError
from deployer.inventory import Inventory, local_host
from deployer.ops.bench import BenchParams, first_difference, probe_prompts
from deployer.ops.launch import unit_url
from deployer.render import render_plan


def _values(unit) -> dict:
    return {v.key: v.value for v in unit.values}


def test_cpu_tiny_renders_for_the_local_host_with_the_harness_and_says_so():
    (unit,) = render_plan([local_host()], "cpu-tiny")
    v = _values(unit)
    engine = v["launch_dir"] + "/cpu-engine"
    assert v["model_path"] == engine + "/models/target" and v["draft_model_path"] == engine + "/models/draft"
    assert "CPU ENGINE PROFILE (topology cpu-tiny): for the `local` host and test hosts only, never" in unit.script
    assert "-m cpu_engine.local_profile" in unit.script and "--arch mla --kind alternating" in unit.script
    assert "--device \\\n  cpu" in unit.script and "--speculative-dflash-tree-budget 14" in unit.script
    assert "--attention-backend torch_native" in unit.script and "--tp-size 2" in unit.script
    assert "export CUDA_VISIBLE_DEVICES=''" in unit.env and "SGLANG_CPU_OMP_THREADS_BIND='0|1'" in unit.env
    assert "\nexport OMP_NUM_THREADS=1\n" in unit.env  # one thread per rank's core
    # The CPU copy first on the path; no JIT cache, no GPU hardware profile values.
    assert unit.env.rstrip().splitlines()[-1].startswith(f"export PYTHONPATH={engine}/cpu-tree/python:")
    assert "SGLANG_JIT_CACHE_DIR" not in unit.env and "NCCL_P2P_DISABLE" not in unit.env
    assert unit.memory is None


@pytest.mark.parametrize("host", ["b300", "rtx6000"])
def test_cpu_tiny_is_never_rendered_for_a_gpu_host(host):
    inventory = Inventory.load("hosts")
    with pytest.raises(
        RenderError, match=f"\\[{host}\\] topology cpu-tiny is the CPU engine profile .* never rendered"
    ):
        render_plan([inventory.get(host)], "cpu-tiny")


def test_cpu_tiny_refuses_unknown_models_and_gpu_layouts():
    with pytest.raises(RenderError, match="cpu_model_arch must be one of mla, llama"):
        render_plan([local_host()], "cpu-tiny", ["cpu_model_arch=qwen"])
    with pytest.raises(RenderError, match="serves one CPU server: nnodes, replicas"):
        render_plan([local_host()], "cpu-tiny", ["replicas=2"])


def test_the_baselines_render_without_the_tree_or_without_speculation():
    gpu = Inventory.load("hosts").get("b300")
    (linear,) = render_plan([gpu], "tp8", ["tree_budget=0"])
    assert "--speculative-algorithm DFLASH" in linear.script and "tree-budget" not in linear.script.split("set -eu")[1]
    (plain,) = render_plan([gpu], "tp8", ["speculative_algorithm="])
    assert "--speculative" not in plain.script.split("set -eu")[1]
    assert "DDTree is proven" not in plain.script


def test_unit_urls_reach_wildcard_listeners_on_loopback():
    host = local_host()
    for listen, url in (
        ("0.0.0.0", "http://127.0.0.1:31000"),
        ("::", "http://[::1]:31000"),
        ("10.0.0.5", "http://10.0.0.5:31000"),
    ):
        (unit,) = render_plan([host], "cpu-tiny", [f"listen_host={listen}", "port=31000"])
        assert unit_url(unit) == url


def test_probe_prompts_are_fixed_per_seed_and_inside_the_vocabulary():
    a, b = probe_prompts(64, 1), probe_prompts(64, 1)
    assert a == b and a != probe_prompts(64, 2) and len(a) == 8
    assert all(4 <= t < 64 for p in a for t in p) and all(4 <= len(p) <= 40 for p in a)
    assert max(t for p in probe_prompts(163840, 1) for t in p) < 32000


def test_first_difference_names_the_prompt_and_position():
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (1, 1)
    assert first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)  # a shorter completion differs too


def test_server_info_summary_names_the_configuration():
    info = {
        "served_model_name": "kimi-k2.6",
        "speculative_algorithm": "DFLASH",
        "speculative_num_draft_tokens": 65,
        "speculative_dflash_tree_budget": 64,
        "speculative_dflash_tree_topk": 8,
        "attention_backend": "triton",
        "tp_size": 8,
    }
    s = serving_summary(info)
    assert (s["config"], s["verify_width"], s["tree_budget"], s["tp_size"]) == ("ddtree", 65, 64, 8)
    assert serving_summary({**info, "speculative_dflash_tree_budget": None})["config"] == "linear"
    assert serving_summary({"speculative_algorithm": None})["config"] == "plain"


def test_bench_params_refuse_what_cannot_run():
    with pytest.raises(UsageError, match="--requests 0, --concurrency 0: must be at least 1"):
        BenchParams(0, (4, 0), 16, 32, 0.0).check()
    with pytest.raises(UsageError, match="--temperature -1: must be 0"):
        BenchParams(8, (4,), 16, 32, -1.0).check()


def test_bad_bench_arguments_fail_before_any_host_is_contacted(cli):
    r = cli("bench", "--host", "local", "--output-len", "0")
    assert r.code == 2 and "--output-len 0: must be at least 1" in r.stderr
    r = cli("bench", "--host", "local", "--compare", "eagle")
    assert r.code == 2 and "'eagle' is not one of 'linear', 'plain'" in r.stderr
    r = cli("bench", "--host", "nohost")
    assert r.code == 3 and "nohost" in r.stderr


RESULT = {
    "host": "local",
    "topology": "cpu-tiny",
    "at": "2026-12-02T04:22:57Z",
    "applied": "ddtree 0.2.9",
    "compare": "linear",
    "params": {"requests": 8, "concurrency": [4], "input_len": 16, "output_len": 32, "temperature": 0.0,
               "warmup": 1, "repeats": 3},
    "configs": [
        {"config": "ddtree", "tree_budget": 14, "tree_topk": 2, "verify_width": 15, "concurrency": 4,
         "accept_length": 4.0, "verify_count": 72, "output_tokens_per_s": 73.6, "speedup": 1.857,
         "output_tokens_per_s_min": 70.2, "output_tokens_per_s_max": 75.0, "repeats": 3,
         "speedup_interval": {"low": 1.71, "high": 1.97, "runs": [3, 3], "excludes_one": True},
         "ttft_ms_median": 386.9, "ttft_ms_p99": 617.6, "itl_ms_median": 32.4, "itl_ms_p99": 130.4,
         "greedy_equal": True},
        {"config": "linear", "tree_budget": None, "tree_topk": None, "verify_width": 4, "concurrency": 4,
         "accept_length": 1.94, "verify_count": 136, "output_tokens_per_s": 39.7, "speedup": None,
         "output_tokens_per_s_min": 38.1, "output_tokens_per_s_max": 41.0, "repeats": 3,
         "speedup_interval": None,
         "ttft_ms_median": 279.1, "ttft_ms_p99": 1095.7, "itl_ms_median": 67.1, "itl_ms_p99": 364.5,
         "greedy_equal": True},
    ],
    "greedy": {"checked": True, "equal": True, "prompts": 8, "difference": None},
}  # fmt: skip


def test_the_bench_table_and_the_status_cell():
    text = bench_table(RESULT)
    assert "; medians of 3 runs per concurrency after 1 warm-up run per config\n" in text
    assert "ddtree B=14 K=2 (W=15)  4            4.00           72            73.6          70.2-75.0     1.86x" in text
    assert "linear (W=4)" in text and "vs linear" in text and "38.1-41.0" in text
    assert text.endswith(
        "speedup at concurrency 4: DDTree 1.86x linear (1.71-1.97 over 3x3 runs)\n"
        "greedy check: 8 prompts, ddtree equals linear token for token"
    )
    assert bench_text(RESULT) == "cpu-tiny: ddtree 73.6 tok/s vs linear 39.7 tok/s, greedy equal (2026-12-02T04:22:57Z)"
    failed = {
        **RESULT,
        "greedy": {"checked": True, "equal": False, "prompts": 8,
                   "difference": {"prompt": 3, "position": 5, "got": 18, "baseline": 11}},
    }  # fmt: skip
    assert bench_table(failed).endswith("greedy check: FAILED on probe prompt 3 at output token 5 (18 vs linear's 11)")
    assert "GREEDY DIFFERS" in bench_text(failed) and bench_text(None) == "-"
