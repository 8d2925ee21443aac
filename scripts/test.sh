#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run it.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for tool in sshd:openssh-server ssh:openssh-client rsync:rsync git:git shellcheck:shellcheck; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || [[ -x "/usr/sbin/${tool%%:*}" ]] || need_apt+=("${tool#*:}")
done
if ((${#need_apt[@]})); then
  echo "test.sh: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
mkdir -p -m 0755 /run/sshd

bash scripts/setup-venv.sh --full
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$PWD/.venv/bin:$CUDA_HOME/bin:$PATH"
# The pristine SGLang base is built once into the user cache (downloads the wheel on first use).
ddeploy base fetch
exec python -m pytest "$@"
