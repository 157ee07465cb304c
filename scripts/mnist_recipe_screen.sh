#!/usr/bin/env bash
# MNIST: which SPLITZ training recipe the envelope comparison uses, chosen on held-out data only.
# Each candidate recipe trains split 1 at σ = SIGMA with the comparison's own budget and command
# (scripts/mnist_envelope.sh, stage splitz-train, so the winner's run is reused there) and is certified on validation
# images its run held out (`--split heldout`, every HELD_SKIP-th: 100 of 6,000 by default), n0 = 100, n = N,
# α = 0.001. The test set is never read here. Candidates (RECIPES): paper, published-code, constrained (L* = 0.5) and
# warm-start (from the RS model of the same σ: run scripts/mnist_envelope.sh's rs stage for that σ first; skipped
# with a message until its checkpoint exists). Results under $RESULTS. Re-running resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}
SIGMA=${SIGMA:-0.75}; EPOCHS=${EPOCHS:-15}; HELD_SKIP=${HELD_SKIP:-60}; N=${N:-2000}; DEVICE=${DEVICE:-cpu}
BATCH=${BATCH:-100}; RECIPES=${RECIPES:-"paper published-code constrained warm-start"}
RUNS=runs/mnist-envelope-e$EPOCHS; OUT=${RESULTS:-docs/results/mnist-recipes}
mkdir -p "$OUT"
tables=(); names=()
for recipe in $RECIPES; do
    if [ "$recipe" = warm-start ] && [ ! -f "$RUNS/rs-$SIGMA/best.pt" ]; then
        echo "warm-start skipped: $RUNS/rs-$SIGMA/best.pt does not exist yet (scripts/mnist_envelope.sh, stage rs)" >&2
        continue
    fi
    STAGES=splitz-train RECIPE=$recipe SPLITZ_SIGMAS=$SIGMA EPOCHS=$EPOCHS DEVICE=$DEVICE scripts/mnist_envelope.sh
    "$SPLITZ" certify mnist "$RUNS/splitz-$recipe-$SIGMA/best.pt" "$SIGMA" "$OUT/$recipe.tsv" --split heldout \
        --skip "$HELD_SKIP" --N0 100 --N "$N" --alpha 0.001 --batch "$BATCH" --device "$DEVICE" --resume
    cp "$RUNS/splitz-$recipe-$SIGMA/train.log" "$OUT/$recipe.train.log"
    tables+=("$OUT/$recipe.tsv"); names+=("$recipe")
done
"$SPLITZ" analyze "${tables[@]}" --names "${names[@]}" --radii 0 0.5 1.0 1.5 2.0 2.5 --out "$OUT"
