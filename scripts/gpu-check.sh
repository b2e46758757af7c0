#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, everything the project claims for GPUs, in one
# call of at most 10 minutes (GPU_CHECK_BUDGET_S, default 600: each step has its own timeout,
# cut to what the budget has left; a step the budget cannot start fails, saying so):
#
#   gpu                 nvidia-smi lists a GPU
#   install             bash .ci/install (kept CUDA torch; the CUDA Mooncake wheel where it installs)
#   torch               torch, CUDA, Triton versions and the device
#   model               the model ready to load (the embedded GGUF converted once), or seeded
#                       random weights for GPU_CHECK_RANDOM_FROM's architecture
#   cuda-tests          the cuda-marked tests (fails when none ran)
#   bench-tiers         tier copies against plain pinned copies, forward stall under offload:
#                       fails below a 0.9 copy ratio or at a 2% stall or more (the design's goals)
#   exactness-float32   bench exactness on CUDA: 1,100-token prompts, cold, cached, a later turn;
#                       fails when a logit differs from transformers' by more than 1e-4 or a
#                       CUDA graph was captured while serving (all are built at start-up)
#   exactness-bfloat16  the same in bfloat16 against transformers' bfloat16: the difference and
#                       the greedy-token agreement reported, not checked
#   bench-engine        bfloat16 engine against transformers, CUDA graphs on
#   bench-multiturn     drop, tiered and tiered+prefetch (at arrival) on the GPU
#   serve               the Serve app on a local Ray cluster: replicas claim the GPU at deploy
#                       (checked: their processes are on it), multi-turn chats over HTTP through
#                       the cost router on the tiered cache, with X-Session-Id prefetch, and on drop
#   nixl-device         a NIXL transfer between two processes' device memory (exact bytes, GB/s)
#   mooncake-cuda       the CUDA Mooncake wheel: installed where this machine can, then the L3
#                       tests on it (skipped, saying why, where it cannot be installed)
#
# Output: one JSON summary line per step on stdout ({"gpu_check": step, "ok": true|false|null,
# "seconds": s, "rc": rc, ...key figures, "failed": [why] | "skipped": why}), then a "total"
# line; each step's own output under ${OUT:-gpu-check-out}/. The script goes through every step
# whatever failed before, and exits 1 when any step failed (0 when none did; 2 without a GPU).
#
#   GPU_CHECK_INSTALL=0          run from the checkout (PYTHONPATH) instead of .ci/install, on a GPU
#                                machine without a package index: torch (CUDA), Triton,
#                                transformers, safetensors, numpy, msgpack, xxhash, ray and pytest
#                                must be there
#   GPU_CHECK_RANDOM_FROM=DIR    a checkpoint directory's config and tokenizer files (no weights
#                                needed): the steps run that architecture with seeded random
#                                weights drawn by transformers (both arms load the same files)
#   GPU_CHECK_MODEL=SPEC         the model (default: the embedded SmolLM2-135M-Instruct)
#   GPU_CHECK_FORCE_FAIL=a,b     these steps fail without running (shows that a failing step
#                                fails the check: tests/unit/test_gpu_check_script.py)
#   GPU_CHECK_DRY=1              no step runs (each reported skipped, forced ones failed): the
#                                script's own logic, on any machine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
DRY=${GPU_CHECK_DRY:-0}
FORCE=",${GPU_CHECK_FORCE_FAIL:-},"
BUDGET_S=${GPU_CHECK_BUDGET_S:-600}
MIN_STEP_S=15          # a step is not started with less than this left
start=$(date +%s)
deadline=$((start + BUDGET_S))
failed_steps=()

# step NAME LIMIT_S COMMAND...: run it (unless forced, dry or out of budget) under its timeout,
# keep its output, print its summary line; never stops the script. A command that exits 3
# was skipped (it prints a {"skipped": why} line).
step() {
  local name=$1 limit=$2 rc note="" t0 left
  shift 2
  t0=$(date +%s)
  left=$((deadline - t0))
  : >"$OUT/$name.out"
  : >"$OUT/$name.err"
  if [[ "$FORCE" == *",$name,"* ]]; then
    rc=97; note="forced to fail by GPU_CHECK_FORCE_FAIL (not run)"
  elif [ "$DRY" = 1 ]; then
    rc=3; note="dry run (GPU_CHECK_DRY=1)"
  elif [ "$left" -lt "$MIN_STEP_S" ]; then
    rc=124; note="not run: the ${BUDGET_S}s budget is spent"
  else
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s)" >&2
    timeout -k 10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
    rc=$?
  fi
  local line status
  line=$("$PY" -m lab.gpu_check.report "$name" "$rc" "$(( $(date +%s) - t0 ))" \
         "$OUT/$name.out" "$OUT/$name.err" "$note")
  status=$?
  echo "$line"
  echo "$line" >>"$OUT/summary.jsonl"
  if [ "$status" = 1 ] || [ -z "$line" ]; then
    failed_steps+=("$name")
    [ -s "$OUT/$name.err" ] && tail -15 "$OUT/$name.err" | sed "s/^/   $name: /" >&2
  fi
  return 0
}

