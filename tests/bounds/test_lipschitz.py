"""Soundness of the Lipschitz bounds: dense float64 SVD oracles, sampled pairs in the ball, the paper's toy example.

The oracle never uses the library's operators: each layer's Jacobian comes from autograd on a float64 copy of the
real modules (standardization included), so the folding of ``1/sd``, padding, stride and masks are all checked.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.bounds.certificate import certified_lambda_max_many
from splitz_fast.bounds.eigen import lanczos_top_eigenvalue, squaring_top_eigenvalue
from splitz_fast.bounds.lipschitz import masked_operators, probabilistic_norm_bound
from splitz_fast.bounds.gram import factor_gram
from splitz_fast.bounds.operators import MaskedAffine


def _clipped(shape, low=0.2, high=1.5, gen=None):
    """A ClippedReLU with random per-element / per-channel / scalar thresholds."""
    act = sz.ClippedReLU(1.0, shape=shape)
    act.threshold.copy_(low + (high - low) * torch.rand(shape, generator=gen))
    return act


def build_left(name: str, seed: int = 0) -> sz.LeftHalf:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "conv-stride-pad-std-elementwise":
        conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        return sz.LeftHalf([conv], [_clipped((3, 4, 4), gen=gen)],
                           standardize=sz.Standardize([0.3, 0.6], [0.2, 0.5]), input_shape=(2, 7, 7))
    if name == "conv-conv-linear":
        c1 = nn.Conv2d(1, 3, 3, padding=1)
        c2 = nn.Conv2d(3, 2, 2, stride=2)
        fc = nn.Linear(2 * 3 * 3, 5)
        return sz.LeftHalf([c1, c2, fc], [_clipped((3,), gen=gen), _clipped((), gen=gen), _clipped((5,), gen=gen)],
                           standardize=sz.Standardize([0.5], [0.3]), input_shape=(1, 6, 6))
    if name == "conv-dilated-asym":
        conv = nn.Conv2d(2, 4, (3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1))
        return sz.LeftHalf([conv], [_clipped((4,), gen=gen)], input_shape=(2, 5, 6))
    if name == "mlp-std-last-linear":
        l1, l2, l3 = nn.Linear(6, 8), nn.Linear(8, 7), nn.Linear(7, 3)
        return sz.LeftHalf([l1, l2, l3], [_clipped((8,), gen=gen), _clipped((), gen=gen), None],
                           standardize=sz.Standardize(torch.rand(6).tolist(), (0.5 + torch.rand(6)).tolist()),
                           input_shape=(6,))
    raise KeyError(name)


CONFIGS = ["conv-stride-pad-std-elementwise", "conv-conv-linear", "conv-dilated-asym", "mlp-std-last-linear"]
GAMMAS = [0.0, 0.05, 0.3, 2.0]


def layer_jacobians(left: sz.LeftHalf, x: torch.Tensor) -> list[torch.Tensor]:
    """Dense float64 Jacobians of each affine layer's pre-activation w.r.t. that layer's input (layer 1 w.r.t. the raw
    input, standardization included), at the point ``x`` — affine maps, so the point does not matter."""
    left64 = copy.deepcopy(left).double()
    h = x.double().unsqueeze(0)
    jacs = []
    for k, (layer, act) in enumerate(zip(left64.layers, left64.activations)):
        def pre(inp, layer=layer, k=k):
            if k == 0 and left64.standardize is not None:
                inp = left64.standardize(inp)
            return layer(left64.layer_input(layer, inp))

        j = torch.autograd.functional.jacobian(pre, h)
        jacs.append(j.reshape(pre(h).numel(), h.numel()))
        with torch.no_grad():
            h = act(pre(h))
    return jacs


def oracle(left: sz.LeftHalf, x: torch.Tensor, gamma: float):
    """(Π_k ‖I_k J_k I_{k−1}‖ by dense SVD, ‖masked Jacobian product‖ by dense SVD)."""
    bounds = sz.ball_bounds(left, x.unsqueeze(0), gamma)
    jacs = layer_jacobians(left, x)
    product_of_norms = 1.0
    chain = None
    prev_mask = None
    for k, j in enumerate(jacs):
        m_out = bounds.masks[k][0].flatten().double()
        a = m_out[:, None] * j
        if prev_mask is not None:
            a = a * prev_mask[None, :]
        product_of_norms *= float(torch.linalg.matrix_norm(a, ord=2))
        chain = a if chain is None else a @ chain
        prev_mask = m_out
    return product_of_norms, float(torch.linalg.matrix_norm(chain, ord=2))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_exact_certificate_matches_dense_svd(name, gamma):
    left = build_left(name)
    x = torch.rand(3, *left.input_shape, generator=torch.Generator().manual_seed(1))
    bound = sz.lipschitz_bound(left, x, gamma, method="exact")
    assert bound.kind == ["exact"] * 3 and bound.failure_prob == [0.0] * 3
    for b in range(3):
        product_of_norms, jacobian_norm = oracle(left, x[b], gamma)
        value = float(bound.value[b])
        assert value >= product_of_norms >= jacobian_norm * (1 - 1e-12)
        # Deterministic and tight: only floating-point slack above the exact product of norms.
        assert value <= product_of_norms * (1 + 1e-6) + 1e-12


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "conv-stride-pad-std-elementwise" else n
                                  for n in CONFIGS])  # that one: ~25 s on 2 CPU cores
def test_probabilistic_certificate_upper_bounds_dense_svd(name):
    left = build_left(name)
    x = torch.rand(4, *left.input_shape, generator=torch.Generator().manual_seed(2))
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        bound = sz.lipschitz_bound(left, x, 0.3, method="probabilistic", delta=1e-6, power_iters=128, generator=gen)
        assert bound.kind == ["probabilistic"] * 4
        assert bound.failure_prob == [pytest.approx(1e-6 * left.depth)] * 4
        for b in range(4):
            product_of_norms, _ = oracle(left, x[b], 0.3)
            value = float(bound.value[b])
            assert value >= product_of_norms
            # Not vacuous: slack about (1/δ)^{1/2k} per factor, plus the start vector's luck.
            assert value <= product_of_norms * 1.25 ** left.depth + 1e-9


def test_probabilistic_failure_rate_is_at_most_delta():
    """On a rank-one operator the bound is exactly as tight as its proof (‖Gᵏb‖ = λᵏ|⟨b, e₁⟩|), so its failure rate
    over many independent random starts is P(|Z| < δ√(π/2)), just below δ. Measured, it must stay ≤ δ (plus sampling
    error) — and come close to δ, so a wrong constant in the bound would show."""
    layer = nn.Linear(50, 50, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[0, 0] = 1.0  # ‖A‖ = 1
    runs = 20000
    for delta in (0.3, 0.05):
        op = MaskedAffine(layer, (50,), out_mask=None, in_mask=None, in_scale=None, batch=runs)
        bounds = probabilistic_norm_bound(op, power_iters=3, delta=delta, generator=torch.Generator().manual_seed(0))
        failure_rate = float((bounds < 1.0).double().mean())
        sd = math.sqrt(delta * (1 - delta) / runs)
        assert failure_rate <= delta + 4 * sd
        expected = math.erf(delta * math.sqrt(math.pi / 2) / math.sqrt(2))  # P(|Z| < t)
        assert failure_rate == pytest.approx(expected, abs=4 * sd)


@pytest.mark.parametrize("name", CONFIGS)
def test_sampled_pairs_in_ball(name):
    """‖f_L(x') − f_L(x'')‖ ≤ L(x, γ)‖x' − x''‖ and every pre-activation within its bounds, for x', x'' in B(x, γ)."""
    left = build_left(name).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(1, *left.input_shape, generator=gen, dtype=torch.float64)
    for gamma in (0.05, 0.5):
        bound = float(sz.lipschitz_bound(left, x, gamma).value[0])
        bounds = sz.ball_bounds(left, x, gamma)
        directions = torch.randn(2000, *left.input_shape, generator=gen, dtype=torch.float64)
        norms = directions.flatten(1).norm(dim=1).view(-1, *([1] * len(left.input_shape)))
        scales = gamma * torch.rand(2000, generator=gen, dtype=torch.float64) ** 0.25
        scales[:500] = gamma  # on the sphere, where bounds are attained
        points = x + directions / norms * scales.view(-1, *([1] * len(left.input_shape)))
        with torch.no_grad():
            h = left.standardize(points) if left.standardize is not None else points
            for k, (layer, act) in enumerate(zip(left.layers, left.activations)):
                z = layer(left.layer_input(layer, h))
                assert (z >= bounds.lower[k] - 1e-12).all() and (z <= bounds.upper[k] + 1e-12).all()
                h = act(z)
            out = left(points).flatten(1)
            center = left(x).flatten(1)
        ratios = (out - center).norm(dim=1) / (points - x).flatten(1).norm(dim=1)
        pair_ratios = (out[::2] - out[1::2]).norm(dim=1) / (points[::2] - points[1::2]).flatten(1).norm(dim=1)
        assert float(ratios.max()) <= bound * (1 + 1e-9)
        assert float(pair_ratios.max()) <= bound * (1 + 1e-9)


def test_first_layer_ball_bound_is_attained_with_border_aware_norms():
    """The exact ball bound: moving γ along a neuron's (in-image, standardized) filter reaches its upper bound, also for
    border neurons whose filter is partly over the padding."""
    left = build_left("conv-stride-pad-std-elementwise").double()
    x = torch.rand(1, *left.input_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    gamma = 0.2
    bounds = sz.ball_bounds(left, x, gamma)
    jac = layer_jacobians(left, x[0])[0]  # rows: d z_i / d x (in-image taps only, 1/sd folded)
    z0 = left.layers[0](left.standardize(x)).flatten().detach()
    for i in range(jac.shape[0]):
        row = jac[i]
        x_star = x + gamma * (row / row.norm()).view_as(x)
        z_star = left.layers[0](left.standardize(x_star)).flatten()[i]
        assert float(z_star.detach()) == pytest.approx(float(bounds.upper[0].flatten()[i]), rel=1e-9, abs=1e-9)
        assert float(bounds.upper[0].flatten()[i] - z0[i]) == pytest.approx(gamma * float(row.norm()), rel=1e-9)


def _toy_left(w3: float) -> sz.LeftHalf:
    """The paper's toy ``f_L`` (Appendix B): W1 = diag(2, 2, w3), θ = 1, then W2 = [1, 1, 1]."""
    l1, l2 = nn.Linear(3, 3, bias=False), nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        l1.weight.copy_(torch.diag(torch.tensor([2.0, 2.0, w3])))
        l2.weight.copy_(torch.ones(1, 3))
    return sz.LeftHalf([l1, l2], [sz.ClippedReLU(1.0), None], input_shape=(3,))


def test_paper_toy_example():
    """Paper Appendix B: W1 = diag(2,2,1), W2 = [1,1,1], x = [1,-1,0], θ = 1, γ = 0.1 → local bound 1.

    The paper states the global bound as 4; the product of spectral norms is ‖W2‖‖W1‖ = √3·2 ≈ 3.46 (≤ 4, so the
    paper's figure is also a valid but looser bound); the true global Lipschitz constant is ‖(2,2,1)‖ = 3."""
    left = _toy_left(1.0)
    x = torch.tensor([[1.0, -1.0, 0.0]])
    bounds = sz.ball_bounds(left, x, 0.1)
    assert torch.allclose(bounds.lower[0], torch.tensor([[1.8, -2.2, -0.1]], dtype=torch.float64))
    assert torch.allclose(bounds.upper[0], torch.tensor([[2.2, -1.8, 0.1]], dtype=torch.float64))
    assert bounds.masks[0].tolist() == [[False, False, True]]
    local = sz.lipschitz_bound(left, x, 0.1)
    assert float(local.value[0]) == pytest.approx(1.0, rel=1e-6)
    glob = sz.global_lipschitz_bound(left, (3,))
    assert float(glob.value[0]) == pytest.approx(2 * math.sqrt(3), rel=1e-9)
    assert 3.0 <= float(glob.value[0]) <= 4.0


@pytest.mark.parametrize("gamma", [5e-324, 1e-320, 1e-200, 1e-100, 1e-12])
def test_a_tiny_ball_keeps_its_varying_neurons(gamma):
    """The toy network with W1 = diag(2, 2, 1/4): at x = [1, −1, 0] the third neuron sits at 0, so on any ball of
    radius γ > 0 it varies and the local constant is exactly 1/4. γ‖w_3‖ underflows to 0 below ~1e-323: the bound
    must not then declare the neuron constant (it bounds such a ball as a larger one)."""
    left = _toy_left(0.25)
    x = torch.tensor([[1.0, -1.0, 0.0]])
    assert sz.ball_bounds(left, x, gamma).masks[0].tolist() == [[False, False, True]]
    value = float(sz.lipschitz_bound(left, x, gamma).value[0])
    assert 0.25 <= value <= 0.25 * (1 + 1e-8)
    assert float(sz.lipschitz_bound(left, x, 0.0).value[0]) == 0.0  # γ = 0 stays the point itself


@pytest.mark.parametrize("name", CONFIGS)
def test_local_bound_is_monotone_in_gamma_and_below_global(name):
    left = build_left(name)
    x = torch.rand(2, *left.input_shape, generator=torch.Generator().manual_seed(5))
    values = [sz.lipschitz_bound(left, x, g).value for g in (0.0, 0.01, 0.1, 0.5, 1.0, 5.0, 100.0)]
    for a, b in zip(values, values[1:]):
        assert (b >= a * (1 - 1e-9)).all()
    glob = sz.global_lipschitz_bound(left, left.input_shape).value[0]
    assert (values[-1] <= glob * (1 + 1e-6)).all()


def test_global_bound_equals_local_bound_when_every_neuron_varies():
    left = build_left("conv-stride-pad-std-elementwise")
    x = torch.rand(1, *left.input_shape)
    local = float(sz.lipschitz_bound(left, x, 1e4).value[0])
    glob = float(sz.global_lipschitz_bound(left, left.input_shape).value[0])
    conv_matrix = layer_jacobians(left, x[0])[0]
    assert glob == pytest.approx(float(torch.linalg.matrix_norm(conv_matrix, ord=2)), rel=1e-6)
    assert local == pytest.approx(glob, rel=1e-9)


@pytest.mark.parametrize("name", CONFIGS)
def test_training_estimate_converges_to_dense_svd(name):
    left = build_left(name)
    x = torch.rand(2, *left.input_shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    estimate = sz.lipschitz_estimate(left, x, 0.3, power_iters=3000, generator=torch.Generator().manual_seed(0))
    for b in range(2):
        product_of_norms, _ = oracle(left, x[b].float(), 0.3)
        # Power iteration approaches from below; it is an estimate, never an upper bound.
        assert float(estimate[b].detach()) == pytest.approx(product_of_norms, rel=1e-4)
        assert float(estimate[b].detach()) <= product_of_norms * (1 + 1e-9)


def test_training_estimate_gradient_matches_dense_svd_gradient():
    """d‖I W D‖/dW of the estimate equals autograd through a dense SVD of the explicitly built masked matrix."""
    left = build_left("conv-stride-pad-std-elementwise")
    x = torch.rand(1, *left.input_shape, generator=torch.Generator().manual_seed(7))
    conv = left.layers[0]
    state = sz.PowerIterationState()
    estimate = sz.lipschitz_estimate(left, x, 0.3, power_iters=3000, state=state)
    (grad_est,) = torch.autograd.grad(estimate.sum(), conv.weight)

    mask = sz.ball_bounds(left, x, 0.3).masks[0][0].flatten().double()
    weight = conv.weight.detach().double().requires_grad_(True)
    eye = torch.eye(math.prod(left.input_shape), dtype=torch.float64).view(-1, *left.input_shape)
    inv_sd = (1 / left.standardize.std.double()).view(1, -1, 1, 1)
    cols = torch.nn.functional.conv2d(eye * inv_sd, weight, None, conv.stride, conv.padding)
    dense = mask[:, None] * cols.flatten(1).T
    (grad_ref,) = torch.autograd.grad(torch.linalg.matrix_norm(dense, ord=2), weight)
    assert torch.allclose(grad_est.double(), grad_ref, rtol=1e-3, atol=1e-5)
    assert len(state.vectors) == 1 and state.vectors[0].shape == left.input_shape


ESTIMATORS = ["eigen", "lanczos"]  # the host solver (CPU default) and device Lanczos (CUDA default), both on CPU here


@pytest.mark.parametrize("estimator", [*ESTIMATORS, "squaring"])
def test_certified_lambda_max_on_hard_spectra(estimator):
    gen = torch.Generator().manual_seed(8)
    for d in (1, 5, 64, 300):
        a = torch.randn(d + 3, d, generator=gen, dtype=torch.float64)
        gram = a.T @ a
        exact = float(torch.linalg.eigvalsh(gram)[-1])
        value = sz.certified_lambda_max(gram, terms=d + 3, estimator=estimator)
        assert exact <= value <= exact * (1 + 1e-6)
    # Clustered top eigenvalues (a multiple of the identity), rank one (Lanczos stops at an invariant subspace after
    # one step) and a zero matrix.
    assert 4.0 <= sz.certified_lambda_max(4.0 * torch.eye(50, dtype=torch.float64), 1, estimator) <= 4.0 * (1 + 1e-6)
    v = torch.randn(40, generator=gen, dtype=torch.float64)
    rank_one = torch.outer(v, v)
    top = float(v @ v)
    assert top <= sz.certified_lambda_max(rank_one, 1, estimator) <= top * (1 + 1e-6)
    assert sz.certified_lambda_max(torch.zeros(7, 7, dtype=torch.float64), 1, estimator) == 0.0
    assert sz.certified_lambda_max(torch.zeros(0, 0, dtype=torch.float64), 1, estimator) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_lanczos_estimate_matches_a_dense_solver_on_lenet_grams(seed):
    """The real case: LeNet conv1's masked Gram (d = 784, a dense band of near-top eigenvalues). The estimate
    converges to the dense solver's top eigenvalue, from below up to rounding (a Ritz value is a compression's)."""
    torch.manual_seed(seed)
    left = sz.lenet(split_index=1).left
    x = torch.rand(1, 1, 28, 28)
    bounds = sz.ball_bounds(left, x, 0.3 * seed)
    gram, _ = factor_gram(masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0], 0, sparse=False)
    exact = float(torch.linalg.eigvalsh(gram)[-1])
    estimate = lanczos_top_eigenvalue(gram)
    assert exact * (1 - 1e-10) <= estimate <= exact * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_squaring_estimate_matches_a_dense_solver_on_lenet_grams(seed):
    """LeNet conv1's masked Gram (d = 784): the repeated-squaring estimate is the dense solver's top eigenvalue to
    rounding, and the certificate placed by it equals the host solver's to the last few ulps."""
    torch.manual_seed(seed)
    left = sz.lenet(split_index=1).left
    x = torch.rand(1, 1, 28, 28)
    bounds = sz.ball_bounds(left, x, 0.3 + 0.3 * seed)
    gram, terms = factor_gram(masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0], 0, sparse=False)
    exact = float(torch.linalg.eigvalsh(gram)[-1])
    assert squaring_top_eigenvalue(gram) == pytest.approx(exact, rel=1e-13)
    squared = sz.certified_lambda_max(gram, terms, "squaring")
    assert exact <= squared and squared == pytest.approx(sz.certified_lambda_max(gram, terms, "eigen"), rel=1e-13)


@pytest.mark.parametrize("below", [1e-3, 1e-8, 1e-10, 0.0])
def test_squaring_estimate_with_eigenvalues_just_below_the_top(below):
    """The estimate's hard case: half the spectrum at λ_1(1 − below), where ``(λ_i/λ_1)^(2^32)`` has not vanished
    (below = 1e-10). The estimate is then low by about ``below`` at most (the documented ``d/(2e·p)`` bound); the
    certificate stays a proven bound, as tight as the host solver's to the shift's slack."""
    d = 200
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    values = 0.5 * torch.rand(d, generator=gen, dtype=torch.float64)
    values[::2] = 1.0 - below
    values[-1] = 1.0
    gram = (q * values) @ q.T
    gram = (gram + gram.T) / 2
    exact = float(torch.linalg.eigvalsh(gram)[-1])
    estimate = squaring_top_eigenvalue(gram)
    assert exact * (1 - max(below, 1e-14)) <= estimate <= exact * (1 + 1e-14)
    bound = sz.certified_lambda_max(gram, 10, "squaring")
    assert exact <= bound <= exact * (1 + 1e-8)


def _hard_grams(gen: torch.Generator) -> list[torch.Tensor]:
    """Grams of several dimensions (so the batch is padded): random PSD ones, a clustered top (half the spectrum at
    λ_1(1 − 1e-10)), rank one, a multiple of the identity, zero, empty, and LeNet conv1's masked Gram as sparse CSR."""
    grams = []
    for d in (1, 5, 64, 130):
        a = torch.randn(d + 3, d, generator=gen, dtype=torch.float64)
        grams.append(a.T @ a)
    q, _ = torch.linalg.qr(torch.randn(90, 90, generator=gen, dtype=torch.float64))
    values = 0.5 * torch.rand(90, generator=gen, dtype=torch.float64)
    values[::2], values[-1] = 1.0 - 1e-10, 1.0
    clustered = (q * values) @ q.T
    grams.append((clustered + clustered.T) / 2)
    v = torch.randn(40, generator=gen, dtype=torch.float64)
    grams += [torch.outer(v, v), 4.0 * torch.eye(50, dtype=torch.float64), torch.zeros(7, 7, dtype=torch.float64),
              torch.zeros(0, 0, dtype=torch.float64)]
    left = sz.lenet(split_index=1).left
    bounds = sz.ball_bounds(left, torch.rand(1, 1, 28, 28, generator=gen), 0.4)
    grams.append(factor_gram(masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0], 0)[0])
    return grams


