"""l2 adversarial attacks on the SPLITZ smoothed classifier ``g`` and on the base classifier ``f = f_R ∘ f_L``.

What is attacked (``ATTACKS``):

* ``smooth-pgd`` / ``smooth-fgsm`` — the paper's setting, SmoothAdv-style (Salman et al. 2019): gradient steps on the
  cross entropy of the Monte Carlo soft classifier ``ĝ(x) = 1/m Σ_j softmax(f_R(f_L(x) + σ ε_j))``, ``ε_j ~ N(0, I)``
  drawn in the latent space of ``f_L`` (``m`` = ``samples`` fresh draws per step), differentiated through ``f_R`` *and*
  ``f_L`` (:func:`smoothed_log_probs`). ``split_index == 0`` is the attack on plain randomized smoothing.
* ``pgd`` / ``fgsm`` / ``deepfool`` — the base classifier ``f`` without noise, for reference.

Every attack is untargeted, works on a batch ``x: [B, *input_shape]`` with labels ``y: [B]`` (int64) and a budget
``eps`` (a float or a ``[B]`` tensor, raw input units), and returns ``x_adv`` with ``‖x_adv − x‖₂ ≤ eps`` per example
(projection onto the l2 ball; ``clamp=(lo, hi)`` additionally projects onto the box, e.g. ``(0, 1)`` for images, which
never increases the distance because ``x`` lies in the box).

Whether an attack worked is never decided by the attack's own samples: :class:`Attacker` decides the smoothed
prediction at the clean and at the attacked point with Cohen's PREDICT (two-sided binomial test, abstention allowed),
each with its own seed (``seed``, ``seed + ADV_PREDICT_SEED_OFFSET``; the attack's noise uses
``seed + ATTACK_SEED_OFFSET``), so a dataset run (``splitz attack``, :func:`splitz_fast.runs.loop.run_over_dataset` of
an :class:`~splitz_fast.runs.tasks.AttackRun`) is resumable and reproducible row by row. :func:`falsify_certificates` attacks certified inputs
inside (a multiple of) their certified radius: the attack-based check of our certificates (tests/certify/test_attacks.py).

Why our own code and not a package: torchattacks 3.5.1 is on the package index and would install, but it attacks
a plain ``nn.Module`` on inputs it clamps to [0, 1], so the smoothed attacks (noise between ``f_L`` and ``f_R``,
the paper's setting and the ones that matter here) would have to be ours anyway, and the three base-classifier
attacks are about a hundred readable lines; a new dependency for those was not worth it.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_certify_counts, check_count, check_positive, check_tensor
from ..model.modules import SplitModel
from .inputs import CallGuard, evaluating, model_device, resolve_seed, with_seeds
from .smoothing import ABSTAIN, CertifyResult, Smoother

ATTACKS = ("smooth-pgd", "smooth-fgsm", "pgd", "fgsm", "deepfool")
SMOOTHED_ATTACKS = ("smooth-pgd", "smooth-fgsm")
ATTACK_COLUMNS = ("idx", "label", "clean_predict", "adv_predict", "eps", "delta_norm", "success", "time")
ATTACK_HEADER = "\t".join(ATTACK_COLUMNS)
# Per-input seeds: clean PREDICT uses the input's seed (as `splitz predict` does), the attack's noise and the PREDICT
# at the attacked point use these offsets of it, so the three draw independent noise.
ATTACK_SEED_OFFSET = 1 << 40
ADV_PREDICT_SEED_OFFSET = 1 << 41

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------- l2 geometry
def _eps_per_example(eps: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``eps`` as a ``[B]`` float32 tensor on ``x``'s device, checked finite and ≥ 0, each value rounded down where
    float32 cannot hold it exactly (so a ball of the float32 radius lies inside the one asked for)."""
    if isinstance(eps, torch.Tensor):
        eps = eps.detach().to(x.device, torch.float64).reshape(-1)
        if eps.numel() == 1:
            eps = eps.expand(x.shape[0])
        if eps.numel() != x.shape[0]:
            raise ValueError(f"eps must be one number or one per example ({x.shape[0]}), got {eps.numel()} values")
    else:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"eps must be a number or a tensor, got {type(eps).__name__}")
        eps = torch.full((x.shape[0],), float(eps), device=x.device, dtype=torch.float64)
    if not torch.isfinite(eps).all() or (eps < 0).any():
        raise ValueError(f"eps must be finite and >= 0 (raw input units), got {eps.tolist()}")
    single = eps.float()
    return torch.where(single.double() > eps, torch.nextafter(single, torch.zeros_like(single)), single)


