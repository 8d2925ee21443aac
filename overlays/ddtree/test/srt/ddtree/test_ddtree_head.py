"""The top-K draft head: full-vocabulary normalisation, TP shards, buffers."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.ddtree_head import DDTreeDraftHead


def _reference(hidden, weight, block, k, vocab):
    bs = hidden.shape[0] // block
    h = hidden.view(bs, block, -1)[:, 1:, :]
    log_probs = torch.log_softmax(h.float() @ weight[:vocab].float().T, dim=-1)
    return log_probs.topk(k, dim=-1)


def test_single_rank_head_is_topk_of_log_softmax_over_the_real_rows():
    gen = torch.Generator().manual_seed(0)
    vocab, padded, hid, block, k, bs = 50, 56, 8, 4, 5, 3
    weight = torch.randn(padded, hid, generator=gen)
    hidden = torch.randn(bs * block, hid, generator=gen)
    head = DDTreeDraftHead(
        weight=weight, block_size=block, topk=k, num_org=vocab, max_bs=1
    )
    log_probs, ids = head.propose(hidden)  # grows past max_bs=1
    want_lp, want_ids = _reference(hidden, weight, block, k, vocab)
    assert log_probs.shape == (bs, block - 1, k) and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(log_probs, want_lp.float(), rtol=0, atol=1e-5)
    head(hidden[: 2 * block])  # the in-graph call fills the static buffers
    assert torch.equal(head.outputs(2)[1], want_ids[:2])


class _FakeGroup:
    """all_gather_into_tensor over R simulated ranks, called in lockstep."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.pending = []

    def all_gather_into_tensor(self, out, inp):
        self.pending.append((out, inp))


def test_tp_shards_merge_to_the_full_vocabulary_top_k():
    gen = torch.Generator().manual_seed(1)
    ranks, shard_rows, real_last, hid, block, k, bs = 3, 16, 11, 6, 3, 7, 2
    vocab = shard_rows * (ranks - 1) + real_last
    weight = torch.randn(shard_rows * ranks, hid, generator=gen)
    hidden = torch.randn(bs * block, hid, generator=gen)
    groups = [_FakeGroup(ranks) for _ in range(ranks)]
    heads = [
        DDTreeDraftHead(
            weight=weight[r * shard_rows : (r + 1) * shard_rows],
            block_size=block,
            topk=k,
            num_org=real_last if r == ranks - 1 else shard_rows,
            org_vocab_start=r * shard_rows,
            max_bs=bs,
            tp_group=groups[r],
        )
        for r in range(ranks)
    ]
    # Run every rank up to its gathers, then deliver them and finish.
    import threading

    barrier = threading.Barrier(ranks + 1)

    def deliver():
        for call in range(3):
            barrier.wait()
            parts = [g.pending[call][1] for g in groups]
            for g in groups:
                g.pending[call][0].copy_(torch.cat(parts, dim=0))
            barrier.wait()

    for g in groups:
        orig = g.all_gather_into_tensor

        def gather(out, inp, g=g, orig=orig):
            orig(out, inp)
            barrier.wait()
            barrier.wait()

        g.all_gather_into_tensor = gather
    threads = [threading.Thread(target=h, args=(hidden,)) for h in heads]
    threads.append(threading.Thread(target=deliver))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    want_lp, want_ids = _reference(hidden, weight, block, k, vocab)
    for head in heads:
        log_probs, ids = head.outputs(bs)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(log_probs, want_lp.float(), rtol=0, atol=1e-5)


def test_k_above_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="topk <= the head's 4 vocabulary rows"):
        DDTreeDraftHead(
            weight=torch.randn(4, 3), block_size=2, topk=6, num_org=4, max_bs=1
        )
