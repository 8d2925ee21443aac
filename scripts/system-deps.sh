#!/usr/bin/env bash
# Install the Debian packages ddeploy needs that a fresh machine may lack.
#   bash scripts/system-deps.sh            # what the tool itself needs (rsync, ssh client, git)
#   bash scripts/system-deps.sh --test     # plus what the test suite needs (sshd, shellcheck)
set -euo pipefail
wanted=(ssh:openssh-client rsync:rsync git:git)
[[ "${1:-}" == "--test" ]] && wanted+=(sshd:openssh-server shellcheck:shellcheck)
missing=()
for tool in "${wanted[@]}"; do
  name=${tool%%:*}
  command -v "$name" >/dev/null 2>&1 || [[ -x "/usr/sbin/$name" ]] || missing+=("${tool#*:}")
done
if ((${#missing[@]})); then
  echo "system-deps: installing ${missing[*]}"
  SUDO=(); [[ $(id -u) -ne 0 ]] && SUDO=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -qq >/dev/null
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [[ "${1:-}" == "--test" && $(id -u) -eq 0 ]]; then
  mkdir -p -m 0755 /run/sshd  # the package does not create it and sshd refuses to start without it
fi
