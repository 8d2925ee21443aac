#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run it.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/system-deps.sh --test

bash scripts/setup-venv.sh --full
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[[ -e .venv/cuda ]] && CUDA_HOME="$PWD/.venv/cuda"  # with cuRAND's headers (setup-venv.sh)
export PATH="$PWD/.venv/bin:$CUDA_HOME/bin:$PATH"
# The pristine SGLang base is built once into the user cache (downloads the wheel on first use).
ddeploy base fetch
exec python -m pytest "$@"
