#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, install the project, run the
# cuda-marked tests, `bench tiers`, `bench engine` (the embedded default model in
# bfloat16 against transformers on the same GPU; CUDA graphs on, then off) and a
# short multi-turn run, and print their JSON. Budget: about 8 minutes in all; each
# step has its own timeout so one slow step cannot eat the others' time. Output:
# stdout, and each step's JSON lines under ${OUT:-gpu-check-out}/.
#
# On a GPU machine without a package index or the model's weights (an air-gapped one):
#   GPU_CHECK_INSTALL=0          run from the checkout (PYTHONPATH) instead of .ci/install; the
#                                steps need torch (CUDA), Triton, transformers, safetensors,
#                                numpy, msgpack, xxhash and pytest there
#   GPU_CHECK_RANDOM_FROM=DIR    a checkpoint directory's config and tokenizer files (no weights
#                                needed): the benches run that architecture with seeded random
#                                weights drawn by transformers (both arms load the same files)
#   GPU_CHECK_MODEL=SPEC         the benches' model (default: the embedded SmolLM2-135M-Instruct)
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

MODEL=${GPU_CHECK_MODEL:-smollm2-135m-instruct}
if [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  # A CUDA build of torch is kept when present: .ci/install only swaps in the CPU build without a GPU.
  step install 240 bash .ci/install
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
if [ -n "${GPU_CHECK_RANDOM_FROM:-}" ]; then
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
# Every test module that holds a cuda-marked test; modules that need what this machine lacks
# (Ray, say, without the install) fail to collect and are skipped, the rest still run.
step cuda-tests 180 "$PY" -m pytest -q -m cuda --continue-on-collection-errors -p no:cacheprovider \
  $(grep -l "mark.cuda" tests/unit/test_*.py)
step bench-tiers 60 "$PY" -m cluster.cli bench tiers --gib 1
step bench-engine 120 "$PY" -m cluster.cli bench engine --model "$MODEL" --device cuda --dtype bfloat16 \
  --threads 8 --prompt-tokens 1000 --concurrency 8 --max-tokens 32
step bench-engine-eager 120 "$PY" -m cluster.cli bench engine --model "$MODEL" --device cuda --dtype bfloat16 \
  --threads 8 --prompt-tokens 1000 --concurrency 8 --max-tokens 32 --cuda-graphs off
step bench-multiturn 180 "$PY" -m cluster.cli bench multiturn --model "$MODEL" --device cuda \
  --dtype bfloat16 --sessions 16 --turns 3 --copy-gb-per-s 0
echo "== gpu-check done in $(( $(date +%s) - start ))s; JSON lines:"
cat "$OUT"/bench-*.out 2>/dev/null | grep '^{' || true
