#!/usr/bin/env bash
# MNIST empirical robust accuracy: l2 FGSM and PGD on the smoothed classifier (SmoothAdv-style,
# `splitz attack --attack smooth-fgsm|smooth-pgd`) of an RS and a SPLITZ checkpoint, on the same test images as their
# certified tables, at ε ∈ EPS; then a table of empirical robust accuracy (PREDICT at the attacked point equals the
# label; abstentions count as wrong) next to certified accuracy at each ε.
# Default models: σ = 0.75 of scripts/mnist_envelope.sh (RS and SPLITZ with RECIPE, EPOCHS epochs) and their certify
# TSVs; a certify TSV made with another checkpoint (digests differ) is refused. Certified accuracy is counted on the
# attacked images only (the first MAX of the certified ones: same SKIP), so both columns describe the same inputs.
# The RS and the SPLITZ model are attacked in two parallel processes.
# Knobs (environment): SIGMA (0.75), EPOCHS (40: the GPU-trained envelope, docs/results/mnist-envelope-e40), RECIPE
# (paper: the recipe chosen on held-out data in docs/results/mnist-recipes), RS_RUN / SPLITZ_RUN (checkpoint folders),
# RS_CERT / SPLITZ_CERT (their certify TSVs), SKIP (default 20, as the certify TSVs), MAX (default 100 inputs: the
# 2-core CPU's budget; -1 = all), N (PREDICT samples, default 10000), EPS (default "0.5 1.0 1.5 2.0"), STEPS (PGD
# steps, default 20), SAMPLES (noise draws per step, default 32), DEVICE (default cpu), RESULTS (default
# docs/results/mnist-attacks). Re-running resumes finished rows.
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}; PYTHON=${PYTHON:-.venv/bin/python}
SIGMA=${SIGMA:-0.75}; EPOCHS=${EPOCHS:-40}; RECIPE=${RECIPE:-paper}; SKIP=${SKIP:-20}; MAX=${MAX:-100}
N=${N:-10000}
EPS=${EPS:-"0.5 1.0 1.5 2.0"}; STEPS=${STEPS:-20}; SAMPLES=${SAMPLES:-32}; DEVICE=${DEVICE:-cpu}
RS_RUN=${RS_RUN:-runs/mnist-envelope-e$EPOCHS/rs-$SIGMA}
SPLITZ_RUN=${SPLITZ_RUN:-runs/mnist-envelope-e$EPOCHS/splitz-$RECIPE-$SIGMA}
RS_CERT=${RS_CERT:-docs/results/mnist-envelope-e$EPOCHS/rs-$SIGMA.tsv}
SPLITZ_CERT=${SPLITZ_CERT:-docs/results/mnist-envelope-e$EPOCHS/splitz-$RECIPE-$SIGMA.tsv}
OUT=${RESULTS:-docs/results/mnist-attacks}
declare -A RUN=([rs]=$RS_RUN [splitz]=$SPLITZ_RUN)
for run in rs splitz; do
    if [ ! -f "${RUN[$run]}/best.pt" ]; then
        echo "error: ${RUN[$run]}/best.pt is missing; train it first (scripts/mnist_envelope.sh)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
attack_all() {  # attack_all RUN: every attack and ε on one model
    for attack in smooth-fgsm smooth-pgd; do
        local steps=()  # FGSM takes one step: `splitz attack` refuses --steps with it
        [ "$attack" = smooth-pgd ] && steps=(--steps "$STEPS")
        for eps in $EPS; do
            "$SPLITZ" attack mnist "${RUN[$1]}/best.pt" "$SIGMA" "$OUT/$1-$attack-$eps.tsv" --attack $attack \
                --eps "$eps" ${steps[@]+"${steps[@]}"} --samples "$SAMPLES" --clamp 0 1 --skip "$SKIP" --max "$MAX" --N "$N" \
                --alpha 0.001 --device "$DEVICE" --resume
        done
    done
}
attack_all rs & rs_job=$!
attack_all splitz & splitz_job=$!
status=0  # wait for both, so that a failed model does not leave the other one running unattended
wait "$rs_job" || status=$?
wait "$splitz_job" || status=$?
[ "$status" = 0 ] || exit "$status"
"$PYTHON" - "$RS_RUN" "$SPLITZ_RUN" "$RS_CERT" "$SPLITZ_CERT" "$OUT" $EPS <<'EOF'
import csv, json, sys
from pathlib import Path

from splitz_fast.training.loop import checkpoint_digest, load_checkpoint_file

rs_run, splitz_run, rs_cert, splitz_cert, out = map(Path, sys.argv[1:6])
eps = sys.argv[6:]
rows = lambda p: list(csv.DictReader(open(p), delimiter="\t"))  # noqa: E731
lines = ["| run (inputs) | " + " | ".join(f"ε={e}" for e in eps) + " |", "|---|" + "---:|" * len(eps)]
for run, name, folder, cert in (("rs", "RS (s=0)", rs_run, rs_cert), ("splitz", "SPLITZ (s=1)", splitz_run, splitz_cert)):
    attacked_rows = {(attack, e): rows(out / f"{run}-{attack}-{e}.tsv") for attack in ("smooth-fgsm", "smooth-pgd")
                     for e in eps}
    if cert.exists():
        recorded = json.loads(Path(f"{cert}.json").read_text())["checkpoint_digest"]
        if recorded != checkpoint_digest(load_checkpoint_file(folder / "best.pt")):
            sys.exit(f"error: {cert} was certified with another checkpoint than {folder / 'best.pt'}")
        attacked = {r["idx"] for r in attacked_rows["smooth-fgsm", eps[0]]}
        c = [r for r in rows(cert) if r["idx"] in attacked]
        if len(c) != len(attacked):
            sys.exit(f"error: {cert} lacks {len(attacked) - len(c)} of the attacked inputs (another --skip?)")
        lines.append(f"| {name}, certified ({len(c)}) | " + " | ".join(
            f"{100 * sum(r['correct'] == '1' and float(r['radius']) >= float(e) for r in c) / len(c):.1f}"
            for e in eps) + " |")
    for attack in ("smooth-fgsm", "smooth-pgd"):
        cells = []
        for e in eps:
            a = attacked_rows[attack, e]
            cells.append(f"{100 * sum(r['adv_predict'] == r['label'] for r in a) / len(a):.1f}")
        lines.append(f"| {name}, {attack} ({len(a)}) | " + " | ".join(cells) + " |")
    if cert.exists():
        # A certificate at ε promises g's class on the whole ball: an attacked point inside it where PREDICT returns
        # another class (not an abstention) contradicts it, which happens with probability ≤ α per input if sound.
        radius = {r["idx"]: float(r["radius"]) for r in c if r["correct"] == "1"}
        cells = []
        for e in eps:
            certified = {i for i, rad in radius.items() if rad >= float(e)}
            flipped = {r["idx"] for attack in ("smooth-fgsm", "smooth-pgd") for r in attacked_rows[attack, e]
                       if r["idx"] in certified and r["adv_predict"] not in (r["label"], "-1")}
            cells.append(f"{len(flipped)} of {len(certified)}")
        lines.append(f"| {name}, certified at ε yet attacked to another class | " + " | ".join(cells) + " |")
table = "\n".join(lines) + "\n"
(out / "table.md").write_text(table)
print(table, end="")
EOF
