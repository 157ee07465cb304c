#!/usr/bin/env bash
# MNIST, σ = 0.75, split after layer 1: SPLITZ vs randomized smoothing trained the same way (same LeNet, epochs,
# batch, noise samples, seed), certified on the same test images; results under docs/results/mnist/.
# Budget knobs (environment): EPOCHS (default 15), SKIP (every SKIP-th test image, default 50), N (default 10000),
# DEVICE (default cpu), BATCH (noise samples per pass, default 100: fastest on a CPU; 10000 on a GPU), RESULTS (default
# docs/results/mnist). Re-running resumes: finished training epochs and certified rows are not redone.
# The full GPU budget (500 test images, n = 10⁵; docs/results/mnist-n1e5/): SKIP=20 N=100000 DEVICE=cuda BATCH=10000 RESULTS=docs/results/mnist-n1e5
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}
EPOCHS=${EPOCHS:-15}; SKIP=${SKIP:-50}; N=${N:-10000}; DEVICE=${DEVICE:-cpu}; BATCH=${BATCH:-100}; SIGMA=0.75
RUNS=runs/mnist-s${SIGMA}-e${EPOCHS}; OUT=${RESULTS:-docs/results/mnist}
mkdir -p "$OUT"
"$SPLITZ" train mnist lenet "$RUNS/rs" --split-index 0 --sigma $SIGMA --epochs "$EPOCHS" --batch 256 \
    --lr-schedule none --device "$DEVICE" --resume
"$SPLITZ" train mnist lenet "$RUNS/splitz" --split-index 1 --sigma $SIGMA --epochs "$EPOCHS" --batch 256 \
    --lr-schedule none --lambda-start 0.8 --lambda-end 0.4 --theta-lip 0.5 --gamma-train 0.1 --power-iters 5 \
    --device "$DEVICE" --resume
for run in rs splitz; do
    "$SPLITZ" certify mnist "$RUNS/$run/best.pt" $SIGMA "$OUT/$run.tsv" --skip "$SKIP" --N0 100 --N "$N" \
        --alpha 0.001 --batch "$BATCH" --device "$DEVICE" --resume
    cp "$RUNS/$run/train.log" "$OUT/$run.train.log"
done
"$SPLITZ" analyze "$OUT/rs.tsv" "$OUT/splitz.tsv" --names "RS (s=0)" "SPLITZ (s=1)" \
    --radii 0 0.5 0.75 1.0 1.25 1.5 1.75 2.0 2.25 2.5 2.75 3.0 --out "$OUT"
