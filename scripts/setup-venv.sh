#!/usr/bin/env bash
# Create (or refresh) the project virtualenv at $VENV (default: .venv).
#   light (default): the deploy tool + torch CPU for the overlay tests.
#   full  (--full):  also SGLang 0.5.23's runtime packages, so SGLang's own JIT loader and
#                    kernels import on this machine (what the test hosts' python needs),
#                    and what `sglang.launch_server` imports, for the overlay's CPU
#                    engine tests. SGLang itself is not installed: test servers run a
#                    source tree via PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MODE=light
[[ "${1:-}" == "--full" ]] && MODE=full
PY=${PYTHON:-python3}

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
inputs=(scripts/setup-venv.sh scripts/cuda-with-curand.sh scripts/constraints-full.txt pyproject.toml)
stamp="$VENV/.ddeploy-$MODE-$(sha256sum "${inputs[@]}" | sha256sum | cut -c1-12)"
if [[ -e "$stamp" ]]; then
  echo "setup-venv: $VENV is up to date ($MODE)"; exit 0
fi

if [[ "$MODE" == full ]]; then
  # torch 2.14.1 is what SGLang 0.5.23 pins; torchvision 0.29.1 is the build that imports beside it.
  "${PIP[@]}" torch==2.14.1 torchvision==0.29.1
  # The constraint keeps every later install from replacing torch (SGLang pins it).
  PIP+=(-c scripts/constraints-full.txt)
  "${PIP[@]}" numpy orjson psutil pybase64 requests triton pillow starlette msgspec pydantic \
    pyzmq tqdm ipython aiohttp apache-tvm-ffi==0.1.11 transformers==5.19.0 dill \
    sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai==2.8.0 partial-json-parser \
    einops ninja fastapi uvicorn uvloop setproctitle python-multipart interegular \
    prometheus-client xxhash msgpack
  # The rest of what a CPU `sglang.launch_server` (plain and DFLASH) imports.
  "${PIP[@]}" xgrammar==0.2.7 tiktoken regex scipy zstandard nvidia-ml-py packaging \
    "python-dateutil<3" tokenizers==0.23.2 watchfiles openai-harmony==0.0.4 \
    jsonschema soundfile
  # SGLang's benchmark client (`python -m sglang.benchmark.serving`, what `ddeploy bench` runs)
  # imports its datasets module at start (a requirement of the sglang wheel).
  "${PIP[@]}" datasets
  # flashinfer-python is what SGLang 0.5.23 pins; its headers are what SGLang's sampling-verify
  # kernel (speculative_sampling) compiles against. Headers only: none of its deps (cuda-python,
  # cutlass-dsl, ...). 65 MB wheel, about 590 MB installed, so not in the light mode.
  "${PIP[@]}" --no-deps flashinfer-python==0.7.2
else
  "${PIP[@]}" torch==2.13.0
fi
"${PIP[@]}" -e '.[overlay,test]'
if [[ "$MODE" == full ]]; then
  # $VENV/cuda: the CUDA toolkit, plus cuRAND's headers when it lacks them (scripts/cuda-with-curand.sh);
  # main-job.sh, test.sh and the test hosts build with it.
  toolkit=${CUDA_HOME:-/usr/local/cuda}
  if [[ -x "$toolkit/bin/nvcc" ]]; then
    bash scripts/cuda-with-curand.sh "$toolkit" "$VENV/cuda" "$VENV/bin/python" >/dev/null ||
      echo "setup-venv: no cuRAND headers for $toolkit; speculative_sampling will not build" >&2
  fi
fi
rm -f "$VENV"/.ddeploy-"$MODE"-*
touch "$stamp"
echo "setup-venv: $VENV ready ($MODE)"
