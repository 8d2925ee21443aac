"""DDTree serves grammars, logprobs and logit processors as plain decoding does.

Real SGLang 0.5.23 servers (CPU) on the tiny Llama of ``test_ddtree_engine_greedy``
(vocabulary 64, spelling characters and a few words: ``models.TOKEN_TEXTS``): the
plain server and DDTree at budget 192 (top-K default: the widest tree) and at
budget 2 with top-K 2 (the smallest), the greedy module's own servers (started
last there, so still running). Each gets the same requests
(``cpu_engine.request_features``):

* a JSON schema, a regex, an EBNF grammar and a tool-call structural tag, greedy:
  DDTree's tokens equal plain decoding's, and XGrammar, run on the output ids
  apart from the server, accepts each output;
* the same grammars at temperature 1: every sampled output is accepted; on a
  small constrained choice (``[abz]{3}``: 27 texts, some with two
  tokenizations) DDTree's and plain decoding's samples agree in distribution;
* logprobs (``return_logprob``, ``top_logprobs_num``, ``token_ids_logprob``,
  the prompt's from position 0): equal to plain decoding's within 1e-4, the top
  tokens in the same order;
* SGLang's ``DisallowedTokensLogitsProcessor``: the same tokens as plain
  decoding, none of them banned;
* all of these at once in one batch;
* an invalid regex or JSON schema: the plain server's error, and serving goes on;
* the control: a mask built over sibling-swapped tokens breaks greedy equality.

Sample size of the distribution test: n = 400 per server (plain and the widest
tree), two-sample chi-square at p < 1e-4 (``sampling.two_sample_p``); the
sampling-parameter tests of ``test_ddtree_engine_sampling`` carry the power.
"""

from __future__ import annotations

import json
import re

import pytest

from cpu_engine.pool import ServerConfig
from cpu_engine.request_features import (
    GRAMMARS,
    post_status,
    INVALID,
    PROMPTS,
    GrammarChecker,
    disallowed_tokens_processor,
    grammar_requests,
    record_requests,
    sample_grammar,
)
from cpu_engine.sampling import P_LOSSLESS, two_sample_p
from cpu_engine.server import dflash_args

pytestmark = pytest.mark.slow

# name -> (budget, topk): the servers of test_ddtree_engine_greedy.
DDTREE = {"vocab-k-default": (192, None), "below-depth-k2": (2, 2)}
SAMPLED = 8  # outputs per grammar at temperature 1
# The control: the grammar's mask built with sibling tokens swapped in pairs
# (each node masked by its sibling's path; ddtree_test_hooks).
CONTROL = "grammar-swap-siblings"
SMALL_N = 400
# The distribution test runs on the widest tree (the most sibling choices per
# node) against plain decoding; 16 requests run at once, so n is what costs.
DISTRIBUTION = ("plain", "vocab-k-default")
LOGPROB_TOL = 1e-4
LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)


@pytest.fixture(scope="module")
def checker(tiny_models):
    return GrammarChecker(tiny_models.target, tiny_models.vocab)


@pytest.fixture(scope="module")
def answers(server_pool, tiny_models, cpu_sglang_python):
    """Every server's answers, samples and the banned tokens, by server name."""
    configs = {
        name: ServerConfig.of(
            tiny_models.target,
            dflash_args(tiny_models.draft, budget=budget, topk=topk),
            name=f"greedy-{name}",
        )
        for name, (budget, topk) in DDTREE.items()
    }
    configs["plain"] = ServerConfig.of(tiny_models.target, name="plain")
    budget, topk = DDTREE["vocab-k-default"]
    configs[CONTROL] = ServerConfig.of(
        tiny_models.target,
        dflash_args(tiny_models.draft, budget=budget, topk=topk),
        {"DDTREE_TEST_GRAMMAR": "swap-siblings"},
        name=CONTROL,
    )
    processor = disallowed_tokens_processor(cpu_sglang_python)
    out = {}
    banned = None
    for name, server in zip(configs, server_pool.each(list(configs.values()))):
        if name == CONTROL:
            out[name] = {
                "answers": {
                    key: post_status(server, body)
                    for key, body in grammar_requests().items()
                }
            }
            continue
        if banned is None:
            # The processor must change something: ban what greedy would say.
            first = server.generate(PROMPTS[0], 8)["output_ids"]
            banned = sorted(set(first))[:3]
        answers = record_requests(server, processor, banned)
        samples = {kind: sample_grammar(server, kind, SAMPLED) for kind in GRAMMARS}
        small = SMALL_N if name in DISTRIBUTION else SAMPLED
        samples["small_regex"] = sample_grammar(server, "small_regex", small)
        out[name] = {"answers": answers, "samples": samples, "banned": banned}
    return out


def _finished(reply) -> bool:
    return (reply["meta_info"].get("finish_reason") or {}).get("type") == "stop"


@pytest.mark.parametrize("server", sorted(DDTREE))
@pytest.mark.parametrize("request_name", sorted(grammar_requests()))
def test_grammar_greedy_equals_plain_and_follows_the_grammar(
    answers, checker, server, request_name
):
    want = answers["plain"]["answers"][request_name]
    got = answers[server]["answers"][request_name]
    assert got["output_ids"] == want["output_ids"], (server, request_name)
    kind = request_name.split("/")[0]
    assert checker.accepts(kind, got["output_ids"], _finished(got)), checker.text(
        got["output_ids"]
    )


