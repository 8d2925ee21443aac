"""What DDTree's verify costs in GPU memory outside the KV pool, per GPU, known before launch.

SGLang sizes its KV pool from `mem_fraction_static`; what the tree adds lives in the rest (the
headroom), and grows with the verify width W = max(B + 1, block size) and with the requests R one
GPU verifies at once:

  verify logits     R x W x vocab x 4 B (float32 logits of every verify row; the LM head's
                    output is gathered over the group its vocabulary is split over, so every GPU
                    holds all of the vocabulary for its rows)
  tree mask         R x W x (context + W) x 1 B (the Triton backend's FULL_MASK buffer,
                    `verify_mask.tree_mask_numel`, allocated for CUDA graphs)
  sampling          what one sampling verify step allocates over [rows, vocab] beside the logits
                    (`sampling_bytes`, below); the two paths never run together

Sampling, counted from the overlay's code (ddtree 0.2.18 on, commit 65932f7: the sort-free target of
`ddtree_sampling.plain_sampling_probs`, `ddtree_worker.DDTreeVerifier._accept_sampled`), in float32
[rows, V] buffers B = rows x V x 4 B, whatever the logits' dtype (a bf16 logits row is cast first;
the cast and the temperature-scaled copy are the 2 alive before the softmax frees one):

  target            softmax probabilities (1) + one float32 scratch (the bisection's 0/1 masks, then
                    the int32 tie count) (1) + two bool [rows, V] masks (2 x 0.25): 2.5 B at peak
                    (2 during the softmax; min_p alone 1.25). The top-k-bounded path keeps the same
                    2.5 B while its [rows, max_top_k] topk values are small (max_top_k << V).
  dense             R x V <= 2^26 elements (R = requests x W): the target over all R rows (2.5 B),
                    then the verify's zero draft probabilities beside the target (2 B): 2.5 x R x V x 4 B
  memory-light      chunks of c = max(1, 2^26 // (W x V)) x W rows (whole requests): each chunk's
                    target (2.5 c) while the previous chunk's probabilities are still bound (1 c), and
                    the exponential race (probabilities, race, their quotient: 3 c):
                    max(3 c, c + 2.5 min(c, R - c)) x V x 4 B; 3.5 x c x V x 4 B from two full chunks

At Kimi's sizes (V = 163,840): B300 budget 128, W = 129, 48 requests (tp8): R = 6,192 rows > 2^26 /
V, memory-light, c = 3 x 129 = 387 rows, 3.5 x 387 x 163,840 x 4 B = 0.83 GiB; ep8 (6 requests per
DP rank, 774 rows, two chunks) the same 0.83 GiB; ep16-2node (3 requests, 387 rows, dense) 2.5 x 387
x 163,840 x 4 B = 0.59 GiB. RTX PRO 6000 budget 64, W = 65, 48 requests: R = 3,120 rows, c = 6 x 65 =
390 rows, 3.5 x 390 x 163,840 x 4 B = 0.83 GiB. tests/test_tree_memory_measured.py runs the
overlay's sampled accept on CPU at a reduced size and holds this estimate within 10% of its
measured peak.
Not counted: the topk path's [rows, max_top_k] float32/float64 values, small while every request's
top_k is (top_k 40: 2.50 buffers measured) but 4.66 buffers at max_top_k = V / 2.

R per GPU:
  plain TP          R = max_running_requests: one scheduler, every TP rank verifies the whole batch.
  attention DP      R = max(1, max_running_requests // attn_dp_size), its DP rank's share: each DP
                    rank has its own scheduler, and SGLang 0.5.23 caps its requests at that share
                    (`kv_cache_configurator.resolve_max_num_reqs`, "max concurrent requests (per dp
                    worker)"), which sizes its request pool, so its CUDA graphs' batch and FULL_MASK
                    buffer; a DP rank's verify batch is padded only up to the busiest rank's count,
                    which the share bounds. Under --enable-dp-lm-head the LM head is split over the
                    DP rank's attention-TP group (tp_size / attn_dp_size GPUs: one in ep8 and
                    ep16-2node) and its logits gathered over that group
                    (`LogitsProcessor._gather_attn_tp_logits`): every GPU of the DP rank holds the
                    whole vocabulary, for its DP rank's rows only.

The constants are the overlay's (`ddtree_step.DDTREE_DENSE_SAMPLING_MAX_ELEMENTS`,
`ddtree_worker.DDTREE_LIGHT_CHUNK_ELEMENTS`, from ddtree 0.2.5 on). An estimate of the largest buffers, not of every
activation: the headroom must hold them with room to spare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1024**3
DENSE_SAMPLING_MAX_ELEMENTS = 1 << 26
LIGHT_CHUNK_ELEMENTS = 1 << 26
# Of the headroom, at most this share may go to the tree: the rest is SGLang's activations,
# CUDA graphs and NCCL buffers.
TREE_SHARE_OF_HEADROOM = 0.5


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    knob: str  # the render value to change when this term dominates


@dataclass(frozen=True)
class TreeMemory:
    width: int
    terms: tuple[Term, ...]
    headroom: int  # GPU memory x (1 - mem_fraction_static)
    requests: int  # R: the requests one GPU verifies at once
    max_running_requests: int
    attn_dp_size: int = 1

    @property
    def per_dp_rank(self) -> bool:
        """Attention DP: the estimate is one DP rank's (its share of the requests), on one GPU."""
        return self.attn_dp_size > 1

    @property
    def scope(self) -> str:
        """What the estimate is of, for messages: "per GPU" or "per DP rank (...)"."""
        if not self.per_dp_rank:
            return "per GPU"
        return (
            f"per DP rank, for its max_running_requests {self.max_running_requests} / attn_dp_size "
            f"{self.attn_dp_size} = {self.requests} requests"
        )

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def budget(self) -> int:
        return int(self.headroom * TREE_SHARE_OF_HEADROOM)

    @property
    def dominant(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


def tree_memory(v: dict[str, Any], gpu_memory_gib: float | None) -> TreeMemory | None:
    """The estimate for one unit's values, or None when DDTree is off or the GPU size unknown."""
    if gpu_memory_gib is None or v["speculative_algorithm"] != "DFLASH" or v["tree_budget"] == 0:
        return None
    width = max(v["tree_budget"] + 1, v["dflash_block_size"])
    dp = v["attn_dp_size"]
    bs = requests_per_gpu(v["max_running_requests"], dp)
    vocab, context = v["model_vocab_size"], v["model_context_length"]
    path, sampling = sampling_bytes(bs, width, vocab)
    terms = (
        Term("verify logits", bs * width * vocab * 4, "max_running_requests or tree_budget"),
        Term("tree mask", bs * width * (context + width), "max_running_requests or tree_budget"),
        Term(f"sampling ({path})", sampling, "tree_budget"),
    )
    headroom = int(gpu_memory_gib * GIB * (1 - v["mem_fraction_static"]))
    return TreeMemory(width, terms, headroom, bs, v["max_running_requests"], dp)


# float32 [rows, V] buffers alive at the peak of the sort-free sampling target, beside the logits:
# probabilities, one scratch, two bool masks (see the module docstring).
TARGET_BUFFERS = 2.5
# The memory-light chunk's exponential race: probabilities, the race, their quotient.
RACE_BUFFERS = 3


def sampling_bytes(
    requests: int,
    width: int,
    vocab: int,
    dense_max_elements: int = DENSE_SAMPLING_MAX_ELEMENTS,
    chunk_elements: int = LIGHT_CHUNK_ELEMENTS,
) -> tuple[str, int]:
    """("dense" or "memory-light", peak bytes) of one sampling verify step over R = requests x W
    rows of V float32 probabilities, beside the verify logits (module docstring, "Sampling")."""
    rows = requests * width
    row_bytes = vocab * 4
    if rows * vocab <= dense_max_elements:
        return "dense", int(TARGET_BUFFERS * rows * row_bytes)
    chunk = max(1, chunk_elements // (width * vocab)) * width
    peak = RACE_BUFFERS * min(chunk, rows)
    if rows > chunk:  # the previous chunk's probabilities are bound while the next is built
        peak = max(peak, chunk + TARGET_BUFFERS * min(chunk, rows - chunk))
    return "memory-light", int(peak * row_bytes)


def requests_per_gpu(max_running_requests: int, attn_dp_size: int) -> int:
    """The requests one GPU verifies at once: all of them under plain TP; under attention DP its
    DP rank's share, as SGLang 0.5.23 splits --max-running-requests (floor, at least one)."""
    return max(1, max_running_requests // attn_dp_size)


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
