"""SpectralSGD against torch.optim.SGD, and the p = 0 proximal mode against the SVD soft-threshold."""

import pytest
import torch

import spectral_ops as so
from spectral_ops.linalg import matrix_with_spectrum, relative_error
from spectral_ops.optim import SpectralSGD

from optim_models import assert_same_trajectory, tiny_model, train


@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_torch_sgd_without_decay(nesterov):
    model_a, model_b = tiny_model(), tiny_model()
    ours = SpectralSGD(model_a.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov)
    theirs = torch.optim.SGD(model_b.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, foreach=False)
    # Same operations in the same order: only fp32 round-off can differ.
    assert_same_trajectory(train(model_a, ours, 20), train(model_b, theirs, 20), 1e-6)


def test_decoupled_ordinary_decay():
    W0 = matrix_with_spectrum((10, 6), torch.linspace(1, 2, 6), torch.float64, seed=1)
    param = torch.nn.Parameter(W0.clone())
    param.grad = torch.ones_like(W0)
    SpectralSGD([param], lr=0.1, momentum=0.0, weight_decay=0.5).step()
    assert relative_error(param.detach(), W0 * (1 - 0.05) - 0.1) < 1e-15


def gapped(seed):
    spectrum = torch.cat([torch.linspace(2.0, 3.0, 4), torch.linspace(0.1, 0.5, 4)]).double()
    return matrix_with_spectrum((12, 8), spectrum, torch.float64, seed=seed)


def test_prox_mode_is_singular_value_soft_thresholding():
    W0 = gapped(2)
    param = torch.nn.Parameter(W0.clone())
    param.grad = torch.zeros_like(W0)
    SpectralSGD([param], lr=0.5, momentum=0.0, p=0, spectral_weight_decay=2.0, p0_mode="prox").step()
    assert relative_error(param.detach(), so.reference.svt_svd(W0, 1.0)) < 1e-10


@pytest.mark.parametrize("mode", ["top", "bot", "top_only", "bot_only", "two_band", "clip"])
def test_band_options(mode):
    W0 = gapped(3)
    param = torch.nn.Parameter(W0.clone())
    param.grad = torch.zeros_like(W0)
    band = {"tau": 1.0, "mode": mode, "p_bot": 0, "spectral_weight_decay_bot": 0.2}
    p = 1 if mode == "clip" else 2  # the clipped decay: s -> s - c (s - tau)_+, whatever p would say
    SpectralSGD([param], lr=0.1, momentum=0.0, p=p, spectral_weight_decay=0.3, band=band).step()
    if mode == "two_band":
        direction = so.reference.band_direction_svd(W0, 1.0, 2, mode, p_bot=0, lambda_top=0.3, lambda_bot=0.2)
        expected = W0 - 0.1 * direction
    else:
        expected = W0 - 0.1 * 0.3 * so.reference.band_direction_svd(W0, 1.0, p, mode)
    assert relative_error(param.detach(), expected) < 1e-10


def test_bad_momentum_settings():
    with pytest.raises(ValueError, match="momentum"):
        SpectralSGD(tiny_model().parameters(), momentum=1.5)
    with pytest.raises(ValueError, match="Nesterov"):
        SpectralSGD(tiny_model().parameters(), momentum=0.0, nesterov=True)
