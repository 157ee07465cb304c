#!/usr/bin/env bash
# MNIST, σ = 0.75 ablations of SPLITZ on a reduced budget, one small table each:
#   bash scripts/mnist_ablations.sh bound    local vs global bound       (the 15-epoch split-1 model of mnist_splitz_vs_rs.sh)
#   bash scripts/mnist_ablations.sh search   bisection vs one-step γ     (same model; radius gained, time spent)
#   bash scripts/mnist_ablations.sh theta    θ_lip ∈ {0.3, 0.5, 0.7}     (retrained, EPOCHS_ABL epochs each)
#   bash scripts/mnist_ablations.sh gamma    γ_train ∈ {0.1, 1, 2}       (retrained, EPOCHS_ABL epochs each)
#   bash scripts/mnist_ablations.sh split    split after affine layer 1, 2, 3 of the authors' LeNet (lenet-splitz;
#                                            layer 3 follows its max-pool, which then sits inside f_L)
#   bash scripts/mnist_ablations.sh all      all of the above, in this order
# Budget knobs (environment): EPOCHS (base model, default 15), EPOCHS_ABL (default 6), SKIP (base-model tables,
# default 50), SKIP_ABL (retrained tables, default 100), N (default 10000), MAX_BATCHES (cap per epoch for the split
# table, default: all), DEVICE (default cpu), RESULTS (output folder, default docs/results/mnist-ablations). Re-running
# resumes: finished epochs and certified rows are not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}
EPOCHS=${EPOCHS:-15}; EPOCHS_ABL=${EPOCHS_ABL:-6}; SKIP=${SKIP:-50}; SKIP_ABL=${SKIP_ABL:-100}; N=${N:-10000}
MAX_BATCHES=${MAX_BATCHES:-}; DEVICE=${DEVICE:-cpu}; SIGMA=0.75
RADII="0 0.5 0.75 1.0 1.25 1.5 1.75 2.0 2.25 2.5"
BASE=runs/mnist-s${SIGMA}-e${EPOCHS}/splitz; MAIN=docs/results/mnist; OUT=${RESULTS:-docs/results/mnist-ablations}
ABL=runs/mnist-ablations-s${SIGMA}-e${EPOCHS_ABL}${MAX_BATCHES:+-b$MAX_BATCHES}

certify() {  # checkpoint outfile skip [extra certify flags]
    local ckpt=$1 out=$2 skip=$3; shift 3
    "$SPLITZ" certify mnist "$ckpt" $SIGMA "$out" --skip "$skip" --N0 100 --N "$N" --alpha 0.001 --batch 100 \
        --device "$DEVICE" --resume "$@"
}

train_splitz() {  # model outdir split theta gamma
    "$SPLITZ" train mnist "$1" "$2" --split-index "$3" --theta-lip "$4" --gamma-train "$5" --sigma $SIGMA \
        --epochs "$EPOCHS_ABL" --batch 256 --lr-schedule none --lambda-start 0.8 --lambda-end 0.4 --power-iters 5 \
        ${MAX_BATCHES:+--max-batches "$MAX_BATCHES"} --device "$DEVICE" --resume
}

base_model() {  # the split-1 model and its local/bisection certificates come from the main comparison
    if [[ ! -f "$BASE/best.pt" || ! -f "$MAIN/splitz.tsv" ]]; then
        EPOCHS=$EPOCHS SKIP=$SKIP N=$N DEVICE=$DEVICE bash scripts/mnist_splitz_vs_rs.sh
    fi
}

ablate_bound() {
    base_model; mkdir -p "$OUT/bound"
    certify "$BASE/best.pt" "$OUT/bound/global.tsv" "$SKIP" --bound global
    "$SPLITZ" analyze "$MAIN/splitz.tsv" "$OUT/bound/global.tsv" --names "local L(x, γ)" "global ∏‖W‖" \
        --radii $RADII --out "$OUT/bound"
}

ablate_search() {
    base_model; mkdir -p "$OUT/search"
    certify "$BASE/best.pt" "$OUT/search/one-step.tsv" "$SKIP" --gamma-search one-step
    "$SPLITZ" analyze "$MAIN/splitz.tsv" "$OUT/search/one-step.tsv" --names "bisection" "one-step" \
        --radii $RADII --out "$OUT/search"
    # Search time on the same images in one process (the TSVs' times include sampling and machine load).
    "$(dirname "$SPLITZ")/python" scripts/gamma_search_cost.py "$BASE/best.pt" "$MAIN/splitz.tsv" \
        "$OUT/search/cost.md" --device "$DEVICE"
}

# One retrained SPLITZ model per (model, split, θ_lip, γ_train): trained under runs/, certified once into
# OUT/models/<name>.tsv (with its training log beside it); the tables below read those files, so a model that belongs
# to two tables (θ_lip = 0.5, γ_train = 0.1, split 1) is trained and certified once.
model_tsv() {  # model split theta gamma → prints the TSV path (after training and certifying if needed)
    local name="$1-split$2-theta$3-gamma$4"
    mkdir -p "$OUT/models"
    train_splitz "$1" "$ABL/$name" "$2" "$3" "$4" >&2
    certify "$ABL/$name/best.pt" "$OUT/models/$name.tsv" "$SKIP_ABL" >&2
    cp "$ABL/$name/train.log" "$OUT/models/$name.train.log"
    echo "$OUT/models/$name.tsv"
}

ablate_theta() {
    local tsvs=()
    for theta in 0.3 0.5 0.7; do tsvs+=("$(model_tsv lenet 1 $theta 0.1)"); done
    "$SPLITZ" analyze "${tsvs[@]}" --names "θ_lip=0.3" "θ_lip=0.5" "θ_lip=0.7" --radii $RADII --out "$OUT/theta"
}

ablate_gamma() {
    local tsvs=()
    for gamma in 0.1 1 2; do tsvs+=("$(model_tsv lenet 1 0.5 $gamma)"); done
    "$SPLITZ" analyze "${tsvs[@]}" --names "γ_train=0.1" "γ_train=1" "γ_train=2" --radii $RADII --out "$OUT/gamma"
}

ablate_split() {
    local tsvs=()
    for split in 1 2 3; do tsvs+=("$(model_tsv lenet-splitz $split 0.5 0.1)"); done
    "$SPLITZ" analyze "${tsvs[@]}" --names "after layer 1" "after layer 2" "after layer 3" --radii $RADII \
        --out "$OUT/split"
}

case "${1:-all}" in
    bound) ablate_bound ;; search) ablate_search ;; theta) ablate_theta ;; gamma) ablate_gamma ;;
    split) ablate_split ;;
    all) ablate_bound; ablate_search; ablate_theta; ablate_gamma; ablate_split ;;
    *) echo "usage: $0 [bound|search|theta|gamma|split|all]" >&2; exit 2 ;;
esac
