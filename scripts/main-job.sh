#!/usr/bin/env bash
# The main job on the built-in `local` host (this machine, no SSH): set everything up, push the
# newest DDTree patch set onto a local SGLang 0.5.23 checkout (made from the PyPI wheel on first
# use), build its kernels in place for the local arch (sm_120 unless DDEPLOY_LOCAL_ARCH says
# otherwise; no GPU needed), run the overlay's tests against the patched checkout, then serve it
# and measure DDTree against linear DFlash with `ddeploy launch --wait` and `ddeploy bench`.
#
# Serving on this machine uses the `cpu-tiny` topology: the CPU engine profile of the `local` host
# only (never rendered for a GPU host). SGLang runs on CPU through the overlay's test harness (its
# CPU changes to a copy of the checkout, the sgl_kernel stand-in) with tiny DeepSeek-V3-architecture
# models (MLA + MoE) at TP 2, built so that a tree accepts more than linear DFlash; the numbers show
# the serving path and the acceptance, not GPU speed (docs/serving.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup-venv.sh --full
export PATH="$PWD/.venv/bin:$PATH" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# The toolkit with cuRAND's headers (setup-venv.sh), for SGLang's sampling-verify kernel.
[[ -e .venv/cuda ]] && CUDA_HOME="$PWD/.venv/cuda"
set -x
ddeploy push --host local --build
# The overlay's tests in the patched checkout; its real-server tests (about 20 minutes on two
# cores) run in CI and `ddeploy patches verify`; the serving step below shows that path here.
ddeploy test --remote --host local -k "not engine"
ddeploy status --host local
# Serve the patched checkout, report what serves, then SGLang's own benchmark client against it
# and against the same launch without the tree (the greedy check compares their tokens).
ddeploy launch --host local --topology cpu-tiny --wait
trap 'ddeploy stop --host local || true' ERR  # a failed run leaves nothing running
ddeploy bench --host local --topology cpu-tiny --compare linear --yes \
  --requests 8 --concurrency 4 --input-len 16 --output-len 32
ddeploy status --host local
trap - ERR
ddeploy stop --host local
