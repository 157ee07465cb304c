"""The estimate protocols behind the SPLITZ paper's numbers: what each computes, checked against a
naive reference, and labelled "not a certificate" everywhere (rows, sidecars, analysis, envelope)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.analysis.plots import analyze
from splitz_fast.analysis.tables import read_certification
from splitz_fast.analysis.envelope import load_group
from splitz_fast.certify.protocols import PAPER_POWER_ITERS, PublishedCode, get_protocol
from splitz_fast.certify.sequential import SequentialCertifier

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
    from splitz_fast.runs.rows import HEADER, format_row

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
    with pytest.raises(ValueError, match="mixes certificates with estimates"):
        load_group([sound, paper_other])
    report = sz.envelope_report({"sound": load_group([sound]), "paper": load_group([paper, paper_other])}, [0.0])
    assert "paper (not a certificate) envelope" in report


def test_cli_certify_records_an_estimate_in_the_sidecar_and_rows(tmp_path, tiny):
    from splitz_fast.cli.main import main

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
    assert json.loads((tmp_path / "sound.tsv.json").read_text())["protocol"] == "sound"


def test_cli_published_code_without_a_known_std_is_one_line_before_anything_is_written(tmp_path, tiny, capsys):
    from splitz_fast.cli.main import main

    ckpt = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(ckpt), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--split-index", "1"]) == 0
    out = tmp_path / "pc.tsv"
    assert main(["certify", "tiny", str(ckpt / "best.pt"), "0.5", str(out), "--N0", "10", "--N", "100",
                 "--protocol", "published-code"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "data_std" in err
    assert not out.exists() and not (tmp_path / "pc.tsv.json").exists()


# ------------------------------------------------------------------------ one notion of "a certificate"
def _dataset(count: int = 3):
    from torch.utils.data import TensorDataset

    x = torch.rand(count, 1, 6, 6, generator=torch.Generator().manual_seed(2))
    return TensorDataset(x, torch.zeros(count, dtype=torch.long))


def _api_run(path, protocol: str, **kwargs):
    """A certification run through the Python API only (no CLI settings), as a user's own script writes one."""
    from splitz_fast.runs.loop import run_over_dataset
    from splitz_fast.runs.tasks import CertifyRun

    model, _ = _model(True)
    data = _dataset()
    task = CertifyRun(sz.Smoother(model, SIGMA, protocol=protocol), **CERTIFY)
    return run_over_dataset(task, data, path, settings={"sigma_note": "api"}, indices=list(range(len(data))), seed=0,
                            progress=False, **kwargs)


def test_certify_result_says_whether_it_is_a_certificate():
    model, x = _model(True)
    assert sz.Smoother(model, SIGMA).certify(x, **CERTIFY, seed=0).is_certificate
    assert not sz.Smoother(model, SIGMA, protocol="paper").certify(x, **CERTIFY, seed=0).is_certificate


def test_the_run_task_records_the_protocol_whatever_the_entry_point(tmp_path):
    _api_run(tmp_path / "paper.tsv", "paper")
    sidecar = json.loads((tmp_path / "paper.tsv.json").read_text())
    assert sidecar["protocol"] == "paper" and sidecar["certificate"] is False
    _api_run(tmp_path / "sound.tsv", "sound")
    sidecar = json.loads((tmp_path / "sound.tsv.json").read_text())
    assert sidecar["protocol"] == "sound" and sidecar["certificate"] is True  # every setting, defaults included


@pytest.mark.parametrize("first,then", [("sound", "paper"), ("paper", "sound"), ("sound", "published-code")])
def test_resume_through_the_api_refuses_another_kind_of_result(tmp_path, first, then):
    out = tmp_path / "run.tsv"
    if then == "published-code":
        then = PublishedCode(data_std=(0.3081,))
    _api_run(out, first, stop_after=1)
    with pytest.raises(ValueError, match="its rows are .* and this run computes .*use a new OUTFILE"):
        _api_run(out, then, resume=True)
    assert len(out.read_text().splitlines()) == 2  # nothing appended


def test_resume_reads_the_rows_when_the_sidecar_does_not_say(tmp_path):
    """A file whose sidecar predates the protocol record (estimate rows, no ``certificate`` entry) still refuses to be
    continued with certificates: the rows themselves say what they are."""
    out = tmp_path / "run.tsv"
    _api_run(out, "paper", stop_after=1)
    sidecar = tmp_path / "run.tsv.json"
    settings = json.loads(sidecar.read_text())
    del settings["protocol"], settings["certificate"]
    sidecar.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="its rows are estimates .* and this run computes certificates"):
        _api_run(out, "sound", resume=True)


