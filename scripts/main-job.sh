#!/usr/bin/env bash
# The main job on the built-in `local` host (this machine, no SSH): set everything up, push the
# newest DDTree patch set onto a local SGLang 0.5.23 checkout (made from the PyPI wheel on first
# use), build its kernels in place for the local arch (sm_120 unless DDEPLOY_LOCAL_ARCH says
# otherwise; no GPU needed), run the overlay's tests against the patched checkout, show status.
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
# Serve for real on the local host: the patched checkout's SGLang on CPU (the overlay's test
# harness supplies the CPU stand-ins), tiny models, linear DFlash vs DDTree, answers printed.
checkout=$(ddeploy hosts --json | python -c \
  'import json, sys; print(next(h["checkout"] for h in json.load(sys.stdin) if h["name"] == "local"))')
python bench/bench_serving.py --root "$checkout" --budgets 192 --requests 4 --new-tokens 32 --show
