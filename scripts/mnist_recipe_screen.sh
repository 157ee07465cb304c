#!/usr/bin/env bash
# MNIST: which SPLITZ training recipe to use for the envelope comparison (issue #12), chosen on held-out data only.
# Each candidate trains split 1 at σ = SIGMA for EPOCHS (a screening budget, shorter than the comparison's) and is
# certified on the validation images its run held out (`--split heldout`, every HELD_SKIP-th: 100 of 6,000 by default),
# n0 = 100, n = N, α = 0.001. The test set is never read. Candidates: the paper's recipe, the published code's, the
# constrained recipe at L* = 0.5 and 0.75, and the warm start from the RS model of the same σ trained by
# scripts/mnist_envelope.sh (skipped, with a message, until that checkpoint exists). Results under $RESULTS.
# Re-running resumes (finished epochs and certified rows are not redone).
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}
SIGMA=${SIGMA:-0.75}; EPOCHS=${EPOCHS:-5}; HELD_SKIP=${HELD_SKIP:-60}; N=${N:-2000}; DEVICE=${DEVICE:-cpu}
BATCH=${BATCH:-100}; RS_CHECKPOINT=${RS_CHECKPOINT:-runs/mnist-envelope-e15/rs-$SIGMA/best.pt}
RUNS=runs/mnist-recipes-s$SIGMA-e$EPOCHS; OUT=${RESULTS:-docs/results/mnist-recipes}
mkdir -p "$OUT"

screen() {  # screen NAME TRAIN-OPTIONS...
    local name=$1; shift
    "$SPLITZ" train mnist lenet "$RUNS/$name" "$@" --sigma "$SIGMA" --epochs "$EPOCHS" --batch 256 \
        --lr-schedule none --device "$DEVICE" --resume
    "$SPLITZ" certify mnist "$RUNS/$name/best.pt" "$SIGMA" "$OUT/$name.tsv" --split heldout --skip "$HELD_SKIP" \
        --N0 100 --N "$N" --alpha 0.001 --batch "$BATCH" --device "$DEVICE" --resume
    cp "$RUNS/$name/train.log" "$OUT/$name.train.log"
}

screen paper --recipe paper
screen published-code --recipe published-code
screen constrained-0.5 --recipe constrained --lip-target 0.5
screen constrained-0.75 --recipe constrained --lip-target 0.75
if [ -f "$RS_CHECKPOINT" ]; then
    screen warm-start --recipe warm-start --init "$RS_CHECKPOINT"
else
    echo "warm-start skipped: $RS_CHECKPOINT does not exist yet (run scripts/mnist_envelope.sh's rs stage)" >&2
fi
tables=(); names=()
for name in paper published-code constrained-0.5 constrained-0.75 warm-start; do
    if [ -f "$OUT/$name.tsv" ]; then tables+=("$OUT/$name.tsv"); names+=("$name"); fi
done
"$SPLITZ" analyze "${tables[@]}" --names "${names[@]}" --radii 0 0.5 1.0 1.5 2.0 2.5 --out "$OUT"