def test_merge_refuses_shards_of_certificates_and_estimates(tmp_path):
    from splitz_fast.runs.shards import ShardData, ShardSpec, merge_shards

    out = tmp_path / "run.tsv"
    sound = _api_run(out, "sound", shard=ShardSpec(0, 2))
    paper = _api_run(out, "paper", shard=ShardSpec(1, 2))
    with pytest.raises(ValueError, match="different settings .*certificate, protocol"):
        merge_shards(out, [ShardData.read(sound), ShardData.read(paper)])
    # Even with sidecars that do not tell them apart (written before the protocol was recorded), the rows refuse.
    for shard in (sound, paper):
        sidecar = shard.with_name(shard.name + ".json")
        settings = json.loads(sidecar.read_text())
        settings.pop("protocol", None), settings.pop("certificate", None)
        sidecar.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="mixes certificates .* with estimates"):
        merge_shards(out, [ShardData.read(sound), ShardData.read(paper)])
    assert not out.exists()


def test_merged_estimate_shards_are_labelled_an_estimate_run(tmp_path):
    from splitz_fast.runs.shards import ShardData, ShardSpec, merge_shards

    out = tmp_path / "run.tsv"
    shards = [_api_run(out, "paper", shard=ShardSpec(k, 2)) for k in range(2)]
    for shard in shards:  # sidecars that do not record the protocol
        sidecar = shard.with_name(shard.name + ".json")
        settings = json.loads(sidecar.read_text())
        del settings["protocol"], settings["certificate"]
        sidecar.write_text(json.dumps(settings))
    merge_shards(out, [ShardData.read(s) for s in shards])
    assert json.loads((tmp_path / "run.tsv.json").read_text())["certificate"] is False
    assert read_certification(out).is_estimate


def _table(radius, bound, correct=None, **kwargs):
    from splitz_fast.analysis.tables import CertificationTable

    k = len(radius)
    correct = np.ones(k, dtype=bool) if correct is None else np.asarray(correct, dtype=bool)
    predict = np.where(correct, 0, 1)
    return CertificationTable(idx=np.arange(k), label=np.zeros(k, dtype=np.int64), predict=predict,
                              radius=np.asarray(radius, dtype=np.float64), correct=correct, time=np.ones(k),
                              extra={"bound": np.array(bound, dtype=object)}, **kwargs)


def test_a_table_never_mixes_certificates_and_estimates():
    with pytest.raises(ValueError, match="mixes certificates \\(local-exact\\) with estimates \\(paper-estimate"):
        _table([0.5, 0.7], ["local-exact", "paper-estimate"])
    with pytest.raises(ValueError, match="sidecar records an estimate run"):
        _table([0.5], ["local-exact"], recorded_certificate=False)
    assert _table([0.5, 0.0], ["paper-estimate", "none"]).is_estimate
    assert _table([0.0], ["none"], recorded_certificate=False).is_estimate  # all abstained: the sidecar says
    assert not _table([0.5, 0.0], ["identity", "none"]).is_estimate


def test_envelope_report_from_python_refuses_a_mixed_group():
    sound, paper = _table([0.5, 0.2], ["local-exact"] * 2), _table([1.5, 1.2], ["published-code-estimate"] * 2)
    with pytest.raises(ValueError, match="group mixed mixes certificates with estimates \\(σ=0.75"):
        sz.envelope_report({"mixed": {0.5: sound, 0.75: paper}}, [0.0, 0.5])
    with pytest.raises(ValueError, match="mixes certificates with estimates"):
        sz.envelope.envelope({0.5: sound, 0.75: paper}, [0.0])
    report = sz.envelope_report({"sound": {0.5: sound}, "estimate": {0.75: paper}}, [0.0, 1.0])
    assert "estimate (not a certificate) envelope" in report


def test_estimates_are_never_the_bold_best_value():
    from splitz_fast.analysis.tables import markdown_table

    sound_a = _table([0.5, 0.2], ["local-exact"] * 2)
    sound_b = _table([0.3, 0.1], ["local-exact"] * 2)
    paper = _table([1.5, 1.2], ["paper-estimate"] * 2)
    text = markdown_table({"a": sound_a, "b": sound_b, "paper (not a certificate)": paper}, [0.0, 0.4])
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert "**" not in rows["paper (not a certificate)"]
    assert "**50.0**" in rows["a"] and "**" not in rows["b"].split("|")[3]  # at r = 0.4: a 50 %, b 0 %
    alone = markdown_table({"a": sound_a, "paper (not a certificate)": paper}, [0.0, 0.4])
    assert "**" not in alone  # one certificate run: nothing to compare it with


