"""DDTree sampling at TP 2 on an MLA + MoE target is lossless and rank-consistent.

A real SGLang 0.5.23 server (CPU) at ``--tp-size 2`` serves the tiny
``DeepseekV3ForCausalLM`` (vocabulary 8) with DDTree, and every rank is made to
draw *different* coins for the tree speculative sampling
(``DDTREE_TEST_RANK_COINS``: each rank reseeds its RNG with its rank before each
sampled accept). Only the accept sync (rank 0's accept broadcast at SGLang's
``SpecTpSync`` sites) can then keep the ranks together:

* the joint distribution of the first three generated tokens over many requests
  matches the target's exact distribution (Hugging Face, same checkpoint), as in
  ``test_ddtree_engine_sampling``;
* both ranks commit the same tokens at every step (each rank writes what it
  commits, ``DDTREE_TEST_RECORD_DIR``);
* the control: with the sync turned off (``SGLANG_SPEC_TP_SYNC=off``) the same
  per-rank coins make the ranks commit different tokens, and the rank check sees it.

The verify attention here is the harness's torch_native TARGET_VERIFY path, not
the Triton backend of ``test_ddtree_engine_mla``: thousands of sampled requests
through the Triton interpreter (about 30 ms per kernel program) would take hours.

Sample size: n = 1000 detects a distortion of Cohen's w >= 0.29 at p < 1e-4 with
99% power (``cpu_engine.sampling.detectable_effect``; the lossy control of
``test_ddtree_engine_sampling`` measures w ~ 0.75). The control needs no test of
distributions: two calls of 100 requests show the ranks' records differ.
"""

from __future__ import annotations

import http.client
from pathlib import Path

import pytest
import torch

from cpu_engine.models import cached_tiny_models
from cpu_engine.pool import ServerConfig
from cpu_engine.server import dflash_args, launch_server, tp_args
from cpu_engine.sampling import (
    P_LOSSLESS,
    PER_CALL,
    VOCAB,
    chi_square_p,
    exact_first_three,
    sample_first_three,
)

pytestmark = pytest.mark.slow

REQUESTS = 1000
CONTROL_REQUESTS = 2 * PER_CALL
BUDGET = 16


@pytest.fixture(scope="module")
def models():
    return cached_tiny_models(vocab=VOCAB, arch="mla")


@pytest.fixture(scope="module")
def exact(models) -> torch.Tensor:
    return exact_first_three(models.target)


def _config(models, record_dir: Path, name: str, sync: str) -> ServerConfig:
    parallel, env = tp_args(2)
    env.update(
        DDTREE_TEST_RECORD_DIR=str(record_dir),
        DDTREE_TEST_RANK_COINS="1",
        SGLANG_SPEC_TP_SYNC=sync,
    )
    args = [*parallel, "--max-running-requests", str(PER_CALL)]
    args += dflash_args(models.draft, budget=BUDGET)
    return ServerConfig.of(models.target, args, env, name=f"tp2-sampling-{name}")


def _sample(server, requests: int, record_dir: Path):
    try:
        tokens = sample_first_three(server.url, requests)
    except (OSError, http.client.HTTPException) as error:
        # Ranks that commit different tokens can break the server (one scheduler
        # fails, the server shuts down): part of what the control shows; the
        # synced run must never get here.
        tokens = error
    ranks = {p.name: p.read_text().splitlines() for p in record_dir.glob("*.jsonl")}
    return tokens, ranks, server.log_path.read_text()


@pytest.fixture(scope="module")
def runs(server_pool, cpu_sglang_python, models, server_log_dir, tmp_path_factory):
    dirs = {name: tmp_path_factory.mktemp(f"ranks-{name}")
            for name in ("synced", "sync-off")}
    synced = _config(models, dirs["synced"], "synced", "all")
    out = {"synced": _sample(server_pool.get(synced), REQUESTS, dirs["synced"])}
    # The control breaks its server: its own, never one from the pool.
    off = _config(models, dirs["sync-off"], "sync-off", "off")
    log = server_log_dir / "tp2-sampling-sync-off.log"
    with launch_server(cpu_sglang_python, off.model, off.args, log,
                       dict(off.env)) as server:
        out["sync-off"] = _sample(server, CONTROL_REQUESTS, dirs["sync-off"])
    return out


def test_tp2_mla_sampling_follows_the_target(runs, exact):
    tokens, _, log = runs["synced"]
    assert isinstance(tokens, torch.Tensor), f"the synced server failed: {tokens}"
    assert tokens.shape == (REQUESTS, 3)
    assert chi_square_p(tokens, exact) > P_LOSSLESS


def test_ranks_drawing_different_coins_commit_the_same_tokens(runs):
    _, ranks, _ = runs["synced"]
    assert sorted(ranks) == ["rank0.jsonl", "rank1.jsonl"]
    assert len(ranks["rank0.jsonl"]) > 0
    assert ranks["rank0.jsonl"] == ranks["rank1.jsonl"]


def test_control_without_the_sync_the_ranks_diverge(runs):
    """Rank 0 and rank 1 commit different tokens (then, typically, a scheduler
    fails and the server goes down: what linear DFlash's sync prevents too)."""
    _, ranks, _ = runs["sync-off"]
    assert sorted(ranks) == ["rank0.jsonl", "rank1.jsonl"]
    assert ranks["rank0.jsonl"] != ranks["rank1.jsonl"]


def test_sampling_logs_ddtrees_verify_and_no_greedy_fallback(runs):
    _, _, log = runs["synced"]
    assert "DDTree sampling verify: lossless tree speculative sampling" in log
    assert "falling back to greedy argmax verification" not in log
