"""Cohen et al.'s randomized-smoothing checkpoints (locuslab/smoothing and the code built on it) load into this
library's models: ``sz.load_checkpoint(path, format="cohen")`` and ``splitz certify ... --checkpoint-format cohen``.

The checkpoints are written here the way that code writes them: ``torch.save({"epoch", "arch", "state_dict",
"optimizer"})`` of ``Sequential(NormalizeLayer, net)``, the normalisation's means/sds plain tensor attributes (not in
the state_dict); ``net`` a bearpaw-style CIFAR ResNet for ``cifar_resnet20``/``cifar_resnet110``, torchvision's
ResNet-50 inside ``DataParallel`` for ``resnet50``. The networks below reproduce that code's module names and shapes
(its state-dict keys), not its code.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
import splitz_fast.cli as cli
from splitz_fast.checkpoints.splitz import checkpoint_digest, load_checkpoint_file

# The normalisation constants of Cohen et al.'s datasets.py.
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class NormalizeLayer(nn.Module):
    """``(x − means) / sds`` per channel, the constants kept as plain attributes (so not in the state_dict)."""

    def __init__(self, means, sds):
        super().__init__()
        self.means, self.sds = torch.tensor(means), torch.tensor(sds)

    def forward(self, x):
        return (x - self.means.view(1, -1, 1, 1)) / self.sds.view(1, -1, 1, 1)


class BearpawBlock(nn.Module):
    """Residual block with the attribute names of bearpaw's BasicBlock (shortcut = ``downsample``)."""

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class BearpawResNet(nn.Module):
    """CIFAR ResNet of depth 6n + 2 with bearpaw's module names: conv1, bn1, layer1..3, avgpool (8×8), fc."""

    def __init__(self, depth, num_classes=10):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        widths, inplanes, stages = (16, 32, 64), 16, []
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BearpawBlock(inplanes, planes, stride),
                                        *[BearpawBlock(planes, planes) for _ in range(n - 1)]))
            inplanes = planes
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.avgpool(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.view(x.size(0), -1))


def _randomize_batchnorm(model: nn.Module, seed: int) -> None:
    """Trained-looking BatchNorm statistics and affine terms, so a misplaced tensor changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(0.5 + torch.rand(c, generator=gen))
                m.bias.copy_(0.1 * torch.randn(c, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(c, generator=gen))


def cohen_model(arch: str, num_classes: int | None = None, seed: int = 0) -> nn.Sequential:
    """``Sequential(NormalizeLayer, net)`` as Cohen et al.'s get_architecture(arch, dataset) builds it."""
    torch.manual_seed(seed)
    if arch == "resnet50":
        from torchvision.models import resnet50

        net = nn.DataParallel(resnet50(weights=None, num_classes=num_classes or 1000))
        normalize = NormalizeLayer(IMAGENET_MEAN, IMAGENET_STD)
    else:
        net = BearpawResNet(int(arch.removeprefix("cifar_resnet")), num_classes or 10)
        normalize = NormalizeLayer(CIFAR10_MEAN, CIFAR10_STD)
    model = nn.Sequential(normalize, net)
    _randomize_batchnorm(model, seed)
    return model


