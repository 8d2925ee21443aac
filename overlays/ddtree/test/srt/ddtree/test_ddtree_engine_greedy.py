"""DDTree on a real SGLang 0.5.23 server (CPU): greedy is lossless, the tree is used.

One module-scoped run takes from the session's server pool, one after the other
(the next one starting while the current one is driven), a plain server (no
speculation), a linear DFlash server (both shared with
``test_cpu_engine_linear``) and DDTree servers at budgets below, equal to and well above
the draft depth (block size 4: depth 3) with top-K 1, 2 and the default, all on
the same tiny models (vocabulary 64), and records what they generate for batches
of 1, 2 and 4 concurrent requests of different prompt lengths. The tests then
assert on those records:

* every DDTree server's tokens equal the plain server's, token for token;
* SGLang's reported accept length with a budget of at least the vocabulary is
  clearly above linear DFlash's on the same models and prompts, and the same
  assertion fails for linear DFlash (the tree flag removed: the control);
* the verify width SGLang reports is max(budget + 1, block size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cpu_engine.pool import ServerConfig
from cpu_engine.server import dflash_args

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
PROMPTS = [
    list(range(5, 20)),
    [30, 31, 32],
    [7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41],
    [50, 12, 50, 12, 50, 12, 8],
]
BATCHES = (1, 2, 4)
# (name, budget, topk): below (2 < 3), equal (3) and well above (192 = 3 x the
# vocabulary) the draft depth; top-K 2, 1 and the default min(budget, vocab).
# The last two are started last, so test_ddtree_engine_greedy_requests, next
# in the session, finds them running.
DDTREE = [
    ("at-depth-k1", 3, 1),
    ("below-depth-k2", 2, 2),
    ("vocab-k-default", 192, None),
]
# And two serving modes with their own KV bookkeeping: the compact draft cache (a
# sliding draft window shorter than prompt plus output, rebuilt every step) and
# KV pages of 4 tokens (the accepted path's KV moves across page boundaries).
EXTRA = [
    ("window-8", 8, None, ("--speculative-draft-window-size", "8")),
    ("paged-4", 8, None, ("--page-size", "4")),
]
# "Clearly above": the wide tree holds most depth-1 tokens, so most steps accept
# a draft token (about 1.8 tokens per step here); a random linear draft almost
# never does (about 1.03).
CLEARLY_ABOVE = 1.5


@dataclass
class Run:
    outputs: dict[int, list[list[int]]] = field(default_factory=dict)  # by batch
    accept_lengths: list[float] = field(default_factory=list)
    verify_width: int = 0


def _spec_args(models, budget=None, topk=None):
    return dflash_args(models.draft, budget=budget, topk=topk)


def _record(server) -> Run:
    run = Run()
    for n in BATCHES:
        results = server.generate_batch(PROMPTS[:n], max_new_tokens=NEW_TOKENS)
        run.outputs[n] = [r["output_ids"] for r in results]
        run.accept_lengths += [
            r["meta_info"]["spec_accept_length"]
            for r in results
            if "spec_accept_length" in r["meta_info"]
        ]
    states = server.server_info().get("internal_states") or [{}]
    run.verify_width = int(states[0].get("speculative_num_draft_tokens") or 0)
    return run


@pytest.fixture(scope="module")
def runs(server_pool, tiny_models) -> dict[str, Run]:
    args = {"plain": [], "linear": _spec_args(tiny_models)}
    for name, budget, topk, extra in EXTRA:
        args[name] = _spec_args(tiny_models, budget, topk) + list(extra)
    for name, budget, topk in DDTREE:
        args[name] = _spec_args(tiny_models, budget, topk)
    # plain and linear: the names test_cpu_engine_linear gives the same servers.
    configs = [
        ServerConfig.of(tiny_models.target, a, name=n if n in ("plain", "linear")
                        else f"greedy-{n}")
        for n, a in args.items()
    ]
    servers = server_pool.each(configs)
    return {name: _record(server) for name, server in zip(args, servers)}


@pytest.mark.parametrize("name", [name for name, *_ in DDTREE + EXTRA])
@pytest.mark.parametrize("batch", BATCHES)
def test_ddtree_greedy_equals_plain_decoding(runs, name, batch):
    plain, tree = runs["plain"].outputs[batch], runs[name].outputs[batch]
    assert [len(o) for o in tree] == [NEW_TOKENS] * batch
    for i, (want, got) in enumerate(zip(plain, tree)):
        assert got == want, f"{name}: prompt {i} of a batch of {batch} diverges"


def test_linear_dflash_also_equals_plain(runs):
    assert runs["linear"].outputs == runs["plain"].outputs


def _mean(values):
    assert values, "the server reported no spec_accept_length"
    return sum(values) / len(values)


def test_tree_accept_length_clearly_above_linear_dflash(runs):
    tree = _mean(runs["vocab-k-default"].accept_lengths)
    linear = _mean(runs["linear"].accept_lengths)
    assert tree > CLEARLY_ABOVE, (tree, linear)
    # Control: without the tree flag the very same assertion fails.
    assert not linear > CLEARLY_ABOVE, (tree, linear)


@pytest.mark.parametrize(
    "name,width", [("below-depth-k2", 4), ("at-depth-k1", 4), ("vocab-k-default", 193)]
)
def test_verify_width_is_budget_plus_one_at_least_the_block(runs, name, width):
    assert runs[name].verify_width == width
    assert runs["linear"].verify_width == 4
