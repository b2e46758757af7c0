"""The Python steps of ``scripts/gpu-check.sh`` (run as ``python -m lab.gpu_check.NAME``)."""
