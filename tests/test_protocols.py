"""The estimate protocols behind the SPLITZ paper's numbers (issue #22 item 1): what each computes, checked against a
naive reference, and labelled "not a certificate" everywhere (rows, sidecars, analysis, envelope)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.analysis import analyze, read_certification
from splitz_fast.envelope import load_group
from splitz_fast.protocols import PAPER_POWER_ITERS, PublishedCode, get_protocol
from splitz_fast.sequential import SequentialCertifier

SIGMA = 0.5


def _model(standardize: bool) -> tuple[sz.SplitModel, torch.Tensor]:
    """One conv layer in f_L on 1×6×6 inputs, f_R biased to class 0 so every input certifies."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(108, 3))
    with torch.no_grad():
        net[-1].bias.copy_(torch.tensor([6.0, 0.0, 0.0]))
    std = sz.Standardize([0.1307], [0.3081]) if standardize else None
    model = sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 6, 6), standardize=std, threshold=1.0)
    return model, torch.rand(1, 6, 6, generator=torch.Generator().manual_seed(1))


def _dense(layer: nn.Conv2d, shape) -> torch.Tensor:
    """The explicit matrix of a bias-free conv layer on inputs of ``shape``."""
    d = int(np.prod(shape))
    eye = torch.eye(d, dtype=torch.float64).view(d, *shape)
    out = nn.functional.conv2d(eye, layer.weight.double(), None, layer.stride, layer.padding)
    return out.reshape(d, -1).T


CERTIFY = dict(n0=20, n=500, alpha=0.01)


def test_sound_is_the_default_and_unchanged():
    model, x = _model(False)
    default = sz.Smoother(model, SIGMA).certify(x, **CERTIFY, seed=0)
    sound = sz.Smoother(model, SIGMA, protocol="sound").certify(x, **CERTIFY, seed=0)
    assert default.bound_kind == sound.bound_kind == "local-exact"
    assert (default.radius, default.lipschitz) == (sound.radius, sound.lipschitz)


def test_paper_protocol_is_algorithm_1_with_power_iteration():
    """γ* = R / L̃(x, R/L̃(x, 0)), radius min(R/L̃(x, γ*), γ*); L̃ is a lower estimate of the masked norm, within
    a few percent of the sound bound at the same γ after 5 steps on this small layer."""
    model, x = _model(False)
    r = sz.Smoother(model, SIGMA, protocol="paper").certify(x, **CERTIFY, seed=0)
    assert r.bound_kind == "paper-estimate" and math.isnan(r.failure_prob)
    assert r.gamma_evaluations == 3
    sound_at_gamma = float(sz.lipschitz_bound(model.left, x.unsqueeze(0), r.gamma, method="exact").value[0])
    assert r.lipschitz <= sound_at_gamma * (1 + 1e-9)
    assert r.lipschitz >= 0.8 * sound_at_gamma
    assert r.radius == pytest.approx(min(r.latent_radius / r.lipschitz, r.gamma))


def test_paper_protocol_takes_the_reference_lipschitz_for_its_first_step():
    model, x = _model(False)
    smoother = sz.Smoother(model, SIGMA, protocol="paper", bound_options=sz.BoundOptions(reference_lipschitz=1e6))
    r = smoother.certify(x, **CERTIFY, seed=0)
    assert r.gamma_evaluations == 2  # L̃_ref given: L̃(x, γ') and L̃(x, γ*) only


def test_published_code_protocol_drops_masks_and_the_standardization():
    """With Standardize in f_L the estimate is the unmasked norm of W (the map from standardized inputs), not of
    W·diag(1/sd): the radius is 1/sd = 3.25x the same computation with the factor."""
    model, x = _model(True)
    r = sz.Smoother(model, SIGMA, protocol="published-code").certify(x, **CERTIFY, seed=0)
    dense = torch.linalg.matrix_norm(_dense(model.left.layers[0], (1, 6, 6)), ord=2).item()
    assert r.bound_kind == "published-code-estimate" and math.isnan(r.failure_prob)
    assert 0.9 * dense <= r.lipschitz <= dense * (1 + 1e-9)
    assert r.radius == pytest.approx(r.latent_radius / r.lipschitz)
    sound_global = float(sz.global_lipschitz_bound(model.left, (1, 6, 6), method="exact").value[0])
    assert sound_global == pytest.approx(dense / 0.3081, rel=1e-6)  # what the factor would have given


def test_published_code_reads_a_raw_input_model_behind_the_dataset_standardization():
    model, x = _model(False)
    with pytest.raises(ValueError, match="data_std"):  # at construction, before anything is sampled
        sz.Smoother(model, SIGMA, protocol="published-code")
    r = sz.Smoother(model, SIGMA, protocol=PublishedCode(data_std=(0.3081,))).certify(x, **CERTIFY, seed=0)
    dense = torch.linalg.matrix_norm(_dense(model.left.layers[0], (1, 6, 6)), ord=2).item()
    assert 0.9 * 0.3081 * dense <= r.lipschitz <= 0.3081 * dense * (1 + 1e-9)


