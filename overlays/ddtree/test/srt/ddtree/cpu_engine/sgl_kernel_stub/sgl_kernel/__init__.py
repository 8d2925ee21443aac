"""Test-only stand-in for sgl-kernel's CPU build: the few ops SGLang's CPU engine needs.

PyPI's ``sglang-kernel`` wheel is CUDA-only (it fails to import without
``libcuda.so.1``) and the CPU build compiles from source for AVX-512/AMX, so neither
runs on the CI machines. Put the directory *containing* this package on the
``PYTHONPATH`` of a test server (never of a deployed one).

Interface, as in the real package: every op is registered in the ``sgl_kernel``
torch library namespace (``torch.ops.sgl_kernel.<name>``, schema with the same
argument names and in-place annotations) and wrapped by a module-level function of
the same name that calls it, which is what SGLang imports (``from sgl_kernel import
assign_req_to_token_pool_cpu``). Ops SGLang probes with
``hasattr(torch.ops.sgl_kernel, ...)`` (AMX kernels, fused norms) stay absent, so
SGLang takes its plain torch paths.

Any other module attribute raises ``AttributeError`` naming it, so a code path that
needs a missing op fails loudly (``cannot import name 'x' from 'sgl_kernel'``).
The exception is :data:`IMPORT_ONLY`: names that SGLang imports at module level on
the DFLASH path but never calls there; they resolve to a function that raises
``NotImplementedError`` naming the op when called.
"""

from __future__ import annotations

import torch

from . import _impl

__version__ = "0.0.0+ddtree.cpu.stub"

# name -> schema; the argument names match the C++ ops (including `retrive_*`).
_SCHEMAS = {
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
        "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()"
    ),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
        "int accept_stride) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, "
        "Tensor(a!) accept_out_cache_loc) -> ()"
    ),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, "
        "Tensor retrive_next_sibling, Tensor target_predict) -> ()"
    ),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()"
    ),
}

# Imported at module level by SGLang files the DFLASH path loads, never called there.
IMPORT_ONLY = {
    "build_tree_kernel_efficient_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
}

# FRAGMENT, not DEF: a process may already hold other sgl_kernel ops (the CUDA
# wheel's); the stub only adds names that wheel does not define.
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")


def _register(name: str):
    if not hasattr(torch.ops.sgl_kernel, name):
        _LIB.define(name + _SCHEMAS[name])
        _LIB.impl(name, getattr(_impl, name), "CPU")
    op = getattr(torch.ops.sgl_kernel, name)

    def wrapper(*args, **kwargs):
        op(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(_impl, name).__doc__
    return wrapper


for _name in _SCHEMAS:
    globals()[_name] = _register(_name)
del _name

__all__ = sorted(_SCHEMAS)


def _import_only(name: str, importer: str):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stub: {name} is not implemented (only imported by "
            f"{importer}); "
            "add it to the test stub if this path needs it"
        )

    unavailable.__name__ = name
    return unavailable


def __getattr__(name: str):
    if name in IMPORT_ONLY:
        return _import_only(name, IMPORT_ONLY[name])
    raise AttributeError(
        f"sgl_kernel stub (ddtree CPU engine tests) has no attribute {name!r}; "
        f"it provides only {', '.join(__all__)}"
    )
