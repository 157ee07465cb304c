#!/usr/bin/env bash
# MNIST: SPLITZ started at randomized smoothing (model lenet-rs-init) against RS given the same training budget.
# 1. rs: the RS LeNet at σ = SIGMA, EPOCHS epochs (batch 256, constant lr, seed 0: scripts/mnist_envelope.sh's).
# 2. finetune: FT_EPOCHS more epochs from that checkpoint for every candidate, so all have the same budget:
#      rs-ft          split 0, Gaussian augmentation (plain RS, trained longer)
#      rs-ft-radius   split 0 with the radius-aimed term (MACER-style: R = σΦ⁻¹(p̃_A))
#      rsinit         lenet-rs-init from the RS checkpoint, Gaussian augmentation only
#      rsinit-radius  lenet-rs-init with the radius-aimed term through the sound local bound
#      rsinit-lip-radius  the same plus the paper's per-sample hinge on L̂ at the certified ball's scale: weight
#                     LIP_WEIGHT, θ_lip = 1, γ_train = LIP_GAMMA (detectors constant on that ball cost nothing)
#    (radius term: --radius-weight RADIUS_WEIGHT --radius-target RADIUS_TARGET).
#    Candidates are read at their last epoch (CKPT=last): the radius term's weight ramps up over training, and the
#    best epoch of `splitz train` (highest noisy validation accuracy) favours a large L(x, γ) over a large radius.
# 3. screen: every candidate certified on HELD images its run held out (--split heldout, every HELD_SKIP-th), n = HELD_N.
#    Rule fixed before any test image is read: on each side (RS, SPLITZ) the candidate with the highest held-out
#    certified accuracy at ε = 2 wins (ties: at ε = 1.5, then the first listed).
# 4. test: the two winners certified on the test set (every SKIP-th image, n0 = 100, n = N, α = 0.001, sound
#    certificates), compared with `splitz analyze`, and the SPLITZ winner explained by `splitz diagnose`.
# Re-running resumes (finished epochs and certified rows are not redone). Results under $RESULTS.
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}; PY=${PY:-.venv/bin/python}
SIGMA=${SIGMA:-1.0}; EPOCHS=${EPOCHS:-15}; FT_EPOCHS=${FT_EPOCHS:-5}; DEVICE=${DEVICE:-cpu}; BATCH=${BATCH:-100}
HELD_SKIP=${HELD_SKIP:-30}; HELD_N=${HELD_N:-2000}; SKIP=${SKIP:-50}; N=${N:-10000}
RADIUS_WEIGHT=${RADIUS_WEIGHT:-0.5}; RADIUS_TARGET=${RADIUS_TARGET:-2.5}; STAGES=${STAGES:-"rs finetune screen test"}
CKPT=${CKPT:-last}; RUNS=${RUNS:-runs/mnist-rs-init}; OUT=${RESULTS:-docs/results/mnist-rs-init}
THREADS=(); if [ -n "${THREADS_PER_JOB:-}" ]; then THREADS=(--threads "$THREADS_PER_JOB"); fi
LIP_WEIGHT=${LIP_WEIGHT:-0.3}; LIP_GAMMA=${LIP_GAMMA:-2.0}
RS_CANDIDATES=${RS_CANDIDATES:-"rs-ft rs-ft-radius"}
SPLITZ_CANDIDATES=${SPLITZ_CANDIDATES:-"rsinit rsinit-radius rsinit-lip-radius"}
mkdir -p "$OUT" "$RUNS"
BASE=$RUNS/rs-$SIGMA

