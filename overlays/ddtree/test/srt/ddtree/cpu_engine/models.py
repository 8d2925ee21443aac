"""Tiny random target and DFlash draft checkpoints for the CPU engine tests.

Nothing can be downloaded on the test machines, so both models are written locally in
about a second: a 2-layer ``LlamaForCausalLM`` (hidden 64, 4 heads, 2 KV heads,
head_dim 16) with a ``tokenizers`` WordLevel tokenizer (characters and a few
words, :data:`TOKEN_TEXTS`), and a 1-layer
``DFlashDraftModel`` checkpoint written by hand (SGLang's ``models/dflash.py`` weight
names; it has no embedding or LM head of its own and borrows the target's).

Two kinds (``kind``):

* ``"random"``: random weights with a wider spread than Hugging Face's default (std
  0.2, not 0.02) so the logits are far apart and greedy decoding does not flip on
  float rounding between SGLang and Hugging Face. The draft is random too: it
  accepts almost nothing (accept length ~1.0), the outputs test exactness.
* ``"alternating"``: hand-set weights that make acceptance measurable. Embeddings
  are one-hot (hidden = vocab), the target's attention and MLP outputs are tiny, so
  the target is a bigram table read off ``lm_head``: every token is followed by
  :data:`ALT_X`, ``X`` by :data:`ALT_Y` and ``Y`` by ``X`` (greedy output: X Y X Y
  ...). The draft's attention and MLP outputs are zero, so at every block position
  it predicts the mask token's ``lm_head`` column: the same distribution at every
  depth, ``X`` slightly above ``Y`` (:func:`alternating_draft_probs`). Linear
  DFLASH drafts ``X X X``: after ``Y`` it accepts one draft (``X``, then ``Y`` is
  the bonus), after ``X`` none, so from the second verify on each verify commits
  two tokens (accept length -> 2.0 for any block size >= 2). A draft tree with the
  top two tokens per depth and a budget that reaches ``X Y X ...`` accepts the
  whole block (accept length -> block size).

Requests that need a fixed number of tokens pass ``ignore_eos`` (SGLang) or
``eos_token_id=None`` (Hugging Face).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import cached, content_key

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
TARGET_LAYERS, DRAFT_LAYERS = 2, 1
MAX_POSITIONS = 2048
INIT_STD = 0.2
# DFlash: the draft reads the target's hidden states after these layers.
DRAFT_TARGET_LAYER_IDS = (0,)
KINDS = ("random", "alternating")
# The "alternating" kind: the two tokens the target alternates between, and the
# draft's logits for them (every other token: 0) after the RMSNorm of a one-hot
# embedding (x / rms(x) = sqrt(hidden) on the hot dimension).
ALT_X, ALT_Y = 10, 11
ALT_DRAFT_LOGITS = (4.1, 4.0)
ALT_TARGET_LOGIT = 8.0
ALT_TARGET_NOISE = 1e-4


ARCHS = ("llama", "mla")
# The "mla" target: Kimi K2's architecture (DeepseekV3ForCausalLM) scaled down:
# MLA attention with q/kv LoRA ranks and split nope/rope head dims
# (qk_head_dim 24 != v_head_dim 16), a dense first layer, then MoE layers with
# MLA_EXPERTS routed experts (top MLA_TOP_K, sigmoid scores, noaux_tc) and one
# shared expert; yarn RoPE (SGLang's CPU rope path does deepseek_yarn only).
MLA_LAYERS, MLA_EXPERTS, MLA_TOP_K = 3, 4, 2
MLA_Q_LORA, MLA_KV_LORA, MLA_NOPE, MLA_ROPE, MLA_V = 32, 32, 16, 8, 16
MLA_MOE_INTERMEDIATE = 32
MLA_YARN = {
    "rope_type": "yarn",
    "type": "yarn",
    "factor": 2.0,
    "original_max_position_embeddings": MAX_POSITIONS // 2,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}


@dataclass(frozen=True)
class TinyModels:
    """Paths of the written checkpoints; both directories hold the tokenizer."""

    target: Path
    draft: Path
    vocab: int
    block_size: int
    kind: str = "random"
    arch: str = "llama"


def _torch_dtype(dtype: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}") from None


# What tokens 4.. spell: single characters and a few words, so grammars (JSON,
# regexes, EBNF, tool-call tags) can be written over a vocabulary of 64, and a
# string has more than one tokenization (a tree holds both). Ids past the list
# spell ``t<id>``.
TOKEN_TEXTS = (
    list('{}":,+[]')
    + list("0123456789")
    + list("abcdefghijklmnopqrstuvwxyz")
    + list("<>/=_-.")
    + ["true", "false", "null", '"id"', '"name"', "ab", "ba", "yes", "no"]
)


def token_texts(vocab: int) -> list[str]:
    """What each id of a ``vocab``-token tokenizer spells (specials included)."""
    rest = [f"t{i}" for i in range(len(_SPECIALS) + len(TOKEN_TEXTS), vocab)]
    return (list(_SPECIALS) + TOKEN_TEXTS + rest)[:vocab]


def write_tokenizer(path: Path, vocab: int) -> None:
    """A WordLevel tokenizer over ``<pad> <s> </s> <unk>`` then
    :data:`TOKEN_TEXTS`; decoding concatenates the tokens' texts (``Fuse``), so a
    grammar's constraint on the text is one on the token sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(token_texts(vocab))}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(path))


