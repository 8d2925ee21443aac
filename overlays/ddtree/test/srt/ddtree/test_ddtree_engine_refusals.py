"""What DDTree cannot serve is refused clearly, on a real SGLang 0.5.23 server (CPU).

Start-up: each refused configuration is refused with its own message while the
server's arguments resolve, before any weight loads: one through a real
``sglang.launch_server`` (the process exits, its log says why), the others
through the same resolution calls in one process (``cpu_engine.resolve``).

Per request: a request the tree verify cannot serve gets its error while another
request on the same server is served.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request

import pytest

from cpu_engine.cpu_tree import DDTREE_TORCH_NATIVE, DDTREE_TORCH_NATIVE_MLA
from cpu_engine.fixtures import cpu_tree_python, tree_root
from cpu_engine.models import cached_tiny_models
from cpu_engine.pool import ServerConfig
from cpu_engine.resolve import resolve_many
from cpu_engine.server import dflash_args, start_expect_failure

pytestmark = pytest.mark.slow


def _ddtree(models, *extra):
    return dflash_args(models.draft, *extra)


REFUSED = {
    "topk-above-vocab": (
        (
            "--speculative-dflash-tree-budget",
            "8",
            "--speculative-dflash-tree-topk",
            "65",
        ),
        "--speculative-dflash-tree-topk 65 exceeds the target vocabulary size 64",
    ),
    "topk-without-budget": (
        ("--speculative-dflash-tree-topk", "2"),
        "--speculative-dflash-tree-topk requires --speculative-dflash-tree-budget",
    ),
    "zero-budget": (
        ("--speculative-dflash-tree-budget", "0"),
        "DDTree requires --speculative-dflash-tree-budget to be positive, got 0",
    ),
    "pipeline-parallel": (
        ("--speculative-dflash-tree-budget", "8", "--pp-size", "2"),
        "only supports pp_size == 1",
    ),
    # Lossy thresholds: the dense verify would apply them, the memory-light one not.
    "lossy-accept-threshold": (
        (
            "--speculative-dflash-tree-budget",
            "8",
            "--speculative-accept-threshold-single",
            "0.9",
        ),
        "--speculative-accept-threshold-single 0.9 would make it lossy",
    ),
}


def _refused_before_loading(python_dir, target, args, log) -> str:
    """The server's log tail; it must have exited while the arguments resolved,
    before any weight loaded."""
    tail = start_expect_failure(python_dir, target, args, log)
    assert "Load weight" not in log.read_text(), tail
    return tail


def test_a_refused_server_exits_at_start_up_before_loading_with_its_message(
    cpu_sglang_python, tiny_models, server_log_dir
):
    """One refusal through a real ``sglang.launch_server``: the process a user
    starts exits, its log names the flag, no weight loaded. The others below
    run the same resolution calls in one process (``cpu_engine.resolve``)."""
    extra, message = REFUSED["topk-above-vocab"]
    log = server_log_dir / "refused-topk-above-vocab.log"
    args = _ddtree(tiny_models, *extra)
    tail = _refused_before_loading(cpu_sglang_python, tiny_models.target, args, log)
    assert message in tail, tail


@pytest.fixture(scope="module")
def lilicorr_draft(tiny_models, tmp_path_factory):
    """The tiny draft, its config naming a LiLiCorr head (a head of its own)."""
    draft = tmp_path_factory.mktemp("drafts") / "lilicorr-draft"
    shutil.copytree(tiny_models.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    config["architectures"] = ["LiLiCorrDraftModel"]
    (draft / "config.json").write_text(json.dumps(config))
    return draft


@pytest.fixture(scope="module")
def resolved(cpu_sglang_python, tiny_models, lilicorr_draft, server_log_dir):
    """Each case's resolution in the CPU tree (one process), and a DDTree
    configuration that must resolve: a resolver that refused everything would
    fail on it."""
    target = tiny_models.target
    cases = {name: (target, _ddtree(tiny_models, *extra))
             for name, (extra, _) in REFUSED.items()}
    cases["lilicorr-draft"] = (target, dflash_args(lilicorr_draft, budget=8))
    cases["accepted"] = (target, dflash_args(tiny_models.draft, budget=8))
    cases["dflash-without-draft"] = (target, ("--speculative-algorithm", "DFLASH"))
    return resolve_many(cpu_sglang_python, cases,
                        server_log_dir / "refused-resolve.log")


def test_a_servable_ddtree_configuration_resolves(resolved):
    fields = resolved["accepted"]["resolved"]
    assert fields["speculative_algorithm"] == "DFLASH"
    assert fields["speculative_dflash_tree_budget"] == 8
    assert fields["speculative_num_draft_tokens"] == 9  # budget + 1


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_configuration_fails_at_start_up_with_its_message(resolved, name):
    _, message = REFUSED[name]
    assert message in resolved[name].get("refused", ""), resolved[name]


def test_linear_dflash_without_a_draft_is_refused_with_sglangs_reason(resolved):
    """SGLang's own refusal, through the same resolution (not DDTree's)."""
    assert (
        "DFLASH speculative decoding requires setting --speculative-draft-model-path"
        in resolved["dflash-without-draft"].get("refused", "")
    ), resolved["dflash-without-draft"]


def test_a_draft_with_a_head_of_its_own_is_refused_before_loading(resolved):
    """The draft's head is known from its config at argument resolution."""
    assert (
        "needs a plain DFlash draft (a per-position token head); this draft uses "
        "a LiLiCorr head" in resolved["lilicorr-draft"].get("refused", "")
    ), resolved["lilicorr-draft"]


