"""DDTree on Kimi K2's architecture (MLA + MoE) at TP 2, through SGLang's own
TritonAttnBackend, on a real SGLang 0.5.23 server (CPU).

The target is a tiny ``DeepseekV3ForCausalLM`` (MLA with q/kv LoRA and split
nope/rope heads, a dense first layer, then routed experts with a shared expert;
``cpu_engine.models``). Its attention runs through SGLang's real
``TritonAttnBackend`` (forward metadata, ``custom_mask`` / ``mask_indptr``,
``extend_attention_fwd`` / ``decode_attention_fwd``), whose Triton kernels the
Triton interpreter runs on CPU: the tree mask is read by the very kernel that
reads it on a GPU, at the offsets it reads. One module-scoped run takes these
servers from the session's pool one after the other (the next one starting while
the current one generates) and records what they generate:

* DDTree on random weights at TP 2: greedy output equals Hugging Face's plain
  greedy decoding of the same checkpoint, token for token, and both ranks
  commit the same tokens (each rank writes what it commits);
* a control at TP 1 whose tree mask is shifted by one element: greedy equality
  fails (on the first prompt, the only one it is sent);
* DDTree on the tiny Llama (MHA) at TP 1 through the same backend: greedy
  equals Hugging Face's; the log names the backend class DDTree's start-up
  check read off the model runner; the random-weight runs accept drafts;
* a regex and a logprob request at TP 2: the grammar's greedy output and the
  logprobs equal the target's (Hugging Face with XGrammar's mask);
* on the "alternating" models (whole blocks accepted) at TP 2 the top logprobs
  equal the target's, values its attention moves by more than 1e-2: the
  accepted trees' mask is checked where the argmax alone could not see it;
* linear DFlash (TP 1, the first prompt) and DDTree (TP 2) on the "alternating"
  models (a bigram target and a draft whose second choice completes the block):
  DDTree's accept length is far above linear DFlash's, as the models force it
  to be. The same comparison at TP 1 on the alternating Llama is
  ``test_cpu_engine_acceptance``'s (exact accept lengths), so this module
  starts no TP 1 DDTree server on these models.

TP 2 is the users' configuration class; the MLA target's TP 1 DDTree greedy
output and accept lengths are ``test_ddtree_engine_dp``'s TP 1 baseline, and
TP 1 through the Triton backend is the Llama's run here and the control's, so
no random-weight TP 1 DDTree server runs here (each Triton-interpreted prompt
costs seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cpu_engine.models import cached_tiny_models, hf_greedy
from cpu_engine.pool import ServerConfig
from cpu_engine.request_features import (
    GRAMMARS,
    GrammarChecker,
    hf_constrained_greedy,
    hf_logprobs,
    hf_output_logprob_rows,
)
from cpu_engine.server import (
    TRITON_VERIFY_ARGS,
    TRITON_VERIFY_ENV,
    dflash_args,
    tp_args,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 20
PROMPTS = [
    list(range(5, 17)),
    [30, 31, 32],
    [7, 9, 11, 13, 17, 19, 23],
    [50, 12, 50, 12, 8],
]
BUDGET = 16
# The alternating models: top two tokens per depth, 2 + 4 + 8 = 14 nodes reach
# X Y X for the draft depth 3, so DDTree accepts the whole block (see
# test_cpu_engine_acceptance); linear DFlash commits two tokens per verify.
ALT_BUDGET, ALT_TOPK = 14, 2
TOP_LOGPROBS = 4


@dataclass(frozen=True)
class Config:
    models: str  # "random" or "alternating"
    tp: int
    budget: int | None  # None: linear DFlash
    topk: int | None = None
    env: dict = field(default_factory=dict)
    record: bool = False
    requests: tuple[str, ...] = ()  # also these: "grammar", "logprob"
    # The first this many of PROMPTS: all for the proofs, one where a single
    # prompt decides (a control, the linear baseline's accept length). Each
    # prompt costs seconds of Triton-interpreted verify kernels.
    prompts: int = len(PROMPTS)


CONFIGS = {
    "tp2-ddtree": Config(
        "random", 2, BUDGET, record=True, requests=("grammar", "logprob")
    ),
    "tp1-ddtree-mask-shifted": Config(
        "random", 1, BUDGET, env={"DDTREE_TEST_MASK": "shift"}, prompts=1
    ),
    "tp1-linear-alt": Config("alternating", 1, None, prompts=1),
    "tp2-ddtree-alt": Config(
        "alternating", 2, ALT_BUDGET, ALT_TOPK, requests=("logprob",)
    ),
    # The Llama (MHA) target's verify through the same backend.
    "tp1-llama-ddtree": Config("llama", 1, BUDGET),
}


@dataclass
class Run:
    outputs: list[list[int]]
    accept_lengths: list[float]
    info: dict
    records: dict[str, list[str]]
    log: str = ""
    grammar: dict | None = None  # the regex request's reply
    logprob: dict | None = None  # the logprob request's reply


@pytest.fixture(scope="module")
def mla_models():
    return {
        "random": cached_tiny_models(arch="mla"),
        "alternating": cached_tiny_models(arch="mla", kind="alternating"),
        "llama": cached_tiny_models(),
    }


@pytest.fixture(scope="module")
def plain_greedy(mla_models):
    """Plain greedy decoding of the random MLA target (Hugging Face, float32)."""
    return hf_greedy(mla_models["random"].target, PROMPTS, NEW_TOKENS)


def _config(name, config, models, record_dir: Path) -> ServerConfig:
    parallel, env = tp_args(config.tp)
    env = {**env, **TRITON_VERIFY_ENV, **config.env}
    if config.record:
        env["DDTREE_TEST_RECORD_DIR"] = str(record_dir)
    args = [*TRITON_VERIFY_ARGS, *parallel]
    args += dflash_args(models.draft, budget=config.budget, topk=config.topk)
    return ServerConfig.of(models.target, args, env, name=f"mla-{name}")


def _record(server, record_dir: Path, config: Config) -> Run:
    prompts = PROMPTS[: config.prompts]
    results = server.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
    records = {p.name: p.read_text().splitlines() for p in record_dir.glob("*.jsonl")}
    run = Run(
        outputs=[r["output_ids"] for r in results],
        accept_lengths=[r["meta_info"]["spec_accept_length"] for r in results],
        info=server.server_info(),
        records=records,
        log=server.log_path.read_text(),
    )
    if "grammar" in config.requests:
        run.grammar = server.generate(
            PROMPTS[0], NEW_TOKENS, ignore_eos=False, regex=GRAMMARS["regex"]
        )
    if "logprob" in config.requests:
        run.logprob = server.generate(
            PROMPTS[1],
            NEW_TOKENS // 2,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=TOP_LOGPROBS,
        )
    return run


@pytest.fixture(scope="module")
def runs(server_pool, mla_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mla-records")
    record_dirs = {name: tmp / name for name in CONFIGS}
    configs = {
        name: _config(name, c, mla_models[c.models], record_dirs[name])
        for name, c in CONFIGS.items()
    }
    for path in record_dirs.values():
        path.mkdir()
    servers = server_pool.each(list(configs.values()))
    return {name: _record(server, record_dirs[name], CONFIGS[name])
            for name, server in zip(configs, servers)}


def test_mla_moe_ddtree_greedy_equals_plain_decoding(runs, plain_greedy):
    outputs = runs["tp2-ddtree"].outputs
    assert len(outputs) == len(PROMPTS)
    for i, (want, got) in enumerate(zip(plain_greedy, outputs)):
        assert got == want, f"prompt {i} diverges from plain decoding"


def test_llama_ddtree_greedy_through_triton_equals_plain_decoding(runs, mla_models):
    want = hf_greedy(mla_models["llama"].target, PROMPTS, NEW_TOKENS)
    for i, (w, got) in enumerate(zip(want, runs["tp1-llama-ddtree"].outputs)):
        assert got == w, f"Llama through triton: prompt {i} diverges"


@pytest.mark.parametrize("name", ["tp2-ddtree", "tp1-llama-ddtree"])
def test_the_verify_ran_through_sglangs_triton_backend(runs, name):
    """The backend object the server built (its class, as DDTree's start-up
    check reads it off the model runner), not only the flag it echoes."""
    run = runs[name]
    assert "DDTree tree verify attention: TritonAttnBackend" in run.log
    assert "TorchNativeAttnBackend" not in run.log
    assert run.info["tp_size"] == CONFIGS[name].tp
    assert run.info["internal_states"][0]["speculative_num_draft_tokens"] == BUDGET + 1


@pytest.mark.parametrize("name", ["tp2-ddtree", "tp1-llama-ddtree"])
def test_random_weight_runs_accept_drafts(runs, name):
    """Not a run of bonus tokens only: the tree's drafts were accepted."""
    assert max(runs[name].accept_lengths) > 1.0, runs[name].accept_lengths


