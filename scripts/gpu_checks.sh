#!/usr/bin/env bash
# The device checks as one short run (for a session that is lent a GPU; about 6–9 minutes on an H100/H200):
#   0. the CUDA kernels of csrc/noise_votes_cuda.cu: JIT build (nvcc, ninja), their tests (tests/test_native_cuda.py
#      and the `native-cuda` cases of tests/test_kernels_noise_votes.py) and their benchmark against Triton and eager
#      PyTorch (both ratios recorded; AUTO_CUDA_NATIVE_OPS in kernels/__init__.py switches `auto` where they win),
#   1. the CUDA variants of the kernel and backend tests (marked `gpu`; compiled Triton vs the float64 references),
#   2. each Triton op against its PyTorch/cuDNN reference (benchmarks/test_bench_kernels.py),
#   3. the dataset-level certify benchmark (eager, then compiled LeNet), bounds and training step on the GPU, the
#      training step again with SPLITZ_BACKEND=reference,
#   4. SPEC §5's GPU targets end to end (benchmarks/test_bench_targets.py),
#   5. training speed (issue #12: 150 SPLITZ LeNet epochs ≤ 10 min) and torchrun (issue #14): 2 MNIST epochs of the
#      SPLITZ LeNet (paper recipe, batch 256) in one process, then the same under `torchrun --nproc_per_node=1`; the
#      epochs' seconds from each train.log go to $OUT/train.log.
# Logs and pytest-benchmark JSON go to $OUT (the device tool's output folder; ./gpu-out elsewhere); every stage has
# its own time limit so that a slow stage cannot take the later ones' results with it.
# The device stack has no network: the package is installed from this tree without build isolation or deps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
# The device tool returns at most 8 files from $OUT: the 6 logs, and the pytest-benchmark JSON files packed into one
# archive when the script ends (also after a failed stage; not after a kill of the whole run).
trap 'cd "$OUT" && compgen -G "*.json" > /dev/null && tar czf bench-json.tar.gz ./*.json && rm -f ./*.json' EXIT
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONUNBUFFERED=1
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5; } > "$OUT/gpu.txt" 2>&1
echo "== CUDA kernels of csrc/ (build, tests, vs Triton)"; date
timeout 240 $PY -m splitz_fast.kernels.native_cuda > "$OUT/cuda.log" 2>&1  # the JIT build (cached for later stages)
tail -2 "$OUT/cuda.log"
timeout 120 $PY -m pytest -q $XDIST -p no:cacheprovider tests/test_native_cuda.py >> "$OUT/cuda.log" 2>&1
timeout 120 $PY -m pytest -q $XDIST -p no:cacheprovider tests/test_kernels_noise_votes.py -k "native-cuda or philox" \
    >> "$OUT/cuda.log" 2>&1
timeout 90 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_kernels.py -k cuda_kernels --benchmark-only \
    --benchmark-json "$OUT/bench-cuda.json" >> "$OUT/cuda.log" 2>&1
grep -E "speedup|passed|failed|rror" "$OUT/cuda.log"
echo "== kernel tests"; date
timeout 180 $PY -m pytest -q $XDIST -p no:cacheprovider tests/test_kernels_noise_votes.py \
    tests/test_kernels_bounds.py tests/test_kernels_first_layer.py tests/test_kernels_masked_conv2d.py \
    tests/test_backend_integration.py tests/test_kernel_dispatch.py \
    tests/test_lipschitz.py::test_exact_bound_on_cuda_matches_the_cpu_certificate tests/test_thresholds.py \
    tests/test_engine.py > "$OUT/gpu-tests.log" 2>&1
tail -3 "$OUT/gpu-tests.log"
echo "== triton vs reference per op"; date
timeout 60 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_kernels.py -k "not cuda_kernels" \
    --benchmark-only --benchmark-json "$OUT/bench-kernels.json" > "$OUT/bench-kernels.log" 2>&1
grep -E "speedup|passed|failed|rror" "$OUT/bench-kernels.log"
echo "== sampling, bounds, training step"; date
timeout 150 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_certify.py benchmarks/test_bench_bounds.py \
    -k "not compiled" --benchmark-only --benchmark-json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
timeout 120 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_certify.py -k "compiled and lenet" \
    --benchmark-only --benchmark-json "$OUT/bench-compiled.json" >> "$OUT/bench.log" 2>&1
SPLITZ_BACKEND=reference timeout 40 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_certify.py \
    -k training --benchmark-only >> "$OUT/bench.log" 2>&1
grep -E "samples/s|s/image|ms per bound|ratio|passed|failed|rror" "$OUT/bench.log"
echo "== SPEC targets"; date
timeout 200 $PY -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_targets.py --benchmark-only \
    --benchmark-json "$OUT/bench-targets.json" > "$OUT/bench-targets.log" 2>&1
grep -E "met|passed|failed|rror" "$OUT/bench-targets.log"
date
echo "== training: one process, then torchrun --nproc_per_node=1"; date
TRAIN=(--recipe paper --sigma 0.75 --epochs 2 --batch 256 --lr-schedule none)  # torchrun picks cuda:LOCAL_RANK
{ timeout 150 $PY -m splitz_fast train mnist lenet "$OUT/run-single" "${TRAIN[@]}" --device cuda
  timeout 150 $PY -m torch.distributed.run --nproc_per_node=1 -m splitz_fast train mnist lenet "$OUT/run-torchrun" \
      "${TRAIN[@]}"
  for run in run-single run-torchrun; do echo "$run"; cut -c1-400 "$OUT/$run/train.log"; done
  rm -rf "$OUT/run-single" "$OUT/run-torchrun"; } > "$OUT/train.log" 2>&1
grep -E "epoch_seconds|rror" "$OUT/train.log" | grep -oE '"epoch": [0-9]+|"epoch_seconds": [0-9.]+|rror.*' | paste - -
date