def test_diagnose_labels_an_estimate_run_and_reports_no_flatness(tmp_path):
    from splitz_fast.analysis.diagnostics import diagnose, diagnostics_report

    model, _ = _model(True)
    out = _api_run(tmp_path / "paper.tsv", "paper")
    table = read_certification(out)
    assert table.is_estimate and (table.radius > 0).any()
    diag = diagnose(model, _dataset(), table)
    assert diag.estimate and diag.flatness is None
    text = diagnostics_report(diag, "paper run", out_dir=tmp_path / "diag")
    assert "ESTIMATES, NOT CERTIFICATES" in text and "estimated L(x, γ*) (not an upper bound)" in text
    assert "certified inputs" not in text and "flatness" not in text.split("ESTIMATES")[1].split("\n", 2)[2]
    assert (tmp_path / "diag" / "diagnostics.tsv").read_text().startswith("idx\tL_estimate\t")
    sound = diagnose(model, _dataset(), read_certification(_api_run(tmp_path / "sound.tsv", "sound")))
    assert not sound.estimate and sound.flatness is not None and (sound.flatness <= 1 + 1e-9).all()
    assert "certified inputs" in diagnostics_report(sound, "sound run")


# ------------------------------------------------------------------------ the published code's normalisation constant
@pytest.mark.parametrize("factor", [0.2023, 1 / 0.2023, 3.0])
def test_published_code_lipschitz_factor_scales_l_and_divides_the_radius(factor):
    """Same model, same seed (so the same votes and the same power-iteration start): L is c times and the radius
    exactly 1/c times the c = 1 protocol's."""
    model, x = _model(True)
    base = sz.Smoother(model, SIGMA, protocol=PublishedCode()).certify(x, **CERTIFY, seed=0)
    scaled = sz.Smoother(model, SIGMA, protocol=PublishedCode(lipschitz_factor=factor)).certify(x, **CERTIFY, seed=0)
    assert base.radius > 0 and scaled.latent_radius == base.latent_radius
    assert scaled.lipschitz == pytest.approx(factor * base.lipschitz, rel=1e-12)
    assert scaled.radius == pytest.approx(base.radius / factor, rel=1e-12)
    assert scaled.bound_kind == "published-code-estimate"


@pytest.mark.parametrize("factor", [0.0, -1.0, math.inf, math.nan])
def test_published_code_lipschitz_factor_must_be_positive_and_finite(factor):
    with pytest.raises(ValueError, match="lipschitz_factor"):
        PublishedCode(data_std=(0.3081,), lipschitz_factor=factor)


def test_cli_published_lipschitz_factor_reaches_the_sidecar_and_resume_refuses_another(tmp_path, tiny, capsys):
    from splitz_fast.cli.main import main

    ckpt = tmp_path / "run"  # the tiny data under the name mnist, so the published code's MNIST std applies
    assert main(["train", "mnist", "mlp", str(ckpt), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--split-index", "1"]) == 0
    common = ["certify", "mnist", str(ckpt / "best.pt"), "0.5"]
    counts = ["--N0", "10", "--N", "100", "--max", "3", "--protocol", "published-code"]
    one, scaled = tmp_path / "c1.tsv", tmp_path / "c.tsv"
    assert main([*common, str(one), *counts]) == 0
    assert main([*common, str(scaled), *counts, "--published-lipschitz-factor", "0.2023"]) == 0
    assert json.loads((tmp_path / "c1.tsv.json").read_text())["lipschitz_factor"] == 1.0
    sidecar = json.loads((tmp_path / "c.tsv.json").read_text())
    assert sidecar["protocol"] == "published-code" and sidecar["lipschitz_factor"] == 0.2023
    a, b = read_certification(one), read_certification(scaled)
    np.testing.assert_array_equal(a.correct, b.correct)
    np.testing.assert_allclose(b.radius, a.radius / 0.2023, rtol=1e-4)  # TSV radii are rounded
    capsys.readouterr()
    assert main([*common, str(scaled), *counts, "--published-lipschitz-factor", "0.5", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "lipschitz_factor" in err
    assert main([*common, str(scaled), *counts, "--resume"]) == 2  # c = 1 is another run too
    assert len(scaled.read_text().splitlines()) == 4  # header and the 3 rows, nothing appended


@pytest.mark.parametrize("protocol", [[], ["--protocol", "sound"], ["--protocol", "paper"]])
def test_cli_published_lipschitz_factor_is_refused_without_the_published_code_protocol(tmp_path, tiny, capsys,
                                                                                         protocol):
    from splitz_fast.cli.main import main

    ckpt = tmp_path / "run"
    assert main(["train", "mnist", "mlp", str(ckpt), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--split-index", "1"]) == 0
    out = tmp_path / "x.tsv"
    capsys.readouterr()
    assert main(["certify", "mnist", str(ckpt / "best.pt"), "0.5", str(out), "--N0", "10", "--N", "100", *protocol,
                 "--published-lipschitz-factor", "0.2023"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--protocol published-code" in err[0]
    assert not out.exists() and not (tmp_path / "x.tsv.json").exists()
