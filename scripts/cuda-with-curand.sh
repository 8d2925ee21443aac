#!/usr/bin/env bash
# Make DEST a CUDA toolkit root with cuRAND's headers (a link to SRC when SRC has them) and print it.
#   bash scripts/cuda-with-curand.sh SRC DEST PYTHON
# SGLang's sampling-verify kernel includes flashinfer's sampling.cuh, which includes <curand.h>.
# A toolkit assembled from NVIDIA's pip wheels (nvidia-cuda-nvcc, ...) has no cuRAND headers,
# but torch's CUDA wheels install nvidia-curand into PYTHON's site-packages. DEST is SRC with
# those headers added: symlinks only (nvcc finds its include/ next to the bin/ it runs from).
set -euo pipefail
src=$(readlink -f "$1") dest=$(realpath -m "$2") python=$3
if [[ "$src" == "$dest" ]]; then echo "$dest"; exit 0; fi  # made by an earlier run
rm -rf "$dest"
if [[ -e "$src/include/curand.h" ]]; then ln -s "$src" "$dest"; echo "$dest"; exit 0; fi
# The nvidia namespace package's directories (cu13 wheels: nvidia/cu13/include, cu12: nvidia/curand/include).
find_headers='import glob, importlib.util as u
s = u.find_spec("nvidia")
for d in (s.submodule_search_locations if s else []):
    print(*glob.glob(d + "/cu*/include/curand.h") + glob.glob(d + "/curand/include/curand.h"), sep="\n")'
headers=$("$python" -c "$find_headers" | grep . || true)
if [[ -z "$headers" ]]; then
  echo "cuda-with-curand: $src has no include/curand.h and $python has no nvidia-curand wheel" >&2
  exit 1
fi
curand=$(dirname "$(head -n1 <<<"$headers")")
mkdir -p "$dest/bin" "$dest/include"
for entry in "$src"/*; do
  case ${entry##*/} in bin | include | targets) ;; *) ln -s "$entry" "$dest/" ;; esac
done
ln -s "$src"/bin/* "$dest/bin/"
ln -s "$src"/include/* "$dest/include/"
ln -s "$curand"/curand*.h "$dest/include/"
# nvcc reads targets/<arch>/include when targets/ exists: point it at the include/ above.
for target in "$src"/targets/*; do
  [[ -d "$target" ]] || continue
  mkdir -p "$dest/targets/${target##*/}"
  ln -s ../../include "$dest/targets/${target##*/}/include"
  ln -s "$target/lib" "$dest/targets/${target##*/}/lib"
done
echo "$dest"