def test_batched_certificates_are_proven_bounds_equal_to_one_by_one(monkeypatch):
    """certified_lambda_max_many with the squaring estimate (what CUDA takes; forced here on CPU tensors): the Grams
    are bounded together, zero-padded to the largest, and each result is a proven upper bound on λ_max (above the
    dense solver's eigenvalue) equal to certified_lambda_max of that Gram alone up to the estimate's rounding; the
    batched step settles every Gram here except the empty one (no per-Gram fallback)."""
    import splitz_fast.bounds.certificate as certificate

    grams = _hard_grams(torch.Generator().manual_seed(11))
    terms = [g.shape[0] + 3 for g in grams]
    alone = [sz.certified_lambda_max(g, t, "squaring") for g, t in zip(grams, terms)]
    fallbacks = []
    single = certificate.certified_lambda_max
    monkeypatch.setattr(certificate, "certified_lambda_max",
                        lambda g, t, e="auto": fallbacks.append(g.shape[0]) or single(g, t, e))
    together = certified_lambda_max_many(grams, terms, "squaring")
    assert fallbacks == [0]
    for gram, bound, reference in zip(grams, together, alone):
        dense = gram.to_dense() if gram.layout == torch.sparse_csr else gram
        if dense.shape[0] == 0 or not dense.any():
            assert bound == reference == 0.0
            continue
        if gram.layout == torch.sparse_csr:  # the stored upper triangle defines the symmetric matrix
            dense = dense + torch.triu(dense, 1).mT
        assert float(torch.linalg.eigvalsh(dense)[-1]) <= bound
        assert bound == pytest.approx(reference, rel=1e-12)


