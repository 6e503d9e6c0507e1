#!/usr/bin/env bash
# One GPU session's runbook (docs/gpu.md), one `device run` call: make Slipstream importable on the bare
# GPU image, then, each part under its own time limit and each writing under $OUT as it goes:
#   1. the gpu-marked tests (pytest -m gpu)                          -> $OUT/tests.log
#   2. `slipstream train device=cuda` with every role on the one GPU, on the model directory carried in
#      `.gputiny/model` if there is one (SmolLM2's tokenizer on a tiny random decoder: the pipeline, not
#      the learning)                                                  -> $OUT/train.log, train-metrics.jsonl
#   3. `slipstream bench gpu` (fixed-shape steps replayed as CUDA graphs, against HF generate and the
#      eager path on the same card), a JSON row per batch as it is measured -> $OUT/gpu.log, gpu.json
# Run from the repo root on the GPU machine with `.whl` carried (pyzmq, msgspec, structlog, zstandard,
# and reasoning-gym with its dependencies for the train part: the image lacks them). Extra arguments go to
# `bench gpu` (e.g. --shapes qwen2.5-1.5b --batches 1,16). At most 8 files come back from $OUT. Limits in
# seconds: TESTS_S, TRAIN_S (0 skips the train part), BENCH_S, INVARIANT_S (0 skips the batch-invariant
# pass, $OUT/gpu-invariant.json); TESTS picks test paths (default: tests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/slipstream-gpu}
TESTS_S=${TESTS_S:-100}
TRAIN_S=${TRAIN_S:-75}
BENCH_S=${BENCH_S:-300}
mkdir -p "$OUT"
source deploy/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.log"
t0=$(date +%s)
timeout "$TESTS_S" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider ${TESTS:-tests} >"$OUT/tests.log" 2>&1
echo "gpu tests: exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/gpu.log"
if [[ -d .gputiny/model && $TRAIN_S != 0 ]]; then
  t0=$(date +%s)
  timeout "$TRAIN_S" python3 -m slipstream.cli.main train device=cuda model="$PWD/.gputiny/model" \
    drafter.init_from= steps=3 checkpoint_every=0 --run-dir /tmp/run >"$OUT/train.log" 2>&1
  echo "train device=cuda: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.log"
  cp /tmp/run/metrics.jsonl "$OUT/train-metrics.jsonl" 2>/dev/null
  for f in $(find /tmp/run -name '*.log' 2>/dev/null | sort); do echo "== $f"; tail -12 "$f"; done >>"$OUT/train.log"
fi
timeout "$BENCH_S" python3 -m slipstream.cli.main bench gpu --json --no-tests "$@" >"$OUT/gpu.json" \
  2> >(tee -a "$OUT/gpu.log" >&2)
echo "bench gpu: exit $?" | tee -a "$OUT/gpu.log"
# The batch-invariant kernels (engine/invariant.py) on the 1.5B shape: their cost against the rows above,
# and whether self-draft replays are accepted (self_accept near d + 1) once node 0 is a plain row's bits.
if [[ ${INVARIANT_S:-120} != 0 ]]; then
  SLIPSTREAM_BATCH_INVARIANT=1 timeout "${INVARIANT_S:-120}" python3 -m slipstream.cli.main bench gpu --json \
    --no-tests --no-peer --shapes qwen2.5-1.5b --batches 1,16 --eager-batches "" >"$OUT/gpu-invariant.json" \
    2> >(tee -a "$OUT/gpu.log" >&2)
  echo "bench gpu (batch-invariant): exit $?" | tee -a "$OUT/gpu.log"
fi
