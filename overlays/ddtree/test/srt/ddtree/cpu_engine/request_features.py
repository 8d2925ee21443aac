"""Requests with every feature plain decoding serves: grammars, logprobs, logit
processors, and a mix of them in one batch (``test_ddtree_engine_requests``).

:func:`record_requests` sends the same requests to any server and returns what
it answered, so a DDTree server's answers can be compared with the plain one's.
Grammars are checked independently of the server: :func:`grammar_accepts` runs
the output ids through a fresh XGrammar matcher built from the model's
tokenizer (the tiny models spell JSON, see ``models.TOKEN_TEXTS``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .models import EOS_ID
from .server import Server, server_env

PROMPTS = [list(range(5, 20)), [30, 31, 32, 7, 9]]
NEW_TOKENS = 48
GRAMMAR_TOKENS = 96  # a whole JSON document, character by character
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"enum": [1, 12, 7]},
        "name": {"enum": ["ab", "ba", "yes", "no"]},
        "ok": {"type": "boolean"},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "ab"]},
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["id", "name", "ok", "tags"],
    "additionalProperties": False,
}
TOOL = {
    "type": "object",
    "properties": {"id": {"enum": [1, 2]}, "q": {"enum": ["yes", "no"]}},
    "required": ["id", "q"],
    "additionalProperties": False,
}
# kind -> the grammar (as the request field takes it)
GRAMMARS = {
    "json_schema": json.dumps(SCHEMA),
    "regex": r"(ab|ba|[xyz])(,(ab|ba|[xyz])){2,4}",
    "ebnf": 'root ::= pair ("," pair)*\npair ::= "<" key "=" [0-9] ">"\n'
    'key ::= "ab" | "ba" | "id"',
    "structural_tag": json.dumps(
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f=get>", "schema": TOOL, "end": "</f>"}],
            "triggers": ["<f="],
            "at_least_one": True,
        }
    ),
}
# A constrained choice small enough to compare distributions: 27 texts, some
# with two tokenizations ("ab", "ba" are tokens too).
SMALL_REGEX = "[abz]{3}"
# Grammars the server refuses per request (with the plain server's words).
INVALID = {"regex": "(ab", "json_schema": '{"type": "object", "properties": '}
TOP_LOGPROBS = 3
TOKEN_IDS_LOGPROB = [4, 5, 40]


def post(server: Server, body: dict) -> Any:
    """POST /generate; the reply JSON (an HTTP error raises)."""
    from .server import _http

    return _http("POST", server.url + "/generate", body, timeout=900)


def post_status(server: Server, body: dict) -> tuple[int, str]:
    """(HTTP status, body text) of a request that may be refused."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        server.url + "/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _request(prompt, **sampling: Any) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    params.update(sampling)
    return {"input_ids": list(prompt), "sampling_params": params}


def grammar_requests() -> dict[str, dict]:
    """Greedy requests, one per (grammar kind, prompt)."""
    return {
        f"{kind}/{i}": _request(
            prompt, max_new_tokens=GRAMMAR_TOKENS, **{kind: grammar}
        )
        for kind, grammar in GRAMMARS.items()
        for i, prompt in enumerate(PROMPTS)
    }


def logprob_request(prompt) -> dict:
    body = _request(prompt, ignore_eos=True, max_new_tokens=24)
    body.update(
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=TOP_LOGPROBS,
        token_ids_logprob=TOKEN_IDS_LOGPROB,
    )
    return body