def test_batched_certificates_hand_unsettled_grams_to_the_single_path(monkeypatch):
    """A Gram whose batched estimate is too low for every tight shift (here: no squaring at all, so the estimate is a
    column's Rayleigh quotient) is bounded by certified_lambda_max on its own — the host solver's shift — and the
    result is still a proven bound; other estimators never batch."""
    import splitz_fast.bounds.certificate as certificate

    gen = torch.Generator().manual_seed(12)
    grams = [(lambda a: a.T @ a)(torch.randn(d + 2, d, generator=gen, dtype=torch.float64)) for d in (6, 30, 17)]
    monkeypatch.setattr(certificate, "SQUARING_STEPS", 0)  # the batched step reads it there
    calls = []
    single = certificate.certified_lambda_max
    monkeypatch.setattr(certificate, "certified_lambda_max",
                        lambda g, t, e="auto": calls.append(e) or single(g, t, "eigen"))
    bounds = certified_lambda_max_many(grams, [9, 9, 9], "squaring")
    assert calls == ["squaring"] * 3
    for gram, bound in zip(grams, bounds):
        assert float(torch.linalg.eigvalsh(gram)[-1]) <= bound == single(gram, 9, "eigen")
    calls.clear()
    certified_lambda_max_many(grams, [9, 9, 9], "eigen")
    assert calls == ["eigen"] * 3
    with pytest.raises(ValueError, match="one terms count per Gram"):
        certified_lambda_max_many(grams, [9], "squaring")


