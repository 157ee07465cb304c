"""splitz_fast.certify.attacks: the l2 attacks (ball and box kept, success on an easy linear model, argument checks), the
resumable `splitz attack` run, and the attack-based falsification of our certificates — certified inputs attacked
inside 0.99 × their radius must not flip beyond the rate α allows, while the same procedure against a radius inflated
×3 must find flips (so the check has teeth)."""
from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import binom
from torch import nn
from torch.utils.data import TensorDataset

import splitz_fast as sz
from splitz_fast.certify.attacks import (ATTACK_HEADER, ATTACKS, Attacker, deepfool_l2, falsify_certificates, fgsm_l2, pgd_l2,
                                         project_l2)
from splitz_fast.cli.main import main
from splitz_fast.runs.loop import run_over_dataset
from splitz_fast.runs.tasks import AttackRun


def _norms(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).norm(dim=1)


def _mlp(d: int, split: int, seed: int = 0) -> sz.SplitModel:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    return sz.split_sequential(net, split, num_classes=3, input_shape=(d,), threshold=1.0)


def _linear(w: torch.Tensor, b: float) -> sz.SplitModel:
    """Logits ``[w·x + b, −(w·x + b)]``: the decision boundary is the hyperplane ``w·x + b = 0``, for the base and
    (Gaussian noise being symmetric) for the smoothed classifier, at l2 distance ``|w·x + b| / ‖w‖`` from ``x``."""
    layer = nn.Linear(w.numel(), 2)
    with torch.no_grad():
        layer.weight.copy_(torch.stack([w, -w]))
        layer.bias.copy_(torch.tensor([b, -b]))
    return sz.split_sequential(nn.Sequential(layer), 0, num_classes=2, input_shape=(w.numel(),))


# ------------------------------------------------------------------------------------------------ geometry and attacks
def test_project_l2_scales_onto_the_ball_and_keeps_inside_points():
    delta = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out = project_l2(delta, torch.tensor([1.0, 1.0, 1.0]))
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8]))
    assert torch.equal(out[1:], delta[1:])  # inside the ball, and the zero vector: unchanged
    assert torch.allclose(_norms(project_l2(delta, 2.0)), torch.tensor([2.0, 0.5, 0.0]))


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("split", [0, 1])
def test_every_attack_stays_in_its_ball_and_box(attack, split):
    model = _mlp(6, split)
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(5, 6, generator=gen)
    y = torch.randint(0, 3, (5,), generator=gen)
    eps = torch.tensor([0.0, 0.1, 0.5, 1.0, 3.0])
    attacker = Attacker(sz.Smoother(model, 0.5), attack, steps=5, samples=8, random_start=True, clamp=(0.0, 1.0))
    x_adv = attacker.perturb(x, y, seeds=list(range(5)), eps=eps)
    assert x_adv.shape == x.shape and not x_adv.requires_grad
    assert (_norms(x_adv.double() - x.double()) <= eps.double()).all()  # exactly: measured in float64
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert torch.equal(x_adv[0], x[0])  # eps = 0 leaves the input where it is
    again = attacker.perturb(x, y, seeds=list(range(5)), eps=eps)
    assert torch.equal(again, x_adv)  # seeded: the same noise, the same point


@pytest.mark.parametrize("eps", [1e-4, 1e-3, 0.3])
def test_rounding_x_plus_delta_never_leaves_the_ball(eps):
    """x + δ is rounded to float32 entry by entry, which put ~1/3 of the points on the sphere just outside it (by up
    to 2.4e-7): every returned point must lie inside the ball the caller asked for, measured in float64."""
    torch.manual_seed(0)
    x = torch.randn(200, 2) * torch.tensor([2.0, 300.0])  # large entries: coarse float32 spacing
    y = torch.zeros(200, dtype=torch.long)
    fn = lambda z: torch.stack([z[:, 0], z[:, 1], -z.sum(1)], 1)  # noqa: E731
    for x_adv in (pgd_l2(fn, x, y, eps, steps=5), fgsm_l2(fn, x, y, eps), deepfool_l2(fn, x, eps, steps=5)):
        assert (_norms(x_adv.double() - x.double()) <= eps).all()


