"""Sidecar schema 2: every setting recorded, defaults included, and the one migration that reads the sidecars written
before (schema 1, no ``schema`` entry, optional settings left out at their default) for resume and merge. The
schema-1 entries below are written by hand as that code wrote them, not derived from the migration's table."""
from __future__ import annotations

import json

import pytest
import torch

import splitz_fast as sz
from splitz_fast.cli.main import main
from splitz_fast.runs.loop import run_over_dataset
from splitz_fast.runs.schema import current_settings
from splitz_fast.runs.shards import ShardData, ShardSpec, merge_shards
from splitz_fast.runs.tasks import CertifyRun, PredictRun
from splitz_fast.sampling.engine import PHILOX_STREAM, NoiseStream
from splitz_fast.zoo.models import build_model

SIGMA = 0.5

#: What schema 1 left out of a sidecar of each kind where the setting was at its default (by hand, from the code
#: that wrote schema 1: tasks.py, loop.py, cli/certify.py). noise_stream joins where the Philox kernels draw.
OMITTED_AT_DEFAULT = {
    "certify": {"protocol": "sound", "lipschitz_factor": 1.0, "certificate": True, "precision": "float32",
                "gamma_batch": 2, "bn_folded": True, "sequential": False},
    "predict": {"precision": "float32", "bn_folded": True},
}


def _model():
    torch.manual_seed(0)
    return build_model("mlp", in_features=4, num_classes=2, split_index=1, threshold=1.0,
                       learnable_threshold=False).eval()


def _data():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    return [(x[i], int(x[i, 0] > 0)) for i in range(6)]


def _philox() -> bool:
    return NoiseStream(0, torch.device("cpu")).source == PHILOX_STREAM


def _as_schema_1(sidecar, kind: str) -> dict:
    """Rewrite ``sidecar`` (schema 2, written by this code) as schema 1 wrote the same run: no ``schema``, the
    optional settings at their default left out; checks first that schema 2 recorded exactly those defaults."""
    settings = json.loads(sidecar.read_text())
    omitted = dict(OMITTED_AT_DEFAULT[kind])
    if _philox():  # schema 1 recorded the fallback generator only
        omitted["noise_stream"] = PHILOX_STREAM
    if "checkpoint_digest" in settings:  # schema 1 recorded a checkpoint format other than splitz only
        omitted["checkpoint_format"] = "splitz"
    assert settings["schema"] == 2 and {key: settings[key] for key in omitted} == omitted
    earlier = {key: value for key, value in settings.items() if key not in {*omitted, "schema"}}
    sidecar.write_text(json.dumps(earlier, indent=2, sort_keys=True) + "\n")
    return earlier


def _rows(path):
    """The rows of a TSV without their time column."""
    header, *rows = path.read_text().splitlines()
    keep = [k for k, name in enumerate(header.split("\t")) if name != "time"]
    return [[row.split("\t")[k] for k in keep] for row in rows]


ARGS = dict(settings={"dataset": "tiny"}, indices=[0, 1, 2, 3], seed=0, progress=False)


@pytest.mark.parametrize("kind", ["certify", "predict"])
def test_a_schema_1_sidecar_resumes_with_every_omitted_setting_at_its_default(tmp_path, kind):
    smoother = sz.Smoother(_model(), SIGMA)
    task = CertifyRun(smoother, 5, 40, 0.01, 32) if kind == "certify" else PredictRun(smoother, 40, 0.01, 32)
    whole, part = tmp_path / "whole.tsv", tmp_path / "part.tsv"
    run_over_dataset(task, _data(), whole, **ARGS)
    run_over_dataset(task, _data(), part, stop_after=2, **ARGS)
    _as_schema_1(tmp_path / "part.tsv.json", kind)
    run_over_dataset(task, _data(), part, resume=True, **ARGS)
    assert _rows(part) == _rows(whole)


