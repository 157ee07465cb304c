"""The 0.1.0 spellings still work for one more minor version, with a DeprecationWarning that names the new spelling,
and give exactly what the new spelling gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.certify.margin import MarginCertifier
from splitz_fast.bounds.radius import DEPRECATED_BOUND_KEYWORDS

# One non-default value per 0.1.0 keyword of Smoother / MarginCertifier.
OLD_SPELLINGS = {
    "bound": "global", "bound_method": "exact", "bound_delta": 1e-4, "power_iters": 50, "exact_max_dim": 512,
    "gamma_search": "one-step", "gamma_steps": 5, "gamma_batch": 4, "reference_lipschitz": 1.5, "gamma_max": 3.0,
}


def _model() -> sz.SplitModel:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return sz.split_sequential(net, 1, num_classes=3, input_shape=(4,), threshold=1.0)


def test_every_old_keyword_is_covered():
    assert set(OLD_SPELLINGS) == set(DEPRECATED_BOUND_KEYWORDS)


@pytest.mark.parametrize("keyword", sorted(OLD_SPELLINGS))
def test_smoother_old_keyword_warns_and_means_the_bound_option(keyword):
    value = OLD_SPELLINGS[keyword]
    with pytest.warns(DeprecationWarning, match=rf"Smoother\(\.\.\., {keyword}=.*deprecated.*0\.3\.0.*"
                                                rf"bound_options=BoundOptions\({keyword}="):
        old = sz.Smoother(_model(), 0.5, **{keyword: value})
    assert old.options == sz.BoundOptions(**{keyword: value})
    assert getattr(old.options, keyword) == value


def test_smoother_old_keywords_certify_like_the_new_spelling():
    model, x = _model(), torch.tensor([0.3, -0.2, 0.5, 0.1])
    with pytest.warns(DeprecationWarning):
        old = sz.Smoother(model, 0.5, bound="local", bound_method="exact", gamma_search="one-step")
    new = sz.Smoother(model, 0.5, bound_options=sz.BoundOptions(bound_method="exact", gamma_search="one-step"))
    a, b = old.certify(x, 20, 300, 0.01, seed=1), new.certify(x, 20, 300, 0.01, seed=1)
    assert (a.prediction, a.radius, a.lipschitz, a.bound_kind) == (b.prediction, b.radius, b.lipschitz, b.bound_kind)


def test_old_and_new_spelling_together_and_unknown_keywords_are_refused():
    with pytest.raises(TypeError, match="not both"):
        sz.Smoother(_model(), 0.5, bound_options=sz.BoundOptions(), bound_method="exact")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bound_methd'"):
        sz.Smoother(_model(), 0.5, bound_methd="exact")


def test_margin_certifier_old_keywords_warn_and_work():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    model = sz.split_sequential(net, 2, num_classes=3, input_shape=(4,), threshold=float("inf"))
    with pytest.warns(DeprecationWarning, match=r"MarginCertifier\(\.\.\., bound_method='exact'\)"):
        old = MarginCertifier(model, bound_method="exact")
    assert old.options == sz.BoundOptions(bound_method="exact")
    with pytest.raises(TypeError, match="no sigma"):
        MarginCertifier(model, sigma=0.5)


def test_the_version_is_the_changelogs_unreleased_one():
    """The package version moves with CHANGELOG.md: its first section names the version in development."""
    from pathlib import Path

    changelog = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text(encoding="utf-8")
    first = next(line for line in changelog.splitlines() if line.startswith("## ["))
    released = sz.__version__.split(".dev")[0]
    assert f"({released})" in first or f"[{released}]" in first, (sz.__version__, first)
