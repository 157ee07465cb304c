#!/usr/bin/env bash
# The device checks as one short run (for a session that is lent a GPU; about 5–8 minutes on an H100):
#   1. the CUDA variants of the kernel and backend tests (marked `gpu`; compiled Triton vs the float64 references),
#   2. SPEC §5's GPU targets (benchmarks/test_bench_targets.py) and the CPU-vs-loop suites on the GPU.
# Logs and pytest-benchmark JSON go to $OUT (the device tool's output folder; ./gpu-out elsewhere).
# The device stack has no network: the package is installed from this tree without build isolation or deps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || cat "$OUT/install.log"
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_noise_votes.py tests/test_kernels_bounds.py \
    tests/test_kernels_first_layer.py tests/test_kernels_masked_conv2d.py 2>&1 | tail -40 > "$OUT/gpu-tests.log"
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_backend_integration.py 2>&1 | tail -20 >> "$OUT/gpu-tests.log"
timeout 300 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_targets.py benchmarks/test_bench_bounds.py \
    benchmarks/test_bench_certify.py --benchmark-only --benchmark-json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep -E "met|samples/s|ms per bound|ratio|passed|failed|error" "$OUT/bench.log" | tail -40
tail -3 "$OUT/gpu-tests.log"
