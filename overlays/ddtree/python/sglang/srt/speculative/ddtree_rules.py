"""What a DDTree server refuses, as plain rules over its launch settings.

One definition, read by two sides:
  * SGLang, while it resolves the server arguments (``ddtree_config``), so a
    launch it cannot serve fails before any weight loads;
  * the deploy tool (``ddeploy render`` / ``launch``), which checks every
    rendered DDTree script against these rules before anything reaches a host.

Hence this module imports nothing but the standard library (Python 3.8+), and
its messages name SGLang's command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

# --attention-backend values (and their backend classes) that apply a custom
# mask in TARGET_VERIFY: each tree row sees the prefix, its ancestors, itself.
DDTREE_MASK_BACKENDS = {
    "triton": "TritonAttnBackend",
    "flashinfer": "FlashInferAttnBackend",
}
# For MLA targets (Kimi K2.x, DeepSeek-V3) only the triton backend does.
DDTREE_MLA_MASK_BACKENDS = {"triton": "TritonAttnBackend"}
# Draft architectures whose proposals come from a head of their own, not the
# per-position token logits DDTree's top-K head reads.
DRAFT_HEADS = {
    "DFlash2DraftModel": "candidate-selector",
    "DFlash2BeamDraftModel": "candidate-selector",
    "MiniMaxDFlash2DraftModel": "candidate-selector",
    "LiLiCorrDraftModel": "LiLiCorr",
}


@dataclass(frozen=True)
class DDTreeLaunch:
    """The server settings the refusals read (None: not known at this point).

    budget:            --speculative-dflash-tree-budget (None: DDTree off)
    topk:              --speculative-dflash-tree-topk
    block_size:        the resolved DFlash draft block size
    verify_backend:    the --attention-backend that runs TARGET_VERIFY
    is_mla:            whether the target uses MLA attention
    pp_size:           --pp-size
    block_verification: --speculative-use-block-verification
    vocab_size:        the target's vocabulary size
    hybrid_target:     whether the target is hybrid/Mamba (a recurrent state)
    draft_head:        "dflash" for a plain DFlash draft, else its head's name
                       (``draft_head_kind``)
    """

    budget: Optional[int]
    topk: Optional[int] = None
    block_size: Optional[int] = None
    verify_backend: Optional[str] = None
    is_mla: Optional[bool] = None
    pp_size: int = 1
    block_verification: bool = False
    vocab_size: Optional[int] = None
    hybrid_target: Optional[bool] = None
    draft_head: Optional[str] = None


def ddtree_launch_refusals(launch: DDTreeLaunch) -> List[str]:
    """Every reason DDTree cannot serve ``launch``, one line each (empty: ok)."""
    if launch.budget is None:
        if launch.topk is not None:
            return [
                "--speculative-dflash-tree-topk requires "
                "--speculative-dflash-tree-budget (DDTree is off without a budget)."
            ]
        return []
    reasons = _positive("--speculative-dflash-tree-budget", launch.budget)
    if launch.topk is not None:
        reasons += _positive("--speculative-dflash-tree-topk", launch.topk)
        topk = topk_refusal(launch.topk, launch.vocab_size)
        reasons += [topk] if topk else []
    if launch.block_verification:
        reasons.append(
            "DDTree does not support --speculative-use-block-verification (it "
            "verifies a tree, not a block)."
        )
    if launch.block_size is not None and int(launch.block_size) < 2:
        reasons.append(
            "DDTree needs a DFlash block size >= 2 (one draft depth), "
            f"got {launch.block_size}."
        )
    if int(launch.pp_size) > 1:
        reasons.append(
            "DDTree (DFLASH) only supports --pp-size 1 "
            f"(got {launch.pp_size})."
        )
    if launch.hybrid_target:
        reasons.append(HYBRID_REFUSAL)
    if launch.draft_head not in (None, "dflash"):
        reasons.append(draft_head_refusal(launch.draft_head))
    backend = verify_backend_refusal(launch.verify_backend, launch.is_mla)
    return reasons + ([backend] if backend else [])


HYBRID_REFUSAL = (
    "DDTree does not support hybrid/Mamba targets: their state commit after "
    "verify assumes a linear chain."
)


def topk_refusal(topk: int, vocab_size: Optional[int]) -> Optional[str]:
    """Why top-K cannot exceed the target vocabulary (None: fine or unknown)."""
    if vocab_size is None or int(topk) <= int(vocab_size):
        return None
    return (
        f"--speculative-dflash-tree-topk {topk} exceeds the target vocabulary "
        f"size {vocab_size}."
    )


def draft_head_refusal(kind: str) -> str:
    return (
        f"DDTree needs a plain DFlash draft (a per-position token head); this "
        f"draft uses a {kind} head."
    )


def draft_head_kind(architecture: Optional[str], projector_type: Optional[str]) -> str:
    """A draft checkpoint's head, from its config's architecture and DFlash
    ``projector_type``: "dflash", "Domino", "candidate-selector" or "LiLiCorr"."""
    if projector_type == "domino":
        return "Domino"
    return DRAFT_HEADS.get(architecture or "", "dflash")


def verify_backend_refusal(
    backend: Optional[str], is_mla: Optional[bool]
) -> Optional[str]:
    """Why ``backend`` (an --attention-backend value) cannot run the tree verify."""
    if backend is None:
        return None
    return _mask_refusal(backend, f"--attention-backend {backend}", is_mla, False)


def verify_backend_class_refusal(backend_class: str, is_mla: bool) -> Optional[str]:
    """The same rule for a built backend, named by its class (worker start)."""
    return _mask_refusal(backend_class, backend_class, is_mla, True)


def _mask_refusal(
    backend: str, shown: str, is_mla: Optional[bool], by_class: bool
) -> Optional[str]:
    table = DDTREE_MLA_MASK_BACKENDS if is_mla else DDTREE_MASK_BACKENDS
    allowed = sorted(table.values() if by_class else table)
    if backend in allowed:
        return None
    model = "an MLA target (Kimi K2.x, DeepSeek)" if is_mla else "this target"
    return (
        f"DDTree needs a TARGET_VERIFY attention backend that applies the tree "
        f"mask; {shown} does not for {model} (use: {', '.join(allowed)})."
    )


def _positive(flag: str, value: int) -> List[str]:
    if int(value) <= 0:
        return [f"DDTree requires {flag} to be positive, got {value}."]
    return []
