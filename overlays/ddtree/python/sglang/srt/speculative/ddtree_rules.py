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
from typing import List, Mapping, Optional

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
# --moe-a2a-backend values whose low-latency dispatch holds a fixed number of
# tokens per rank, read from the environment when the dispatcher is built
# (SGLang 0.5.23, layers/moe/token_dispatcher/{deepep,mooncake,nixl}.py;
# defaults in environ.py): backend -> (its name, the variable). Each asserts
# the value is <= DISPATCH_CAP_MAX (the FINISHED_SUM_TAG of its kernels).
# Not here: deepep_v2 and pplx (SGLang 0.5.23 checks their budgets itself at
# argument resolution, from speculative_num_draft_tokens = W), mori (4096,
# checked against --chunked-prefill-size), flashinfer and megamoe (sized by
# SGLang from the server arguments).
LOW_LATENCY_DISPATCH_CAPS = {
    "deepep": ("DeepEP", "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"),
    "mooncake": ("Mooncake EP", "SGLANG_MOONCAKE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"),
    "nixl": ("NIXL EP", "SGLANG_NIXL_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"),
}
DISPATCH_CAP_DEFAULT = 128
DISPATCH_CAP_MAX = 1024
# --max-running-requests when unset: DFLASH's _handle_dflash sets 48 right
# after DDTree's check runs (arg_groups/speculative_hook.py).
DFLASH_MAX_RUNNING_REQUESTS = 48


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
    moe_a2a_backend:   --moe-a2a-backend
    deepep_mode:       --deepep-mode
    max_running_requests: --max-running-requests (None: unset, DFLASH's 48)
    attn_dp_size:      --attn-dp-size
    tp_size:           --tp-size
    dispatch_cap:      the backend's dispatch cap variable (``dispatch_cap_of``;
                       None: unset, DISPATCH_CAP_DEFAULT)
    accept_threshold_single / accept_threshold_acc:
                       --speculative-accept-threshold-single / -acc
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
    moe_a2a_backend: Optional[str] = None
    deepep_mode: Optional[str] = None
    max_running_requests: Optional[int] = None
    attn_dp_size: int = 1
    tp_size: int = 1
    dispatch_cap: Optional[int] = None
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0


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
    reasons += [backend] if backend else []
    dispatch = dispatch_refusal(launch)
    reasons += [dispatch] if dispatch else []
    threshold = accept_threshold_refusal(launch)
    return reasons + ([threshold] if threshold else [])


def ddtree_verify_width(budget: int, block_size: int) -> int:
    """Verify slots per request: the tree's budget + 1, at least the draft block."""
    return max(int(budget) + 1, int(block_size))


