"""A scratch copy of an SGLang tree that runs DFLASH on CPU (test-only changes).

Stock SGLang 0.5.23 serves plain models on CPU but refuses or breaks on the DFLASH
path there. :func:`prepare_cpu_tree` copies a ``python/`` directory (the one holding
``sglang/``) and applies small changes to the copy, never to the tree under test:

1. ``arg_groups/speculative_hook.py``: accept device ``cpu`` for DFLASH;
2. ``arg_groups/choices.py``: allow ``torch_native`` as draft attention backend;
3. ``layers/attention/torch_native_backend.py``: a TARGET_VERIFY path in
   ``forward_extend`` (stock code indexes ``extend_prefix_lens``, unset in verify);
4. ``speculative/dflash_worker_v2.py``: ``record_stream`` only on device tensors;
5. ``models/dflash.py``: the Triton ``table_qk_norm_rope_`` only for CUDA tensors;
6. ``model_executor/model_runner.py``: keep float32 ``input_embeds`` for float32
   models (stock casts them to bf16, which a float32 DFlash draft cannot take);
7. ``speculative/ddtree_rules.py`` (only where DDTree is wired, i.e. the file
   exists): let DDTree accept ``torch_native`` as a target backend that applies
   the tree mask in TARGET_VERIFY, which it does after change 3 (for MHA and,
   as a separate change, for MLA targets);
8. ``models/deepseek_common/attention_backend_handler.py``: a ``torch_native``
   handler that runs absorbed MLA (stock falls back to the Triton handler, whose
   MHA prefill reads the latent cache at the wrong width);
9. ``distributed/parallel_state.py``: no PyNccl communicator for ``gloo``
   groups, so TP > 1 runs on CPU (stock creates one for any multi-rank group);
10. ``speculative/ddtree_worker.py``: calls into ``ddtree_test_hooks`` (copied
    beside it from this directory): per-rank records of the committed tokens,
    per-rank coins, a shifted-mask control, a sibling-swapped grammar control,
    an accept-sync control and a lossy-threshold control, each off unless its
    environment variable is set
    (see that module);
11. attention DP on CPU (``--attn-dp-size``, with ``--ep-size``): the
    torch_native backend's CPU fill value for padded requests; ``reduce_scatterv``
    and ``all_gatherv`` over gloo (stock requires PyNccl); ``moe_forward_native``
    reads expert parallel's -1 ids (another rank's expert) as weight 0; DFLASH
    with attention DP accepted on device ``cpu``;
12. ``speculative/dflash_worker_v2.py``: ``DDTREE_TEST_IDLE_VERIFY=skip`` makes
    an idle DP rank skip its idle verify (a control: the busy rank's collectives
    then have no partner);
13. ``managers/data_parallel_controller.py``: under ``--sleep-on-idle`` the DP
    controller waits on its socket (stock polls it without blocking, forever:
    a whole core per DP server, half of a 2-core test machine, whatever the
    flag says; the schedulers already honour it).

Where a test runs the target's verify through SGLang's own ``TritonAttnBackend``
(``--attention-backend triton``), changes 3, 7 and 8 are not on its path: the
backend and its Triton kernels run as shipped, under the Triton interpreter.

Each change is an exact-snippet replacement that must match exactly once; otherwise
:class:`CpuTreeError` names the file and the change. Snippets are short and local so
they still apply on top of the DDTree overlay's hunks into the same files.

Layout written under ``dest``::

    dest/python/sglang/...            the patched copy (returned)
    dest/sgl_kernel_stub/sgl_kernel/  the pure-torch sgl_kernel stand-in

Test servers need both on ``PYTHONPATH`` (:func:`stub_dir_for` finds the second).

:func:`cached_cpu_tree` is the same, built once per content (``cache``) and
byte-compiled: every server process of a run (and of later runs) then loads
SGLang's compiled modules instead of compiling the sources it imports again,
which machines with ``PYTHONDONTWRITEBYTECODE`` set would do at every start.
"""

from __future__ import annotations

