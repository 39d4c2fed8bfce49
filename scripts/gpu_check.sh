#!/usr/bin/env bash
# One short check on a machine with an NVIDIA GPU: install, run the CUDA tests, benchmarks.
#
#   bash scripts/gpu_check.sh                  # a machine that reaches PyPI
#   WHEELS=.whl bash scripts/gpu_check.sh      # one that cannot, with CUDA torch on it
#
# Writes OUT (default gpu_check/): env.txt (GPU, torch), test_cuda.log, benchmarks.log,
# the JSON and figure of learned_curve and defaults, the two mixed_resolution JSONs and
# step_cache_device.json, compile_device.json and worker_restart.json (twelve files).
#
# With PyPI: a venv (.venv-gpu) with the CUDA build of the pinned torch (PyPI's default
# Linux wheel) and diffbatch with its test and bench extras. Without (WHEELS=DIR): the
# machine's python3 and its own torch, plus the wheels in DIR that `scripts/gpu_wheels.sh`
# fetched elsewhere (diffbatch itself runs from this checkout through PYTHONPATH).
#
# Steps, each under its own time limit (about four minutes in all on an H200, plus the
# compile step: inductor compiles four buckets of two models, minutes on a first run):
#   1. tests/test_cuda.py: auto batching, batch invariance, fp16, step mode on CUDA;
#   2. how far a request's image in a wave is from its image alone, TF32 on and off;
#   3. benchmarks/learned_curve.py on the GPU (calibration against free device memory);
#   4. benchmarks/defaults.py, the plain diffusers loop on the GPU too
#      (`diffbatch serve tiny-sd` with no flags vs `pipe.to("cuda")`);
#   5. `diffbatch bench serve` against `diffbatch serve tiny-sd` with no flags and with
#      fixed settings, at 16 and 64 closed-loop clients (mean wave size, queue wait);
#   6. benchmarks/mixed_resolution.py: one packed transformer call over several sizes vs
#      one call per size, then serving a 64/96/128 mix with and without
#      --mixed-resolution (tiny-sd3, tiny-pixart): whether packing pays on a GPU;
#   7. benchmarks/step_cache.py --parts device: a PixArt-Sigma-sized transformer with
#      random weights, built on the GPU, at 1024x1024: a wave of 8 denoised with the
#      per-request step cache (all caching, half caching) against no caching;
#   8. benchmarks/compile.py --parts device: the denoiser forward at wave sizes 1, 4, 16
#      and 32, eager against compiled (inductor) against compiled with CUDA graphs
#      (reduce-overhead), on the tiny-sd UNet and a PixArt-Sigma-sized transformer with
#      random weights at 512x512;
#   9. benchmarks/worker_restart.py --device cuda (its forkserver rows force the fork): whether
#      a worker forked from the fork server can use CUDA (CUDA workers are spawned
#      until this passes), and what a forked replacement saves against a spawned one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -n "${WHEELS:-}" ]; then
    SITE=${SITE:-/tmp/diffbatch-site}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PY=python3
else
    BASE=${PYTHON:-python3.11}
    command -v "$BASE" >/dev/null || BASE=python3
    test -x .venv-gpu/bin/python || "$BASE" -m venv .venv-gpu
    .venv-gpu/bin/pip install -q "torch==2.13.0" || exit 1
    .venv-gpu/bin/pip install -q "torch==2.13.0" -e ".[dev,bench]" || exit 1
    PY=$PWD/.venv-gpu/bin/python
fi
LOG=$OUT/benchmarks.log
: > "$LOG"
status=0

{
    nvidia-smi
    "$PY" -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) \
if torch.cuda.is_available() else ''); print('diffusers', diffusers.__version__, \
'transformers', transformers.__version__)"
    echo "cpus: $(nproc)"
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. tests/test_cuda.py"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs 2>&1 \
    | tee "$OUT/test_cuda.log" || status=1

echo "== 2. batch invariance: |wave of 3 - alone| on [0, 1] images" | tee -a "$LOG"
PYTHONPATH="benchmarks:${PYTHONPATH:-}" timeout 120 "$PY" - <<'EOF' 2>&1 | tee -a "$LOG" || status=1
import torch
from peers_servers.pipeline import ImageJob, load_pipeline, pipeline_call
pipe = load_pipeline("tiny-sd", device="cuda")
jobs = [ImageJob(p, 1, 64, 64, 4, None, None, s)
        for p, s in (("a red circle", 1), ("a blue square", 2), ("a cat", 3))]
for tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    together = pipeline_call(pipe, jobs)[1]
    alone = pipeline_call(pipe, jobs[1:2])[0]
    diff = (together - alone).abs()
    print(f"tf32 {tf32}: max {diff.max().item():.2e}, mean {diff.mean().item():.2e}, "
          f"8-bit pixels changed {((together * 255).round() != (alone * 255).round()).sum().item()}"
          f" of {diff.numel()}")
EOF

echo "== 3. learned_curve.py" | tee -a "$LOG"
(cd benchmarks && timeout 120 "$PY" learned_curve.py --device cuda \
    --out "$OUT/learned_curve_cuda.json" --figure "$OUT/learned_curve_cuda.png") 2>&1 \
    | grep -v " INFO " | tee -a "$LOG" || status=1

echo "== 4. defaults.py" | tee -a "$LOG"
(cd benchmarks && timeout 200 "$PY" defaults.py --models tiny-sd --device cuda \
    --repeats "${DEFAULTS_REPEATS:-2}" --out "$OUT/defaults_cuda.json") 2>&1 \
    | grep -v " INFO " | tee -a "$LOG" || status=1

echo "== 5. bench serve: flags -> clients: images/s, mean wave, queue wait" | tee -a "$LOG"
serve_and_bench() {  # PORT FLAGS... ; then benches at 16 and 64 clients
    local port=$1; shift
    "$PY" -m diffbatch.entrypoints.cli serve tiny-sd --port "$port" --log-level warning "$@" \
        > "/tmp/serve-$port.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 1
    done
    for clients in 16 64; do
        echo "-- serve ${*:-(no flags)}, $clients clients" | tee -a "$LOG"
        timeout 60 "$PY" -m diffbatch.entrypoints.cli bench serve \
            --base-url "http://127.0.0.1:$port" --num-prompts $((clients * 8)) \
            --max-concurrency "$clients" --warmup-requests "$clients" --disable-tqdm 2>&1 \
            | grep -iE "throughput|p50|mean wave|queue|failed" | tee -a "$LOG"
    done
    kill "$pid"; wait "$pid" 2>/dev/null
}
serve_and_bench 8101
serve_and_bench 8102 --max-num-seqs 16 --request-batch-max-wait-ms 0
serve_and_bench 8103 --max-num-seqs 64 --request-batch-max-wait-ms 0

echo "== 6. mixed_resolution.py: packed vs per-size calls, then serving a size mix" \
    | tee -a "$LOG"
timeout 150 "$PY" benchmarks/mixed_resolution.py --device cuda --rounds 5 --repeats 10 \
    --out "$OUT/mixed_resolution_cuda.json" 2>&1 | grep -v " INFO " | tee -a "$LOG" || status=1
timeout 240 "$PY" benchmarks/mixed_resolution.py --device cuda --serve --rounds 3 \
    --window-s 5 --models tiny-sd3 tiny-pixart --out "$OUT/mixed_resolution_serve_cuda.json" \
    2>&1 | grep -v " INFO " | tee -a "$LOG" || status=1

echo "== 7. step_cache.py: per-request step caching at 1024x1024 (random weights)" \
    | tee -a "$LOG"
timeout 180 "$PY" benchmarks/step_cache.py --parts device --device-size 1024 --rounds 3 \
    --serve-threshold 0.2 --out "$OUT/step_cache_device.json" 2>&1 | grep -v " INFO " \
    | tee -a "$LOG" || status=1

echo "== 8. compile.py: eager vs compiled vs CUDA graphs, waves 1/4/16/32" | tee -a "$LOG"
timeout 420 "$PY" benchmarks/compile.py --parts device --device-size 512 \
    --device-waves 1 4 16 32 --out "$OUT/compile_device.json" --no-plot 2>&1 \
    | grep -v " INFO " | tee -a "$LOG" || status=1

echo "== 9. worker_restart.py: a forked worker on CUDA, and its restart time" | tee -a "$LOG"
timeout 180 "$PY" benchmarks/worker_restart.py --rounds 3 --device cuda \
    --out "$OUT/worker_restart.json" 2>&1 | grep -v " INFO " | tee -a "$LOG" || status=1
exit $status
