"""DDTree under attention data parallel (the EP topologies) on a real SGLang
0.5.23 server (CPU), with the MLA + MoE target.

The servers run ``--tp-size 2 --attn-dp-size 2 --ep-size 2
--enable-dp-lm-head``: two attention-DP replicas of one rank each, the MoE
experts split over both ranks, the LM head whole on each replica. SGLang only
allows DFLASH with DP attention on CUDA or NPU, and its DP gathers need PyNccl;
the CPU tree's test-only changes 11 and 12 (``cpu_engine/cpu_tree.py``,
docs/cpu-engine.md) make it run over gloo. The target is the vocabulary-8
``DeepseekV3ForCausalLM`` of the sampling tests (``cpu_engine.sampling``), so
one server serves both the greedy and the sampled checks:

* greedy DDTree output equals Hugging Face's plain greedy decoding and the
  plain DP server's, with one request (the other DP rank idle: it runs the
  tree verify's idle input) and with four concurrent requests (both replicas
  busy, the verify batch padded to the busier one's requests);
* each DP rank records what it commits (``DDTREE_TEST_RECORD_DIR``): with one
  request only the rank SGLang names in the reply commits, the tokens the
  reply carries; with four both do;
* per request, the accept length equals the same models' TP 1 DDTree run;
* sampled output (temperature 0.9) follows the target's exact distribution of
  the first three tokens (chi-square, as the TP 2 sampling test), each DP
  rank's samples on their own: every replica seeds its sampler with the same
  ``--random-seed``, so with the same requests the two replicas draw largely
  the same samples (request for request where they run the same batches,
  which depends on when the dispatch hands requests on: so no test asserts
  it); only one replica's samples are independent of each other. n is about
  600 per rank: a distortion of Cohen's w >= 0.35 is caught at p < 1e-4 with
  99% power (``sampling.detectable_effect``);
* the control: an idle rank that skips its idle verify
  (``DDTREE_TEST_IDLE_VERIFY=skip``) leaves the busy rank's collectives without
  a partner; the request does not complete within a bound many times a normal
  request's time (a request that completes fails the test: never a silent
  pass).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cpu_engine.models import cached_tiny_models, hf_greedy
from cpu_engine.pool import ServerConfig
from cpu_engine.sampling import (
    P_LOSSLESS,
    PER_CALL,
    VOCAB,
    chi_square_p,
    exact_first_three,
    outside_support,
    sample_replies,
)
from cpu_engine.server import dflash_args, launch_server, tp_args

pytestmark = pytest.mark.slow

DP_ARGS = ("--attn-dp-size", "2", "--ep-size", "2", "--enable-dp-lm-head")
BUDGET = 16
NEW_TOKENS = 12
PROMPTS = [[4, 6, 5, 7, 4, 5], [5, 5], [6, 4, 7], [7, 6, 5, 4, 7, 6, 5]]
REQUESTS = 1200  # about 600 per DP rank
# The control's request (4 tokens: the first verify already hangs) takes a few
# seconds on a working server, beside the other test worker too; its hang is
# caught after this many.
CONTROL_TOKENS, CONTROL_TIMEOUT = 4, 30


@dataclass
class Run:
    single: dict  # the reply to PROMPTS[0] alone
    batch: list[dict]  # the replies to all PROMPTS at once
    records: dict[str, list[list[list[int]]]]  # per phase: rank file -> steps
    sampled: dict[int, torch.Tensor] | None = None  # DP rank -> int64 [n, 3]
    log: str = ""

    @property
    def outputs(self) -> list[list[int]]:
        return [r["output_ids"] for r in self.batch]


@pytest.fixture(scope="module")
def models():
    return cached_tiny_models(vocab=VOCAB, arch="mla")


def _config(models, name: str, tp: int, dp: bool, budget, record_dir=None):
    parallel, env = tp_args(tp)
    args = [*parallel, *(DP_ARGS if dp else ()), "--max-running-requests",
            str(PER_CALL)]
    if budget is not None:
        args += dflash_args(models.draft, budget=budget)
    if record_dir is not None:
        env["DDTREE_TEST_RECORD_DIR"] = str(record_dir)
    return ServerConfig.of(models.target, args, env, name=f"dp-{name}")


def _read_records(record_dir: Path, seen: dict[str, int]) -> dict[str, list]:
    """The steps each rank recorded since the last call (``seen``: lines read)."""
    out = {}
    for path in sorted(record_dir.glob("rank*.jsonl")):
        lines = path.read_text().splitlines()
        out[path.name] = [json.loads(ln) for ln in lines[seen.get(path.name, 0):]]
        seen[path.name] = len(lines)
    return out


def _run(server, record_dir: Path | None, sample: bool) -> Run:
    seen: dict[str, int] = {}
    records = {}
    single = server.generate(PROMPTS[0], NEW_TOKENS)
    if record_dir is not None:
        records["single"] = _read_records(record_dir, seen)
    batch = server.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
    if record_dir is not None:
        records["batch"] = _read_records(record_dir, seen)
    sampled = _sample_by_rank(server.url, REQUESTS) if sample else None
    return Run(single, batch, records, sampled, server.log_path.read_text())


def _sample_by_rank(url: str, requests: int) -> dict[int, torch.Tensor]:
    """The first three sampled tokens of ``requests`` requests (as
    ``sampling.sample_first_three``), by the DP rank that served each."""
    rows: dict[int, list] = {}
    for reply in sample_replies(url, requests):
        rank = reply["meta_info"]["dp_rank"]
        rows.setdefault(rank, []).append(reply["output_ids"][:3])
    return {rank: torch.tensor(r) for rank, r in sorted(rows.items())}


@pytest.fixture(scope="module")
def runs(server_pool, models, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("dp-records")
    configs = {
        "dp-plain": _config(models, "plain", 2, True, None),
        "dp-ddtree": _config(models, "ddtree", 2, True, BUDGET, record_dir),
        "tp1-ddtree": _config(models, "tp1-ddtree", 1, False, BUDGET),
    }
    out = {}
    for name, server in zip(configs, server_pool.each(list(configs.values()))):
        is_dp_tree = name == "dp-ddtree"
        out[name] = _run(server, record_dir if is_dp_tree else None, is_dp_tree)
    return out


@pytest.fixture(scope="module")
def plain_greedy(models):
    return hf_greedy(models.target, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("name", ["dp-plain", "dp-ddtree"])
def test_greedy_output_equals_plain_decoding(runs, plain_greedy, name):
    run = runs[name]
    assert run.single["output_ids"] == plain_greedy[0], f"{name}: one request"
    for i, (want, got) in enumerate(zip(plain_greedy, run.outputs)):
        assert got == want, f"{name}: prompt {i} of four concurrent diverges"


def test_ddtree_equals_the_plain_dp_server(runs):
    assert runs["dp-ddtree"].outputs == runs["dp-plain"].outputs


def test_both_dp_ranks_served_and_ddtree_ran_on_both(runs):
    run = runs["dp-ddtree"]
    assert sorted({r["meta_info"]["dp_rank"] for r in run.batch}) == [0, 1]
    assert run.log.count("DDTree on: budget=16") == 2  # once per DP rank
    assert "DP0 TP0 EP0" in run.log and "DP1 TP1 EP1" in run.log


def test_one_request_only_its_rank_commits_its_tokens(runs):
    run = runs["dp-ddtree"]
    busy = f"rank{run.single['meta_info']['dp_rank']}.jsonl"
    steps = run.records["single"]
    idle = [name for name in steps if name != busy]
    assert all(steps[name] == [] for name in idle), "the idle rank committed"
    committed = [t for step in steps[busy] for row in step for t in row]
    # The first token comes from the prefill; the verifies commit the rest.
    assert committed[: NEW_TOKENS - 1] == run.single["output_ids"][1:]


def test_four_requests_both_ranks_commit(runs):
    steps = runs["dp-ddtree"].records["batch"]
    assert sorted(steps) == ["rank0.jsonl", "rank1.jsonl"]
    assert all(steps[name] for name in steps)


def test_accept_length_equals_the_tp1_run(runs):
    dp, tp1 = runs["dp-ddtree"], runs["tp1-ddtree"]
    assert tp1.outputs == dp.outputs
    for i, (a, b) in enumerate(zip(dp.batch, tp1.batch)):
        got, want = (r["meta_info"]["spec_accept_length"] for r in (a, b))
        assert got == pytest.approx(want, abs=1e-9), f"prompt {i}"
    assert max(r["meta_info"]["spec_accept_length"] for r in dp.batch) > 1.0


def test_sampled_output_follows_the_target_on_each_dp_rank(runs, models):
    sampled = runs["dp-ddtree"].sampled
    exact = exact_first_three(models.target)
    assert sorted(sampled) == [0, 1]
    assert sum(len(t) for t in sampled.values()) == REQUESTS
    for rank, tokens in sampled.items():
        assert len(tokens) >= REQUESTS // 3, f"rank {rank}: {len(tokens)} samples"
        assert outside_support(tokens, exact) == 0
        assert chi_square_p(tokens, exact) > P_LOSSLESS, f"rank {rank}"


def test_control_an_idle_rank_that_skips_its_verify_hangs_the_round(
    cpu_sglang_python, models, server_log_dir
):
    """The busy rank's verify gathers wait for a partner that never comes: the
    request is cut by the bound, never answered (and never answered right)."""
    config = _config(models, "idle-verify-skipped", 2, True, BUDGET)
    env = {**dict(config.env), "DDTREE_TEST_IDLE_VERIFY": "skip"}
    log = server_log_dir / "dp-idle-verify-skipped.log"
    with launch_server(cpu_sglang_python, config.model, config.args, log,
                       env) as server:
        with pytest.raises((socket.timeout, TimeoutError, urllib.error.URLError,
                            http.client.HTTPException, ConnectionError)):
            server.generate(PROMPTS[0], CONTROL_TOKENS, timeout=CONTROL_TIMEOUT)
