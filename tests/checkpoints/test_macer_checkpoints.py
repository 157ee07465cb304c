"""MACER's checkpoints (RuntianZ/macer) load behind the input normalisation the user states:
``sz.load_checkpoint(path, format="macer", input_normalization=...)`` and ``splitz certify ... --checkpoint-format
macer --input-normalization ...``.

The files are made here as MACER's main.py writes them: ``torch.save({"net": base_model.state_dict(), "epoch": N})``
of its CIFAR ResNet, whose state-dict keys are ours with ``downsample`` for ``shortcut``; the network is this
library's own, its BatchNorms given trained-looking statistics, and its keys renamed to MACER's.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
import splitz_fast.cli as cli
from _helpers import one_line_error
from splitz_fast.checkpoints.macer import input_normalization
from splitz_fast.zoo.models import build_model

COHEN_MEAN, COHEN_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


def our_network(depth: int, seed: int = 0) -> nn.Module:
    """This library's CIFAR ResNet-``depth`` (split 0's network) with every BatchNorm statistic and affine term drawn
    at random, so that a misplaced tensor changes the logits."""
    torch.manual_seed(seed)
    network = build_model(f"cifar_resnet{depth}", split_index=0).right.network
    with torch.no_grad():
        for m in network.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return network.eval()


def save_macer(network: nn.Module, path, epoch: int = 440) -> None:
    """The dict MACER's main.py saves, its keys under MACER's names."""
    net = {key.replace(".shortcut.", ".downsample."): value for key, value in network.state_dict().items()}
    assert any(".downsample." in key for key in net)
    torch.save({"net": net, "epoch": epoch}, path)


def test_a_macer_resnet110_computes_the_logits_of_the_network_it_came_from(tmp_path):
    network = our_network(110)
    path = tmp_path / "440.pth"
    save_macer(network, path)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ckpt = sz.load_checkpoint(path, format="macer", input_normalization="none")
    assert ckpt.model.split_index == 0 and ckpt.sigma is None and ckpt.epoch == 439
    assert ckpt.model_spec["name"] == "cifar_resnet110" and ckpt.model_spec["input_normalization"] == "none"
    with torch.no_grad():
        expected = network(x)
        torch.testing.assert_close(ckpt.model(x), expected, rtol=0, atol=0)  # (x - 0) / 1 is x exactly
        behind_cohen = sz.load_checkpoint(path, format="macer", input_normalization="cohen-cifar10").model
        mean, std = torch.tensor(COHEN_MEAN).view(1, 3, 1, 1), torch.tensor(COHEN_STD).view(1, 3, 1, 1)
        torch.testing.assert_close(behind_cohen(x), network((x - mean) / std))


def test_the_normalisation_is_in_the_digest_and_parsed_strictly(tmp_path):
    path = tmp_path / "200.pth"
    save_macer(our_network(20), path, epoch=200)
    digests = {text: sz.load_checkpoint(path, format="macer", input_normalization=text).digest
               for text in ("none", "cohen-cifar10", "0.5,0.25")}
    assert len(set(digests.values())) == 3
    assert input_normalization("0.5,0.25").mean == (0.5,) * 3
    six = input_normalization("0.1,0.2,0.3,0.4,0.5,0.6")
    assert six.mean == (0.1, 0.2, 0.3) and six.std == (0.4, 0.5, 0.6)
    for bad in ("cohen", "0.5", "0.5,0", "1,2,3", "a,b"):
        with pytest.raises(ValueError, match="input normalisation"):
            input_normalization(bad)


def test_python_refuses_a_missing_or_misplaced_normalisation_in_one_line(tmp_path):
    path = tmp_path / "200.pth"
    save_macer(our_network(20), path)
    with pytest.raises(ValueError, match="MACER checkpoints store no input normalisation") as err:
        sz.load_checkpoint(path, format="macer")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="input_normalization belongs to format='macer'"):
        sz.load_checkpoint(path, format="cohen", input_normalization="none")


def test_each_format_names_the_other(tmp_path):
    macer = tmp_path / "200.pth"
    save_macer(our_network(20), macer)
    cohen = tmp_path / "checkpoint.pth.tar"
    net = our_network(20).state_dict()
    torch.save({"epoch": 90, "arch": "cifar_resnet20", "state_dict": {f"1.{k}": v for k, v in net.items()}}, cohen)
    for path, format, hint in ((macer, "cohen", "format='macer'"), (macer, "splitz", "format='macer'"),
                               (cohen, "macer", "format='cohen'")):
        with pytest.raises(ValueError, match=hint) as err:
            sz.load_checkpoint(path, format=format, input_normalization="none" if format == "macer" else None)
        assert "\n" not in str(err.value)
    lenet = tmp_path / "mnist.pth"
    torch.save({"net": {"conv1.weight": torch.zeros(20, 1, 5, 5)}, "epoch": 1}, lenet)
    with pytest.raises(ValueError, match="MNIST LeNet; only its CIFAR ResNet"):
        sz.load_checkpoint(lenet, format="macer", input_normalization="none")


def test_cli_certifies_records_and_refuses_a_resume_behind_another_normalisation(tmp_path, capsys, fake_cifar10):
    path = tmp_path / "200.pth"
    save_macer(our_network(20), path)
    out = tmp_path / "out.tsv"
    argv = ["certify", "cifar10", str(path), "0.25", str(out), "--checkpoint-format", "macer", "--skip", "2",
            "--N0", "4", "--N", "16", "--batch", "16"]
    assert cli.main(argv) == 2
    assert "MACER checkpoints store no normalisation: pass --input-normalization none" in one_line_error(capsys)
    assert not out.exists()
    assert cli.main(argv + ["--input-normalization", "0.5"]) == 2
    assert "--input-normalization: input normalisation '0.5' is not" in one_line_error(capsys)

    assert cli.main(argv + ["--input-normalization", "none"]) == 0, capsys.readouterr().err
    sidecar = json.loads(out.with_name("out.tsv.json").read_text())
    assert sidecar["checkpoint_format"] == "macer" and sidecar["input_normalization"] == "none"
    assert sidecar["model_spec"]["kwargs"]["mean"] == [0.0] * 3
    assert sidecar["checkpoint_digest"] == sz.load_checkpoint(path, format="macer", input_normalization="none").digest
    capsys.readouterr()

    assert cli.main(argv + ["--input-normalization", "cohen-cifar10", "--resume"]) == 2
    err = one_line_error(capsys)
    assert 'input_normalization ("none" in out.tsv.json, "cohen-cifar10" now)' in err
    assert cli.main(argv + ["--input-normalization", "none", "--resume"]) == 0, capsys.readouterr().err


def test_cli_refuses_the_option_with_another_format_and_hints_the_format(tmp_path, capsys, fake_cifar10):
    path = tmp_path / "200.pth"
    save_macer(our_network(20), path)
    base = ["predict", "cifar10", str(path), "0.25", str(tmp_path / "out.tsv"), "--N", "16"]
    assert cli.main(base + ["--checkpoint-format", "cohen", "--input-normalization", "none"]) == 2
    assert "--input-normalization belongs to --checkpoint-format macer" in one_line_error(capsys)
    assert cli.main(base + ["--checkpoint-format", "cohen"]) == 2
    assert "--checkpoint-format macer --input-normalization" in one_line_error(capsys)
    assert cli.main(base + ["--checkpoint-format", "macer", "--input-normalization", "none", "--split",
                            "heldout"]) == 2
    assert "MACER's checkpoints do not record theirs" in one_line_error(capsys)
    assert cli.main(["predict", "imagenet", *base[2:], "--checkpoint-format", "macer",
                     "--input-normalization", "none"]) == 2
    assert "MACER's resnet20 is a cifar10 model, not one for 'imagenet'" in one_line_error(capsys)


def test_diagnose_reads_the_checkpoint_behind_the_recorded_normalisation(tmp_path, capsys, fake_cifar10):
    path = tmp_path / "200.pth"
    save_macer(our_network(20), path)
    out = tmp_path / "out.tsv"
    assert cli.main(["certify", "cifar10", str(path), "0.25", str(out), "--checkpoint-format", "macer",
                     "--input-normalization", "0.5,0.25", "--max", "2", "--N0", "4", "--N", "16", "--batch",
                     "16"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    code = cli.main(["diagnose", str(path), str(out), "--headroom"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "input normalisation 0.5,0.5,0.5,0.25,0.25,0.25" in captured.out
