"""Data-parallel training (`torchrun ... -m splitz_fast train`, splitz_fast.training.parallel.DataParallelGroup) on
the CPU with gloo: two ranks sharing a global batch must take the step one process takes on it (the gradients, the parameters
and the power-iteration warm starts), a torchrun run must write the single-process run's checkpoints, and the
device-resident data must come in the order DataLoader(shuffle=True) gave."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from _helpers import TORCHRUN, finish_torchrun, installed, start_torchrun
from splitz_fast.kernels import BACKEND_ENV
from splitz_fast.zoo.models import build_model
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.batches import epoch_order
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loop import train, training_step
from splitz_fast.training.parallel import SINGLE_PROCESS, DataParallelGroup


# ------------------------------------------------------------------------------------------------ data order
@pytest.mark.parametrize("size,batch", [(1, 4), (30, 8), (1000, 64), (4097, 512)])
def test_epoch_order_is_the_shuffling_dataloaders_order(size, batch):
    for seed in (0, 7, 100_003 * 5 + 3):
        loader = DataLoader(TensorDataset(torch.arange(size)), batch_size=batch, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        visited = torch.cat([b for (b,) in loader])
        assert torch.equal(epoch_order(size, torch.Generator().manual_seed(seed)), visited)


# ------------------------------------------------------------------------------------------------ rank chunks
def test_rank_chunks_tile_the_global_batch_in_rank_order():
    for world in (1, 2, 3, 4):
        for batch in range(world, 13):
            chunks = [DataParallelGroup(rank, world).rows(batch) for rank in range(world)]
            assert chunks[0].start == 0 and chunks[-1].stop == batch
            assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
            assert max(c.count for c in chunks) - min(c.count for c in chunks) <= 1 and min(c.count for c in chunks)
            assert sum(c.share for c in chunks) == pytest.approx(1.0) and all(c.total == batch for c in chunks)
    assert SINGLE_PROCESS.rows(5).share == 1.0


def test_more_ranks_than_rows_of_a_batch_are_refused_before_any_work(tmp_path, tiny):
    """40 rows, a quarter held out: 30 training rows (batches of 8: the last has 6) and 10 validation rows (8, 2)."""
    config = TrainConfig(sigma=0.5, epochs=1, batch_size=8, val_fraction=0.25)
    model = build_model("mlp", in_features=4, num_classes=2)
    with pytest.raises(ValueError, match="4 ranks but the smallest validation batch has 2 rows") as err:
        train(model, tiny.dataset, config, tmp_path / "run", data_parallel=DataParallelGroup(0, 4))
    assert "\n" not in str(err.value)
    config.batch_size = 3
    with pytest.raises(ValueError, match="4 ranks but the smallest training batch has 3 rows"):
        train(model, tiny.dataset, config, tmp_path / "run", data_parallel=DataParallelGroup(0, 4))
    config.batch_size, config.max_batches = 8, 1  # only full batches run: 2 ranks fit, with or without the cap
    with pytest.raises(ValueError, match="needs the job's process group"):
        train(model, tiny.dataset, config, tmp_path / "run", data_parallel=DataParallelGroup(0, 2))
    with pytest.raises(ValueError, match="BatchNorm"):
        train(build_model("cifar_resnet20", split_index=1), tiny.dataset, config, tmp_path / "run",
              data_parallel=DataParallelGroup(0, 2))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ one step, 2 ranks
# (model, split index, SPLITZ_BACKEND, Lipschitz objective): the Philox training noise with the native kernels where
# they are built ("auto"), torch.randn noise and the reference power iteration ("reference"); the batch-mean hinge
# and the Lagrangian read the global batch's mean estimate (an all-reduce before the backward pass).
CASES = [("mlp", 0, "auto", "per-sample-hinge"), ("mlp", 1, "auto", "per-sample-hinge"),
         ("lenet", 1, "auto", "per-sample-hinge"), ("lenet", 1, "reference", "per-sample-hinge"),
         ("mlp", 1, "auto", "batch-mean-hinge"), ("mlp", 1, "auto", "lagrangian"),
         ("mlp", 1, "auto", "per-sample-hinge+radius"), ("lenet", 1, "auto", "per-sample-hinge+radius")]
GLOBAL_BATCH = 9  # two ranks: chunks of 4 and 5 rows, so the share weighting matters


def _two_steps(case, group: DataParallelGroup) -> dict:
    """Two SGD steps of `training_step` on this rank's chunk of two fixed global batches (the second starts from the
    first's power-iteration warm starts); the gradients and parameters after each, and the warm starts."""
    name, split, backend, objective = case
    objective, _, extra = objective.partition("+")  # "+radius": the radius term too, at its full weight
    os.environ[BACKEND_ENV] = backend
    torch.manual_seed(1)
    if name == "mlp":
        model = build_model("mlp", in_features=4, num_classes=2, split_index=split, learnable_threshold=True)
        x, y = torch.randn(2, GLOBAL_BATCH, 4), torch.randint(0, 2, (2, GLOBAL_BATCH))
    else:
        model = build_model("lenet", split_index=split, learnable_threshold=True)
        x, y = torch.rand(2, GLOBAL_BATCH, 1, 28, 28), torch.randint(0, 10, (2, GLOBAL_BATCH))
    config = TrainConfig(sigma=0.5, noise_samples=2, power_iters=3, lambda_start=0.8, optimizer="sgd", lr=0.05,
                         lip_objective=objective, theta_lip=0.05,
                         radius_weight=0.5 if extra == "radius" else 0.0, radius_target=1.0, radius_ramp_fraction=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    state, generator = group.power_iteration_state(), torch.Generator().manual_seed(5)
    rows = group.rows(GLOBAL_BATCH)
    steps = []
    for step in range(2):
        loss, parts = training_step(model, x[step, rows.start:rows.stop], y[step, rows.start:rows.stop], rows, config,
                                    0.8, state, generator, optimizer, group)
        steps.append({"grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
                      "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                      "loss": float(loss.detach()), "ce": parts["ce"], "lip": parts.get("lip", 0.0),
                      "radius": parts.get("radius", 0.0)})
    return {"steps": steps, "power_vectors": [v.clone() for v in state.vectors]}


def _rank_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {case: _two_steps(case, DataParallelGroup(rank, world)) for case in CASES}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_steps(tmp_path_factory):
    """Every case's two steps on two gloo ranks, spawned once (a few seconds of process start-up, on 2 cores)."""
    out = tmp_path_factory.mktemp("ranks")
    context = mp.start_processes(_rank_worker, args=(2, str(out / "rendezvous"), str(out)), nprocs=2, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join(timeout=120)
    alive = [p for p in context.processes if p.is_alive()]
    for process in alive:
        process.kill()
    assert not alive and all(p.exitcode == 0 for p in context.processes), "a rank failed or hung (see its stderr)"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_two_ranks_take_the_single_process_step_on_the_same_global_batch(case, two_rank_steps, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, case[2])
    single = _two_steps(case, SINGLE_PROCESS)
    ranks = [results[case] for results in two_rank_steps]
    for step, expected in enumerate(single["steps"]):
        for rank, got in enumerate(r["steps"][step] for r in ranks):
            assert got["grads"].keys() == expected["grads"].keys()
            for what in ("grads", "params"):
                for key, value in expected[what].items():
                    torch.testing.assert_close(got[what][key], value, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"step {step}, rank {rank}, {what} {key}: {m}")
        # Each rank's loss parts are its share of the global batch's.
        assert (expected["radius"] > 0) == case[3].endswith("+radius")
        for part in ("loss", "ce", "lip", "radius"):
            assert sum(r["steps"][step][part] for r in ranks) == pytest.approx(expected[part], rel=1e-5, abs=1e-7)
    for got in ranks:
        assert len(got["power_vectors"]) == len(single["power_vectors"]) == (case[1] > 0)
        for v, expected in zip(got["power_vectors"], single["power_vectors"]):
            torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ teardown
GLOO_TEARDOWN_SCRIPT = """
import json, os, sys, torch.distributed as dist
from splitz_fast.runs.torchrun import TorchrunEnv, process_group
env = TorchrunEnv.from_environ()
with process_group(env, "cpu"):
    dist.barrier()
    import torch._dynamo  # what the optimizer's first step imports, inside the group
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(os.path.join(sys.argv[1], f"threads-{env.rank}.json"), "w") as fh:
    json.dump(threads, fh)
"""


@pytest.mark.slow  # one torchrun launch, ~10 s
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"needs torchrun beside {sys.executable}")
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_process_group_leaves_no_gloo_thread_behind(tmp_path):
    """After `process_group` the gloo worker threads are gone, even when a module that binds `group.WORLD` as a default
    argument is imported inside it. (They outlived the group before, and one freeing a finished collective's tensors
    during interpreter shutdown aborted a successful run: SIGABRT, 'terminate called without an active exception'.)"""
    script = tmp_path / "teardown.py"
    script.write_text(GLOO_TEARDOWN_SCRIPT)
    code, log = finish_torchrun(start_torchrun([str(tmp_path)], program=(str(script),)), 120)
    assert code == 0, log[-3000:]
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"threads-{rank}.json").read_text())
        assert threads and not any("gloo" in name for name in threads), (rank, threads)


