"""Fused convolution epilogues (splitz_fast/sampling/epilogues.py): which patterns the rewrite fuses and which it leaves, that
the rewritten ResNets compute the same function (bitwise where the fused modules run unfused: the CPU), that each
fused site runs fused only where its fused form computes alike and measures faster (one slow, failing or differing
site leaves the others fused; once per layout and batch), and, on a GPU, that the fused cuDNN calls agree with the
unfused kernels in every precision and through the engine."""
from __future__ import annotations

import copy
import itertools
import time
import warnings

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import splitz_fast as sz
from splitz_fast.sampling import choices
from splitz_fast.sampling.choices import Variant
from splitz_fast.sampling.epilogues import (ConvAddReLU, ConvReLU, ConvReLUMaxPool2, FusionChoice,
                                            cpu_sites_have_a_kernel, fuse_conv_epilogues, fused_sites,
                                            has_fused_modules)
from splitz_fast.sampling.folding import folded_copy
from splitz_fast.sampling.score_checks import ACCEPT_FACTOR, ROUNDING_UNIT, score_gap
from splitz_fast.sampling.engine import SamplingEngine


def _gpu(test):
    """A test that needs CUDA (marked ``gpu``; skipped elsewhere)."""
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)
    return pytest.mark.gpu(test)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randomized_resnet(name: str, split: int) -> sz.SplitModel:
    """A project ResNet with BatchNorm statistics away from their initial values (a fold or a fusion that drops a
    bias or a shortcut changes the function)."""
    torch.manual_seed(0)
    model = sz.build_model(name, split_index=split).eval()
    gen = _gen(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(torch.rand(c, generator=gen) - 0.5)
                m.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(c, generator=gen) * 0.4 + 0.3)
                m.bias.copy_((torch.rand(c, generator=gen) - 0.5) * 0.4)
    return model


def _count(module: nn.Module, kind: type) -> int:
    return sum(type(m) is kind for m in module.modules())


# (model, latent input shape, residual blocks, convolutions per block) of the project's ResNets (depth 20 stands in
# for 110: the same blocks, fewer of them)
RESNETS = [("cifar_resnet20", (3, 32, 32), 9, 2), ("imagenet_resnet50", (3, 64, 64), 16, 3)]


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("name,shape,blocks,convs_per_block", RESNETS)
def test_every_residual_block_of_the_project_resnets_is_fused(name, shape, blocks, convs_per_block, split):
    """After folding, every block's last convolution + shortcut addition + ReLU is one ConvAddReLU and every other
    convolution + ReLU (the stem's at s = 0) one ConvReLU; only the shortcut convolutions (whose output is the
    addition's other operand) stay plain. Unfused on the CPU, the rewritten network is bitwise the folded one."""
    if name == "imagenet_resnet50":
        pytest.importorskip("torchvision")
    model = _randomized_resnet(name, split)
    folded, _ = folded_copy(model.right)
    reference = copy.deepcopy(folded)
    convs = _count(folded, nn.Conv2d)
    fused = fuse_conv_epilogues(folded)
    assert _count(fused, ConvAddReLU) == blocks
    assert _count(fused, ConvReLU) == blocks * (convs_per_block - 1) + (split == 0)
    assert _count(fused, nn.Conv2d) == convs  # every convolution kept, inside a fused module or as it was
    shortcuts = convs - blocks * convs_per_block - (split == 0)
    plain = [m for m in _plain_children(fused) if type(m) is nn.Conv2d]
    assert len(plain) == shortcuts and all(m.kernel_size == (1, 1) for m in plain)
    with torch.no_grad():
        latents = model.left(torch.rand(2, *shape, generator=_gen(2)))
        assert torch.equal(fused(latents), reference(latents))


def _plain_children(module: nn.Module):
    """The modules of ``module`` that are not inside a fused module."""
    for child in module.children():
        if isinstance(child, (ConvReLU, ConvAddReLU)):
            continue
        yield child
        yield from _plain_children(child)


def test_a_chain_fuses_a_convolution_directly_followed_by_relu_only():
    """In an nn.Sequential: Conv2d → ReLU fuses (parameters shared, not copied); a convolution followed by a pool, a
    non-zero padding mode, a ReLU subclass or another activation stays; nested chains are rewritten too."""

    class MyReLU(nn.ReLU):
        pass

    inner = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
    chain = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), inner, nn.Conv2d(4, 4, 3, padding=1),
                          nn.MaxPool2d(2), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                          nn.Conv2d(4, 4, 1), MyReLU(), nn.Conv2d(4, 4, 1), nn.LeakyReLU(), nn.Flatten()).eval()
    reference = copy.deepcopy(chain)
    fused = fuse_conv_epilogues(chain)
    assert [type(m).__name__ for m in fused] == ["ConvReLU", "Sequential", "Conv2d", "MaxPool2d", "ReLU", "Conv2d",
                                                 "ReLU", "Conv2d", "MyReLU", "Conv2d", "LeakyReLU", "Flatten"]
    assert [type(m).__name__ for m in fused[1]] == ["ConvReLU"]
    assert fused[0].conv is chain[0] and fused[0].conv.weight is chain[0].weight
    x = torch.randn(3, 2, 8, 8, generator=_gen(3))
    with torch.no_grad():
        assert torch.equal(fused(x), reference(x))


class _Patterns(nn.Module):
    """Additions and ReLUs around convolutions in the forms a traced block can hold, fusable or not."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e, self.f = (nn.Conv2d(3, 3, 3, padding=1) for _ in range(6))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = F.relu(x + self.a(x))               # z + conv(x): fuses (addition commutes exactly)
        u = self.b(y)
        v = torch.relu(u + y) + u               # the convolution's output is read twice: stays
        w = self.c(v)
        w += v                                  # conv += z, then ReLU (torchvision's form): fuses
        w = self.relu(w)
        t = torch.add(w, self.d(w), alpha=2.0)  # a scaled addition: stays (the fused call adds z once)
        t = t.relu()
        s = t.clone()
        s += self.e(t)                          # z += conv(x) would not update z: stays
        return self.relu(s) + F.leaky_relu(self.f(s))


def test_graph_rewrite_fuses_exactly_the_patterns_it_can_prove_equal():
    gm = torch.fx.symbolic_trace(_Patterns().eval())
    reference = copy.deepcopy(gm)
    a, c = gm.a, gm.c
    fuse_conv_epilogues(gm)
    fused = [m for m in gm.children() if isinstance(m, (ConvReLU, ConvAddReLU))]
    assert [type(m) for m in fused] == [ConvAddReLU, ConvAddReLU] and {id(m.conv) for m in fused} == {id(a), id(c)}
    plain = {name for name, m in gm.named_children() if type(m) is nn.Conv2d}
    assert plain == {"b", "d", "e", "f"}
    x = torch.randn(2, 3, 6, 6, generator=_gen(4))
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))


def test_a_site_runs_its_fused_form_or_the_unfused_operations_it_replaces():
    """Each fused module is a site switched by ``fused``: both forms are the same function (off CUDA the cuDNN
    epilogues bitwise; the pool's fused form on the CPU is the C++ kernel where built, within float32 rounding), and
    the pool's unfused form is the conv + ReLU + 2x2 max pool it replaces, bitwise."""
    conv = nn.Conv2d(2, 3, 3, padding=1).eval()
    x, z = torch.randn(2, 2, 6, 6, generator=_gen(5)), torch.randn(2, 3, 6, 6, generator=_gen(6))
    cases = ((ConvReLU(conv), (x,), F.relu(conv(x))), (ConvAddReLU(conv), (x, z), F.relu(conv(x) + z)),
             (ConvReLUMaxPool2(conv), (x,), F.max_pool2d(F.relu(conv(x)), 2)))
    with torch.no_grad():
        for module, args, want in cases:
            assert module.fused
            if isinstance(module, ConvReLUMaxPool2):
                torch.testing.assert_close(module(*args), want)
            else:
                assert torch.equal(module(*args), want)
            module.fused = False
            assert torch.equal(module(*args), want) and "fused=False" in repr(module)


def test_the_fused_copy_is_a_separate_prepared_copy(monkeypatch):
    """For a CUDA device the prepared classifier keeps the plain copy and, asked for it, a fused copy (every block
    fused); the user's f_R is never rewritten (decided here without a GPU: moves to the device are stubbed out)."""
    model = _randomized_resnet("cifar_resnet20", 1)
    user_types = [type(m) for m in model.right.modules()]
    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)
    engine = SamplingEngine(model.right, 10, 0.25, torch.device("cuda"))
    engine.prepared.check_current()
    plain, fused = engine.prepared.get(channels_last=True), engine.prepared.get(channels_last=True, fused=True)
    assert not has_fused_modules(plain) and _count(fused, ConvAddReLU) == 9 and _count(fused, ConvReLU) == 9
    assert engine.prepared.get(channels_last=True, fused=True) is fused  # kept, like the plain copy
    assert [type(m) for m in model.right.modules()] == user_types


