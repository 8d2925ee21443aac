#!/usr/bin/env bash
# Pack the DDTree GPU check into one archive for a bare GPU machine (torch, nvcc, Triton):
#   bash scripts/gpu-bundle.sh OUT.tar.gz
# On the GPU machine: tar xzf OUT.tar.gz && python gpu-check/run.py
# Carries: the overlay's DDTree modules and kernel sources, the SGLang 0.5.23 files the JIT
# loader and the Triton attention kernels need (copied from the base tree now; the DeepEP
# dispatcher's source for check (h), read, never imported, and the Triton renorm kernels for
# check (i) when flashinfer is absent), the wheels
# beyond torch/numpy/triton, and scripts/gpu_bundle/*.py.
# Env: PYTHON (a python with pip; default python3), GPU_BUNDLE_PYTHON (default 3.12, the GPU
# machine's python), SGLANG_BASE (the base tree's python/sglang; default
# ~/.cache/ddeploy/base/sglang-0.5.23/python/sglang).
set -euo pipefail

out=${1:?usage: gpu-bundle.sh OUT.tar.gz}
repo=$(cd "$(dirname "$0")/.." && pwd)
base=${SGLANG_BASE:-$HOME/.cache/ddeploy/base/sglang-0.5.23/python/sglang}
python_version=${GPU_BUNDLE_PYTHON:-3.12}
wheels=(msgspec apache-tvm-ffi==0.1.11 ninja)
overlay=$repo/overlays/ddtree/python/sglang
sglang_files=(
  srt/environ.py
  kernels/jit/__init__.py
  kernels/jit/utils/__init__.py kernels/jit/utils/arch.py kernels/jit/utils/common.py
  kernels/jit/utils/deps.py
  kernels/ops/attention/extend_attention.py kernels/ops/attention/decode_attention.py
  kernels/ops/attention/score_mod.py
  kernels/ops/sampling/renorm_triton.py
  srt/layers/moe/token_dispatcher/deepep.py
)

[[ -f $base/kernels/jit/utils/compile/loader.py ]] || {
  echo "gpu-bundle: no SGLang 0.5.23 tree at $base (set SGLANG_BASE)" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
dest=$stage/gpu-check
mkdir -p "$dest/sglang/srt/speculative" "$dest/sglang/kernels/jit/csrc/speculative" "$dest/wheels"

for rel in "${sglang_files[@]}"; do
  install -D -m 0644 "$base/$rel" "$dest/sglang/$rel"
done
cp -r "$base/kernels/jit/utils/compile" "$dest/sglang/kernels/jit/utils/"
cp -r "$base/kernels/jit/include" "$dest/sglang/kernels/jit/"
cp "$overlay"/srt/speculative/ddtree_*.py "$dest/sglang/srt/speculative/"
cp "$overlay"/kernels/jit/csrc/speculative/ddtree*.cuh "$dest/sglang/kernels/jit/csrc/speculative/"
echo "sglang 0.5.23 + overlays/ddtree @ $(git -C "$repo" rev-parse --short HEAD)" \
  > "$dest/sglang/BASE"
cp "$repo"/scripts/gpu_bundle/*.py "$repo/scripts/gpu_check.py" "$dest/"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +

"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest/wheels" "${wheels[@]}"

tar czf "$out" -C "$stage" gpu-check
echo "gpu-bundle: $out ($(du -h "$out" | cut -f1), wheels for python $python_version)"
