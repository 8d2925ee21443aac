"""A scratch copy of an SGLang tree that runs DFLASH on CPU (test-only changes).

Stock SGLang 0.5.23 serves plain models on CPU but refuses or breaks on the DFLASH
path there. :func:`prepare_cpu_tree` copies a ``python/`` directory (the one holding
``sglang/``) and applies six small changes to the copy, never to the tree under test:

1. ``arg_groups/speculative_hook.py``: accept device ``cpu`` for DFLASH;
2. ``arg_groups/choices.py``: allow ``torch_native`` as draft attention backend;
3. ``layers/attention/torch_native_backend.py``: a TARGET_VERIFY path in
   ``forward_extend`` (stock code indexes ``extend_prefix_lens``, unset in verify);
4. ``speculative/dflash_worker_v2.py``: ``record_stream`` only on device tensors;
5. ``models/dflash.py``: the Triton ``table_qk_norm_rope_`` only for CUDA tensors;
6. ``model_executor/model_runner.py``: keep float32 ``input_embeds`` for float32
   models (stock casts them to bf16, which a float32 DFlash draft cannot take);
7. ``speculative/ddtree_config.py`` (only where DDTree is wired, i.e. the file
   exists): let DDTree accept ``TorchNativeAttnBackend`` as a target backend that
   applies the tree mask in TARGET_VERIFY, which it does after change 3.

Each change is an exact-snippet replacement that must match exactly once; otherwise
:class:`CpuTreeError` names the file and the change. Snippets are short and local so
they still apply on top of the DDTree overlay's hunks into the same files.

Layout written under ``dest``::

    dest/python/sglang/...            the patched copy (returned)
    dest/sgl_kernel_stub/sgl_kernel/  the pure-torch sgl_kernel stand-in

Test servers need both on ``PYTHONPATH`` (:func:`stub_dir_for` finds the second).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"


class CpuTreeError(RuntimeError):
    """A test-only CPU change did not apply (the snippet is missing or ambiguous)."""


@dataclass(frozen=True)
class Change:
    """Replace ``old`` (must occur exactly once) by ``new`` in ``path``."""

    name: str
    path: str  # relative to the python/ directory
    old: str
    new: str
    optional: bool = False  # skipped when the file is absent (not when it differs)


_SPEC_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
_CHOICES = "sglang/srt/arg_groups/choices.py"
_TORCH_NATIVE = "sglang/srt/layers/attention/torch_native_backend.py"
_DFLASH_WORKER = "sglang/srt/speculative/dflash_worker_v2.py"
_DFLASH_MODEL = "sglang/srt/models/dflash.py"
_MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
_DDTREE_CONFIG = "sglang/srt/speculative/ddtree_config.py"
DDTREE_TORCH_NATIVE = "ddtree_config: torch_native applies the tree mask (change 3)"

# The TARGET_VERIFY attention for the torch_native backend (change 3). Why a loop:
# requests have different prefix lengths and the tests batch at most four.
_VERIFY_METHOD = '''
    def _forward_target_verify(
        self, q_, o_, k, v, layer, forward_batch, cache_loc, save_kv_cache
    ):
        """TARGET_VERIFY for the CPU engine tests (a test-only change).

        Each request has n = q_.shape[0] // bs verify rows. Row j attends to the
        committed prefix (req_to_token[r, :seq_lens[i]]; in verify seq_lens is the
        prefix length) and to the n verify tokens, whose KV sits at out_cache_loc.
        Mask: spec_info.custom_mask when set (FULL_MASK: bool, per request a
        row-major n x (prefix + n) block, requests concatenated, True = allowed),
        else causal within the block (prefix + j), none for ENCODER_ONLY layers.

        q_, o_: [bs * n, heads, head_dim]; k, v: this forward's [bs * n, ...] KV.
        """
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError("torch_native TARGET_VERIFY: sliding window")
        bs = forward_batch.req_pool_indices.shape[0]
        n = q_.shape[0] // bs
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if not save_kv_cache and k is not None:
            # Not written to the pool: take the block's KV from this forward.
            k_blk = k.reshape(bs * n, layer.tp_k_head_num, -1).to(k_buf.dtype)
            v_blk = v.reshape(bs * n, layer.tp_v_head_num, -1).to(v_buf.dtype)
        else:
            k_blk, v_blk = k_buf[cache_loc], v_buf[cache_loc]
        custom_mask = getattr(forward_batch.spec_info, "custom_mask", None)
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        rows = forward_batch.req_pool_indices.tolist()
        prefix_lens = forward_batch.seq_lens.tolist()
        req_to_token = self.req_to_token_pool.req_to_token
        mask_start = 0
        for i in range(bs):
            p, blk = prefix_lens[i], slice(i * n, (i + 1) * n)
            prefix_loc = req_to_token[rows[i], :p].to(torch.int64)
            key = torch.cat([k_buf[prefix_loc], k_blk[blk]]).to(q_.dtype)
            value = torch.cat([v_buf[prefix_loc], v_blk[blk]]).to(q_.dtype)
            mask = None
            if custom_mask is not None:
                mask_end = mask_start + n * (p + n)
                mask = custom_mask[mask_start:mask_end].view(n, p + n)
                mask_start = mask_end
            elif causal:
                mask = torch.ones(n, p + n, dtype=torch.bool, device=q_.device)
                mask = mask.tril(diagonal=p)
            out = scaled_dot_product_attention(
                q_[blk].movedim(0, 1).unsqueeze(0),
                key.movedim(0, 1).unsqueeze(0),
                value.movedim(0, 1).unsqueeze(0),
                attn_mask=mask,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                scale=layer.scaling,
            )
            o_[blk] = out.squeeze(0).movedim(0, 1)

    def forward_decode(
'''

CHANGES: tuple[Change, ...] = (
    Change(
        "speculative_hook: DFLASH on device cpu",
        _SPEC_HOOK,
        '            cfg.device.startswith("cuda") or cfg.device == "npu" '
        'or cfg.device == "xpu"\n        )\n',
        '            cfg.device.startswith("cuda") or cfg.device == "npu" '
        'or cfg.device == "xpu"\n'
        "            or cfg.device == \"cpu\"  # test-only CPU engine change\n"
        "        )\n",
    ),
    Change(
        "choices: torch_native draft attention backend",
        _CHOICES,
        '    "trtllm_mha",\n    "intel_xpu",\n]\n\n'
        "DETERMINISTIC_ATTENTION_BACKEND_CHOICES",
        '    "trtllm_mha",\n    "intel_xpu",\n'
        '    "torch_native",  # test-only CPU engine change\n'
        "]\n\nDETERMINISTIC_ATTENTION_BACKEND_CHOICES",
    ),
    Change(
        "torch_native_backend: TARGET_VERIFY dispatch in forward_extend",
        _TORCH_NATIVE,
        "        causal = True\n"
        "        if layer.is_cross_attention or layer.attn_type == "
        "AttentionType.ENCODER_ONLY:\n",
        "        if forward_batch.forward_mode.is_target_verify():\n"
        "            # Test-only CPU engine change: stock code has no verify path.\n"
        "            self._forward_target_verify(\n"
        "                q_, o_, k, v, layer, forward_batch, cache_loc, save_kv_cache\n"
        "            )\n"
        "            return o\n\n"
        "        causal = True\n"
        "        if layer.is_cross_attention or layer.attn_type == "
        "AttentionType.ENCODER_ONLY:\n",
    ),
    Change(
        "torch_native_backend: TARGET_VERIFY attention",
        _TORCH_NATIVE,
        "\n    def forward_decode(\n",
        _VERIFY_METHOD,
    ),
    Change(
        "dflash_worker_v2: record_stream only on device tensors",
        _DFLASH_WORKER,
        "        # produced on another stream.\n"
        "        batch.seq_lens.record_stream(\n"
        "            torch.get_device_module(self.device).current_stream()\n"
        "        )\n",
        "        # produced on another stream.\n"
        '        if batch.seq_lens.device.type != "cpu":  # test-only CPU change\n'
        "            batch.seq_lens.record_stream(\n"
        "                torch.get_device_module(self.device).current_stream()\n"
        "            )\n",
    ),
    Change(
        "dflash: Triton table_qk_norm_rope_ only on CUDA",
        _DFLASH_MODEL,
        "        elif self.use_table_qk_norm_rope and qkv.dtype == torch.bfloat16:\n",
        "        elif (\n"
        "            self.use_table_qk_norm_rope\n"
        "            and qkv.dtype == torch.bfloat16\n"
        "            and qkv.is_cuda  # test-only CPU change: the kernel is Triton\n"
        "        ):\n",
    ),
    Change(
        "model_runner: float32 input_embeds for float32 models",
        _MODEL_RUNNER,
        '            kwargs["input_embeds"] = forward_batch.input_embeds.bfloat16()\n',
        "            # Test-only CPU change: a float32 DFlash draft needs float32"
        " embeds.\n"
        '            kwargs["input_embeds"] = forward_batch.input_embeds.to(\n'
        "                torch.float32 if self.dtype == torch.float32"
        " else torch.bfloat16\n"
        "            )\n",
    ),
    Change(
        DDTREE_TORCH_NATIVE,
        _DDTREE_CONFIG,
        'DDTREE_MASK_BACKENDS = frozenset({"TritonAttnBackend", '
        '"FlashInferAttnBackend"})\n',
        "DDTREE_MASK_BACKENDS = frozenset(\n"
        '    {"TritonAttnBackend", "FlashInferAttnBackend", "TorchNativeAttnBackend"}\n'
        ")  # test-only CPU change: torch_native's verify path applies the mask\n",
        optional=True,
    ),
)


def apply_change(python_dir: Path, change: Change) -> None:
    """Apply one change in place; :class:`CpuTreeError` unless it matches once."""
    path = python_dir / change.path
    if not path.is_file():
        if change.optional:
            return
        raise CpuTreeError(f"{change.path}: missing (change {change.name!r})")
    text = path.read_text()
    count = text.count(change.old)
    if count != 1:
        raise CpuTreeError(
            f"{change.path}: change {change.name!r} expects its snippet exactly once, "
            f"found {count} times"
        )
    path.write_text(text.replace(change.old, change.new))


def stub_dir_for(python_dir: Path) -> Path:
    """The sgl_kernel stand-in's directory for a tree made by :func:`prepare_cpu_tree`
    (``python_dir/../sgl_kernel_stub``), else the one shipped beside this module."""
    beside = Path(python_dir).parent / "sgl_kernel_stub"
    return beside if (beside / "sgl_kernel" / "__init__.py").is_file() else STUB_DIR


def prepare_cpu_tree(
    src_python: Path, dest: Path, skip: Sequence[str] = ()
) -> Path:
    """Copy ``src_python`` (a dir holding ``sglang/``) to ``dest/python``, apply
    :data:`CHANGES` (but those named in ``skip``) and put the sgl_kernel stand-in
    at ``dest/sgl_kernel_stub``.

    ``dest`` must not exist or be empty. Returns ``dest/python``. Skipping
    :data:`DDTREE_TORCH_NATIVE` leaves DDTree's released backend policy, which
    refuses torch_native (the refusal tests start such a server).
    """
    src_python, dest = Path(src_python), Path(dest)
    if not (src_python / "sglang" / "__init__.py").is_file():
        raise CpuTreeError(f"{src_python}: no sglang/ package")
    if dest.exists() and any(dest.iterdir()):
        raise CpuTreeError(f"{dest}: not empty")
    python_dir = dest / "python"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(src_python / "sglang", python_dir / "sglang", ignore=ignore)
    for change in CHANGES:
        if change.name not in skip:
            apply_change(python_dir, change)
    shutil.copytree(STUB_DIR / "sgl_kernel", dest / "sgl_kernel_stub" / "sgl_kernel",
                    ignore=ignore)
    return python_dir