def save_cohen(model: nn.Sequential, arch: str, path, *, step: bool = False, **extra) -> None:
    """torch.save of the dict Cohen et al.'s train.py writes after each epoch (``step``: with SGD momentum state)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    if step:
        model.train()
        model(torch.rand(2, 3, 32, 32)).logsumexp(1).sum().backward()
        optimizer.step()
    torch.save({"epoch": 90, "arch": arch, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                **extra}, path)


@pytest.mark.parametrize("arch, name, shape, step", [
    ("cifar_resnet20", "cifar_resnet20", (3, 32, 32), True),
    ("cifar_resnet110", "cifar_resnet110", (3, 32, 32), False),
    ("resnet50", "imagenet_resnet50", (3, 64, 64), False),
])
def test_cohen_checkpoint_loads_with_the_same_logits_and_certifies(tmp_path, arch, name, shape, step):
    original = cohen_model(arch)
    path = tmp_path / "checkpoint.pth.tar"
    save_cohen(original, arch, path, step=step)

    ckpt = sz.load_checkpoint(path, format="cohen")
    assert isinstance(ckpt, sz.LoadedCheckpoint)
    assert ckpt.sigma is None and ckpt.epoch == 89 and ckpt.config == {}
    assert (ckpt.model_spec["name"], ckpt.model_spec["format"], ckpt.model_spec["arch"]) == (name, "cohen", arch)
    assert ckpt.dataset == ("imagenet" if arch == "resnet50" else "cifar10")
    assert ckpt.digest == checkpoint_digest(load_checkpoint_file(path, format="cohen"))
    assert ckpt.data["arch"] == arch and "optimizer" in ckpt.data
    model = ckpt.model
    assert model.split_index == 0 and not model.training
    # The normalisation is the model's Standardize, in front of f_R at split 0 (noise is added to the raw input).
    torch.testing.assert_close(model.right.standardize.mean, original[0].means, atol=0, rtol=0)
    torch.testing.assert_close(model.right.standardize.std, original[0].sds, atol=0, rtol=0)

    x = torch.rand(2, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original.eval()(x)
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    # The same model rebuilt from its spec, as every other checkpoint's.
    rebuilt = sz.build_model(ckpt.model_spec["name"], **ckpt.model_spec["kwargs"])
    rebuilt.right.network.load_state_dict(ckpt.data["model"])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(x), expected, atol=1e-5, rtol=0)

    n0, n = 4, 16
    if arch == "resnet50":  # certified at 64×64 to keep the test light (convolutions, then an adaptive pool)
        model.left.input_shape, n0, n = shape, 1, 2
    result = sz.Smoother(model, 0.25).certify(x[0], n0=n0, n=n, alpha=0.001, batch_size=n, seed=0)
    assert result.n == n and result.count_a <= n
    if result.prediction != -1:  # abstentions evaluate no bound
        assert 0 <= result.prediction < model.num_classes and result.bound_kind == "identity"


def test_digest_identifies_the_weights(tmp_path):
    save_cohen(cohen_model("cifar_resnet20", seed=0), "cifar_resnet20", tmp_path / "a.pth.tar")
    save_cohen(cohen_model("cifar_resnet20", seed=0), "cifar_resnet20", tmp_path / "b.pth.tar")
    save_cohen(cohen_model("cifar_resnet20", seed=1), "cifar_resnet20", tmp_path / "c.pth.tar")
    a, b, c = (sz.load_checkpoint(tmp_path / f"{k}.pth.tar", format="cohen").digest for k in "abc")
    assert a == b != c


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unknown_arch_names_the_supported_ones(tmp_path):
    path = tmp_path / "wrn.pth.tar"
    save_cohen(cohen_model("cifar_resnet20"), "wide_resnet28", path)
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(path, format="cohen")
    message = _one_line(err)
    assert "unknown Cohen et al. arch 'wide_resnet28'" in message
    assert "cifar_resnet20, cifar_resnet110, resnet50" in message


@pytest.mark.parametrize("content, found", [
    ([1, 2, 3], "a list"),
    ({"state_dict": {}}, "1 key (state_dict)"),
    ({"arch": "cifar_resnet20", "model": {}}, "2 keys (arch, model)"),
])
def test_a_file_without_arch_and_state_dict_is_refused(tmp_path, content, found):
    path = tmp_path / "other.pt"
    torch.save(content, path)
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(path, format="cohen")
    message = _one_line(err)
    assert "is not a Cohen et al. checkpoint" in message and found in message and "'arch' and 'state_dict'" in message


def test_a_file_with_python_objects_or_garbage_is_refused(tmp_path):
    path = tmp_path / "args.pth.tar"
    torch.save({"arch": "cifar_resnet20", "state_dict": {}, "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(path, format="cohen")
    assert "Python objects other than tensors" in _one_line(err)
    garbage = tmp_path / "garbage.pth.tar"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(garbage, format="cohen")
    assert "not a torch.save archive" in _one_line(err)
    with pytest.raises(FileNotFoundError):
        sz.load_checkpoint(tmp_path / "missing.pth.tar", format="cohen")


def test_another_head_says_the_classes_found_and_expected(tmp_path):
    path = tmp_path / "cifar100.pth.tar"
    save_cohen(cohen_model("cifar_resnet20", num_classes=100), "cifar_resnet20", path)
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(path, format="cohen")
    message = _one_line(err)
    assert "has 100 classes (fc 64→100)" in message and "cifar_resnet20 has 10 (cifar10)" in message


def test_weights_of_another_depth_are_refused(tmp_path):
    path = tmp_path / "mislabelled.pth.tar"
    save_cohen(cohen_model("cifar_resnet20"), "cifar_resnet110", path)
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(path, format="cohen")
    message = _one_line(err)
    assert "does not fit Cohen et al.'s cifar_resnet110" in message and "missing" in message


def test_a_state_dict_outside_the_normalize_sequential_is_refused(tmp_path):
    net = cohen_model("cifar_resnet20")[1]
    path = tmp_path / "bare.pth.tar"
    torch.save({"epoch": 1, "arch": "cifar_resnet20", "state_dict": net.state_dict()}, path)
    with pytest.raises(ValueError) as err:
        sz.load_checkpoint(path, format="cohen")
    assert "'conv1.weight' is not a tensor under '1.'" in _one_line(err)


def test_formats_do_not_mix(tmp_path):
    path = tmp_path / "checkpoint.pth.tar"
    save_cohen(cohen_model("cifar_resnet20"), "cifar_resnet20", path)
    with pytest.raises(ValueError, match="is not a splitz_fast checkpoint.*looks like a Cohen et al. checkpoint.*"
                                         "format='cohen'.*--checkpoint-format cohen"):
        sz.load_checkpoint(path)
    with pytest.raises(ValueError, match="unknown checkpoint format 'smoothing'; valid formats: splitz, cohen"):
        sz.load_checkpoint(path, format="smoothing")


def test_a_bare_state_dict_is_named_in_one_short_line(tmp_path):
    """``torch.save(model.state_dict())`` of a ResNet-110 (hundreds of keys): the message says what it is and what to do,
    with a few of its keys, not all of them."""
    path = tmp_path / "weights.pt"
    state = cohen_model("cifar_resnet110").state_dict()
    torch.save(state, path)
    for format in ("splitz", "cohen"):
        with pytest.raises(ValueError) as err:
            sz.load_checkpoint(path, format=format)
        message = _one_line(err)
        assert f"{len(state)} keys" in message and "more)" in message and len(message) < 700, message
    assert "bare state_dict" in str(pytest.raises(ValueError, sz.load_checkpoint, path).value)


def test_data_parallel_around_the_whole_normalize_sequential_loads(tmp_path):
    """``nn.DataParallel(Sequential(NormalizeLayer, net))`` saves keys ``module.1.*``: the same weights, the same
    logits as the plain file."""
    model = cohen_model("cifar_resnet20")
    plain, wrapped = tmp_path / "plain.pth.tar", tmp_path / "wrapped.pth.tar"
    save_cohen(model, "cifar_resnet20", plain)
    torch.save({"epoch": 90, "arch": "cifar_resnet20", "state_dict": nn.DataParallel(model).state_dict()}, wrapped)
    assert next(iter(torch.load(wrapped, weights_only=True)["state_dict"])).startswith("module.1.")
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = [sz.load_checkpoint(p, format="cohen").model(x) for p in (plain, wrapped)]
    assert torch.equal(logits[0], logits[1])


def test_the_dataset_refusal_reads_as_english():
    from splitz_fast.checkpoints.cohen import check_cohen_dataset

    with pytest.raises(ValueError, match="is an imagenet model"):
        check_cohen_dataset({"model_spec": {"arch": "resnet50"}}, "cifar10")


def test_cli_certifies_a_cohen_checkpoint_and_resumes(tmp_path, capsys, fake_cifar10):
    path = tmp_path / "checkpoint.pth.tar"
    save_cohen(cohen_model("cifar_resnet20"), "cifar_resnet20", path)
    out = tmp_path / "out.tsv"
    argv = ["certify", "cifar10", str(path), "0.25", str(out), "--checkpoint-format", "cohen", "--skip", "2",
            "--N0", "4", "--N", "16", "--alpha", "0.001", "--batch", "16"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    header, *rows = out.read_text().splitlines()
    assert header.split("\t")[:6] == ["idx", "label", "predict", "radius", "correct", "time"]
    assert [row.split("\t")[0] for row in rows] == ["0", "2"]
    sidecar = json.loads(out.with_name("out.tsv.json").read_text())
    assert sidecar["checkpoint_format"] == "cohen" and sidecar["model_spec"]["format"] == "cohen"
    assert sidecar["model_spec"]["arch"] == "cifar_resnet20" and sidecar["sigma"] == 0.25
    assert sidecar["checkpoint_digest"] == sz.load_checkpoint(path, format="cohen").digest

    # A torn run resumes to the same rows; the same file read as another format is refused.
    out.write_text("\n".join([header, rows[0]]) + "\n")
    assert cli.main(argv + ["--resume"]) == 0, capsys.readouterr().err
    assert out.read_text().splitlines()[2].split("\t")[:5] == rows[1].split("\t")[:5]
    capsys.readouterr()
    assert cli.main([a for a in argv if a not in ("--checkpoint-format", "cohen")] + ["--resume"]) == 2
    assert "is not a splitz_fast checkpoint" in capsys.readouterr().err


def test_cli_refuses_another_dataset_or_the_held_out_split(tmp_path, capsys, fake_cifar10):
    path = tmp_path / "checkpoint.pth.tar"
    save_cohen(cohen_model("cifar_resnet20"), "cifar_resnet20", path)
    base = [str(path), "0.25", str(tmp_path / "out.tsv"), "--checkpoint-format", "cohen", "--N", "16"]
    assert cli.main(["predict", "imagenet", *base]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "Cohen et al.'s cifar_resnet20 is a cifar10 model" in err and "not one for 'imagenet'" in err
    assert cli.main(["certify", "cifar10", *base, "--N0", "4", "--split", "heldout"]) == 2
    assert "Cohen et al.'s and MACER's checkpoints do not record theirs" in capsys.readouterr().err
    assert not (tmp_path / "out.tsv").exists()


def test_help_names_the_option():
    for command in ("certify", "predict", "attack"):
        parser = cli.build_parser()
        text = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        assert "--checkpoint-format {splitz,cohen,macer}" in text.format_help()
        assert "--input-normalization NAME|MEAN,STD" in text.format_help()
