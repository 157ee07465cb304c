#!/usr/bin/env bash
# MNIST empirical robust accuracy (issue 15, item 2): l2 FGSM and PGD on the smoothed classifier (SmoothAdv-style,
# `splitz attack --attack smooth-fgsm|smooth-pgd`) of the RS and SPLITZ checkpoints of scripts/mnist_splitz_vs_rs.sh,
# on the same test images as its certified table, at ε ∈ EPS; then a table of empirical robust accuracy
# (PREDICT at the attacked point equals the label; abstentions count as wrong) next to certified accuracy at each ε.
# Knobs (environment): EPOCHS (default 15: which checkpoints), SKIP (default 50), N (PREDICT samples, default 10000),
# EPS (default "0.5 1.0 1.5 2.0"), STEPS (PGD steps, default 20), SAMPLES (noise draws per step, default 32), DEVICE
# (default cpu), RUNS (checkpoint folder, default runs/mnist-s0.75-e$EPOCHS), CERTIFIED (certify TSVs, default
# docs/results/mnist), RESULTS (default docs/results/mnist-attacks). Re-running resumes finished rows.
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITZ=${SPLITZ:-.venv/bin/splitz}; PYTHON=${PYTHON:-.venv/bin/python}
EPOCHS=${EPOCHS:-15}; SKIP=${SKIP:-50}; N=${N:-10000}; EPS=${EPS:-"0.5 1.0 1.5 2.0"}; STEPS=${STEPS:-20}
SAMPLES=${SAMPLES:-32}; DEVICE=${DEVICE:-cpu}; SIGMA=0.75
RUNS=${RUNS:-runs/mnist-s${SIGMA}-e${EPOCHS}}; CERTIFIED=${CERTIFIED:-docs/results/mnist}
OUT=${RESULTS:-docs/results/mnist-attacks}
for run in rs splitz; do
    if [ ! -f "$RUNS/$run/best.pt" ]; then
        echo "error: $RUNS/$run/best.pt is missing; train it first: EPOCHS=$EPOCHS bash scripts/mnist_splitz_vs_rs.sh" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
for run in rs splitz; do
    for attack in smooth-fgsm smooth-pgd; do
        for eps in $EPS; do
            "$SPLITZ" attack mnist "$RUNS/$run/best.pt" $SIGMA "$OUT/$run-$attack-$eps.tsv" --attack $attack \
                --eps "$eps" --steps "$STEPS" --samples "$SAMPLES" --clamp 0 1 --skip "$SKIP" --N "$N" --alpha 0.001 \
                --device "$DEVICE" --resume
        done
    done
done
"$PYTHON" - "$RUNS" "$CERTIFIED" "$OUT" $EPS <<'EOF'
import csv, hashlib, json, sys
from pathlib import Path

runs, certified, out, eps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
rows = lambda p: list(csv.DictReader(open(p), delimiter="\t"))  # noqa: E731
lines = ["| run | " + " | ".join(f"ε={e}" for e in eps) + " |", "|---|" + "---:|" * len(eps)]
for run, name in (("rs", "RS (s=0)"), ("splitz", "SPLITZ (s=1)")):
    cert = certified / f"{run}.tsv"
    recorded = json.loads(Path(f"{cert}.json").read_text()).get("checkpoint_sha256") if cert.exists() else None
    if recorded and recorded != hashlib.sha256((runs / run / "best.pt").read_bytes()).hexdigest():
        print(f"warning: {cert} was certified with another {run} checkpoint than {runs / run / 'best.pt'}", file=sys.stderr)
    if cert.exists():
        c = rows(cert)
        lines.append(f"| {name}, certified | " + " | ".join(
            f"{100 * sum(r['correct'] == '1' and float(r['radius']) >= float(e) for r in c) / len(c):.1f}"
            for e in eps) + " |")
    for attack in ("smooth-fgsm", "smooth-pgd"):
        cells = []
        for e in eps:
            a = rows(out / f"{run}-{attack}-{e}.tsv")
            cells.append(f"{100 * sum(r['adv_predict'] == r['label'] for r in a) / len(a):.1f}")
        lines.append(f"| {name}, {attack} | " + " | ".join(cells) + " |")
table = "\n".join(lines) + "\n"
(out / "table.md").write_text(table)
print(table, end="")
EOF