def _write_target(
    path: Path, vocab: int, seed: int, dtype: str, kind: str, arch: str = "llama"
) -> None:
    if arch == "mla":
        _write_mla_target(path, vocab, seed, dtype, kind)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, initializer_range=INIT_STD,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=PAD_ID,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if kind == "alternating":
            _make_alternating_target(model, vocab)
    model.to(_torch_dtype(dtype)).save_pretrained(str(path))


def mla_config(vocab: int) -> dict:
    """The tiny DeepseekV3ForCausalLM's config keys (Hugging Face names)."""
    return dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        moe_intermediate_size=MLA_MOE_INTERMEDIATE, num_hidden_layers=MLA_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS,
        n_shared_experts=1, n_routed_experts=MLA_EXPERTS,
        num_experts_per_tok=MLA_TOP_K, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        q_lora_rank=MLA_Q_LORA, kv_lora_rank=MLA_KV_LORA,
        qk_nope_head_dim=MLA_NOPE, qk_rope_head_dim=MLA_ROPE, v_head_dim=MLA_V,
        max_position_embeddings=MAX_POSITIONS, initializer_range=INIT_STD,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=PAD_ID,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, rope_parameters=dict(MLA_YARN),
        num_nextn_predict_layers=0,
    )


def _write_mla_target(path: Path, vocab: int, seed: int, dtype: str, kind: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**mla_config(vocab))
    config.architectures = ["DeepseekV3ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    param.zero_()
        if kind == "alternating":
            _make_alternating_target(model, vocab)
    model.to(_torch_dtype(dtype)).save_pretrained(str(path))
    # Keys Kimi K2 / DeepSeek-V3 checkpoints carry that HF's config leaves out,
    # and the RoPE scaling under its pre-5.x name, which SGLang's factory reads.
    raw = json.loads((path / "config.json").read_text())
    raw.update(
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_scaling=dict(MLA_YARN), rope_theta=MLA_YARN["rope_theta"],
    )
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def _one_hot_embeddings(vocab: int) -> torch.Tensor:
    """[vocab, HIDDEN]: token t is e_t (RMSNorm maps it to sqrt(HIDDEN) * e_t)."""
    if vocab > HIDDEN:
        raise ValueError(f'kind "alternating" needs vocab <= {HIDDEN}')
    return torch.eye(vocab, HIDDEN)


def alternating_lm_head(vocab: int) -> torch.Tensor:
    """The "alternating" target's lm_head [vocab, HIDDEN]: column t, times
    sqrt(HIDDEN), is the logits after token t (a bigram table)."""
    scale = HIDDEN**-0.5
    head = torch.zeros(vocab, HIDDEN)  # head[u, t]: logit of u after t, / sqrt(H)
    head[ALT_X, :vocab] = ALT_TARGET_LOGIT * scale  # every token (Y too) -> X
    head[ALT_X, ALT_X] = 0.0
    head[ALT_Y, ALT_X] = ALT_TARGET_LOGIT * scale  # except X -> Y
    # After the mask token: what the draft predicts at every block position.
    head[ALT_X, UNK_ID] = ALT_DRAFT_LOGITS[0] * scale
    head[ALT_Y, UNK_ID] = ALT_DRAFT_LOGITS[1] * scale
    return head


def alternating_draft_probs(vocab: int = 64) -> torch.Tensor:
    """[vocab] float32: the "alternating" draft's distribution at every depth."""
    logits = torch.zeros(vocab)
    logits[ALT_X], logits[ALT_Y] = ALT_DRAFT_LOGITS
    return logits.softmax(-1)


def _make_alternating_target(model, vocab: int) -> None:
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(_one_hot_embeddings(vocab))
        model.lm_head.weight.copy_(alternating_lm_head(vocab))
        # Tiny, not zero: the layers still run (and feed the draft), but their
        # output cannot move an argmax decided by a margin of ALT_TARGET_LOGIT.
        # Every attention output and every MLP / expert down projection.
        for name, param in model.model.layers.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.mul_(ALT_TARGET_NOISE / INIT_STD)


def draft_config(
    vocab: int, dtype: str, block_size: int, target_layers: int = TARGET_LAYERS
) -> dict:
    """The DFlash draft's config.json (a qwen3 text config plus the DFlash keys)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": DRAFT_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "torch_dtype": dtype,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "block_size": block_size,
        "num_target_layers": target_layers,
        "dflash_config": {
            "mask_token_id": UNK_ID,
            "target_layer_ids": list(DRAFT_TARGET_LAYER_IDS),
        },
    }


def draft_weight_shapes() -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes, as ``DFlashDraftModel.load_weights`` reads them
    (q/k/v and gate/up are stacked by the loader; ``fc`` maps the concatenated
    target features, one per target layer id, to the hidden size)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        })
    shapes["norm.weight"] = (HIDDEN,)
    shapes["hidden_norm.weight"] = (HIDDEN,)
    shapes["fc.weight"] = (HIDDEN, len(DRAFT_TARGET_LAYER_IDS) * HIDDEN)
    return shapes


def _write_draft(
    path: Path,
    vocab: int,
    seed: int,
    dtype: str,
    block_size: int,
    kind: str,
    target_layers: int = TARGET_LAYERS,
) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    # A separate stream from the target's, so changing one never moves the other.
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    tensors = {}
    for name, shape in draft_weight_shapes().items():
        if len(shape) == 1:  # RMSNorm weights: ones, as a trained norm starts
            t = torch.ones(shape)
        elif kind == "alternating" and name.endswith(("o_proj.weight",
                                                        "down_proj.weight")):
            # No attention or MLP output: each position's hidden state is its input
            # embedding, so every masked position predicts the mask token's column.
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * INIT_STD
        tensors[name] = t.to(_torch_dtype(dtype)).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = draft_config(vocab, dtype, block_size, target_layers)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_tiny_models(
    root: Path,
    vocab: int = 64,
    seed: int = 0,
    dtype: str = "float32",
    block_size: int = 4,
    kind: str = "random",
    arch: str = "llama",
) -> TinyModels:
    """Write ``root/target`` and ``root/draft`` (deterministic for ``seed``).

    vocab: at least 8 (four specials, then :data:`TOKEN_TEXTS`; 16 to 64 for
    "alternating"); block_size: the DFlash verify width (the draft's ``block_size``,
    picked up by SGLang); kind: see the module docstring.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    least = 16 if kind == "alternating" else 8
    if vocab < least:
        raise ValueError(f"vocab must be at least {least} for kind {kind!r}")
    root = Path(root)
    target, draft = root / "target", root / "draft"
    _write_target(target, vocab, seed, dtype, kind, arch)
    write_tokenizer(target, vocab)
    layers = MLA_LAYERS if arch == "mla" else TARGET_LAYERS
    _write_draft(draft, vocab, seed, dtype, block_size, kind, layers)
    write_tokenizer(draft, vocab)
    return TinyModels(target=target, draft=draft, vocab=vocab, block_size=block_size,
                      kind=kind, arch=arch)


def cached_tiny_models(**params) -> TinyModels:
    """:func:`make_tiny_models` (same keywords, no ``root``) from the cache: the
    checkpoints depend only on the parameters, this module and torch's RNG (its
    version), so a run reuses what an earlier run with the same inputs wrote.
    Treat the directories as read-only (copy a model to change it)."""
    key = content_key(
        "tiny-models",
        json.dumps(params, sort_keys=True),
        Path(__file__).resolve(),
        torch.__version__,
    )
    root = cached("models", key, lambda dest: make_tiny_models(dest, **params))
    bound = inspect.signature(make_tiny_models).bind(root, **params)
    bound.apply_defaults()
    a = bound.arguments
    return TinyModels(target=root / "target", draft=root / "draft", vocab=a["vocab"],
                      block_size=a["block_size"], kind=a["kind"], arch=a["arch"])


def hf_greedy(model_dir: Path, prompts, new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with Hugging Face (float32 argmax loop, no cache):
    the reference the served outputs must equal token for token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            for _ in range(new_tokens):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs
