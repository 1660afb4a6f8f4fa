"""SpectralAdamW against torch.optim.AdamW and the SVD reference (SPEC 1.5)."""

import copy

import pytest
import torch

import spectral_ops as so
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.optim import SpectralAdamW

from optim_models import assert_same_trajectory, tiny_model, train

# Same operations in the same order as torch's single-tensor AdamW, so the only allowed difference
# is fp32 round-off accumulated over 20 steps of size ~lr: 20 * 1e-2 * 2^-24 ~ 1e-8; 1e-6 is slack.
ROUNDOFF_20_STEPS = 1e-6


def test_p1_through_weight_decay_matches_torch_adamw():
    model_a, model_b = tiny_model(), tiny_model()
    ours = SpectralAdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert_same_trajectory(train(model_a, ours, 20), train(model_b, theirs, 20), ROUNDOFF_20_STEPS)


def test_p1_through_spectral_weight_decay_matches_torch_adamw():
    # S_1(W) = W, so lambda_p with p = 1 is ordinary decay; the spectral term acts on matrices only,
    # hence a bias-free model.
    model_a, model_b = tiny_model(bias=False), tiny_model(bias=False)
    ours = SpectralAdamW(model_a.parameters(), lr=1e-2, weight_decay=0.0, p=1, spectral_weight_decay=0.1)
    theirs = torch.optim.AdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert_same_trajectory(train(model_a, ours, 20), train(model_b, theirs, 20), ROUNDOFF_20_STEPS)


@pytest.mark.parametrize("p", range(5))
def test_each_power_gives_the_spec_update_from_pre_update_weights(p):
    W0 = matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 10), torch.float64, seed=p)
    gradient = matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 3), torch.float64, seed=50 + p)
    ours, theirs = W0.clone().requires_grad_(), W0.clone().requires_grad_()
    ours.grad, theirs.grad = gradient.clone(), gradient.clone()
    lr, lam_p, lam_1 = 1e-2, 0.3, 0.1
    SpectralAdamW([ours], lr=lr, weight_decay=lam_1, p=p, spectral_weight_decay=lam_p).step()
    torch.optim.AdamW([theirs], lr=lr, weight_decay=lam_1, foreach=False).step()
    # torch's step = W0 (1 - lr lam_1) - Adam; ours must subtract lr lam_p S_p(W0) on top.
    expected = theirs.detach() - lr * lam_p * so.reference.spectral_power_svd(W0, p)
    assert relative_error(ours.detach(), expected) < 1e-12


def test_tensor_lr_matches_float_lr():
    model_a, model_b = tiny_model(), tiny_model()
    a = SpectralAdamW(model_a.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, p=2, spectral_weight_decay=0.05)
    b = SpectralAdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, p=2, spectral_weight_decay=0.05)
    assert_same_trajectory(train(model_a, a, 5), train(model_b, b, 5), 1e-6)


def test_state_dict_round_trip_continues_bitwise():
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.05)
    train(model, optimizer, 5)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    continued = train(model, optimizer, 5, start=5)

    restored_model = tiny_model(seed=99)
    restored_model.load_state_dict(saved_model)
    restored = SpectralAdamW(restored_model.parameters(), lr=1.0)
    restored.load_state_dict(saved_optimizer)
    assert restored.param_groups[0]["p"] == 2
    assert_same_trajectory(continued, train(restored_model, restored, 5, start=5), atol=0)


def test_per_group_options_and_independent_convention_with_a_scheduler():
    W = matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10), torch.float64, seed=3)
    param = W.clone().requires_grad_()
    param.grad = torch.zeros_like(W)  # a zero gradient leaves Adam's update at exactly zero
    optimizer = SpectralAdamW([{"params": [param], "p": 2, "spectral_weight_decay": 0.5,
                                "convention": "independent", "weight_decay": 0.0}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.25)
    optimizer.step()
    # eta_t = 0.25 (lr 0.025 / peak 0.1): the independent convention scales by eta_t, not lr.
    assert relative_error(param.detach(), so.reference.spectral_decay_svd(W, 2, 0.25, 0.5)) < 1e-12
    assert scheduler.get_last_lr() == [0.025]



def test_independent_convention_divides_the_lr_by_the_groups_peak_lr():
    W = matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10), torch.float64, seed=3)
    options = {"p": 2, "spectral_weight_decay": 0.5, "convention": "independent", "weight_decay": 0.0}
    expected = so.reference.spectral_decay_svd(W, 2, 0.25, 0.5)  # eta_t = lr 0.1 / peak_lr 0.4

    def decayed(group, lr):
        param = W.clone().requires_grad_()
        param.grad = torch.zeros_like(W)  # Adam's update is then exactly zero
        optimizer = SpectralAdamW([{"params": [param], **options, **group}], lr=lr)
        assert optimizer.param_groups[0]["peak_lr"] == 0.4
        optimizer.param_groups[0]["lr"] = 0.1  # as the training loop schedules: peak_lr x multiplier
        optimizer.step()
        return param.detach()

    assert relative_error(decayed({}, lr=0.4), expected) < 1e-12  # by default, the starting lr
    assert relative_error(decayed({"peak_lr": 0.4}, lr=0.1), expected) < 1e-12

