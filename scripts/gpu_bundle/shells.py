"""SGLang's packages as bare shells, so its JIT loader and Triton kernels import alone.

The bundle carries a few SGLang 0.5.23 files under ``<root>/sglang``. SGLang's package
``__init__`` files (and ``sglang.srt.utils``, which imports ~20 runtime packages) are not
run: each parent package is an empty module whose ``__path__`` points into the bundle,
the way the overlay's test conftest does it. ``sglang.kernels.jit`` is imported for real,
because the JIT loader finds its sources through that package's ``__init__.py``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

SHELLS = (
    "sglang",
    "sglang.srt",
    "sglang.srt.speculative",
    "sglang.kernels",
    "sglang.kernels.ops",
    "sglang.kernels.ops.attention",
)
# The JIT loader and the Triton kernels import these from sglang.srt.utils(.common).
UTILS_NAMES = ("sglang.srt.utils", "sglang.srt.utils.common")


def _attach(name: str, module: types.ModuleType) -> None:
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _shell(root: Path, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(root.joinpath(*name.split(".")))]
    module.__package__ = name
    return module


def _utils_stand_in() -> types.ModuleType:
    """The six helpers the loader and kernels use, behaving as SGLang 0.5.23's do."""
    import torch

    module = types.ModuleType("sglang.srt.utils")
    module.__doc__ = "Stand-in for sglang.srt.utils (gpu-check bundle)."
    module.is_hip = lambda: torch.version.hip is not None
    module.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    module.is_gfx95_supported = lambda: _hip_arch_has("gfx95")
    module.is_gfx1250_supported = lambda: _hip_arch_has("gfx1250")
    module.get_cuda_version = _cuda_version
    module.get_device_core_count = _core_count
    return module


def _hip_arch_has(name: str) -> bool:
    import torch

    return bool(torch.version.hip) and name in torch.cuda.get_device_properties(0).gcnArchName


def _cuda_version() -> tuple[int, ...]:
    import torch

    return tuple(map(int, torch.version.cuda.split("."))) if torch.version.cuda else (0, 0)


def _core_count(device_id: int = 0) -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device_id).multi_processor_count


def register(root: Path) -> None:
    """Register the shells (and the utils stand-in) for the SGLang tree under ``root``."""
    for name in SHELLS:
        if name in sys.modules:
            raise RuntimeError(f"{name} is already imported; run the check in a fresh python")
        _attach(name, _shell(root, name))
    utils = _utils_stand_in()
    for name in UTILS_NAMES:
        _attach(name, utils)
