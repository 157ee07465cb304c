"""What a resume says: that there was nothing to resume (a new run starts), that a cut last line is recomputed, where
a damaged row is and what to do about it, and how many rows this call computed of the file's."""
from __future__ import annotations

import pytest
import torch

import splitz_fast as sz
from splitz_fast.cli.main import main
from splitz_fast.runs.loop import run_over_dataset
from splitz_fast.runs.tasks import CertifyRun
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loop import train
from splitz_fast.zoo.models import build_model


def _model():
    torch.manual_seed(0)
    return build_model("mlp", in_features=4, num_classes=2, split_index=1, threshold=1.0, learnable_threshold=False)


def _certify(out, *extra, ckpt):
    return ["certify", "tiny", str(ckpt), "0.5", str(out), "--skip", "10", "--N0", "10", "--N", "50", *extra]


@pytest.fixture
def ckpt(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "8"]) == 0
    capsys.readouterr()
    return run / "best.pt"


def _notice(err: str) -> str:
    """The one notice of a resume on stderr: a line of its own (progress bars apart), the only one naming resume."""
    lines = [line for line in err.splitlines() if "resume" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_certify_resume_of_a_missing_outfile_starts_and_says_so_in_one_line(tmp_path, ckpt, capsys):
    out = tmp_path / "results.tsv"
    assert main(_certify(out, "--resume", ckpt=ckpt)) == 0
    captured = capsys.readouterr()
    assert _notice(captured.err) == f"--resume: {out} does not exist yet; starting a new run"
    assert captured.out == f"certify: 4 images → {out}\n"


def test_a_resume_of_a_missing_file_from_python_warns(tmp_path):
    out = tmp_path / "results.tsv"
    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01)
    data = [(torch.zeros(4), 0), (torch.ones(4), 1)]
    with pytest.warns(UserWarning, match=rf"^resume=True: {out} does not exist yet; starting a new run$"):
        run_over_dataset(task, data, out, settings={}, indices=[0, 1], seed=0, resume=True, progress=False)
    assert len(out.read_text().splitlines()) == 3


def test_train_resume_of_a_folder_without_checkpoint_trains_from_epoch_0_and_says_so(tmp_path, tiny, capsys):
    run = tmp_path / "runs" / "x"
    assert main(["train", "tiny", "mlp", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--resume"]) == 0
    assert _notice(capsys.readouterr().err) == f"--resume: {run} holds no checkpoint (last.pt); training from epoch 0"
    assert (run / "last.pt").exists()


def test_train_resume_of_a_folder_without_checkpoint_warns_from_python(tmp_path, tiny):
    run = tmp_path / "x"
    config = TrainConfig(sigma=0.5, epochs=1, batch_size=8)
    with pytest.warns(UserWarning, match=rf"^resume=True: {run} holds no checkpoint \(last.pt\); training from "
                                         "epoch 0$"):
        train(_model(), tiny.dataset, config, run, resume=True)


def test_a_malformed_middle_row_names_its_line_and_deleting_it_recomputes_it(tmp_path, ckpt, capsys):
    out = tmp_path / "out.tsv"
    assert main(_certify(out, ckpt=ckpt)) == 0
    whole = out.read_text().splitlines()
    damaged = [*whole[:2], whole[2][:9], *whole[3:]]  # line 3 cut short
    out.write_text("\n".join(damaged) + "\n")
    capsys.readouterr()
    assert main(_certify(out, "--resume", ckpt=ckpt)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot resume {out}: line 3 is not a row of ") and err.count("\n") == 1
    assert "restore the file, or delete that line and rerun with --resume to recompute it" in err
    out.write_text("\n".join([*whole[:2], *whole[3:]]) + "\n")  # the damaged line deleted
    assert main(_certify(out, "--resume", ckpt=ckpt)) == 0
    assert capsys.readouterr().out == f"certify: 1 images computed now, 4 in the file → {out}\n"
    assert _without_time(out.read_text()) == _without_time("\n".join(whole) + "\n")  # recomputed, in its place


def test_a_cut_last_line_is_said_on_resume(tmp_path, ckpt, capsys):
    out = tmp_path / "out.tsv"
    assert main(_certify(out, ckpt=ckpt)) == 0
    whole = out.read_text()
    out.write_text(whole[:-7])  # the last row cut by an interruption
    capsys.readouterr()
    assert main(_certify(out, "--resume", ckpt=ckpt)) == 0
    captured = capsys.readouterr()
    assert _notice(captured.err) == f"resume: the last line of {out} was cut by an interruption and is recomputed"
    assert captured.out == f"certify: 1 images computed now, 4 in the file → {out}\n"
    assert _without_time(out.read_text()) == _without_time(whole)


def test_the_summary_of_a_resumed_shard_counts_both(tmp_path, ckpt, capsys):
    out = tmp_path / "out.tsv"
    assert main(_certify(out, "--shard", "0/2", ckpt=ckpt)) == 0
    shard = tmp_path / "out.tsv.shard-0-of-2"
    assert capsys.readouterr().out.startswith(f"certify: shard 0/2, 2 of 4 images → {shard};")
    shard.write_text("\n".join(shard.read_text().splitlines()[:2]) + "\n")
    assert main(_certify(out, "--shard", "0/2", "--resume", ckpt=ckpt)) == 0
    assert capsys.readouterr().out.startswith(
        f"certify: shard 0/2, 1 images computed now, 2 in the file (of 4) → {shard};")


def _without_time(text: str) -> list[list[str]]:
    header, *rows = text.splitlines()
    keep = [k for k, name in enumerate(header.split("\t")) if name != "time"]
    return [[row.split("\t")[k] for k in keep] for row in rows]