finish() {
  local failed_json="" s
  for s in "${failed_steps[@]+"${failed_steps[@]}"}"; do failed_json+="${failed_json:+, }\"$s\""; done
  local ok=true
  [ "${#failed_steps[@]}" -gt 0 ] && ok=false
  echo "{\"gpu_check\": \"total\", \"ok\": $ok, \"seconds\": $(( $(date +%s) - start )), \"failed_steps\": [$failed_json]}" \
    | tee -a "$OUT/summary.jsonl"
  [ "$ok" = true ] && exit 0
  exit "${1:-1}"
}

: >"$OUT/summary.jsonl"
step gpu 20 nvidia-smi -L
if [ "$DRY" != 1 ] && [[ "$FORCE" != *",gpu,"* ]] && [[ " ${failed_steps[*]+"${failed_steps[*]}"} " == *" gpu "* ]]; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L failed)" >&2
  finish 2
fi

MODEL=${GPU_CHECK_MODEL:-smollm2-135m-instruct}
if [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step install 1 bash -c 'echo "{\"skipped\": \"GPU_CHECK_INSTALL=0: running from the checkout\"}"; exit 3'
else
  # A CUDA build of torch is kept when present: .ci/install only swaps in the CPU build without a GPU.
  step install 180 bash .ci/install
fi
step torch 60 "$PY" -c '
import json, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
ok = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "triton": tv,
                  "device": torch.cuda.get_device_name(0) if ok else None,
                  "failed": [] if ok and tv else ["torch sees no CUDA device" if not ok else "Triton is not importable"]}))'
if [ -z "${GPU_CHECK_RANDOM_FROM:-}" ]; then
  # The model once, here (the embedded GGUF is converted on first use, ~20 s), not in a timed step.
  step model 120 "$PY" -c 'import sys; from serve_app.local import prepare_model; print(prepare_model(sys.argv[1]))' "$MODEL"
else
  MODEL=${TMPDIR:-/tmp}/gpu-check-random-model
  step model 120 "$PY" -c '
import shutil, sys
from pathlib import Path
import torch, transformers
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf"))
torch.manual_seed(0)
config = transformers.AutoConfig.from_pretrained(dst)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dst)
print("random weights for", config.model_type, "in", dst)' "$GPU_CHECK_RANDOM_FROM" "$MODEL"
fi
# Every test module that holds a cuda-marked test, CI=true: a part missing there fails, not skips.
step cuda-tests 90 env CI=true "$PY" -m pytest -q -m cuda -p no:cacheprovider \
  $(grep -l "mark.cuda" tests/unit/test_*.py)
step bench-tiers 50 "$PY" -m cluster.cli bench tiers --gib 1
step exactness-float32 60 "$PY" -m cluster.cli bench exactness --model "$MODEL" --device cuda --dtype float32
step exactness-bfloat16 45 "$PY" -m cluster.cli bench exactness --model "$MODEL" --device cuda --dtype bfloat16
step bench-engine 75 "$PY" -m cluster.cli bench engine --model "$MODEL" --device cuda --dtype bfloat16 \
  --threads 8 --prompt-tokens 1000 --concurrency 8 --max-tokens 32 --repeats 2
step bench-multiturn 90 "$PY" -m cluster.cli bench multiturn --model "$MODEL" --device cuda --dtype bfloat16 \
  --sessions 16 --turns 3 --copy-gb-per-s 0 --policies drop,tiered,tiered+prefetch --prefetch-trigger arrival
step serve 200 "$PY" -m lab.gpu_check.serve --model "$MODEL" --expect-gpu
step nixl-device 40 "$PY" -m lab.gpu_check.nixl --device cuda
step mooncake-cuda 90 "$PY" -m lab.gpu_check.mooncake
finish 1
