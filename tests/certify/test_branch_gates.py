"""The branch certificate of scripts/branch_gates_mnist.py: its 1-Lipschitz gates are 1-Lipschitz (spectral norms and
sampled pairs), and on a 2-D toy the composed classifier is constant on every ball where the certificate says so —
checked over a dense grid of each ball, with the RS part a constant classifier of known radius."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "branch_gates_mnist", Path(__file__).resolve().parents[2] / "scripts" / "branch_gates_mnist.py")
branch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(branch)

RS_CLASS, RS_RADIUS, OUTSIDE_RS_BALL = 1, 0.6, 2  # RS answers 1 on B(x, 0.6) and, adversarially, 2 beyond it


def test_every_gate_output_is_1_lipschitz_by_construction_and_on_sampled_pairs():
    torch.manual_seed(0)
    gates = branch.GateNetwork(784, 64, 2, 10)
    norms = [torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2) for layer in gates.layers]
    rows = gates.head_weight().detach().double().norm(dim=1)
    assert all(float(n) <= 1 + 1e-5 for n in norms) and bool((rows <= 1 + 1e-5).all())
    assert bool((gates.lipschitz_upper_bounds() <= 1 + 1e-5).all())
    x = torch.rand(256, 784)
    step = torch.randn(256, 784) * torch.rand(256, 1)
    with torch.no_grad():
        change = (gates(x + step) - gates(x)).abs()
    assert bool((change <= step.norm(dim=1, keepdim=True) * (1 + 1e-4) + 1e-5).all())
    assert float((change / step.norm(dim=1, keepdim=True)).max()) > 0.05  # the check is not vacuous


def test_training_keeps_the_bound():
    x, y = torch.rand(64, 1, 4, 4), torch.arange(64) % 3
    gates = branch.train_gates(x, y, epochs=3, batch=16, hidden=8, depth=2)
    assert bool((gates.lipschitz_upper_bounds() <= 1 + 1e-5).all())


def test_branch_certificate_on_hand_written_scores():
    label = torch.tensor([0])
    pinned = branch.branch_certificate(torch.tensor([[3.0, -3.0, -2.5]]), label, 2.0)
    assert bool(pinned.only_label) and not bool(pinned.wrong_one_hot)
    # bit 0 may switch off (1 ≤ 2), bit 2 may switch on: the code (0, 0, 1) is reachable
    risky = branch.branch_certificate(torch.tensor([[1.0, -3.0, -0.5]]), label, 2.0)
    assert not bool(risky.only_label) and bool(risky.wrong_one_hot)
    # bit 1 is certainly on and bit 0 may be on: (1, 1, 0) and (0, 1, 0) reachable, the latter a wrong class
    assert bool(branch.branch_certificate(torch.tensor([[1.0, 2.5, -3.0]]), label, 2.0).wrong_one_hot)
    # the label's bit may switch off but no other can switch on: only non-one-hot codes besides the label's
    fallback = branch.branch_certificate(torch.tensor([[1.0, -3.0, -3.0]]), label, 2.0)
    assert not bool(fallback.only_label) and not bool(fallback.wrong_one_hot)
    rs_wrong, radius = torch.tensor([False]), torch.tensor([5.0])
    assert not bool(branch.composed_certified(fallback, rs_wrong, radius, 2.0))
    assert bool(branch.composed_certified(fallback, torch.tensor([True]), radius, 2.0))
    assert not bool(branch.composed_certified(fallback, torch.tensor([True]), torch.tensor([1.9]), 2.0))
    assert bool(branch.composed_certified(pinned, rs_wrong, radius, 2.0))


def ball_grid(center: torch.Tensor, radius: float, rings: int = 40, angles: int = 160) -> torch.Tensor:
    r = torch.linspace(0, radius, rings).repeat_interleave(angles)
    t = torch.linspace(0, 2 * math.pi, angles + 1)[:-1].repeat(rings)
    return center + torch.stack([r * torch.cos(t), r * torch.sin(t)], 1)


def violations(certify) -> int:
    """Balls certified by ``certify`` on which the composed toy classifier takes a value other than the label."""
    torch.manual_seed(3)
    gates = branch.GateNetwork(2, 4, 1, 3)
    with torch.no_grad():
        gates.head_bias.copy_(torch.tensor([0.2, -0.1, 0.0]))
    wrong, checked = 0, 0
    centers = ball_grid(torch.zeros(2), 2.0, rings=8, angles=12)
    for center in centers:
        for eps in (0.1, 0.3, 0.6, 1.0):
            with torch.no_grad():
                score = gates(center[None])
            for label in range(3):
                label_t = torch.tensor([label])
                ok = branch.composed_certified(certify(score, label_t, eps), label_t == RS_CLASS,
                                               torch.tensor([RS_RADIUS]), eps)
                if not bool(ok):
                    continue
                checked += 1
                points = ball_grid(center, eps)
                inside_rs = (points - center).norm(dim=1) <= RS_RADIUS * (1 + 1e-5)  # the grid's last ring rounds
                rs = torch.where(inside_rs, RS_CLASS, OUTSIDE_RS_BALL)
                with torch.no_grad():
                    answers = branch.composed_prediction(gates(points), rs)
                wrong += int(bool((answers != label).any()))
    assert checked > 20  # enough certified balls, with gates pinned and with the RS fallback
    return wrong


def test_the_composed_toy_classifier_is_constant_wherever_certified():
    assert violations(branch.branch_certificate) == 0


def test_the_dense_check_catches_a_certificate_that_assumes_too_small_a_lipschitz_constant():
    assert violations(lambda s, y, eps: branch.branch_certificate(s, y, eps, 0.2)) > 0


def test_the_rule_needs_the_gain_at_2_and_no_loss_beyond_2_points():
    def table(rs, composed):
        return [{"eps": e, "rs": r, "composed": c} for e, r, c in zip(branch.EPSILONS, rs, composed)]
    rs = [90, 88, 85, 80, 75, 60, 45, 35, 25]
    assert branch.passes_rule(table(rs, [r - 2 for r in rs[:-1]] + [32]))
    assert not branch.passes_rule(table(rs, [r - 2 for r in rs[:-1]] + [31.5]))
    assert not branch.passes_rule(table(rs, [rs[0] - 2.5] + rs[1:-1] + [40]))
