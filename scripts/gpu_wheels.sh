#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach PyPI but already has CUDA torch on it.
#
#   bash scripts/gpu_wheels.sh [DIR]      # default DIR: .whl (ignore it in git)
#
# Downloads, for CPython 3.12 on x86-64 Linux (PYVER / PLATFORMS override), the
# packages diffbatch and its tests need beyond what a CUDA image with PyTorch,
# transformers, accelerate, peft, safetensors, numpy, pillow, httpx, pytest and
# prometheus-client already holds, at the versions installed in .venv here (the ones
# the suite passes with). `scripts/gpu_check.sh` installs them when WHEELS=DIR is set.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${PYVER:-3.12}
PLATFORMS=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64"}
PACKAGES=(diffusers importlib-metadata fastapi fastapi-offline starlette opentelemetry-api
          annotated-doc pydantic pydantic-core annotated-types typing-inspection
          typing-extensions python-multipart uvicorn httptools greenlet pytest-asyncio)
platform_args=()
for p in $PLATFORMS; do platform_args+=(--platform "$p"); done
pins=()
for name in "${PACKAGES[@]}"; do
    pins+=("$name==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")")
done
mkdir -p "$DIR"
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platform_args[@]}" -d "$DIR" "${pins[@]}"
ls "$DIR"