@pytest.mark.parametrize("protocol", ["paper", "published-code"])
def test_estimates_at_split_0_are_labelled_too(protocol):
    model = sz.SplitModel(sz.LeftHalf([]), nn.Linear(4, 2), 2)
    with torch.no_grad():
        model.right.bias.copy_(torch.tensor([5.0, 0.0]))
    r = sz.Smoother(model, SIGMA, protocol=protocol).certify(torch.zeros(4), **CERTIFY, seed=0)
    assert r.bound_kind == f"{protocol}-estimate" and r.lipschitz == 1.0


def test_displacement_protocol_is_never_below_sound_and_gains_where_clipping_binds():
    """A narrow clipped layer (θ = 0.05): every neuron's output range is tiny, so the latent cannot move by R however
    far the input goes — the displacement certificate reaches the search ceiling, the Lipschitz one does not."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        net[-1].bias.copy_(torch.tensor([4.0, 0.0]))
    model = sz.split_sequential(net, 1, num_classes=2, input_shape=(8,), threshold=0.05)
    x = torch.rand(8, generator=torch.Generator().manual_seed(2))
    exact = sz.BoundOptions(bound_method="exact")
    sound = sz.Smoother(model, SIGMA, bound_options=exact).certify(x, **CERTIFY, seed=0)
    moved = sz.Smoother(model, SIGMA, bound_options=exact, protocol="displacement").certify(x, **CERTIFY, seed=0)
    assert sound.prediction == moved.prediction == 0
    assert moved.radius > 2 * sound.radius and moved.bound_kind == "displacement-exact"
    conv, image = _model(False)
    plain = sz.Smoother(conv, SIGMA).certify(image, **CERTIFY, seed=0)
    tighter = sz.Smoother(conv, SIGMA, protocol="displacement").certify(image, **CERTIFY, seed=0)
    assert tighter.radius >= plain.radius


def test_power_iteration_steps_are_the_papers():
    assert PAPER_POWER_ITERS == 5


def test_unknown_protocol_and_sequential_estimates_are_refused():
    model, _ = _model(False)
    with pytest.raises(ValueError, match="protocol must be one of sound, displacement, paper, published-code"):
        sz.Smoother(model, SIGMA, protocol="cohen")
    with pytest.raises(ValueError, match="estimate"):
        SequentialCertifier(sz.Smoother(model, SIGMA, protocol="paper"), radii=[0.5])
    assert get_protocol("sound").certificate and not get_protocol("paper").certificate


# ------------------------------------------------------------------------ labelled everywhere
def _write_run(tmp_path, name: str, protocol: str, sigma: float) -> str:
    from splitz_fast.results import HEADER, format_row

    model, x = _model(True)
    smoother = sz.Smoother(model, sigma, protocol=protocol)
    path = tmp_path / f"{name}.tsv"
    rows = [format_row(i, 0, smoother.certify(x, **CERTIFY, seed=i)) for i in range(3)]
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    (tmp_path / f"{name}.tsv.json").write_text(json.dumps({"sigma": sigma}))
    return str(path)


def test_analysis_and_envelope_label_estimates_and_refuse_to_mix(tmp_path):
    sound = _write_run(tmp_path, "sound", "sound", 0.5)
    paper = _write_run(tmp_path, "paper", "paper", 0.5)
    paper_other = _write_run(tmp_path, "paper-other", "paper", 0.25)
    assert read_certification(paper).is_estimate and not read_certification(sound).is_estimate
    text = analyze([sound, paper], [0.0, 0.5], out_dir=tmp_path / "out")
    assert "paper (not a certificate)" in text and "sound (not a certificate)" not in text
    with pytest.raises(ValueError, match="mixes sound certificates with estimates"):
        load_group([sound, paper_other])
    report = sz.envelope_report({"sound": load_group([sound]), "paper": load_group([paper, paper_other])}, [0.0])
    assert "paper (not a certificate) envelope" in report


def test_cli_certify_records_an_estimate_in_the_sidecar_and_rows(tmp_path, tiny):
    from splitz_fast.cli import main

    ckpt = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(ckpt), "--sigma", "0.5", "--epochs", "1", "--batch", "8", "--split-index", "1"]) == 0
    out = tmp_path / "paper.tsv"
    assert main(["certify", "tiny", str(ckpt / "best.pt"), "0.5", str(out), "--N0", "10", "--N", "100",
                 "--max", "3", "--protocol", "paper"]) == 0
    sidecar = json.loads((tmp_path / "paper.tsv.json").read_text())
    assert sidecar["protocol"] == "paper" and sidecar["certificate"] is False
    bounds = set(read_certification(out).extra["bound"])
    assert bounds <= {"paper-estimate", "none"}
    sound = tmp_path / "sound.tsv"
    assert main(["certify", "tiny", str(ckpt / "best.pt"), "0.5", str(sound), "--N0", "10", "--N", "100",
                 "--max", "3"]) == 0
    assert "protocol" not in json.loads((tmp_path / "sound.tsv.json").read_text())


def test_cli_published_code_without_a_known_std_is_one_line_before_anything_is_written(tmp_path, tiny, capsys):
    from splitz_fast.cli import main

    ckpt = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(ckpt), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--split-index", "1"]) == 0
    out = tmp_path / "pc.tsv"
    assert main(["certify", "tiny", str(ckpt / "best.pt"), "0.5", str(out), "--N0", "10", "--N", "100",
                 "--protocol", "published-code"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "data_std" in err
    assert not out.exists() and not (tmp_path / "pc.tsv.json").exists()