def test_a_cli_schema_1_sidecar_of_a_checkpoint_run_resumes(tmp_path, tiny, capsys):
    """The command line's schema 1 also left out checkpoint_format (splitz) and bn_folded, gamma_batch, sequential."""
    run = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "8"]) == 0
    out = tmp_path / "out.tsv"
    args = ["certify", "tiny", str(run / "best.pt"), "0.5", str(out), "--skip", "10", "--N0", "10", "--N", "50"]
    assert main(args) == 0
    whole = _rows(out)
    out.write_text("\n".join(out.read_text().splitlines()[:2]) + "\n")  # the header and one row
    _as_schema_1(tmp_path / "out.tsv.json", "certify")
    assert main([*args, "--resume"]) == 0
    assert _rows(out) == whole


@pytest.mark.parametrize("change,key", [(dict(precision="bfloat16"), "precision"),
                                        (dict(bound_options=sz.BoundOptions(gamma_batch=4)), "gamma_batch")])
def test_a_schema_1_omission_is_refused_against_a_value_off_its_default(tmp_path, change, key):
    """A schema-1 file without ``precision`` was sampled in float32: resuming it in bfloat16 would mix rows of two
    base classifiers in one file; likewise a file without gamma_batch against another γ batch."""
    out = tmp_path / "out.tsv"
    run_over_dataset(CertifyRun(sz.Smoother(_model(), SIGMA), 5, 40, 0.01, 32), _data(), out, stop_after=1, **ARGS)
    _as_schema_1(tmp_path / "out.tsv.json", "certify")
    other = CertifyRun(sz.Smoother(_model(), SIGMA, **change), 5, 40, 0.01, 32)
    with pytest.raises(ValueError, match=f"different settings: {key} "):
        run_over_dataset(other, _data(), out, resume=True, **ARGS)
    assert len(out.read_text().splitlines()) == 2  # nothing appended


def test_the_migration_writes_in_exactly_what_schema_1_left_out():
    earlier = {"kind": "certify", "n0": 10, "n": 50, "alpha": 0.001, "sigma": 0.5, "seed": 0, "indices": [0, 9, 4],
               "bound": "local", "bound_method": "exact", "gamma_search": "bisection", "checkpoint_digest": "ab",
               "checkpoint_digest_covers": "model, config", "precision": "tf32", "sequential": True,
               "radii": [0.5], "budget": 50}
    assert current_settings(earlier, "out.tsv.json") == {
        **earlier, "schema": 2, "protocol": "sound", "lipschitz_factor": 1.0, "certificate": True,
        "gamma_batch": 2, "bn_folded": True, "noise_stream": PHILOX_STREAM, "checkpoint_format": "splitz"}
    estimate = {"kind": "certify", "protocol": "paper", "certificate": False, "noise_stream": "torch-cpu"}
    assert current_settings(estimate, "x.json") == {
        **estimate, "schema": 2, "lipschitz_factor": 1.0, "precision": "float32", "gamma_batch": 2, "bn_folded": True,
        "sequential": False}
    margin = {"kind": "certify-margin", "certifier": "margin", "model_digest": "cd"}
    assert current_settings(margin, "m.json") == {**margin, "schema": 2}  # no noise, no checkpoint
    written = {**estimate, "schema": 2}
    assert current_settings(written, "x.json") is written  # schema 2 is read as it is


def test_a_schema_1_shard_merges_with_a_schema_2_shard_of_the_same_run(tmp_path):
    task = CertifyRun(sz.Smoother(_model(), SIGMA), 5, 40, 0.01, 32)
    whole, out = tmp_path / "whole.tsv", tmp_path / "out.tsv"
    run_over_dataset(task, _data(), whole, **ARGS)
    shards = [run_over_dataset(task, _data(), out, shard=ShardSpec(k, 2), **ARGS) for k in range(2)]
    _as_schema_1(shards[0].with_name(shards[0].name + ".json"), "certify")
    merge_shards(out, [ShardData.read(path) for path in shards])
    assert _rows(out) == _rows(whole)
    assert json.loads((tmp_path / "out.tsv.json").read_text()) == json.loads((tmp_path / "whole.tsv.json").read_text())