def test_stability_guard_in_the_optimizer(caplog):
    big = matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10) * 10, torch.float64, seed=4)
    param = big.clone().requires_grad_()
    param.grad = torch.zeros_like(big)
    with pytest.raises(so.SpectralStabilityError):
        SpectralAdamW([param], lr=0.1, p=2, spectral_weight_decay=2.0, weight_decay=0, stability="raise").step()
    assert torch.equal(param.detach(), big)
    # The optimizers' default is "clamp": a long run does not die on one aggressive step.
    optimizer = SpectralAdamW([param], lr=0.1, p=2, spectral_weight_decay=2.0, weight_decay=0)
    assert optimizer.param_groups[0]["stability"] == "clamp"
    with caplog.at_level("WARNING", logger="spectral_ops"):
        optimizer.step()
    assert "stability='clamp' reduced the spectral coefficient" in caplog.text  # the first clamp is logged
    assert (torch.linalg.svdvals(param.detach()) > 0).all()
    assert [int(record.count) for record in optimizer.clamped.values()] == [1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "lr"),
    (dict(p=-1), "p"),
    (dict(spectral_weight_decay=-0.1), "weight_decay"),
    (dict(convention="sometimes"), "convention"),
    (dict(band={"tau": 0.0}), "tau"),
    (dict(betas=(1.0, 0.999)), "betas"),
    (dict(p0_mode="soft"), "p0_mode"),
])
def test_bad_hyper_parameters_raise_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SpectralAdamW(tiny_model().parameters(), **kwargs)


def test_a_bad_added_group_is_not_kept():
    optimizer = SpectralAdamW(tiny_model()[0].parameters())
    with pytest.raises(ValueError):
        optimizer.add_param_group({"params": tiny_model()[2].parameters(), "p": -2})
    assert len(optimizer.param_groups) == 1


def test_a_state_saved_before_capturable_with_a_plain_step_count_resumes_identically():
    # Old or converted checkpoints: no "capturable" group key, and Adam step counts as plain numbers
    # (torch's Adam converts those; so must we).
    model, reference_model = tiny_model(), tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.05)
    reference = SpectralAdamW(reference_model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.05)
    train(model, optimizer, 3)
    train(reference_model, reference, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    for group in saved["param_groups"]:
        del group["capturable"]
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())
    restored = SpectralAdamW(model.parameters(), lr=1.0)
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["capturable"] is False
    assert_same_trajectory(train(model, restored, 3, start=3), train(reference_model, reference, 3, start=3), 0.0)


def test_a_state_with_a_band_loads_with_weights_only(tmp_path):
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.05, band=so.Band(0.5, "top"))
    train(model, optimizer, 1)
    torch.save(optimizer.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state["param_groups"][0]["band"] == {"tau": 0.5, "mode": "top", "p_bot": 1, "spectral_weight_decay_bot": 0.0,
                                                "sign_steps": None, "sign_method": "polar_express"}
    SpectralAdamW(model.parameters()).load_state_dict(state)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_any_one_element_lr_tensor_is_accepted_and_followed_in_place(shape):
    model_a, model_b = tiny_model(), tiny_model()
    lr = torch.full(shape, 1e-2)
    ours = SpectralAdamW(model_a.parameters(), lr=lr, p=2, spectral_weight_decay=0.05)
    reference = SpectralAdamW(model_b.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.05)
    history_a, history_b = train(model_a, ours, 2), train(model_b, reference, 2)
    lr.fill_(5e-3)  # the user's tensor, changed in place, still drives the step
    reference.param_groups[0]["lr"] = 5e-3
    history_a += train(model_a, ours, 2, start=2)
    history_b += train(model_b, reference, 2, start=2)
    assert_same_trajectory(history_a, history_b, ROUNDOFF_20_STEPS)


def test_errors_name_the_users_keys():
    with pytest.raises(ValueError, match="^weight_decay must be >= 0"):
        SpectralAdamW(tiny_model().parameters(), weight_decay=-0.1)
    with pytest.raises(ValueError, match="^spectral_weight_decay must be >= 0"):
        SpectralAdamW(tiny_model().parameters(), p=2, spectral_weight_decay=-0.1)