@pytest.fixture(scope="module")
def strict_python(cpu_sglang_python):
    """The CPU tree under the released rules: without the harness's allowance,
    torch_native does not count as a backend that applies the tree mask."""
    skip = [DDTREE_TORCH_NATIVE, DDTREE_TORCH_NATIVE_MLA]
    return cpu_tree_python(tree_root(), skip=skip)


@pytest.fixture(scope="module")
def mla_models():
    return cached_tiny_models(arch="mla")


MLA_BACKENDS = ("flashinfer", "torch_native")


@pytest.fixture(scope="module")
def strict_resolved(strict_python, tiny_models, mla_models, server_log_dir):
    """Resolutions under the released rules (one process); the MLA target with
    triton, the backend that applies the tree mask, must resolve."""
    cases = {
        "torch-native": (
            tiny_models.target,
            _ddtree(tiny_models, "--speculative-dflash-tree-budget", "8"),
        ),
        "mla-triton": (
            mla_models.target,
            dflash_args(mla_models.draft, "--attention-backend", "triton",
                        budget=8),
        ),
    }
    for backend in MLA_BACKENDS:
        cases[f"mla-{backend}"] = (
            mla_models.target,
            dflash_args(mla_models.draft, "--attention-backend", backend,
                        budget=8),
        )
    return resolve_many(strict_python, cases,
                        server_log_dir / "refused-strict-resolve.log")


def test_released_backend_policy_refuses_a_backend_without_a_verify_mask(
    strict_resolved,
):
    assert (
        "DDTree needs a TARGET_VERIFY attention backend that applies the tree "
        "mask; --attention-backend torch_native does not for this target "
        "(use: flashinfer, triton)" in strict_resolved["torch-native"].get(
            "refused", "")
    ), strict_resolved["torch-native"]
    assert "resolved" in strict_resolved["mla-triton"], strict_resolved


@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_mla_target_with_a_backend_other_than_triton_is_refused_before_loading(
    strict_resolved, backend
):
    """For an MLA target (Kimi K2.x) only triton applies the tree mask: any other
    backend is refused at argument resolution, naming the flag and what works,
    before any weight loads. (B300's default trtllm_mla is refused the same way,
    test_ddtree_config; on CPU SGLang's own hardware check refuses it first.)"""
    outcome = strict_resolved[f"mla-{backend}"]
    assert (
        f"--attention-backend {backend} does not for an MLA target (Kimi K2.x, "
        "DeepSeek) (use: triton)" in outcome.get("refused", "")
    ), outcome


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


# Penalties: plain decoding updates them after every token, a verify cannot.
REFUSED_REQUESTS = {
    "repetition_penalty": (
        {"sampling_params": {"repetition_penalty": 1.3}},
        "DDTree speculative decoding does not support repetition_penalty",
    ),
    "min_new_tokens": (
        {"sampling_params": {"min_new_tokens": 4, "frequency_penalty": 0.5}},
        "does not support frequency_penalty, min_new_tokens",
    ),
    # SGLang would capture linear DFlash's top-k-first target, not DDTree's.
    "sampled-sampling-mask": (
        {
            "sampling_params": {"temperature": 1.0, "top_k": 4},
            "return_sampling_mask": True,
        },
        "does not support return_sampling_mask for sampled requests",
    ),
}


@pytest.fixture(scope="module")
def ddtree_server(server_pool, tiny_models):
    """The greedy modules' budget-2, top-K-2 tree (the same configuration, so
    the pool's server from test_ddtree_engine_greedy_requests when it still runs)."""
    args = dflash_args(tiny_models.draft, budget=2, topk=2)
    return server_pool.get(ServerConfig.of(tiny_models.target, args,
                                           name="greedy-below-depth-k2"))


@pytest.mark.parametrize("name", sorted(REFUSED_REQUESTS))
def test_refused_request_gets_its_error_while_another_is_served(ddtree_server, name):
    extra, message = REFUSED_REQUESTS[name]
    sampling = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    good = {"input_ids": list(range(5, 20)), "sampling_params": sampling}
    bad = {"input_ids": [7, 8, 9], **extra, "sampling_params": dict(sampling)}
    bad["sampling_params"].update(extra.get("sampling_params", {}))
    results = {}

    def send(key, body):
        results[key] = _post(ddtree_server.url, body)

    threads = [
        threading.Thread(target=send, args=item)
        for item in (("good", good), ("bad", bad))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    status, reply = results["good"]
    assert status == 200 and len(reply["output_ids"]) == 48
    status, reply = results["bad"]
    assert message in json.dumps(reply), (status, reply)
    # The server still serves after the refusal.
    assert (
        _post(ddtree_server.url, good)[1]["output_ids"]
        == results["good"][1]["output_ids"]
    )
