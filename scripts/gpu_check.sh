#!/usr/bin/env bash
# One short check on a machine with an NVIDIA GPU: install, run the CUDA tests, one benchmark.
#
#   bash scripts/gpu_check.sh            # writes gpu_check/ (logs, JSON) in the repo root
#
# It makes its own venv (.venv-gpu) with the CUDA build of the pinned torch (PyPI's
# default Linux wheel), installs diffbatch with its test extra, prints the GPU, runs
# tests/test_cuda.py (skipped on machines without CUDA) and the learned-curve benchmark
# on the GPU (the start-up calibration measures wave sizes against free device memory).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
test -x .venv-gpu/bin/python || "$PY" -m venv .venv-gpu
.venv-gpu/bin/pip install -q "torch==2.13.0"
.venv-gpu/bin/pip install -q "torch==2.13.0" -e ".[dev]"
nvidia-smi | tee "$OUT/nvidia-smi.txt" || true
.venv-gpu/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/torch.txt"
.venv-gpu/bin/python -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs 2>&1 | tee "$OUT/test_cuda.log"
(cd benchmarks && ../.venv-gpu/bin/python learned_curve.py --device cuda \
    --out "../$OUT/learned_curve_cuda.json" --figure "../$OUT/learned_curve_cuda.png" 2>&1 \
    | grep -v " INFO " | tee "../$OUT/learned_curve.log")