def _choice(setting=None):
    """A FusionChoice for a CUDA device (its decisions need no GPU when the timings are given)."""
    return FusionChoice(setting, torch.device("cuda"))


def test_fusion_settings_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"fused_kernels must be None \(measure\), True or False, got 'yes'"):
        sz.Smoother(sz.build_model("lenet", split_index=1), 0.5, fused_kernels="yes")
    with pytest.raises(ValueError, match="fused_kernels=True needs f_R on a CUDA device"):
        FusionChoice(True, torch.device("cpu"))
    # on the CPU measured where the C++ conv + ReLU + pool kernel is built (tests/kernels/test_native_conv_pool.py)
    assert FusionChoice(None, torch.device("cpu")).considered == cpu_sites_have_a_kernel()
    assert not FusionChoice(False, torch.device("cpu")).considered and not _choice(False).considered
    assert _choice().considered and _choice(True).considered


def _at(rows: int) -> Variant:
    """The plain channels_last variant of a batch of ``rows`` (what a fusion decision is keyed by)."""
    return Variant(channels_last=True, pooled=False, rows=rows)


class _StandInSite(ConvReLU):
    """A fused site whose forms a test controls: the unfused form slowed by 2 ms (so a healthy fused form measures
    faster), the fused one slowed by ``delay`` s, off by ``offset`` or raising as a kernel without an image would."""

    def __init__(self, conv: nn.Conv2d, delay: float = 0.0, offset: float = 0.0, broken: bool = False):
        super().__init__(conv)
        self.delay, self.offset, self.broken = delay, offset, broken

    def fused_forward(self, x):
        if self.broken:
            raise RuntimeError("no kernel image is available for execution on the device")
        time.sleep(self.delay)
        return F.relu(self.conv(x)) + self.offset  # what the fused form computes off CUDA, without the 2 ms

    def unfused_forward(self, x):
        time.sleep(2e-3)
        return super().unfused_forward(x)


def _three_sites(**middle):
    """A plain conv chain of three conv + ReLU sites and its fused copy of stand-in sites ("0", "1", "2"), the
    middle one made with ``middle``."""
    torch.manual_seed(4)
    convs = [nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 4, 3, padding=1)]
    head = [nn.Flatten(), nn.Linear(4 * 6 * 6, 5)]
    plain = nn.Sequential(*itertools.chain.from_iterable((c, nn.ReLU()) for c in convs), *head).eval()
    fused = nn.Sequential(_StandInSite(convs[0]), _StandInSite(convs[1], **middle), _StandInSite(convs[2]),
                          *head).eval()
    return plain, fused


def _scores(net, batch):
    with torch.no_grad():
        return net(batch)


def _choose_sites(choice: FusionChoice, plain: nn.Module, fused: nn.Module, rows: int = 8):
    batch = torch.randn(rows, 3, 6, 6, generator=_gen(7))
    return choice.choose(_at(rows), lambda b: _scores(plain, b), fused, _scores, lambda: batch, lambda: 1e-3)


def _fused_names(net: nn.Module) -> list[str]:
    return [name for name, site in fused_sites(net).items() if site.fused]


def test_one_slow_site_stays_unfused_and_the_others_run_fused(lenient):
    """The decision is per site, on the activation each sees: the middle site's fused form measured slower keeps
    it unfused (no warning: the measurement working), the two others run fused; the copy returned shares the fused
    copy's parameters and leaves its switches alone; every site's timing is in the variant's record."""
    plain, fused = _three_sites(delay=0.02)
    choice = _choice()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = _choose_sites(choice, plain, fused)
    assert _fused_names(net) == ["0", "2"] and _fused_names(fused) == ["0", "1", "2"]
    assert all(p is q for p, q in zip(net.parameters(), fused.parameters()))
    decision = choice.decisions[_at(8)]
    assert decision.used and decision.reason.startswith("2 of 3 sites fused at batch 8: plain ")
    sites = choice.records()[0]["sites"]
    assert [sites[name]["used"] for name in "012"] == [True, False, True]
    assert sites["1"]["fused_s"] > 0.02 > sites["1"]["plain_s"] and sites["1"]["reason"].startswith(
        "measured on 8x6x6x6: plain ")
    torch.testing.assert_close(_scores(net, torch.ones(2, 3, 6, 6)), _scores(plain, torch.ones(2, 3, 6, 6)))


@pytest.mark.parametrize("middle, why", [(dict(broken=True), r"failed: RuntimeError: no kernel image"),
                                         (dict(offset=0.5), r"its output differs from the unfused layer's by 0\.5")])
