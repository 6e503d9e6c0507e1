#!/usr/bin/env bash
# One GPU session's runbook (docs/gpu.md): make Slipstream importable on the bare GPU image, then run
# `slipstream bench gpu`. Run from the repo root on the GPU machine with the `.whl` folder carried
# (pyzmq, msgspec, structlog: the image lacks them); the JSON lands in $OUT/gpu.json. Extra arguments go
# to `bench gpu` (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/slipstream-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# pyproject maps the top-level folders into slipstream.*; without a build step, the same by links.
mkdir -p /tmp/pkg/slipstream
for d in runtime actors protocols engine deploy benchmarks cli tasks; do
  ln -sfn "$PWD/$d" "/tmp/pkg/slipstream/$d"
done
export PYTHONPATH="/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -m slipstream.cli.main bench gpu --json --tests-log "$OUT/tests.log" "$@" >"$OUT/gpu.json" 2> >(tee "$OUT/gpu.log" >&2)
cat "$OUT/gpu.json"
