#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, install the project, run the
# cuda-marked tests, `bench tiers`, `bench engine` (the embedded default model in
# bfloat16 against transformers on the same GPU) and a short multi-turn run, and
# print their JSON. Budget: about 8 minutes in all; each step has its own timeout
# so one slow step cannot eat the others' time. Output: stdout, and each step's
# JSON lines under ${OUT:-gpu-check-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0

if ! nvidia-smi -L; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L failed)" >&2
  exit 2
fi
start=$(date +%s)
step() {   # step NAME TIMEOUT_S COMMAND...: run, keep the output, never stop the script
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" > >(tee "$OUT/$name.out") 2>"$OUT/$name.err"
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || tail -20 "$OUT/$name.err"
  return 0
}

# A CUDA build of torch is kept when present: .ci/install only swaps in the CPU build without a GPU.
step install 240 bash .ci/install
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
step cuda-tests 120 "$PY" -m pytest -q -m cuda tests/unit -p no:cacheprovider
step bench-tiers 60 "$PY" -m cluster.cli bench tiers --gib 1
step bench-engine 120 "$PY" -m cluster.cli bench engine --device cuda --dtype bfloat16 --threads 8 \
  --prompt-tokens 1000 --concurrency 8 --max-tokens 32
step bench-multiturn 180 "$PY" -m cluster.cli bench multiturn --model smollm2-135m-instruct --device cuda \
  --dtype bfloat16 --sessions 16 --turns 3 --copy-gb-per-s 0
echo "== gpu-check done in $(( $(date +%s) - start ))s; JSON lines:"
cat "$OUT"/bench-*.out 2>/dev/null | grep '^{' || true