@dataclass(frozen=True)
class DispatchBudget:
    """Tokens one EP rank sends through low-latency dispatch in a DDTree verify.

    A verify batch has no extend in it, so ``--deepep-mode auto`` dispatches it
    low-latency, in a captured CUDA graph and eagerly past the largest graph
    alike: a graph max batch does not bound it, the running requests do. Each
    DP rank sends the W rows of each of its requests: SGLang splits
    --max-running-requests over the DP ranks (max(1, R // attn_dp_size) per
    worker, ``resolve_max_num_reqs``) and pads a graph batch to a multiple of
    the attention-TP size; SGLang's ``mega_moe_decode_tokens_per_rank`` counts
    the same way.

    name / env_var: the dispatcher and the variable holding its cap.
    cap:            the cap in force (DISPATCH_CAP_DEFAULT when unset).
    verify_width:   W = max(budget + 1, block size).
    """

    name: str
    env_var: str
    cap: int
    max_running_requests: int
    attn_dp_size: int
    attn_tp_size: int
    verify_width: int

    @property
    def requests_per_rank(self) -> int:
        share = max(1, self.max_running_requests // self.attn_dp_size)
        return -(-share // self.attn_tp_size) * self.attn_tp_size

    @property
    def tokens(self) -> int:
        return self.requests_per_rank * self.verify_width

    def arithmetic(self) -> str:
        """E.g. "48/8 x 129 = 774": requests per DP rank x W."""
        share = f"{self.max_running_requests}/{self.attn_dp_size}"
        if self.requests_per_rank != self.max_running_requests // self.attn_dp_size:
            share += f" (= {self.requests_per_rank} per rank)"
        return f"{share} x {self.verify_width} = {self.tokens}"

    def max_requests_that_fit(self) -> int:
        """The largest --max-running-requests whose verify fits DISPATCH_CAP_MAX."""
        per_rank = DISPATCH_CAP_MAX // self.verify_width
        return (per_rank - per_rank % self.attn_tp_size) * self.attn_dp_size

    def max_budget_that_fits(self) -> int:
        """The largest tree budget whose verify fits DISPATCH_CAP_MAX (W = B + 1)."""
        return DISPATCH_CAP_MAX // self.requests_per_rank - 1


def dispatch_cap_of(
    backend: Optional[str], environ: Mapping[str, str]
) -> Optional[int]:
    """The backend's dispatch cap as set in ``environ`` (None: unset or no cap)."""
    caps = LOW_LATENCY_DISPATCH_CAPS.get(backend or "none")
    raw = environ.get(caps[1], "") if caps else ""
    if not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{caps[1]} must be an integer, got {raw!r}") from None


def dispatch_budget(launch: DDTreeLaunch) -> Optional[DispatchBudget]:
    """The verify's low-latency dispatch per rank (None: DDTree off, no capped
    dispatcher, or low-latency off)."""
    caps = LOW_LATENCY_DISPATCH_CAPS.get(launch.moe_a2a_backend or "none")
    if launch.budget is None or caps is None or launch.deepep_mode == "normal":
        return None
    requests = launch.max_running_requests
    dp = max(1, int(launch.attn_dp_size))
    cap = launch.dispatch_cap
    return DispatchBudget(
        name=caps[0],
        env_var=caps[1],
        cap=DISPATCH_CAP_DEFAULT if cap is None else cap,
        max_running_requests=int(requests or DFLASH_MAX_RUNNING_REQUESTS),
        attn_dp_size=dp,
        attn_tp_size=max(1, int(launch.tp_size) // dp),
        verify_width=ddtree_verify_width(launch.budget, launch.block_size or 0),
    )


def dispatch_refusal(launch: DDTreeLaunch) -> Optional[str]:
    """Why the verify's low-latency dispatch would trip the dispatcher's cap."""
    caps = LOW_LATENCY_DISPATCH_CAPS.get(launch.moe_a2a_backend or "none")
    if launch.budget is None or caps is None:
        return None
    if launch.dispatch_cap is not None and launch.dispatch_cap > DISPATCH_CAP_MAX:
        return (
            f"{caps[1]}={launch.dispatch_cap} exceeds {caps[0]}'s limit of "
            f"{DISPATCH_CAP_MAX} tokens per rank (its dispatcher asserts it)."
        )
    if launch.deepep_mode == "normal":
        return None
    budget = dispatch_budget(launch)
    if budget.tokens > DISPATCH_CAP_MAX:
        return (
            f"{budget.name} low-latency dispatch needs {budget.arithmetic()} "
            f"tokens per rank in a DDTree verify, over its limit of "
            f"{DISPATCH_CAP_MAX} ({budget.env_var}); use {_what_fits(budget)}."
        )
    if budget.tokens > budget.cap:
        shown = "default " if launch.dispatch_cap is None else ""
        return (
            f"{budget.name} low-latency dispatch needs {budget.arithmetic()} "
            f"tokens per rank in a DDTree verify, over {budget.env_var}'s "
            f"{shown}{budget.cap}; set {budget.env_var}={budget.tokens}."
        )
    return None


def accept_threshold_refusal(launch: DDTreeLaunch) -> Optional[str]:
    """Why lossy accept thresholds are refused (None: both are 1.0).

    Below 1.0 they accept draft tokens plain decoding would not sample; the
    dense tree verify applies them, the memory-light one (one target sample
    per slot, used for larger batches) cannot, so the output distribution
    would depend on the batch size.
    """
    flags = [
        f"--speculative-accept-threshold-{name} {value}"
        for name, value in (
            ("single", launch.accept_threshold_single),
            ("acc", launch.accept_threshold_acc),
        )
        if float(value) != 1.0
    ]
    if launch.budget is None or not flags:
        return None
    return (
        f"DDTree serves plain decoding's distribution only: {' and '.join(flags)} "
        "would make it lossy, and differently so at different batch sizes (its "
        "memory-light verify cannot apply thresholds); use 1.0."
    )


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


def _what_fits(budget: DispatchBudget) -> str:
    """The flag values that bring the verify's dispatch under DISPATCH_CAP_MAX."""
    fits = []
    if budget.max_requests_that_fit() > 0:
        fits.append(f"--max-running-requests {budget.max_requests_that_fit()}")
    if budget.max_budget_that_fits() > 0:
        fits.append(f"--speculative-dflash-tree-budget {budget.max_budget_that_fits()}")
    return " or ".join(fits) or "fewer requests per DP rank and a smaller tree"


def _positive(flag: str, value: int) -> List[str]:
    if int(value) <= 0:
        return [f"DDTree requires {flag} to be positive, got {value}."]
    return []