def test_attacks_flip_an_easy_linear_model_just_beyond_its_boundary_distance():
    w, b = torch.tensor([3.0, -4.0, 0.0, 12.0]), 0.5  # ‖w‖ = 13
    model = _linear(w, b)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, generator=gen)
    margin = x @ w + b
    distance = margin.abs() / w.norm()
    y = (margin < 0).long()  # class 0 where w·x + b > 0
    assert torch.equal(model(x).argmax(1), y)
    for attack in (lambda e: fgsm_l2(model, x, y, e), lambda e: pgd_l2(model, x, y, e, steps=10)):
        assert (model(attack(1.05 * distance)).argmax(1) != y).all()   # just past the boundary: every input flips
        assert (model(attack(0.95 * distance)).argmax(1) == y).all()   # short of it: none can
    unbounded = deepfool_l2(model, x, overshoot=0.02)
    assert (model(unbounded).argmax(1) != y).all()
    assert torch.allclose(_norms(unbounded - x), 1.02 * distance, rtol=1e-3, atol=1e-3)  # DeepFool is minimal here
    assert (_norms(deepfool_l2(model, x, 0.5 * distance) - x) <= 0.5 * distance + 1e-6).all()


def test_smoothed_attack_flips_the_smoothed_linear_classifier_and_predict_sees_it():
    w, b = torch.tensor([1.0, 0.0, 0.0]), 0.0
    model = _linear(w, b)
    x = torch.tensor([[0.6, 0.3, -1.0], [-0.9, 0.0, 2.0]])
    y = torch.tensor([0, 1])
    attacker = Attacker(sz.Smoother(model, 0.25), "smooth-pgd", eps=1.5, steps=10, samples=16, group=2)
    results = list(attacker.attack_many(zip(x, y.tolist()), n=1000, alpha=0.001, seeds=[0, 1], keep_adversarial=True))
    assert [r.clean_prediction for r in results] == [0, 1]
    assert [r.adversarial_prediction for r in results] == [1, 0] and all(r.success for r in results)
    for r, x0 in zip(results, x):
        assert r.delta_norm <= 1.5 * (1 + 1e-6) and torch.allclose(torch.tensor(r.delta_norm), (r.x_adv - x0).norm())
    short = Attacker(sz.Smoother(model, 0.25), "smooth-fgsm", eps=0.3, samples=16)
    assert [r.adversarial_prediction for r in short.attack_many(zip(x, y.tolist()), 1000, 0.001, seeds=[0, 1])] == [0, 1]


def test_rows_do_not_depend_on_how_inputs_are_grouped():
    model = _mlp(6, 1)
    gen = torch.Generator().manual_seed(3)
    pairs = [(torch.rand(6, generator=gen), i % 3) for i in range(5)]

    def rows(group):
        attacker = Attacker(sz.Smoother(model, 0.5), "smooth-pgd", eps=0.7, steps=3, samples=8, group=group)
        return [(r.clean_prediction, r.adversarial_prediction, f"{r.delta_norm:.6g}")  # as the TSV writes it
                for r in attacker.attack_many(pairs, 200, 0.01, seeds=range(10, 15))]

    assert rows(1) == rows(3)