def disallowed_tokens_processor(python_dir: Path) -> str:
    """SGLang's ``DisallowedTokensLogitsProcessor``, serialized as a request
    carries it (``CustomLogitProcessor.to_str``), made by the tree's own code."""
    code = (
        "from sglang.srt.sampling.custom_logit_processor import "
        "DisallowedTokensLogitsProcessor as P; print(P.to_str())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=server_env(python_dir),
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def processor_request(prompt, processor: str, banned: list[int]) -> dict:
    body = _request(prompt, ignore_eos=True, custom_params={"token_ids": banned})
    body["custom_logit_processor"] = processor
    return body


def record_requests(server: Server, processor: str, banned: list[int]) -> dict:
    """What ``server`` answers to every request of this module, by name.

    ``mixed/*`` are sent at once (one batch): a grammar, a logprob, a
    logit-processor and a plain request.
    """
    out = {name: post(server, body) for name, body in grammar_requests().items()}
    for i, prompt in enumerate(PROMPTS):
        out[f"logprob/{i}"] = post(server, logprob_request(prompt))
        out[f"processor/{i}"] = post(
            server, processor_request(prompt, processor, banned)
        )
    for kind, grammar in INVALID.items():
        out[f"invalid/{kind}"] = post_status(
            server, _request(PROMPTS[0], **{kind: grammar})
        )
    mixed = {
        "mixed/grammar": _request(PROMPTS[0], regex=GRAMMARS["regex"]),
        "mixed/logprob": logprob_request(PROMPTS[1]),
        "mixed/processor": processor_request(PROMPTS[0], processor, banned),
        "mixed/plain": _request(PROMPTS[1], ignore_eos=True),
    }
    with ThreadPoolExecutor(max_workers=len(mixed)) as pool:
        replies = pool.map(lambda body: post(server, body), mixed.values())
        out.update(zip(mixed, replies))
    return out


def sample_grammar(server: Server, kind: str, n: int, prompt=None) -> list[list[int]]:
    """n outputs at temperature 1 under ``GRAMMARS[kind]`` (one batch request)."""
    grammar = SMALL_REGEX if kind == "small_regex" else GRAMMARS[kind]
    field = "regex" if kind == "small_regex" else kind
    body = {
        "input_ids": [list(prompt or PROMPTS[0])] * n,
        "sampling_params": {
            "max_new_tokens": GRAMMAR_TOKENS,
            "temperature": 1.0,
            field: grammar,
        },
    }
    return [reply["output_ids"] for reply in post(server, body)]


class GrammarChecker:
    """Does an output follow a grammar? XGrammar over the model's tokenizer."""

    def __init__(self, model_dir: Path, vocab: int):
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[EOS_ID]
        )
        self._xgrammar = xgrammar
        self._compiler = xgrammar.GrammarCompiler(info)
        self.tokenizer = tokenizer

    def _compiled(self, kind: str, grammar: str):
        c = self._compiler
        if kind == "json_schema":
            return c.compile_json_schema(grammar, any_whitespace=True)
        if kind in ("regex", "small_regex"):
            return c.compile_regex(grammar)
        if kind == "ebnf":
            return c.compile_grammar(grammar)
        tag = json.loads(grammar)
        items = [
            self._xgrammar.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
            )
            for s in tag["structures"]
        ]
        structural = self._xgrammar.StructuralTag.from_legacy_structural_tag(
            items, tag["triggers"]
        )
        structural.format.at_least_one = bool(tag.get("at_least_one"))
        return c.compile_structural_tag(structural)

    def accepts(self, kind: str, output_ids: list[int], finished: bool) -> bool:
        """Every token is allowed in turn; a finished output ends the grammar."""
        grammar = SMALL_REGEX if kind == "small_regex" else GRAMMARS[kind]
        matcher = self._xgrammar.GrammarMatcher(self._compiled(kind, grammar))
        ids = list(output_ids)
        if ids and ids[-1] == EOS_ID:
            ids.pop()
            finished = True
        for token in ids:
            if not matcher.accept_token(int(token)):
                return False
        return not finished or matcher.accept_token(EOS_ID)

    def text(self, output_ids: list[int]) -> str:
        return self.tokenizer.decode(
            [t for t in output_ids if t != EOS_ID], skip_special_tokens=True
        )


def hf_constrained_greedy(
    model_dir: Path, checker: GrammarChecker, kind: str, prompt, new_tokens: int
) -> list[int]:
    """Plain greedy decoding under a grammar, by Hugging Face and XGrammar: at
    each step the matcher's allowed tokens, the target's argmax among them."""
    import torch
    from transformers import AutoModelForCausalLM

    xgrammar = checker._xgrammar
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    matcher = xgrammar.GrammarMatcher(checker._compiled(kind, GRAMMARS[kind]))
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    ids, out = torch.tensor([list(prompt)]), []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids).logits[:, -1].clone()
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits[0].argmax())
            out.append(token)
            if token == EOS_ID or not matcher.accept_token(token):
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def hf_output_logprob_rows(
    model_dir: Path, prompt, output_ids, without_attention: bool = False
):
    """float64 [len(output_ids), V]: the target's log-softmax at each output
    position (Hugging Face, float32 weights); ``without_attention`` zeroes every
    attention output projection first (what the output would be without it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if without_attention:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("self_attn.o_proj.weight"):
                    param.zero_()
    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(output_ids)], dim=-1)


def hf_logprobs(model_dir: Path, prompt, output_ids) -> tuple[list, list]:
    """(prompt logprobs from position 1, output logprobs) of the target, float32:
    log_softmax of Hugging Face's logits at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    picked = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
    n = len(prompt)
    return picked[: n - 1], picked[n - 1 :]