def test_a_poor_lanczos_estimate_falls_back_to_the_host_solver(monkeypatch):
    """A Lanczos estimate far below λ_max fails every tight shift; the host solver's estimate must then keep the
    bound tight (and it is a proven bound either way)."""
    import splitz_fast.bounds.certificate as certificate

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(80, 60, generator=gen, dtype=torch.float64)
    gram = a.T @ a
    exact = float(torch.linalg.eigvalsh(gram)[-1])
    monkeypatch.setattr(certificate, "lanczos_top_eigenvalue", lambda g: 0.5 * exact)
    assert exact <= sz.certified_lambda_max(gram, 80, "lanczos") <= exact * (1 + 1e-6)
    with pytest.raises(ValueError, match="estimator"):
        sz.certified_lambda_max(gram, 80, "svd")


def test_split_zero_is_identity_and_negative_thresholds_are_refused():
    left = sz.LeftHalf([], [], input_shape=(3,))
    bound = sz.lipschitz_bound(left, torch.rand(2, 3), 0.5)
    assert bound.kind == ["identity"] * 2 and torch.equal(bound.value, torch.ones(2, dtype=torch.float64))
    act = sz.ClippedReLU(1.0, learnable=True)
    bad = sz.LeftHalf([nn.Linear(3, 2)], [act], input_shape=(3,))
    with torch.no_grad():
        act.threshold.fill_(-0.5)
    with pytest.raises(ValueError, match="negative"):
        sz.lipschitz_bound(bad, torch.rand(1, 3), 0.1)
    act.project_()
    assert float(act.threshold.detach()) == 0.0
    sz.lipschitz_bound(bad, torch.rand(1, 3), 0.1)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("d", [60, 400, 1500])