finetune() {  # finetune NAME
    local model=lenet options=(--split-index 0) radius=()
    case $1 in
    rsinit-lip*) model=lenet-rs-init; options=(--recipe rs-init --lambda-start "$LIP_WEIGHT" --lambda-end "$LIP_WEIGHT"
                                               --theta-lip 1.0 --gamma-train "$LIP_GAMMA") ;;
    rsinit*) model=lenet-rs-init; options=(--recipe rs-init) ;;
    esac
    case $1 in
    *-radius) radius=(--radius-weight "$RADIUS_WEIGHT" --radius-target "$RADIUS_TARGET") ;;
    esac
    "$SPLITZ" train mnist "$model" "$RUNS/$1-$SIGMA" "${options[@]}" --init "$BASE/best.pt" "${radius[@]}" \
        --sigma "$SIGMA" --epochs "$FT_EPOCHS" --batch 256 --lr-schedule none --device "$DEVICE" --resume "${THREADS[@]}"
    cp "$RUNS/$1-$SIGMA/train.log" "$OUT/$1-$SIGMA.train.log"
}

winner() {  # winner CANDIDATES...: the held-out rule above
    "$PY" - "$OUT" "$SIGMA" "$@" <<'EOF'
import csv
import sys
out, sigma, names = sys.argv[1], sys.argv[2], sys.argv[3:]
def score(name):
    with open(f"{out}/heldout-{name}-{sigma}.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    def certified(eps):
        return sum(r["correct"] == "1" and float(r["radius"]) >= eps for r in rows) / len(rows)
    return certified(2.0), certified(1.5)
print(max(names, key=score))  # max keeps the first of equal scores
EOF
}

for stage in $STAGES; do
    case $stage in
    rs)
        "$SPLITZ" train mnist lenet "$BASE" --split-index 0 --sigma "$SIGMA" --epochs "$EPOCHS" --batch 256 \
            --lr-schedule none --device "$DEVICE" --resume "${THREADS[@]}"
        cp "$BASE/train.log" "$OUT/rs-$SIGMA.train.log" ;;
    finetune)
        for name in $RS_CANDIDATES $SPLITZ_CANDIDATES; do finetune "$name"; done ;;
    screen)
        tables=(); for name in $RS_CANDIDATES $SPLITZ_CANDIDATES; do
            "$SPLITZ" certify mnist "$RUNS/$name-$SIGMA/$CKPT.pt" "$SIGMA" "$OUT/heldout-$name-$SIGMA.tsv" \
                --split heldout --skip "$HELD_SKIP" --N0 100 --N "$HELD_N" --alpha 0.001 --batch "$BATCH" \
                --device "$DEVICE" --resume "${THREADS[@]}"
            tables+=("$OUT/heldout-$name-$SIGMA.tsv")
        done
        "$SPLITZ" analyze "${tables[@]}" --names $RS_CANDIDATES $SPLITZ_CANDIDATES --radii 0 0.5 1.0 1.5 2.0 2.5 \
            --out "$OUT/heldout-$SIGMA" ;;
    test)
        # shellcheck disable=SC2086  # candidate lists are words
        rs=$(winner $RS_CANDIDATES); splitz=$(winner $SPLITZ_CANDIDATES)
        echo "held-out winners: RS $rs, SPLITZ $splitz" | tee "$OUT/winners-$SIGMA.txt"
        for name in "$rs" "$splitz"; do
            "$SPLITZ" certify mnist "$RUNS/$name-$SIGMA/$CKPT.pt" "$SIGMA" "$OUT/test-$name-$SIGMA.tsv" --skip "$SKIP" \
                --N0 100 --N "$N" --alpha 0.001 --batch "$BATCH" --device "$DEVICE" --resume "${THREADS[@]}"
        done
        "$SPLITZ" analyze "$OUT/test-$rs-$SIGMA.tsv" "$OUT/test-$splitz-$SIGMA.tsv" --names "RS ($rs)" \
            "SPLITZ ($splitz)" --radii 0 0.5 1.0 1.5 2.0 2.5 --out "$OUT/test-$SIGMA"
        "$SPLITZ" diagnose "$RUNS/$splitz-$SIGMA/$CKPT.pt" "$OUT/test-$splitz-$SIGMA.tsv" \
            --out "$OUT/diagnostics-$splitz-$SIGMA" ;;
    *) echo "unknown stage $stage (rs, finetune, screen, test)" >&2; exit 2 ;;
    esac
done
