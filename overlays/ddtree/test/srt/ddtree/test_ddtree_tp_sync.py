"""Every TP rank commits what rank 0 commits: DDTree's accept goes through the
worker's ``SpecTpSync`` at linear DFlash's sites (greedy and sampling)."""

from __future__ import annotations

import enum
import sys
import types

import pytest
import torch

from sglang.srt.speculative.ddtree_config import DDTreeConfig
from sglang.srt.speculative.ddtree_step import accept_sampling
from sglang.srt.speculative.ddtree_worker import DDTreeVerifier, _sync_accept

BS, DEPTH, K, BUDGET, VOCAB = 3, 3, 3, 8, 12


class _Site(enum.IntEnum):  # SGLang's SpecTpSyncSite, the two sites DDTree uses
    DFLASH_ACCEPT_SAMPLE = 14
    DFLASH_ACCEPT_GREEDY = 15


@pytest.fixture(autouse=True)
def spec_tp_sync_module(monkeypatch):
    """``spec_tp_sync`` as SGLang ships it (the bare overlay tree has none)."""
    module = types.ModuleType("sglang.srt.speculative.spec_tp_sync")
    module.SpecTpSyncSite = _Site
    monkeypatch.setitem(sys.modules, module.__name__, module)


class RankZeroSync:
    """A rank != 0's SpecTpSync: each broadcast overwrites with rank 0's values."""

    def __init__(self, rank_zero_values):
        self.rank_zero_values = list(rank_zero_values)
        self.sites = []

    def sync(self, site, values):
        self.sites.append(site)
        values.copy_(self.rank_zero_values.pop(0))
        return values


def _verifier(seed):
    gen = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(BS, DEPTH, K, generator=gen).log_softmax(-1)
    log_probs = log_probs.sort(-1, descending=True).values
    ids = torch.stack(
        [torch.randperm(VOCAB, generator=gen)[:K] for _ in range(BS * DEPTH)]
    )
    config = DDTreeConfig(budget=BUDGET, topk=K, block_size=DEPTH + 1,
                          verify_width=BUDGET + 1)
    verifier = DDTreeVerifier(config, eager_head=None)
    roots = torch.randint(0, VOCAB, (BS,), generator=gen)
    verifier.build_step((log_probs, ids.view(BS, DEPTH, K)), roots,
                        torch.tensor([5, 7, 9]), None)
    return verifier, gen


def test_greedy_accept_uses_rank_zeros_argmax():
    verifier, gen = _verifier(0)
    width = BUDGET + 1
    rank0_logits = torch.randn(BS * width, VOCAB, generator=gen)
    # Rank 0's targets follow the tree, so it accepts drafts; rank 1's differ.
    tokens = verifier._step.tokens.reshape(-1)
    rank0_logits[torch.arange(BS * width), torch.roll(tokens, -1)] += 10.0
    rank1_logits = torch.randn(BS * width, VOCAB, generator=gen)
    want = verifier.accept(rank0_logits, None, None, None, 1.0, 1.0)
    verifier, _ = _verifier(0)
    sync = RankZeroSync([rank0_logits.argmax(-1)])
    got = verifier.accept(rank1_logits, None, None, None, 1.0, 1.0, tp_sync=sync)
    assert sync.sites == [_Site.DFLASH_ACCEPT_GREEDY]
    for a, b in zip(want, got):
        if a is not None:
            assert torch.equal(a, b)
    verifier, _ = _verifier(0)
    alone = verifier.accept(rank1_logits, None, None, None, 1.0, 1.0)
    assert not all(torch.equal(a, b) for a, b in zip(want[:4], alone[:4])), (
        "the control: without the sync rank 1 would commit other tokens"
    )


def test_sampled_accept_is_broadcast_in_one_collective():
    verifier, gen = _verifier(1)
    step = verifier._step
    width = step.width
    probs = torch.rand(BS, width, VOCAB, generator=gen).softmax(-1)
    rank0 = accept_sampling(step, probs, DEPTH + 1,
                            coins=torch.rand(BS, width, generator=gen),
                            final_coins=torch.rand(BS, generator=gen))
    rank1 = accept_sampling(step, probs, DEPTH + 1,
                            coins=torch.rand(BS, width, generator=gen),
                            final_coins=torch.rand(BS, generator=gen))
    packed = torch.cat([rank0.accept_index.reshape(-1), rank0.accept_len,
                        rank0.predicts]).to(torch.int32)
    sync = RankZeroSync([packed])
    got = _sync_accept(sync, rank1)
    assert sync.sites == [_Site.DFLASH_ACCEPT_SAMPLE]
    assert torch.equal(got.accept_index, rank0.accept_index.to(torch.int32))
    assert torch.equal(got.accept_len, rank0.accept_len.to(torch.int32))
    assert torch.equal(got.predicts, rank0.predicts.to(torch.int32))
    assert _sync_accept(None, rank1) is rank1  # one rank: nothing to sync


def test_build_kernels_runs_one_dummy_step_through_the_real_path():
    """At start (on CUDA) the verifier builds what a step runs; the dummy inputs are
    valid for the step's functions (here their torch twins on CPU)."""
    verifier, _ = _verifier(2)
    verifier.build_kernels(torch.device("cpu"), VOCAB)


def test_a_kernel_that_fails_to_build_fails_the_start_with_a_clear_error(monkeypatch):
    import sglang.srt.speculative.ddtree_worker as worker

    def no_toolkit(*args, **kwargs):
        raise RuntimeError("nvcc: not found")

    verifier, _ = _verifier(3)
    monkeypatch.setattr(worker, "build_verify_step", no_toolkit)
    with pytest.raises(RuntimeError) as info:
        verifier.build_kernels(torch.device("cpu"), VOCAB)
    message = str(info.value)
    assert "could not build or load its kernels on cpu at start" in message
    assert "nvcc: not found" in message and "ddeploy build" in message


def test_path_logits_are_the_accepted_rows_in_chain_layout():
    """Logprobs read row b * S + k: the verify row that produced request b's
    k-th committed token; rows past the accepted path repeat the root's."""
    verifier, gen = _verifier(1)
    width = BUDGET + 1
    logits = torch.randn(BS * width, VOCAB, generator=gen)
    tokens = verifier._step.tokens.reshape(-1)
    logits[torch.arange(BS * width), torch.roll(tokens, -1)] += 10.0
    accept_len, _, _, out_tokens, _ = verifier.accept(
        logits, None, None, None, 1.0, 1.0
    )
    rows = verifier.path_logits(logits)
    s = DEPTH + 1
    assert rows.shape == (BS * s, VOCAB)
    index = verifier._accept.accept_index.tolist()
    for b in range(BS):
        for k in range(s):
            slot = index[b][k] if k <= int(accept_len[b]) else b * width
            assert torch.equal(rows[b * s + k], logits[slot])
            if k <= int(accept_len[b]):  # the committed token is that row's argmax
                assert int(rows[b * s + k].argmax()) == int(out_tokens[b, k])
    assert int(accept_len.max()) > 0  # the tree was followed somewhere