# ------------------------------------------------------------------------------------------------ torchrun train
@pytest.mark.slow  # two torchrun launches, ~30 s on 2 loaded CPU cores
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"needs torchrun beside {sys.executable}")
@pytest.mark.skipif(not installed("virny"), reason="needs `pip install --no-deps virny==0.6.0` (Law School data)")
def test_torchrun_training_writes_the_single_process_checkpoints_and_resumes(tmp_path):
    """SPLITZ MLP on Law School (split 1, λ > 0, learnable thresholds), 2 epochs of 3 batches of 63 (unequal rank
    chunks): the torchrun run's last.pt / best.pt hold the single-process weights; a run stopped after one
    epoch and continued with `--resume` under torchrun ends there too."""
    from splitz_fast.data.datasets import get_dataset

    options = ["--sigma", "0.5", "--epochs", "2", "--batch", "63", "--max-batches", "3", "--val-fraction", "0.00655",
               "--lr-schedule", "none", "--learnable-threshold", "--seed", "3"]
    # The same run through the API (`splitz train` with these options; --resume refuses any other config or spec).
    config = TrainConfig(sigma=0.5, epochs=2, batch_size=63, max_batches=3, val_fraction=0.00655, lr_schedule="none",
                         seed=3)
    info = get_dataset("law_school", "train")
    kwargs = {"split_index": 1, "threshold": 1.0, "learnable_threshold": True, "in_features": info.input_shape[0],
              "num_classes": info.num_classes}
    spec = {"name": "mlp", "kwargs": kwargs, "dataset": "law_school"}
    # 109 validation rows: batches of 63 and 46 rows, chunks of 31/32 and 23/23; training chunks 31/32.
    assert round(len(info.dataset) * config.val_fraction) == 109

    def single_process(out, **stop):
        torch.manual_seed(config.seed)  # as `splitz train` seeds the initial weights
        return train(build_model("mlp", **kwargs), info.dataset, config, out, model_spec=spec, **stop)

    single_process(tmp_path / "single")
    code, log = finish_torchrun(start_torchrun(["train", "law_school", "mlp", str(tmp_path / "ranks"), *options]), 240)
    assert code == 0 and "on 2 ranks" in log, log[-3000:]
    assert log.count("epoch 1 of 0-1: loss") == 1  # rank 0 alone prints
    single_process(tmp_path / "resumed", stop_after_epochs=1)
    code, log = finish_torchrun(start_torchrun(["train", "law_school", "mlp", str(tmp_path / "resumed"), *options,
                                                "--resume"]), 240)
    assert code == 0, log[-3000:]
    expected = {name: load_checkpoint_file(tmp_path / "single" / name) for name in ("last.pt", "best.pt")}
    for run in ("ranks", "resumed"):
        assert len((tmp_path / run / "train.log").read_text().splitlines()) == 2
        for name, want in expected.items():
            got = load_checkpoint_file(tmp_path / run / name)
            assert (got["epoch"], got["best_epoch"], got["config"]) == (want["epoch"], want["best_epoch"],
                                                                        want["config"])
            for key, value in want["model"].items():
                torch.testing.assert_close(got["model"][key], value, rtol=1e-5, atol=1e-6, msg=f"{run} {name} {key}")
            for v, w in zip(got["power_vectors"], want["power_vectors"], strict=True):
                torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6)
            for record, wanted in zip(got["history"], want["history"], strict=True):
                assert record == pytest.approx(wanted, rel=1e-5), json.dumps([record, wanted])
