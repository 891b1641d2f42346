#!/usr/bin/env bash
# The GPU checks of the torch backend's Triton kernels (issue 29), in one call on a GPU machine, from the repository
# root. The device machine reaches nothing outside it, so nothing is downloaded: PocketLLM is installed from this tree
# into the machine's own python (its CUDA torch and the triton that comes with it), and what is missing is reported.
#   1. what the machine has (GPU, driver, torch, CUDA, triton);
#   2. the kernel tests on CUDA: every kernel against the torch ops (the grouped GGUF GEMM too), and whole models
#      (Llama, Qwen3, Qwen3.5, a GGUF Llama)
#      through the kernels against the torch ops on the same GPU (tests/torch/test_triton_kernels.py);
#   3. single-stream and batch-64 decode of a random Llama in bf16 against the HBM bound (bench/gpu/decode.py).
# Writes what it saw under $OUT (the device tool's folder), else bench/results/gpu.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi: not found"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    "$PY" -c "import triton; print('triton', triton.__version__)" || echo "triton: not installed"
    "$PY" -c "import pytest; print('pytest', pytest.__version__)" || echo "pytest: not installed"
} 2>&1 | tee "$OUT/machine.txt"
"$PY" -m pip install -q --no-deps --no-build-isolation ./packages/pocketllm-core ./packages/pocketllm-torch \
    2>&1 | tail -5 | tee "$OUT/install.txt"
PYTHONPATH=. "$PY" -m pytest -q -p no:cacheprovider tests/torch/test_triton_kernels.py \
    2>&1 | tee "$OUT/kernels.txt"
PYTHONPATH=. "$PY" bench/gpu/decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.txt"
