"""What DDTree's verify costs in GPU memory outside the KV pool, per GPU, known before launch.

SGLang sizes its KV pool from `mem_fraction_static`; what the tree adds lives in the rest (the
headroom), and grows with the verify width W = max(B + 1, block size) and with the requests R one
GPU verifies at once:

  verify logits     R x W x vocab x 4 B (float32 logits of every verify row; the LM head's
                    output is gathered over the group its vocabulary is split over, so every GPU
                    holds all of the vocabulary for its rows)
  tree mask         R x W x (context + W) x 1 B (the Triton backend's FULL_MASK buffer,
                    `verify_mask.tree_mask_numel`, allocated for CUDA graphs)
  sampling          the larger of the two sampling verify paths, which never run together:
                    dense, min(R x W x vocab, 2^26) x 4 B of probabilities; memory-light (above
                    2^26 elements), rows x vocab x 4 B x 3 (probabilities, their top-k/top-p
                    renormalisation, the exponential race) for `rows` = whole requests in 2^26
                    elements (at least one request)

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
    rows = max(1, LIGHT_CHUNK_ELEMENTS // (width * vocab)) * width
    dense = bs * width * vocab <= DENSE_SAMPLING_MAX_ELEMENTS
    sampling = bs * width * vocab * 4 if dense else rows * vocab * 4 * 3
    terms = (
        Term("verify logits", bs * width * vocab * 4, "max_running_requests or tree_budget"),
        Term("tree mask", bs * width * (context + width), "max_running_requests or tree_budget"),
        Term("sampling (dense)" if dense else "sampling (memory-light)", sampling, "tree_budget"),
    )
    headroom = int(gpu_memory_gib * GIB * (1 - v["mem_fraction_static"]))
    return TreeMemory(width, terms, headroom, bs, v["max_running_requests"], dp)


def requests_per_gpu(max_running_requests: int, attn_dp_size: int) -> int:
    """The requests one GPU verifies at once: all of them under plain TP; under attention DP its
    DP rank's share, as SGLang 0.5.23 splits --max-running-requests (floor, at least one)."""
    return max(1, max_running_requests // attn_dp_size)


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