def test_arguments_are_checked_with_messages_that_say_what_to_fix():
    model = _mlp(4, 1)
    smoother = sz.Smoother(model, 0.5)
    x, y = torch.rand(2, 4), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="attack must be one of"):
        Attacker(smoother, "carlini")
    with pytest.raises(TypeError, match="splitz_fast.Smoother"):
        Attacker(model, "pgd")
    with pytest.raises(ValueError, match="evaluate must be"):
        Attacker(smoother, evaluate="both")
    with pytest.raises(ValueError, match="clamp must be"):
        Attacker(smoother, clamp=(1.0, 0.0))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        Attacker(smoother, steps=0)
    attacker = Attacker(smoother, "pgd", clamp=(0.0, 1.0))
    for eps in (-0.1, float("nan"), torch.tensor([0.1, 0.2, 0.3])):
        with pytest.raises(ValueError, match="eps must be"):
            attacker.perturb(x, y, [0, 1], eps=eps)
    with pytest.raises(ValueError, match="int64"):
        attacker.perturb(x, y.float(), [0, 1])
    with pytest.raises(ValueError, match="one seed per example"):
        attacker.perturb(x, y, [0])
    with pytest.raises(ValueError, match="outside the clamp box"):
        attacker.perturb(x + 2, y, [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        attacker.perturb(torch.full((2, 4), float("nan")), y, [0, 1])
    with pytest.raises(ValueError, match="alpha"):
        next(attacker.attack_many([(x[0], 0)], 100, 1.5))
    with pytest.raises(ValueError, match="certificates"):
        falsify_certificates(attacker, x, [])


# ------------------------------------------------------------------------------------------------ runs and the CLI
def test_attack_run_resumes_to_the_rows_of_an_uninterrupted_one(tmp_path):
    gen = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.rand(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen))
    attacker = Attacker(sz.Smoother(_mlp(6, 1), 0.5), "smooth-pgd", eps=0.5, steps=3, samples=8, group=2)
    kwargs = dict(settings={"dataset": "t", **attacker.settings()}, indices=list(range(0, 12, 2)), seed=7,
                  progress=False)
    task = AttackRun(attacker, 200, 0.01)
    whole = run_over_dataset(task, data, tmp_path / "whole.tsv", **kwargs)
    part = run_over_dataset(task, data, tmp_path / "part.tsv", stop_after=3, **kwargs)
    run_over_dataset(task, data, part, resume=True, **kwargs)
    drop_time = lambda p: [line.rsplit("\t", 1)[0] for line in p.read_text().splitlines()]  # noqa: E731
    assert drop_time(part) == drop_time(whole)
    lines = whole.read_text().splitlines()
    assert lines[0] == ATTACK_HEADER and len(lines) == 7
    assert json.loads((tmp_path / "whole.tsv.json").read_text())["attack"] == "smooth-pgd"
    with pytest.raises(ValueError, match="different settings"):
        other = Attacker(attacker.smoother, "smooth-pgd", eps=0.6, steps=3, samples=8)
        run_over_dataset(AttackRun(other, 200, 0.01), data, whole, resume=True,
                         **dict(kwargs, settings={"dataset": "t", **other.settings()}))


def test_attack_command_writes_resumable_rows_shards_and_refuses_bad_options(tmp_path, capsys, monkeypatch, tiny):
    run = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--val-fraction", "0.25", "--lr-schedule", "none"]) == 0
    out = tmp_path / "attack.tsv"
    args = ["attack", "tiny", str(run / "best.pt"), "0.5", str(out), "--eps", "0.5", "--steps", "3", "--samples", "8",
            "--N", "100", "--skip", "10"]
    assert main(args) == 0
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert rows[0] == ATTACK_HEADER.split("\t") and [r[0] for r in rows[1:]] == ["0", "10", "20", "30"]
    assert all(float(r[5]) <= 0.5 * (1 + 1e-5) and r[4] == "0.5" for r in rows[1:])
    assert main(args + ["--resume"]) == 0 and len(out.read_text().splitlines()) == 5
    drop_time = lambda p: [line.rsplit("\t", 1)[0] for line in p.read_text().splitlines()]  # noqa: E731
    # Ctrl-C: one line saying where it stopped and the command that resumes it, which completes the same rows.
    part = tmp_path / "part.tsv"
    part_args = args[:4] + [str(part)] + args[5:] + ["--group", "1"]
    original, calls = Attacker._attack_group, []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(Attacker, "_attack_group", interrupted)
    capsys.readouterr()
    assert main(part_args) == 130
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"interrupted: 2 rows in {part}; to continue, run: splitz ") and err.endswith(" --resume")
    monkeypatch.setattr(Attacker, "_attack_group", original)
    assert main(part_args + ["--resume"]) == 0 and drop_time(part) == drop_time(out)
    # Shards (--shard K/N, then `splitz merge`) give the rows of the whole run.
    merged = tmp_path / "merged.tsv"
    for k in ("0/2", "1/2"):
        assert main(args[:4] + [str(merged)] + args[5:] + ["--shard", k]) == 0
    assert main(["merge", str(merged)]) == 0 and drop_time(merged) == drop_time(out)
    capsys.readouterr()
    for bad, message in ((["--eps", "-1"], "--eps must be"), (["--clamp", "1", "0"], "--clamp must be"),
                         (["--samples", "0"], "--samples must be")):
        assert main(args[:4] + [str(tmp_path / "bad.tsv")] + args[5:] + bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
        assert not (tmp_path / "bad.tsv").exists()


# ------------------------------------------------------------------------------------------------ falsification
SIGMA, N0, N, ALPHA = 0.5, 100, 2000, 0.001
N_PREDICT, ALPHA_PREDICT = 1000, 0.001


def _blobs(m: int, gen: torch.Generator, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Two Gaussian blobs at ±e₁ (spread 0.6): most points sit about 0.3–1.5 from the boundary x₁ = 0, so certified
    radii are moderate and three of them reach well into the other class."""
    y = torch.randint(0, 2, (m,), generator=gen)
    x = 0.6 * torch.randn(m, d, generator=gen)
    x[:, 0] += 2.0 * y - 1.0
    return x, y


@pytest.fixture(scope="module", params=[0, 1], ids=["RS-s0", "SPLITZ-s1"])
def certified(request):
    """A small MLP trained here (Gaussian noise in the latent of f_L, as the smoothed classifier sees it; < 1 s),
    split at 0 (plain RS) or 1 (SPLITZ), and the CERTIFY results of 30 fresh test points."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = _blobs(1024, gen)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    model = sz.split_sequential(net, request.param, num_classes=2, input_shape=(8,), threshold=1.0)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(300):
        latent = model.left(x)
        loss = nn.functional.cross_entropy(model.right(latent + SIGMA * torch.randn_like(latent)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    smoother = sz.Smoother(model, SIGMA)
    x_test, _ = _blobs(30, gen)
    certificates = list(smoother.certify_many(x_test, N0, N, ALPHA, seeds=range(30)))
    return smoother, x_test, certificates


def _falsify(certified, scale):
    smoother, x_test, certificates = certified
    attacker = Attacker(smoother, "smooth-pgd", steps=20, samples=64, random_start=True, group=30)
    return falsify_certificates(attacker, x_test, certificates, scale=scale, n=N_PREDICT, alpha=ALPHA_PREDICT,
                                seeds=list(range(100, 130)))


def _allowed_flips(rows) -> int:
    """Flips a sound certificate exceeds with probability ≤ 1e-6: each row flips with probability at most its
    certificate's failure probability plus PREDICT's α at the attacked point."""
    p = max(r.failure_prob for r in rows) + ALPHA_PREDICT
    return int(binom.isf(1e-6, len(rows), p))


def test_no_certified_prediction_flips_inside_its_radius(certified):
    rows = _falsify(certified, 0.99)
    assert len(rows) >= 20  # most of the 30 points are certified
    assert all(r.delta_norm <= r.eps * (1 + 1e-5) for r in rows)
    flips = [r for r in rows if r.flipped]
    assert len(flips) <= _allowed_flips(rows), [(r.radius, r.delta_norm) for r in flips]


def test_the_same_attack_finds_flips_against_an_inflated_radius(certified):
    """The teeth: a certificate reporting 3× its radius is wrong for many inputs, and this procedure must say so."""
    rows = _falsify(certified, 3.0)
    flips = [r for r in rows if r.flipped]
    assert len(flips) > _allowed_flips(rows) and len(flips) >= len(rows) // 3, (len(flips), len(rows))
    assert all(r.delta_norm > r.radius for r in flips)  # a flip inside the true radius would be a soundness bug
