"""Which constant neurons a screened model has (docs/results/stable-recipe): at each certified held-out input's γ*, the
share of f_L's neurons constant on B(x, γ*) (the certificate's float64 bounds, as `splitz diagnose`), split into neurons
constant on *every* certified input (switched off or stuck whatever the image: they carry no signal) and neurons constant
on some inputs only (the input-dependent share through which SPLITZ can beat RS), and the channels with any neuron not
inactive on some certified input. Usage: python scripts/stable_screen_channels.py RUN_DIR TSV [RUN_DIR TSV ...]"""
from __future__ import annotations

import sys

import numpy as np
import torch

from splitz_fast.analysis.tables import read_certification
from splitz_fast.bounds.intervals import ball_bounds
from splitz_fast.data.datasets import get_dataset
from splitz_fast.zoo.models import build_model
from splitz_fast.checkpoints.splitz import load_checkpoint_file, load_state_into
from splitz_fast.training.batches import held_out_part


def main(pairs: list[str]) -> None:
    data = get_dataset("mnist", "train").dataset
    print("| run | certified inputs | constant on B(x, γ*) (%) | constant on every input (%) | input-dependent (%) "
          "| live channels |")
    print("|---|---:|---:|---:|---:|---:|")
    for run, tsv in zip(pairs[::2], pairs[1::2]):
        ckpt = load_checkpoint_file(f"{run}/best.pt")
        spec = ckpt["model_spec"]
        model = load_state_into(build_model(spec["name"], **spec["kwargs"]), ckpt).eval()
        held = held_out_part(data, ckpt)
        table = read_certification(tsv)
        rows = np.flatnonzero(table.correct & (table.radius > 0))
        gammas = np.loadtxt(tsv, skiprows=1, usecols=7, delimiter="\t")[rows]
        x = torch.stack([held[int(table.idx[r])][0] for r in rows])
        bounds = ball_bounds(model.left, x, torch.as_tensor(gammas, dtype=torch.float64))
        varying = bounds.masks[0].flatten(1)  # [B, C·H·W]
        constant = ~varying
        always = constant.all(0)
        live = int((bounds.upper[0] > 0).any(0).flatten(1).any(1).sum())  # channels not inactive on every ball
        share = 100 * float(constant.double().mean())
        always_share = 100 * float(always.double().mean())
        print(f"| {run} | {len(rows)} | {share:.1f} | {always_share:.1f} | {share - always_share:.1f} | "
              f"{live} of {bounds.upper[0].shape[1]} |")


if __name__ == "__main__":
    main(sys.argv[1:])