def test_both_tp_ranks_commit_the_same_tokens(runs):
    records = runs["tp2-ddtree"].records
    assert sorted(records) == ["rank0.jsonl", "rank1.jsonl"]
    # One line per verify step: every step of every request, on both ranks.
    assert len(records["rank0.jsonl"]) >= NEW_TOKENS // 4
    assert records["rank0.jsonl"] == records["rank1.jsonl"]


def test_control_a_shifted_tree_mask_breaks_greedy_equality(runs, plain_greedy):
    """The backend really reads the mask: one element off and the tokens change."""
    outputs = runs["tp1-ddtree-mask-shifted"].outputs
    assert len(outputs) == 1 and outputs != plain_greedy[:1]


def test_tree_accepts_far_more_than_linear_dflash(runs):
    linear = runs["tp1-linear-alt"].accept_lengths
    tree = runs["tp2-ddtree-alt"].accept_lengths
    # Linear DFlash: two tokens per verify (the first verify one); DDTree: the
    # whole block of four from the second verify on.
    assert max(linear) < 2.1, linear
    assert min(tree) > 3.0, (tree, linear)


def test_mla_moe_ddtree_greedy_under_a_grammar_equals_plain_decoding(
    runs, mla_models
):
    """A regex request: the tokens of Hugging Face's greedy decoding restricted,
    step by step, to what XGrammar allows (the plain decoding of the grammar)."""
    models = mla_models["random"]
    checker = GrammarChecker(models.target, models.vocab)
    want = hf_constrained_greedy(
        models.target, checker, "regex", PROMPTS[0], NEW_TOKENS
    )
    got = runs["tp2-ddtree"].grammar["output_ids"]
    assert got == want[: len(got)] and len(got) >= min(len(want), 5), (got, want)
    assert checker.accepts("regex", got, finished=False)


