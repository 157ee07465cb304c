"""The up-front image check: every image file a run will read is decoded before the first row, so a truncated file
in a user's ImageFolder stops the run at once, named (not when the run reaches it), and leaves no file behind."""
from __future__ import annotations

import argparse
import io

import pytest
import torchvision.transforms as T
from PIL import Image
from torchvision.datasets import ImageFolder

import splitz_fast as sz
import splitz_fast.cli as cli
from _helpers import small_splitz
from splitz_fast.data.images import check_images, image_files
from splitz_fast.runs.loop import run_over_dataset
from splitz_fast.runs.tasks import CertifyRun


def image_folder(root, damaged: dict[int, str]) -> ImageFolder:
    """Six 6×6 images in two class folders (sorted: items 0-2 in ``a``, 3-5 in ``b``), read as the 1×6×6 inputs of
    :func:`small_splitz`; the items of ``damaged`` written as a truncated JPEG or PNG (``"jpeg"``/``"png"``)."""
    for item in range(6):
        folder = root / ("a" if item < 3 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        kind = damaged.get(item, "png")
        data = io.BytesIO()
        Image.new("RGB", (6, 6), (40 * item, 20, 200)).save(data, format=kind.upper())
        whole = data.getvalue()
        (folder / f"{item}.{kind}").write_bytes(whole[: len(whole) // 2] if item in damaged else whole)
    return ImageFolder(str(root), transform=T.Compose([T.Grayscale(), T.ToTensor()]))


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_a_truncated_image_is_named_and_only_selected_images_are_checked(tmp_path, kind):
    dataset = image_folder(tmp_path / "images", {4: kind})
    assert len(image_files(dataset)) == 6
    assert check_images(dataset, [0, 1, 2, 3, 5], progress=False) == 5  # item 4 is not read
    with pytest.raises(ValueError, match=rf"image .*4\.{kind} \(dataset item 4\) cannot be decoded") as err:
        check_images(dataset, [0, 4], progress=False)
    assert "\n" not in str(err.value) and "repair or replace that file" in str(err.value)
    assert check_images([(None, 0)], [0], progress=False) == 0  # not a folder dataset: nothing to decode


def test_a_run_refuses_before_its_first_row_and_leaves_no_file(tmp_path):
    dataset = image_folder(tmp_path / "images", {5: "jpeg"})
    model, _ = small_splitz()
    task = CertifyRun(sz.Smoother(model.eval(), 0.5), 4, 16, 0.01, 16)
    out = tmp_path / "out.tsv"
    args = dict(settings={"dataset": "folder"}, indices=list(range(6)), seed=0, progress=False)
    with pytest.raises(ValueError, match="dataset item 5"):
        run_over_dataset(task, dataset, out, **args)
    assert not out.exists() and not out.with_name("out.tsv.json").exists()
    # Without the check the run computes the images before the damaged one, then stops there.
    with pytest.raises(ValueError, match="dataset item 5 cannot be read"):
        run_over_dataset(task, dataset, out, check_images=False, **args)
    assert len(out.read_text().splitlines()) == 1 + 5
    # A resume decodes only the images it still has to read: item 5 repaired, item 0 (its row written) damaged now.
    Image.new("RGB", (6, 6), (200, 20, 200)).save(image_files(dataset)[5], format="JPEG")
    first = tmp_path / "images" / "a" / "0.png"
    first.write_bytes(first.read_bytes()[:20])
    run_over_dataset(task, dataset, out, resume=True, **args)
    assert len(out.read_text().splitlines()) == 1 + 6


def test_every_dataset_command_offers_the_check_on_by_default():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("certify", "predict", "certify-margin", "attack"):
        assert "--check-images, --no-check-images" in commands[command].format_help()
        assert commands[command].parse_args(["x", "y", "1", "z"][: 3 if command == "certify-margin" else 4]
                                            + (["--eps", "1"] if command == "attack" else [])).check_images