def _norms(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).norm(dim=1)


def _per_row(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(-1, *([1] * (like.ndim - 1)))


def project_l2(delta: torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """``delta: [B, ...]`` scaled down, per example, onto the l2 ball of radius ``eps`` (unchanged inside it)."""
    eps = _eps_per_example(eps, delta)
    scale = (eps / _norms(delta).clamp_min(1e-12)).clamp(max=1.0)
    return delta * _per_row(scale, delta)


def _unit(g: torch.Tensor) -> torch.Tensor:
    """``g / ‖g‖₂`` per example (zero where the gradient vanishes). A saturated softmax gives gradients of 1e-30 whose
    direction is still right, so there is no floor on the norm: ``g`` is rescaled by its largest entry first, so that
    its squares do not underflow."""
    peak = _per_row(g.flatten(1).abs().amax(dim=1), g)
    g = torch.where(peak > 0, g / peak.clamp_min(torch.finfo(g.dtype).tiny), torch.zeros_like(g))  # no underflow
    norms = _per_row(_norms(g), g)
    return torch.where(norms > 0, g / norms.clamp_min(1.0), torch.zeros_like(g))  # after rescaling, ‖g‖ ≥ 1 or 0


# Shrinks of a step whose rounded sum x + δ still lies outside the ball, before that row falls back to x itself.
_ROUNDING_SHRINKS = 8


def _finish(x: torch.Tensor, x_adv: torch.Tensor, eps: torch.Tensor,
            clamp: tuple[float, float] | None) -> torch.Tensor:
    """Project ``x_adv`` onto the ball ``B(x, eps)`` and then the box ``clamp`` (the box never moves a point away from
    ``x``, which lies in it, so the ball constraint still holds). Forming ``x + δ`` in ``x``'s dtype rounds each
    entry, which can put a point on the sphere just outside it (by up to ~1e-7 absolute in float32): the distance is
    measured in float64 and a row outside has its ``δ`` shrunk by its excess until it lies inside (``x`` itself after
    :data:`_ROUNDING_SHRINKS` tries), so ``‖x_adv − x‖₂ ≤ eps`` holds for the returned points."""
    eps = _eps_per_example(eps, x)
    delta = project_l2(x_adv - x, eps).detach()
    for attempt in range(_ROUNDING_SHRINKS + 2):  # the last pass only confirms the rows set back to x
        x_adv = x + delta
        if clamp is not None:
            x_adv = x_adv.clamp(*clamp)
        distance = _norms(x_adv.double() - x.double())
        outside = distance > eps.double()
        if not outside.any():
            break
        # back onto the sphere, and one float32 ulp further in
        shrink = (eps.double() / distance.clamp_min(torch.finfo(torch.float64).tiny)) * (1 - 2.0**-23)
        factor = torch.where(outside, shrink if attempt < _ROUNDING_SHRINKS else torch.zeros_like(shrink), 1.0)
        delta = delta * _per_row(factor.to(delta.dtype), delta)
    return x_adv.detach()


def _check_attack_inputs(x: torch.Tensor, y: torch.Tensor | None, clamp) -> None:
    check_tensor("x", x, ndim=None)
    if x.ndim < 2:
        raise ValueError(f"x must be a batch [B, *input_shape], got shape {tuple(x.shape)}")
    if y is not None:
        if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 or y.shape != (x.shape[0],):
            raise ValueError(f"y must be an int64 tensor of shape [{x.shape[0]}] (one label per example)")
    if clamp is not None:
        lo, hi = clamp
        if not lo < hi:
            raise ValueError(f"clamp must be (lo, hi) with lo < hi, got {clamp}")
        if (x < lo).any() or (x > hi).any():
            raise ValueError(f"x lies outside the clamp box {clamp}; the attack would move it out of its own ball")


def _loss_grad(fn: LogitsFn, x_adv: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of the summed cross entropy ``CE(fn(x_adv), y)`` with respect to ``x_adv`` (parameters untouched)."""
    x_adv = x_adv.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = F.cross_entropy(fn(x_adv), y, reduction="sum")
        (grad,) = torch.autograd.grad(loss, x_adv)
    return grad


# ---------------------------------------------------------------------------------------------------- the attacks
def fgsm_l2(fn: LogitsFn, x: torch.Tensor, y: torch.Tensor, eps: float | torch.Tensor, *,
            clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """One step of length ``eps`` along the normalized loss gradient (the l2 version of FGSM).

    ``fn``: ``[B, *input_shape] → [B, C]`` logits or log-probabilities (cross entropy treats both alike).
    Returns ``x_adv: [B, *input_shape]`` with ``‖x_adv − x‖₂ ≤ eps``."""
    _check_attack_inputs(x, y, clamp)
    eps = _eps_per_example(eps, x)
    return _finish(x, x + _per_row(eps, x) * _unit(_loss_grad(fn, x, y)), eps, clamp)


def pgd_l2(fn: LogitsFn, x: torch.Tensor, y: torch.Tensor, eps: float | torch.Tensor, *, steps: int = 20,
           step_size: float | None = None, random_start: bool = False, clamp: tuple[float, float] | None = None,
           generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Projected gradient ascent on the cross entropy in the l2 ball (Madry et al. 2018): ``steps`` normalized steps of
    ``step_size × eps`` (default ``2.5 / steps``, so the path can cross the ball), each followed by the projection onto
    ``B(x, eps)`` (and the box). ``random_start``: begin at a uniform point of the ball, example ``b``'s drawn from
    ``generators[b]`` (default: torch's global generator). Returns the last iterate."""
    _check_attack_inputs(x, y, clamp)
    check_count("steps", steps)
    eps = _eps_per_example(eps, x)
    relative = 2.5 / steps if step_size is None else check_positive("step_size", step_size)
    x_adv = x.detach().clone()
    if random_start:
        gens = [None] * x.shape[0] if generators is None else generators
        direction = _unit(torch.stack([torch.randn(x.shape[1:], generator=g, device=x.device) for g in gens]))
        u = torch.stack([torch.rand((), generator=g, device=x.device) for g in gens]) ** (1.0 / x[0].numel())
        x_adv = _finish(x, x + _per_row(eps * u, x) * direction, eps, clamp)
    for _ in range(steps):
        step = _per_row(eps * relative, x) * _unit(_loss_grad(fn, x_adv, y))
        x_adv = _finish(x, x_adv + step, eps, clamp)
    return x_adv


def deepfool_l2(fn: LogitsFn, x: torch.Tensor, eps: float | torch.Tensor | None = None, *, steps: int = 50,
                overshoot: float = 0.02, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """DeepFool (Moosavi-Dezfooli et al. 2016), multi-class l2: linearize the logits at the current point and step to
    the nearest linearized decision boundary, until the predicted class changes (at most ``steps`` steps); the total
    step is scaled by ``1 + overshoot``. ``eps`` (optional) then projects it onto ``B(x, eps)``: without it the result
    is DeepFool's (unbounded) minimal perturbation. One backward pass per class per step."""
    _check_attack_inputs(x, None, clamp)
    check_count("steps", steps)
    eps_t = None if eps is None else _eps_per_example(eps, x)
    x = x.detach()
    with torch.no_grad():
        original = fn(x).argmax(1)
    r_total = torch.zeros_like(x)
    active = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    for _ in range(steps):
        x_cur = (x + (1 + overshoot) * r_total).detach().requires_grad_(True)
        with torch.enable_grad():
            logits = fn(x_cur)
            grads = torch.stack([torch.autograd.grad(logits[:, k].sum(), x_cur, retain_graph=True)[0]
                                 for k in range(logits.shape[1])], 1)  # [B, C, *input_shape]
        logits = logits.detach()
        active &= logits.argmax(1) == original
        if not active.any():
            break
        w = grads - grads[rows, original].unsqueeze(1)                  # [B, C, ...]
        f = logits - logits[rows, original].unsqueeze(1)                # [B, C]
        w_norm = w.flatten(2).norm(dim=2)                                # [B, C]
        distance = f.abs() / w_norm.clamp_min(1e-12)
        distance[rows, original] = math.inf
        k = distance.argmin(1)
        step = (distance[rows, k] + 1e-4) / w_norm[rows, k].clamp_min(1e-12)
        r = _per_row(step, x) * w[rows, k]
        r_total = r_total + r * _per_row(active.float(), x)
    x_adv = x + (1 + overshoot) * r_total
    if eps_t is None:
        return (x_adv.clamp(*clamp) if clamp is not None else x_adv).detach()
    return _finish(x, x_adv, eps_t, clamp)


# ---------------------------------------------------------------------------------------------------- what is attacked
def smoothed_log_probs(model: SplitModel, sigma: float, samples: int,
                       generators: list[torch.Generator]) -> LogitsFn:
    """``x: [B, *input_shape] → log ĝ(x): [B, C]``, the log of the Monte Carlo soft smoothed classifier
    ``1/m Σ_j softmax(f_R(f_L(x) + σ ε_j))`` with ``m = samples`` fresh float32 draws per call; example ``b`` draws from
    ``generators[b]`` (on the model's device), so its noise depends only on its own seed. Differentiable in ``x``."""
    sigma = check_positive("sigma", sigma)
    check_count("samples", samples)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != len(generators):
            raise ValueError(f"got {x.shape[0]} inputs for {len(generators)} noise generators")
        latent = model.left(x).float()                                   # [B, *latent]
        noise = torch.stack([torch.randn((samples, *latent.shape[1:]), generator=g, device=latent.device)
                             for g in generators], 1)                    # [m, B, *latent]
        logits = model.right((latent.unsqueeze(0) + sigma * noise).flatten(0, 1)).float()
        log_p = F.log_softmax(logits, dim=1).view(samples, x.shape[0], -1)
        return torch.logsumexp(log_p, dim=0) - math.log(samples)        # log of the mean softmax, [B, C]

    return fn


@dataclass
class AttackResult:
    """One attacked input. ``clean_prediction`` / ``adversarial_prediction``: PREDICT of the smoothed classifier at
    ``x`` and ``x_adv`` (``ABSTAIN`` = −1), or the base classifier's argmax with ``evaluate="base"``;
    ``success``: the prediction was right at ``x`` and is not at ``x_adv`` (wrong class or abstention);
    ``delta_norm``: ``‖x_adv − x‖₂`` (≤ ``eps``); ``seconds``: this input's share of its group's wall time."""

    clean_prediction: int
    adversarial_prediction: int
    label: int
    eps: float
    delta_norm: float
    seed: int
    seconds: float
    x_adv: torch.Tensor | None = None

    @property
    def success(self) -> bool:
        return self.clean_prediction == self.label and self.adversarial_prediction != self.label

    def row(self, idx: int) -> str:
        """The TSV row (``ATTACK_HEADER``)."""
        return "\t".join([str(idx), str(self.label), str(self.clean_prediction), str(self.adversarial_prediction),
                          f"{self.eps:.6g}", f"{self.delta_norm:.6g}", str(int(self.success)), f"{self.seconds:.4f}"])


class Attacker:
    """Attacks through a :class:`~splitz_fast.certify.smoothing.Smoother` (its model, σ and PREDICT).

    Args:
        smoother: the smoothed classifier; σ and the sampling engine are its own.
        attack: one of ``ATTACKS``.
        eps: l2 budget in raw input units (:meth:`perturb` may override it per call).
        steps: PGD / DeepFool iterations. step_size: PGD's step as a fraction of ``eps`` (default ``2.5 / steps``).
        samples: ``m``, noise draws per gradient step of the smoothed attacks.
        random_start: PGD from a uniform point of the ball.
        clamp: ``(lo, hi)`` box of valid inputs (e.g. ``(0, 1)`` for images), or ``None``.
        evaluate: ``"smoothed"`` (default: PREDICT at both points) or ``"base"`` (argmax of ``f``).
        group: inputs attacked together in one batch by :meth:`attack_many`.
    """

    def __init__(self, smoother: Smoother, attack: str = "smooth-pgd", eps: float = 0.5, *, steps: int = 20,
                 step_size: float | None = None, samples: int = 32, random_start: bool = False,
                 clamp: tuple[float, float] | None = None, evaluate: str = "smoothed", overshoot: float = 0.02,
                 group: int = 8):
        if not isinstance(smoother, Smoother):
            raise TypeError(f"smoother must be a splitz_fast.Smoother, got {type(smoother).__name__}")
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
        if evaluate not in ("smoothed", "base"):
            raise ValueError(f"evaluate must be 'smoothed' or 'base', got {evaluate!r}")
        if clamp is not None:
            clamp = (float(clamp[0]), float(clamp[1]))
            if not clamp[0] < clamp[1]:
                raise ValueError(f"clamp must be (lo, hi) with lo < hi, got {clamp}")
        self.smoother, self.attack, self.evaluate, self.clamp = smoother, attack, evaluate, clamp
        self.eps = float(_eps_per_example(eps, torch.zeros(1, 1))[0])
        self.steps = check_count("steps", steps)
        self.step_size = None if step_size is None else check_positive("step_size", step_size)
        self.samples = check_count("samples", samples)
        self.random_start = bool(random_start)
        self.overshoot = check_positive("overshoot", overshoot) if overshoot else 0.0
        self.group = check_count("group", group)

    @property
    def model(self) -> SplitModel:
        return self.smoother.model

    @property
    def sigma(self) -> float:  # recorded in a run's settings
        return self.smoother.sigma

    def settings(self) -> dict:
        """What determines the rows besides the model, data and seeds (a run's sidecar records it)."""
        return {"attack": self.attack, "eps": self.eps, "steps": self.steps, "step_size": self.step_size,
                "samples": self.samples, "random_start": self.random_start,
                "clamp": None if self.clamp is None else list(self.clamp),
                "evaluate": self.evaluate, "overshoot": self.overshoot}

    def perturb(self, x: torch.Tensor, y: torch.Tensor, seeds: list[int], eps: float | torch.Tensor | None = None
                ) -> torch.Tensor:
        """``x_adv: [B, *input_shape]`` for the batch ``x`` with labels ``y: [B]``; example ``b``'s noise (smoothed
        attacks, random start) comes from ``seeds[b]`` alone. ``eps``: the attacker's, or per call (float or ``[B]``)."""
        device = model_device(self.model)
        x = x.to(device, torch.float32)
        y = y.to(device)
        if len(seeds) != x.shape[0]:
            raise ValueError(f"perturb needs one seed per example: {x.shape[0]} inputs, {len(seeds)} seeds")
        eps = self.eps if eps is None else eps
        gens = [torch.Generator(device=device).manual_seed(resolve_seed(s)) for s in seeds]
        if self.attack in SMOOTHED_ATTACKS:
            fn = smoothed_log_probs(self.model, self.sigma, self.samples, gens)
        else:
            fn = self.model
        with evaluating(self.model):
            if self.attack in ("smooth-fgsm", "fgsm"):
                return fgsm_l2(fn, x, y, eps, clamp=self.clamp)
            if self.attack == "deepfool":
                return deepfool_l2(fn, x, eps, steps=self.steps, overshoot=self.overshoot, clamp=self.clamp)
            return pgd_l2(fn, x, y, eps, steps=self.steps, step_size=self.step_size, random_start=self.random_start,
                          clamp=self.clamp, generators=gens)

    def _predictions(self, xs: torch.Tensor, n: int, alpha: float, batch_size: int | None,
                     seeds: list[int]) -> list[int]:
        if self.evaluate == "base":
            with evaluating(self.model), torch.no_grad():
                return self.model(xs).argmax(1).tolist()
        return [r.prediction for r in self.smoother.predict_many(xs, n, alpha, batch_size=batch_size, seeds=seeds)]

    def attack_many(self, pairs: Iterable[tuple[torch.Tensor, int]], n: int, alpha: float,
                    batch_size: int | None = None, seeds: Iterable[int | None] | None = None,
                    keep_adversarial: bool = False) -> Iterator[AttackResult]:
        """Attack each ``(x, label)`` of ``pairs`` (``x: [*input_shape]``) and yield its :class:`AttackResult` in order.

        Input ``i`` with seed ``s``: PREDICT(``n``, ``alpha``) at ``x`` with seed ``s``, the attack's noise from
        ``s + ATTACK_SEED_OFFSET``, PREDICT at ``x_adv`` with ``s + ADV_PREDICT_SEED_OFFSET`` — a result depends only
        on its input, label and seed (not on the grouping). ``keep_adversarial`` stores ``x_adv`` in the result.
        ``seeds``: one per pair (``None``: fresh random seeds), as many as the pairs, else a ``ValueError``. Editing the
        model while the results are consumed stops the call with a ``RuntimeError`` before the next result."""
        _, n, alpha, batch_size = check_certify_counts(None, n, alpha, batch_size)
        return self._attack_stream(with_seeds(pairs, seeds), n, alpha, batch_size, keep_adversarial)

    def _attack_stream(self, seeded, n, alpha, batch_size, keep) -> Iterator[AttackResult]:
        guard = CallGuard(self.model)
        group: list[tuple[torch.Tensor, int, int]] = []
        for (x, label), seed in seeded:
            group.append((x, int(label), resolve_seed(seed)))
            if len(group) == self.group:
                yield from self._checked_group(guard, group, n, alpha, batch_size, keep)
                group = []
        if group:
            yield from self._checked_group(guard, group, n, alpha, batch_size, keep)

    def _checked_group(self, guard, group, n, alpha, batch_size, keep) -> Iterator[AttackResult]:
        """One group's results, the model checked unedited before attacking it and before yielding each result."""
        guard.check()
        for result in self._attack_group(group, n, alpha, batch_size, keep):
            guard.check()
            yield result

    def _attack_group(self, group, n, alpha, batch_size, keep) -> list[AttackResult]:
        start = time.perf_counter()
        shape = self.model.input_shape
        xs = torch.stack([check_tensor("x", x, shape_tail=shape) for x, _, _ in group])
        xs = xs.to(model_device(self.model), torch.float32)
        labels = torch.tensor([label for _, label, _ in group], dtype=torch.int64)
        seeds = [s for _, _, s in group]
        clean = self._predictions(xs, n, alpha, batch_size, seeds)
        x_adv = self.perturb(xs, labels, [(s + ATTACK_SEED_OFFSET) % (1 << 64) for s in seeds])
        adv = self._predictions(x_adv, n, alpha, batch_size, [(s + ADV_PREDICT_SEED_OFFSET) % (1 << 64) for s in seeds])
        norms = _norms(x_adv - xs).tolist()
        seconds = (time.perf_counter() - start) / len(group)
        return [AttackResult(c, a, label, self.eps, d, s, seconds, x_adv[i].cpu() if keep else None)
                for i, (c, a, label, d, s) in enumerate(zip(clean, adv, labels.tolist(), norms, seeds))]


# ---------------------------------------------------------------------------------------------------- falsification
@dataclass
class FalsificationRow:
    """One certified input attacked inside ``scale ×`` its certified radius: ``flipped`` when PREDICT at the attacked
    point returns a class other than the certified one (an abstention is no flip: PREDICT may abstain where ``g``'s
    top class has probability just above 1/2)."""

    certified: int
    radius: float
    eps: float
    delta_norm: float
    adversarial_prediction: int
    failure_prob: float

    @property
    def flipped(self) -> bool:
        return self.adversarial_prediction not in (self.certified, ABSTAIN)


def falsify_certificates(attacker: Attacker, inputs: torch.Tensor, certificates: list[CertifyResult], *,
                         scale: float = 0.99, n: int = 10_000, alpha: float = 0.001,
                         seeds: list[int] | None = None) -> list[FalsificationRow]:
    """Attack every certified input of ``inputs: [M, *input_shape]`` (abstentions skipped) with ``attacker`` against
    its certified class inside ``eps = scale × radius``, and decide the attacked point with PREDICT(``n``, ``alpha``).

    With a sound certificate, each row is a flip with probability at most ``failure_prob + alpha`` (the certificate
    is wrong, or PREDICT at the attacked point errs), so over many rows the flips must stay within that binomial rate;
    ``scale > 1`` (an inflated radius) is how a test shows that the attack finds flips where no guarantee holds.
    ``seeds``: one per input (default ``0 .. M−1``); the attack uses ``seed + ATTACK_SEED_OFFSET``, PREDICT
    ``seed + ADV_PREDICT_SEED_OFFSET``."""
    check_positive("scale", scale)
    _, n, alpha, _ = check_certify_counts(None, n, alpha, None)
    if len(certificates) != inputs.shape[0]:
        raise ValueError(f"got {inputs.shape[0]} inputs but {len(certificates)} certificates")
    seeds = list(range(inputs.shape[0])) if seeds is None else list(seeds)
    chosen = [i for i, c in enumerate(certificates) if c.prediction != ABSTAIN and c.radius > 0]
    if not chosen:
        return []
    device = model_device(attacker.model)
    xs = inputs[chosen].to(device, torch.float32)
    certified = torch.tensor([certificates[i].prediction for i in chosen], dtype=torch.int64)
    radii = torch.tensor([certificates[i].radius for i in chosen], dtype=torch.float32)
    pieces = []
    for j in range(0, len(chosen), attacker.group):
        part = chosen[j:j + attacker.group]
        pieces.append(attacker.perturb(xs[j:j + len(part)], certified[j:j + len(part)],
                                       [(seeds[i] + ATTACK_SEED_OFFSET) % (1 << 64) for i in part],
                                       eps=scale * radii[j:j + len(part)]))
    x_adv = torch.cat(pieces)
    adv = attacker.smoother.predict_many(x_adv, n, alpha, seeds=[(seeds[i] + ADV_PREDICT_SEED_OFFSET) % (1 << 64) for i in chosen])
    norms = _norms(x_adv - xs).tolist()
    return [FalsificationRow(certificates[i].prediction, certificates[i].radius, scale * certificates[i].radius,
                             d, r.prediction, certificates[i].failure_prob)
            for i, d, r in zip(chosen, norms, adv)]


__all__ = ["ATTACKS", "SMOOTHED_ATTACKS", "ATTACK_COLUMNS", "ATTACK_HEADER", "ATTACK_SEED_OFFSET",
           "ADV_PREDICT_SEED_OFFSET", "AttackResult", "Attacker", "FalsificationRow", "deepfool_l2",
           "falsify_certificates", "fgsm_l2", "pgd_l2", "project_l2", "smoothed_log_probs"]