def test_one_failing_or_differing_site_stays_unfused_with_one_warning(lenient, middle, why):
    plain, fused = _three_sites(**middle)
    choice = _choice()
    with pytest.warns(UserWarning, match=rf"fused kernels are not used at 1 \({why}.*\); those layers run unfused"):
        net = _choose_sites(choice, plain, fused)
    assert _fused_names(net) == ["0", "2"] and choice.decisions[_at(8)].used
    assert not dict(choice.decisions[_at(8)].sites)["1"].used
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per engine
        assert _fused_names(_choose_sites(choice, plain, fused, rows=16)) == ["0", "2"]


def test_a_later_engine_takes_each_sites_verdict_from_memory(lenient, monkeypatch, tmp_path):
    """Per site, as measured: a later engine (same f_R structure and batch) times no site, never runs the fused
    form of the site remembered slower, and still checks the fused forms it uses; the sites' reasons say so."""
    import splitz_fast.sampling.memory as memory

    monkeypatch.setenv(memory.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setattr(memory, "machine_key", lambda device: ["stand-in card"])  # no GPU to name here
    plain, fused = _three_sites(delay=0.02)
    first = _choice()
    first.memory_key = lambda: (repr(plain), "bfloat16")
    assert _fused_names(_choose_sites(first, plain, fused)) == ["0", "2"]
    monkeypatch.setattr(choices, "seconds_per_call", lambda *args, **kwargs: pytest.fail("timed"))
    ran = []
    fused[1].fused_forward = lambda x: pytest.fail("the site remembered slower ran fused")
    fused[2].fused_forward = lambda x, site=fused[2]: ran.append(2) or F.relu(site.conv(x))
    second = _choice()
    second.memory_key = first.memory_key
    # site 2 ran fused twice: its own check, then the check of the copy with its sites switched
    assert _fused_names(_choose_sites(second, plain, fused)) == ["0", "2"] and ran == [2, 2]
    sites = second.records()[0]["sites"]
    assert all(sites[name]["reason"].startswith("remembered (measured on 8x") for name in "012")


def test_a_failing_site_raises_under_splitz_strict(monkeypatch):
    monkeypatch.setenv("SPLITZ_STRICT", "1")
    plain, fused = _three_sites(broken=True)
    with pytest.raises(RuntimeError, match=r"not used at 1 \(failed: RuntimeError.*SPLITZ_STRICT=1"):
        _choose_sites(_choice(), plain, fused)


def test_forced_fusion_checks_every_site_and_times_none(lenient, monkeypatch):
    """fused_kernels=True fuses every site that runs and computes alike, without timing; a differing site stays
    unfused, reported; with no site fused the plain copy samples."""
    monkeypatch.setattr(choices, "seconds_per_call", lambda *args, **kwargs: pytest.fail("timed"))
    plain, fused = _three_sites(delay=0.01)
    forced = _choice(True)
    assert _fused_names(_choose_sites(forced, plain, fused)) == ["0", "1", "2"]
    assert forced.decisions[_at(8)].reason == "fused_kernels=True"
    torch.manual_seed(4)
    lone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten()).eval()
    with pytest.warns(UserWarning, match="not used at 0"):
        assert _choose_sites(forced, lone, nn.Sequential(_StandInSite(lone[0], offset=1.0), nn.Flatten())) is None
    assert not forced.decisions[_at(8)].used