def test_certified_lambda_max_on_sparse_banded_grams(d, estimator):
    """Banded Grams (the shape of a convolution's) take the sparse Lanczos estimate: still a proven bound, tight."""
    gen = torch.Generator().manual_seed(d)
    band = torch.randn(d, d, generator=gen, dtype=torch.float64).triu().tril(4)  # 5 diagonals
    gram = band.T @ band
    assert float(torch.count_nonzero(gram)) / gram.numel() < 0.25
    exact = float(torch.linalg.eigvalsh(gram)[-1])
    assert exact <= sz.certified_lambda_max(gram, terms=5, estimator=estimator) <= exact * (1 + 1e-6)
    # Repeated top eigenvalue: the same block three times on the diagonal.
    block = gram[:10, :10]
    repeated = torch.block_diag(block, block, block, 0.1 * block)
    top = float(torch.linalg.eigvalsh(repeated)[-1])
    assert top <= sz.certified_lambda_max(repeated, terms=5, estimator=estimator) <= top * (1 + 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("estimator", ["auto", "lanczos", "squaring"])
@pytest.mark.parametrize("seed", range(3))
def test_exact_bound_on_cuda_matches_the_cpu_certificate(seed, estimator, monkeypatch):
    """On CUDA the exact bound places its shift on the device (for these d = 784 Grams of two inputs: repeated
    squaring, both Grams in one batch, under auto and squaring; Lanczos one by one); the CPU uses the host solver.
    Both are proven bounds of the same Gram, so they must agree to the shift's slack and sit above the dense solver's
    λ_max."""
    import splitz_fast.bounds.lipschitz as lipschitz

    certify = lipschitz.certified_lambda_max_many
    monkeypatch.setattr(lipschitz, "certified_lambda_max_many",
                        lambda grams, terms: certify(grams, terms, "eigen" if not grams[0].is_cuda else estimator))
    torch.manual_seed(seed)
    left = sz.lenet(split_index=1).left
    x = torch.rand(2, 1, 28, 28)
    cpu = sz.lipschitz_bound(left, x, 0.3 * seed, method="exact").value
    cuda = sz.lipschitz_bound(copy.deepcopy(left).cuda(), x.cuda(), 0.3 * seed, method="exact").value
    bounds = sz.ball_bounds(left, x, 0.3 * seed)
    ops = masked_operators(left, bounds, (1, 28, 28), 2, bounds.input_scale)
    for b in range(2):
        exact = math.sqrt(float(torch.linalg.eigvalsh(factor_gram(ops[0], b, sparse=False)[0])[-1]))
        assert exact <= float(cuda[b]) <= exact * (1 + 1e-6)
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-6, atol=0)
