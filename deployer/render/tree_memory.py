"""What DDTree's verify costs in GPU memory outside the KV pool, per GPU, known before launch.

SGLang sizes its KV pool from `mem_fraction_static`; what the tree adds lives in the rest (the
headroom), and grows with the verify width W = max(B + 1, block size):

  verify logits     max_running_requests x W x vocab x 4 B (float32 logits of every verify row;
                    the LM head's output is gathered over TP, so every GPU holds all of it)
  tree mask         max_running_requests x W x (context + W) x 1 B (the Triton backend's
                    FULL_MASK buffer, `verify_mask.tree_mask_numel`, allocated for CUDA graphs)
  sampling          the larger of the two sampling verify paths, which never run together:
                    dense, min(max_running_requests x W x vocab, 2^26) x 4 B of probabilities;
                    memory-light (above 2^26 elements), rows x vocab x 4 B x 3 (probabilities,
                    their top-k/top-p renormalisation, the exponential race) for `rows` = whole
                    requests in 2^26 elements (at least one request)

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
    bs, vocab, context = v["max_running_requests"], v["model_vocab_size"], v["model_context_length"]
    rows = max(1, LIGHT_CHUNK_ELEMENTS // (width * vocab)) * width
    dense = bs * width * vocab <= DENSE_SAMPLING_MAX_ELEMENTS
    sampling = bs * width * vocab * 4 if dense else rows * vocab * 4 * 3
    terms = (
        Term("verify logits", bs * width * vocab * 4, "max_running_requests or tree_budget"),
        Term("tree mask", bs * width * (context + width), "max_running_requests or tree_budget"),
        Term("sampling (dense)" if dense else "sampling (memory-light)", sampling, "tree_budget"),
    )
    headroom = int(gpu_memory_gib * GIB * (1 - v["mem_fraction_static"]))
    return TreeMemory(width, terms, headroom)


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