def test_mla_moe_ddtree_logprobs_equal_the_targets(runs, mla_models):
    """Prompt and output logprobs of the greedy tokens: the target's own
    (Hugging Face, float32) within 1e-4; the top token is the one generated."""
    reply = runs["tp2-ddtree"].logprob
    meta = reply["meta_info"]
    want_in, want_out = hf_logprobs(
        mla_models["random"].target, PROMPTS[1], reply["output_ids"]
    )
    got_out = [lp for lp, _, _ in meta["output_token_logprobs"]]
    got_in = [lp for lp, _, _ in meta["input_token_logprobs"]][1:]
    assert len(got_out) == len(want_out) == NEW_TOKENS // 2
    for got, want in ((got_in, want_in), (got_out, want_out)):
        assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-4, (got, want)
    for token, top in zip(reply["output_ids"], meta["output_top_logprobs"]):
        assert top[0][1] == token


def test_high_acceptance_runs_return_the_targets_logprobs_attention_included(
    runs, mla_models
):
    """On the models that accept the whole block, the returned top logprobs
    equal the target's within 1e-4, and the target's attention moves those very
    values by more than 1e-2: a tree mask that let a row see the wrong keys would
    show here, though the argmax (a bigram margin of 8) cannot change."""
    model = mla_models["alternating"].target
    reply = runs["tp2-ddtree-alt"].logprob
    out = reply["output_ids"]
    rows = hf_output_logprob_rows(model, PROMPTS[1], out)
    blind = hf_output_logprob_rows(model, PROMPTS[1], out, without_attention=True)
    tops = reply["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(out) == NEW_TOKENS // 2
    got = [(k, token, lp) for k, top in enumerate(tops) for lp, token, _ in top]
    assert len(got) == len(out) * TOP_LOGPROBS
    assert max(abs(lp - float(rows[k, t])) for k, t, lp in got) <= 1e-4
    assert max(abs(float(rows[k, t] - blind[k, t])) for k, t, _ in got) > 1e-2
    assert min(runs["tp2-ddtree-alt"].accept_lengths) > 3.0
