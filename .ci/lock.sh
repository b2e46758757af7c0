# Sourced by .ci/install and .ci/run: which lock this machine installs.
#   GPU=1 where an NVIDIA GPU answers (locks/cuda.txt), else 0 (locks/cpu.txt)
#   LOCK    the lock's path, from the repository root
#   EXTRAS  the extras of pyproject.toml it was written for (scripts/lock)
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi
if [ "$GPU" = 1 ]; then LOCK=locks/cuda.txt EXTRAS=test,l3-cuda; else LOCK=locks/cpu.txt EXTRAS=test,l3; fi