def test_control_a_mask_over_swapped_siblings_breaks_greedy_equality(answers):
    """The tree's own node order matters: built over sibling-swapped tokens, the
    mask lets the accept commit what plain decoding would not, which SGLang's
    grammar then rejects (the request fails) or the tokens differ."""
    plain, control = answers["plain"]["answers"], answers[CONTROL]["answers"]
    broken = []
    for key in grammar_requests():
        status, body = control[key]
        if status != 200 or json.loads(body)["output_ids"] != plain[key]["output_ids"]:
            broken.append(key)
    assert len(broken) >= len(grammar_requests()) // 2, broken


def test_greedy_grammar_outputs_are_whole_documents(answers, checker):
    """The JSON schema's and the tool call's outputs parse (not only prefixes)."""
    for i in range(len(PROMPTS)):
        reply = answers["vocab-k-default"]["answers"][f"json_schema/{i}"]
        assert _finished(reply), reply["meta_info"]
        document = json.loads(checker.text(reply["output_ids"]))
        assert set(document) == {"id", "name", "ok", "tags"}
        tool = checker.text(
            answers["vocab-k-default"]["answers"][f"structural_tag/{i}"]["output_ids"]
        )
        assert tool.startswith("<f=get>") and "</f>" in tool, tool
        call = json.loads(tool[len("<f=get>") : tool.index("</f>")])
        assert call["id"] in (1, 2) and call["q"] in ("yes", "no")


@pytest.mark.parametrize("server", sorted(DDTREE) + ["plain"])
@pytest.mark.parametrize("kind", sorted(GRAMMARS) + ["small_regex"])
def test_sampled_outputs_follow_the_grammar(answers, checker, server, kind):
    outputs = answers[server]["samples"][kind]
    bad = [o for o in outputs if not checker.accepts(kind, o, finished=False)]
    assert not bad, [checker.text(o) for o in bad[:3]]


def test_constrained_samples_match_plain_decoding_in_distribution(answers):
    plain = answers["plain"]["samples"]["small_regex"]
    tree = answers["vocab-k-default"]["samples"]["small_regex"]
    assert len(plain) == len(tree) == SMALL_N
    assert two_sample_p(plain, tree) > P_LOSSLESS


def _assert_logprobs_close(want, got, where):
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        if isinstance(want, int) and isinstance(got, int):
            assert got == want, where  # a token id
        else:
            assert abs(got - want) <= LOGPROB_TOL, (where, got, want)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (w, g) in enumerate(zip(want, got)):
            _assert_logprobs_close(w, g, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("server", sorted(DDTREE))
@pytest.mark.parametrize("request_name", ["logprob/0", "logprob/1", "mixed/logprob"])
def test_logprobs_equal_plain_decoding(answers, server, request_name):
    want = answers["plain"]["answers"][request_name]
    got = answers[server]["answers"][request_name]
    assert got["output_ids"] == want["output_ids"]
    for key in LOGPROB_KEYS:
        assert want["meta_info"].get(key), key  # the plain server answered it
        _assert_logprobs_close(
            want["meta_info"][key], got["meta_info"].get(key), f"{server} {key}"
        )


@pytest.mark.parametrize("server", sorted(DDTREE))
@pytest.mark.parametrize(
    "request_name", ["processor/0", "processor/1", "mixed/processor"]
)
def test_logit_processor_applies_as_in_plain_decoding(answers, server, request_name):
    banned = answers[server]["banned"]
    want = answers["plain"]["answers"][request_name]["output_ids"]
    got = answers[server]["answers"][request_name]["output_ids"]
    assert got == want
    assert not set(got) & set(banned), banned


def test_the_logit_processor_changed_the_output(answers):
    """Control: the banned tokens are what plain greedy says unconstrained."""
    banned = answers["plain"]["banned"]
    free = answers["plain"]["answers"]["logprob/0"]["output_ids"][:8]
    assert set(banned) <= set(free)
    assert answers["plain"]["answers"]["processor/0"]["output_ids"][:8] != free


@pytest.mark.parametrize("server", sorted(DDTREE))
@pytest.mark.parametrize(
    "request_name", ["mixed/grammar", "mixed/logprob", "mixed/processor", "mixed/plain"]
)
def test_a_mixed_batch_is_served_request_by_request(answers, server, request_name):
    want = answers["plain"]["answers"][request_name]["output_ids"]
    assert answers[server]["answers"][request_name]["output_ids"] == want


@pytest.mark.parametrize("server", sorted(DDTREE))
@pytest.mark.parametrize("kind", sorted(INVALID))
def test_an_invalid_grammar_gets_the_plain_servers_error(answers, server, kind):
    """Bad input: the same status and words as plain decoding; the server then
    went on serving (every later request of the recording was answered)."""
    want = answers["plain"]["answers"][f"invalid/{kind}"]
    got = answers[server]["answers"][f"invalid/{kind}"]
    assert want[0] >= 400 and got[0] == want[0]
    assert _untimed(got[1]) == _untimed(want[1])
    assert answers[server]["answers"]["mixed/plain"]["output_ids"]


def _untimed(message: str) -> str:
    """XGrammar stamps its errors with the time of day: not part of the words."""
    return re.sub(r"\[\d\d:\d\d:\d\d\] ", "", message)
