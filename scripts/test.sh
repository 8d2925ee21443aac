#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run it.
#   bash scripts/test.sh [pytest args...]
# The suite runs on $DDEPLOY_TEST_WORKERS pytest-xdist workers (default 2): each module's tests on
# one worker, the overlay's CPU-engine tests all on one (they share its server pool), the longest
# groups first (tests/conftest.py, docs/testing.md). DDEPLOY_TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/system-deps.sh --test

bash scripts/setup-venv.sh --full
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[[ -e .venv/cuda ]] && CUDA_HOME="$PWD/.venv/cuda"  # with cuRAND's headers (setup-venv.sh)
export PATH="$PWD/.venv/bin:$CUDA_HOME/bin:$PATH"
# The pristine SGLang base is built once into the user cache (downloads the wheel on first use).
ddeploy base fetch
workers=${DDEPLOY_TEST_WORKERS:-2}
parallel=()
[[ "$workers" != 0 ]] && parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
exec python -m pytest "${parallel[@]}" "$@"