import compileall
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .cache import cached, content_key

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
_DDTREE_RULES = "sglang/srt/speculative/ddtree_rules.py"
_DDTREE_WORKER = "sglang/srt/speculative/ddtree_worker.py"
_DEEPSEEK_HANDLER = "sglang/srt/models/deepseek_common/attention_backend_handler.py"
_PARALLEL_STATE = "sglang/srt/distributed/parallel_state.py"
_MOE_NATIVE = "sglang/srt/layers/moe/fused_moe_native.py"
_DP_CONTROLLER = "sglang/srt/managers/data_parallel_controller.py"
DDTREE_TORCH_NATIVE = "ddtree_rules: torch_native applies the tree mask (change 3)"
DDTREE_TORCH_NATIVE_MLA = "ddtree_rules: torch_native applies it for MLA too"
HOOKS = Path(__file__).resolve().parent / "ddtree_test_hooks.py"

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

# all_gatherv over a gloo group (stock requires PyNccl): every rank's rows padded
# to the largest count, all_gather, then each rank's real rows in rank order.
_CPU_ALL_GATHERV = '''
def _cpu_all_gatherv(group, input_, sizes, output):
    """all_gatherv over ``group``'s gloo device group (a test-only CPU change)."""
    single = isinstance(input_, torch.Tensor)
    gathered = []
    for tensor in [input_] if single else input_:
        counts = sizes or [tensor.shape[0]] * group.world_size
        padded = tensor.new_zeros((max(counts),) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(group.world_size)]
        torch.distributed.all_gather(parts, padded, group=group.device_group)
        rows = torch.cat([part[:n] for part, n in zip(parts, counts)])
        if output is not None:
            rows = output.copy_(rows)
        gathered.append(rows)
    return gathered[0] if single else gathered

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
        _DDTREE_RULES,
        'DDTREE_MASK_BACKENDS = {\n    "triton": "TritonAttnBackend",\n',
        'DDTREE_MASK_BACKENDS = {\n    "triton": "TritonAttnBackend",\n'
        '    "torch_native": "TorchNativeAttnBackend",  # test-only CPU change\n',
        optional=True,
    ),
    Change(
        DDTREE_TORCH_NATIVE_MLA,
        _DDTREE_RULES,
        'DDTREE_MLA_MASK_BACKENDS = {"triton": "TritonAttnBackend"}\n',
        'DDTREE_MLA_MASK_BACKENDS = {\n    "triton": "TritonAttnBackend",\n'
        '    "torch_native": "TorchNativeAttnBackend",  # test-only CPU change\n'
        "}\n",
        optional=True,
    ),
    Change(
        "deepseek attention_backend_handler: torch_native runs absorbed MLA",
        _DEEPSEEK_HANDLER,
        'AttentionBackendRegistry.register("intel_xpu", handle_attention_intel_xpu)\n',
        'AttentionBackendRegistry.register("intel_xpu", handle_attention_intel_xpu)\n'
        "# Test-only CPU change: torch_native reads the latent MLA cache as MLA.\n"
        "AttentionBackendRegistry.register(\n"
        '    "torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA\n'
        ")\n",
    ),
    Change(
        "parallel_state: no PyNccl for CPU (gloo) groups",
        _PARALLEL_STATE,
        '            use_pynccl = not (_is_npu or _is_xpu or backend == "mooncake")\n',
        '            use_pynccl = not (_is_npu or _is_xpu or backend == "mooncake")\n'
        '            use_pynccl = use_pynccl and backend != "gloo"  # test-only CPU\n',
    ),
    Change(
        "torch_native: the DP padding's seq-len fill value on CPU",
        _TORCH_NATIVE,
        "class TorchNativeAttnBackend(AttentionBackend):\n",
        "class TorchNativeAttnBackend(AttentionBackend):\n"
        "    def get_cpu_graph_seq_len_fill_value(self):  # test-only CPU change\n"
        "        return 1\n\n",
    ),
    Change(
        "parallel_state: reduce_scatterv over gloo (all-reduce, then this rank's rows)",
        _PARALLEL_STATE,
        "        if envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get():\n"
        "            return self._deterministic_reduce_scatterv(input_, output, sizes)\n",
        "        if envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get() or (\n"
        "            pynccl_comm is None  # test-only CPU change: gloo groups\n"
        "        ):\n"
        "            return self._deterministic_reduce_scatterv(input_, output, sizes)\n",
    ),
    Change(
        "parallel_state: all_gatherv over gloo (padded all_gather)",
        _PARALLEL_STATE,
        "        with pynccl_comm.change_state(enable=True):\n"
        "            assert pynccl_comm is not None and not pynccl_comm.disabled, (\n"
        '                "pynccl is required for all_gatherv"\n',
        "        if pynccl_comm is None:  # test-only CPU change: gloo groups\n"
        "            return _cpu_all_gatherv(self, input_, sizes, output)\n"
        "        with pynccl_comm.change_state(enable=True):\n"
        "            assert pynccl_comm is not None and not pynccl_comm.disabled, (\n"
        '                "pynccl is required for all_gatherv"\n',
    ),
    Change(
        "parallel_state: the gloo all_gatherv itself",
        _PARALLEL_STATE,
        "\nclass GroupCoordinator:\n",
        _CPU_ALL_GATHERV + "\nclass GroupCoordinator:\n",
    ),
    Change(
        "fused_moe_native: expert parallel's -1 ids (experts on other ranks)",
        _MOE_NATIVE,
        "    topk_weights, topk_ids, _ = topk_output\n\n    # Ref code from",
        "    topk_weights, topk_ids, _ = topk_output\n"
        "    # Test-only CPU change: under --ep-size > 1, id -1 is another rank's\n"
        "    # expert; it adds nothing here (the EP combine sums the ranks).\n"
        "    off_rank = topk_ids < 0\n"
        "    topk_weights = topk_weights.masked_fill(off_rank, 0)\n"
        "    topk_ids = topk_ids.masked_fill(off_rank, 0)\n\n    # Ref code from",
    ),
    Change(
        "fused_moe_native: count a token's repeated expert id once per slot",
        _MOE_NATIVE,
        "    cnts.scatter_(1, topk_ids.to(torch.int64), 1)\n",
        "    cnts.scatter_add_(  # test-only CPU change: ids may repeat (-1 -> 0)\n"
        "        1, topk_ids.to(torch.int64), torch.ones_like(cnts)\n"
        "    )\n",
    ),
    Change(
        "speculative_hook: DFLASH with attention DP on device cpu",
        _SPEC_HOOK,
        '        if not cfg.device.startswith("cuda"):\n'
        '            raise ValueError("DFLASH with dp attention requires CUDA or NPU.")\n',
        '        if not (cfg.device.startswith("cuda") or cfg.device == "cpu"):\n'
        '            raise ValueError("DFLASH with dp attention requires CUDA or NPU.")\n',
    ),
    Change(
        "data_parallel_controller: wait on the socket under --sleep-on-idle",
        _DP_CONTROLLER,
        "    def event_loop(self):\n        while True:\n            while True:\n",
        "    def event_loop(self):\n"
        "        # Test-only CPU change: under --sleep-on-idle, block until a request\n"
        "        # arrives (at most 1 s, so the soft watchdog is still fed) instead\n"
        "        # of polling the socket in a loop.\n"
        "        poller = zmq.Poller()\n"
        "        poller.register(self.recv_from_tokenizer, zmq.POLLIN)\n"
        "        while True:\n"
        "            if get_device().sleep_on_idle:\n"
        "                poller.poll(1000)\n"
        "            while True:\n",
    ),
    Change(
        "dflash_worker_v2: DDTREE_TEST_IDLE_VERIFY=skip drops the idle verify (control)",
        _DFLASH_WORKER,
        "            if get_parallel().attn_dp_enabled:\n",
        "            if get_parallel().attn_dp_enabled and (\n"
        '                os.environ.get("DDTREE_TEST_IDLE_VERIFY") != "skip"  # test-only\n'
        "            ):\n",
    ),
    Change(
        "ddtree_worker: test hooks (rank records, per-rank coins, mask control)",
        _DDTREE_WORKER,
        "        out_tokens, commit_lens, bonus = commit_outputs(accept, "
        "self.config.block_size)\n",
        "        out_tokens, commit_lens, bonus = commit_outputs(accept, "
        "self.config.block_size)\n"
        "        from sglang.srt.speculative import ddtree_test_hooks  # test-only\n\n"
        "        ddtree_test_hooks.record_commit(out_tokens, commit_lens)\n",
        optional=True,
    ),
    Change(
        "ddtree_worker: test hook before the sampled accept draws its coins",
        _DDTREE_WORKER,
        "        bs, width = step.tokens.shape\n        s = self.config."
        "num_speculative_tokens\n        vocab = logits.shape[-1]\n",
        "        bs, width = step.tokens.shape\n        s = self.config."
        "num_speculative_tokens\n        vocab = logits.shape[-1]\n"
        "        from sglang.srt.speculative import ddtree_test_hooks  # test-only\n\n"
        "        ddtree_test_hooks.before_sampling()\n",
        optional=True,
    ),
    Change(
        "ddtree_worker: test hook on the built verify step (mask control)",
        _DDTREE_WORKER,
        "            prefix_lens_bound,\n        )\n        return self._step\n",
        "            prefix_lens_bound,\n        )\n"
        "        from sglang.srt.speculative import ddtree_test_hooks  # test-only\n\n"
        "        ddtree_test_hooks.corrupt_mask(self._step)\n"
        "        return self._step\n",
        optional=True,
    ),
    Change(
        "ddtree_worker: test hook on DDTree's accept sync (sync control)",
        _DDTREE_WORKER,
        "        step = self._step\n        s = self.config.num_speculative_tokens\n",
        "        from sglang.srt.speculative import ddtree_test_hooks  # test-only\n\n"
        "        tp_sync = ddtree_test_hooks.accept_sync(tp_sync)\n"
        "        step = self._step\n        s = self.config.num_speculative_tokens\n",
        optional=True,
    ),
    Change(
        "ddtree_worker: test hook on the sampled accept's threshold (lossy control)",
        _DDTREE_WORKER,
        "        tp_sync = ddtree_test_hooks.accept_sync(tp_sync)\n",
        "        tp_sync = ddtree_test_hooks.accept_sync(tp_sync)\n"
        "        threshold_acc = ddtree_test_hooks.threshold_acc(threshold_acc)\n",
        optional=True,
    ),
    Change(
        "ddtree_worker: test hook on the grammar tree's tokens (grammar control)",
        _DDTREE_WORKER,
        "        step = self._step\n        return GrammarTree.from_device(\n"
        "            step.retrieve.retrieve_next_token,\n"
        "            step.retrieve.retrieve_next_sibling,\n            step.tokens,\n",
        "        from sglang.srt.speculative import ddtree_test_hooks  # test-only\n\n"
        "        step = self._step\n        return GrammarTree.from_device(\n"
        "            step.retrieve.retrieve_next_token,\n"
        "            step.retrieve.retrieve_next_sibling,\n"
        "            ddtree_test_hooks.grammar_tokens(step),\n",
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
    if (python_dir / _DDTREE_WORKER).is_file():
        shutil.copy2(HOOKS, python_dir / "sglang/srt/speculative" / HOOKS.name)
    shutil.copytree(STUB_DIR / "sgl_kernel", dest / "sgl_kernel_stub" / "sgl_kernel",
                    ignore=ignore)
    return python_dir


def _harness_key_parts() -> tuple:
    """What the CPU tree is made of besides the source: this module, the hooks and
    the stand-in package."""
    here = Path(__file__).resolve()
    return (here, HOOKS, STUB_DIR / "sgl_kernel")


def cached_cpu_tree(
    key_parts: Sequence,
    make_source: Callable[[Path], Path],
    skip: Sequence[str] = (),
) -> Path:
    """:func:`prepare_cpu_tree` with every module byte-compiled, from the cache
    when its inputs are unchanged; returns the tree's ``python/`` dir.

    ``key_parts`` identify the source (its files, or the base commit and the
    overlay it is made from; see ``cache.content_key``); this harness's own files
    are added. On a miss ``make_source(workdir)`` returns the ``python/`` dir to
    copy (it may build one in ``workdir``, which is removed afterwards).
    ``skip``: as for :func:`prepare_cpu_tree`.
    """
    skipped = "skip:" + "\n".join(sorted(skip))
    key = content_key("cpu-tree", skipped, *key_parts, *_harness_key_parts())

    def build(dest: Path) -> None:
        src_python = make_source(dest / "source")
        python_dir = prepare_cpu_tree(src_python, dest / "tree", skip)
        shutil.rmtree(dest / "source", ignore_errors=True)
        compileall.compile_dir(str(python_dir), quiet=1, workers=0)
        compileall.compile_dir(str(dest / "tree" / "sgl_kernel_stub"), quiet=1)

    return cached("trees", key, build) / "tree" / "python"
