"""SpectralDecay bolted onto other optimizers."""

import pytest
import torch

import spectral_ops as so
from spectral_ops.optim import SpectralAdamW, SpectralDecay
from spectral_ops.testing import log_spaced_spectrum, matrix_with_spectrum, relative_error

from optim_models import assert_same_trajectory, tiny_model, train


def matrices(model):
    return [p for p in model.parameters() if p.ndim == 2]


@pytest.mark.parametrize("convention", ["decoupled", "independent"])
def test_attached_to_torch_adamw_equals_spectral_adamw(convention):
    model_a, model_b = tiny_model(), tiny_model()
    host = torch.optim.AdamW(model_a.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    SpectralDecay(matrices(model_a), p=2, weight_decay=0.05, convention=convention).attach(host)
    reference = SpectralAdamW(
        [{"params": matrices(model_b), "p": 2, "spectral_weight_decay": 0.05},
         {"params": [p for p in model_b.parameters() if p.ndim < 2]}],
        lr=1e-2, weight_decay=0.0, convention=convention,
    )
    # Both follow the lr of a decaying schedule; the decay runs before each host step.
    host_schedule = torch.optim.lr_scheduler.StepLR(host, step_size=3, gamma=0.5)
    reference_schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=3, gamma=0.5)
    assert_same_trajectory(train(model_a, host, 12, scheduler=host_schedule),
                           train(model_b, reference, 12, scheduler=reference_schedule), 1e-6)


def test_standalone_step_and_detach():
    W0 = matrix_with_spectrum((16, 8), log_spaced_spectrum(8, 10), torch.float64, seed=1)
    param = torch.nn.Parameter(W0.clone())
    param.grad = torch.zeros_like(W0)
    decay = SpectralDecay([param], p=4, weight_decay=0.2, lr=0.1)
    decay.step()
    assert relative_error(param.detach(), so.reference.spectral_decay_svd(W0, 4, 0.1, 0.2)) < 1e-12
    host = torch.optim.SGD([param], lr=0.0)
    decay.attach(host)
    with pytest.raises(RuntimeError, match="already attached"):
        decay.attach(host)
    decay.detach()
    before = param.detach().clone()
    host.step()
    assert torch.equal(param.detach(), before)


def test_standalone_step_needs_an_lr():
    param = torch.nn.Parameter(torch.ones(4, 4))
    param.grad = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="lr="):
        SpectralDecay([param], p=2, weight_decay=0.1).step()


def test_parameters_unknown_to_the_host_are_reported():
    a, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4))
    a.grad, b.grad = torch.zeros(4, 4), torch.zeros(4, 4)
    host = torch.optim.SGD([a], lr=0.1)
    SpectralDecay([a, b], p=2, weight_decay=0.1).attach(host)
    with pytest.raises(ValueError, match="does not optimise"):
        host.step()


def test_state_dict_round_trip_of_the_groups():
    decay = SpectralDecay(tiny_model().parameters(), p=2, weight_decay=0.1, band={"tau": 1.0, "mode": "top"})
    state = decay.state_dict()
    other = SpectralDecay(tiny_model().parameters(), p=1)
    other.load_state_dict(state)
    assert other.param_groups[0]["p"] == 2 and other.param_groups[0]["band"] == {"tau": 1.0, "mode": "top"}