def test_the_engine_decides_once_per_layout_and_batch_and_again_after_an_edit(monkeypatch):
    """PreparedClassifier.chosen asks the choice once per (layout, batch), hands back the copy it chose, and forgets
    its decisions when f_R changes (checked without a GPU: moves stubbed, timings scripted)."""
    model = _randomized_resnet("cifar_resnet20", 1)
    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)
    monkeypatch.setenv("SPLITZ_MEMORY", "0")  # within one engine (the memory across engines names the card: none here)
    engine = SamplingEngine(model.right, 10, 0.25, torch.device("cuda"))
    engine.prepared.check_current()
    asked = []
    original = FusionChoice.choose

    def choose(self, key, *args):
        asked.append(key)
        return original(self, key, *args)

    monkeypatch.setattr(FusionChoice, "choose", choose)
    timings = itertools.cycle([1.0, 0.5])  # plain, then fused: every fused site measures faster
    monkeypatch.setattr(choices, "seconds_per_call", lambda call, device, rounds: next(timings))
    latent = model.left(torch.rand(2, 3, 32, 32, generator=_gen(3)))[0]
    example = lambda: latent.expand(8, *latent.shape).contiguous(memory_format=torch.channels_last)  # noqa: E731

    def scores(net, batch):
        with torch.no_grad():
            return net(batch)

    first = engine.prepared.chosen(_at(8), engine.fusion, scores, example, lambda: 1e-2)
    again = engine.prepared.chosen(_at(8), engine.fusion, scores, example, lambda: 1e-2)
    assert first == again and len(asked) == 1 and first[1].fused and engine.fusion.decisions[_at(8)].used
    shared = engine.prepared.get(True, False, fused=True)
    assert has_fused_modules(first[0]) and _fused_names(first[0]) == list(fused_sites(shared))
    assert all(p is q for p, q in zip(first[0].parameters(), shared.parameters()))
    engine.prepared.chosen(_at(16), engine.fusion, scores, example, lambda: 1e-2)
    assert len(asked) == 2
    with torch.no_grad():
        model.right[0][0].conv1.weight.mul_(1.5)  # an edit: the copies and their decisions are rebuilt
    engine.prepared.check_current()
    engine.prepared.chosen(_at(8), engine.fusion, scores, example, lambda: 1e-2)
    assert len(asked) == 3


# ---------------------------------------------------------------------------------------------------------- GPU


@_gpu
@pytest.mark.parametrize("precision", ["float32", "tf32", "bfloat16"])
@pytest.mark.parametrize("add", [False, True])
def test_fused_cudnn_calls_match_the_unfused_kernels(precision, add):
    """torch.cudnn_convolution_relu / _add_relu on channels_last CUDA tensors (as the engine runs them) against
    conv + add + ReLU in the same precision; the fused call is accepted (no fallback)."""
    from splitz_fast.cuda_math import cuda_math
    from splitz_fast.sampling.engine import PRECISIONS

    torch.manual_seed(7)
    conv = nn.Conv2d(16, 32, 3, padding=1).cuda().eval().to(memory_format=torch.channels_last)
    x = torch.randn(64, 16, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    z = torch.randn(64, 32, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    module = ConvAddReLU(conv) if add else ConvReLU(conv)
    dtype = PRECISIONS[precision]
    autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad(), autocast, cuda_math(torch.device("cuda"), tf32=precision == "tf32"):
        xs = x.to(dtype)
        got = module(xs, z.to(dtype)) if add else module(xs)
        want = F.relu(conv(xs) + z.to(dtype)) if add else F.relu(conv(xs))
    assert module.fused and got.dtype == want.dtype and got.shape == want.shape
    # The engine's acceptance rule (score_checks.copy_tolerance): within ACCEPT_FACTOR x the unfused kernels' own
    # rounding, measured against float64.
    exact = F.relu(F.conv2d(xs.double(), conv.weight.double(), conv.bias.double(), padding=1)
                   + (z.to(dtype).double() if add else 0))
    rounding, scale = score_gap(want.flatten(1), exact.flatten(1))
    gap, _ = score_gap(got.flatten(1), want.flatten(1))
    assert gap <= ACCEPT_FACTOR * max(rounding / scale, ROUNDING_UNIT[precision]) * scale


@_gpu
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_fused_resnet_certifies_like_the_unfused_one(precision):
    """CIFAR ResNet-20 at s = 1 on CUDA: through the fused copy (fused_kernels=True) cuDNN accepts every fused call,
    and the certificates (through the engine's default CUDA graph choice) are those of the plain f_R up to votes on
    the decision boundary; the default measures and records its choice."""
    model = _randomized_resnet("cifar_resnet20", 1).cuda()
    xs = torch.rand(3, 3, 32, 32, generator=_gen(8)).cuda()
    results = {}
    for setting in (False, True, None):
        smoother = sz.Smoother(model, 0.25, precision=precision, fused_kernels=setting)
        results[setting] = list(smoother.certify_many(xs, 64, 2000, 0.001, seeds=range(3), batch_size=512))
        decisions = smoother.engine().fusion.decisions
        assert [d.used for d in decisions.values()] in (([],) if setting is False else ([True], [False]))
        if setting:
            assert decisions[_at(512)].used
            fused = [m for m in smoother.engine().prepared.get(channels_last=True, fused=True).modules()
                     if isinstance(m, (ConvReLU, ConvAddReLU))]
            assert len(fused) == 18 and all(m.fused for m in fused)
    for off, on in zip(results[False], results[True]):
        assert off.prediction == on.prediction and abs(off.count_a - on.count_a) <= 0.01 * off.n