def test_a_schema_1_shard_with_an_omitted_default_does_not_merge_with_a_shard_off_it(tmp_path):
    out = tmp_path / "out.tsv"
    plain = run_over_dataset(CertifyRun(sz.Smoother(_model(), SIGMA), 5, 40, 0.01, 32), _data(), out,
                             shard=ShardSpec(0, 2), **ARGS)
    bf16 = run_over_dataset(CertifyRun(sz.Smoother(_model(), SIGMA, precision="bfloat16"), 5, 40, 0.01, 32), _data(),
                            out, shard=ShardSpec(1, 2), **ARGS)
    _as_schema_1(plain.with_name(plain.name + ".json"), "certify")
    with pytest.raises(ValueError, match=r"different settings .*\(precision\)"):
        merge_shards(out, [ShardData.read(plain), ShardData.read(bf16)])
    assert not out.exists()


def test_a_newer_schema_is_refused_in_one_line(tmp_path):
    task = CertifyRun(sz.Smoother(_model(), SIGMA), 5, 40, 0.01, 32)
    out = tmp_path / "out.tsv"
    shard = run_over_dataset(task, _data(), out, shard=ShardSpec(0, 1), **ARGS)
    run_over_dataset(task, _data(), out, stop_after=1, **ARGS)
    for sidecar in (tmp_path / "out.tsv.json", shard.with_name(shard.name + ".json")):
        sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "schema": 3}))
    with pytest.raises(ValueError) as resumed:
        run_over_dataset(task, _data(), out, resume=True, **ARGS)
    assert str(resumed.value) == (f"cannot resume {out}: out.tsv.json has sidecar schema 3, newer than this "
                                  "splitz_fast reads (2); upgrade splitz_fast or start a new OUTFILE")
    with pytest.raises(ValueError, match="^cannot merge: .*sidecar schema 3, newer .*upgrade splitz_fast") as merged:
        merge_shards(tmp_path / "merged.tsv", [ShardData.read(shard)])
    assert "\n" not in str(merged.value)


def test_the_written_sidecar_has_the_schema_and_every_setting(tmp_path):
    out = tmp_path / "out.tsv"
    run_over_dataset(CertifyRun(sz.Smoother(_model(), SIGMA), 5, 40, 0.01, 32), _data(), out, stop_after=1, **ARGS)
    settings = json.loads((tmp_path / "out.tsv.json").read_text())
    assert settings["schema"] == 2
    assert {key: settings[key] for key in OMITTED_AT_DEFAULT["certify"]} == OMITTED_AT_DEFAULT["certify"]
    assert settings["noise_stream"] == NoiseStream(0, torch.device("cpu")).source


def test_train_resumes_a_checkpoint_whose_spec_left_out_split_and_recipe(tmp_path, tiny, capsys):
    """``splitz train`` recorded split (train) and recipe (none) in model_spec only when set: such a last.pt resumes,
    and is refused against another split."""
    run = tmp_path / "run"
    train = ["train", "tiny", "mlp", str(run), "--sigma", "0.5", "--batch", "8", "--epochs", "1"]
    assert main(train) == 0
    ckpt = torch.load(run / "last.pt", weights_only=True)
    assert ckpt["model_spec"]["split"] == "train" and ckpt["model_spec"]["recipe"] is None  # recorded in full now
    del ckpt["model_spec"]["split"], ckpt["model_spec"]["recipe"]
    torch.save(ckpt, run / "last.pt")
    capsys.readouterr()
    assert main([*train, "--split", "test", "--resume"]) == 2
    assert "another config or model: model_spec (" in capsys.readouterr().err
    assert main([*train, "--resume"]) == 0  # the run is complete: nothing is trained, but the settings must match
    assert "cannot resume" not in capsys.readouterr().err
