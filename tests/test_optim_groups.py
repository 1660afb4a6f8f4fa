"""Role-based parameter groups, the SPEC 4 recipes and the width rule."""

import math

import pytest
import torch

from spectral_ops.decay import Band
from spectral_ops.optim import (
    SpectralAdamW,
    SpectralMuon,
    full_v_extra_decay,
    module_wise_powers,
    param_groups_by_module,
    width_scaled_hyperparameters,
    width_transfer,
)
from spectral_ops.optim.groups import width_decay_factor


class Block(torch.nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.embed = torch.nn.Embedding(16, d)
        self.norm = torch.nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(d, 2 * d, bias=False)
        self.down_proj = torch.nn.Linear(2 * d, d, bias=False)
        self.extra = torch.nn.Linear(d, d, bias=False)
        self.lm_head = torch.nn.Linear(d, 16, bias=False)


def roles(groups):
    return {g["role"]: g for g in groups}


def test_roles_are_recognised_by_name():
    groups = roles(param_groups_by_module(Block()))
    assert set(groups) == {"embedding", "vector", "q", "k", "v", "o", "mlp_in", "mlp_out", "matrix", "head"}
    assert len(groups["mlp_in"]["params"]) == 2 and len(groups["vector"]["params"]) == 2
    for role in ("embedding", "vector", "head"):
        assert groups[role]["algorithm"] == "adamw" and groups[role]["weight_decay"] == 0.0


def test_patterns_can_be_overridden():
    groups = roles(param_groups_by_module(Block(), patterns={"mlp_in": r"extra\.weight$"}))
    assert len(groups["mlp_in"]["params"]) == 1 and "matrix" in groups


def test_module_wise_powers_recipe_builds_a_working_optimizer():
    model = Block()
    groups = roles(param_groups_by_module(model, module_wise_powers(lambda_attention=1e-3, lambda_mlp=2e-3)))
    assert groups["q"]["p"] == 0 and groups["o"]["p"] == 0 and groups["mlp_out"]["p"] == 2
    assert groups["v"]["convention"] == "independent" and groups["v"]["weight_decay"] == 0.0
    optimizer = SpectralMuon(list(groups.values()), lr=1e-2)
    tokens = torch.randint(0, 16, (4, 5))
    model.lm_head(model.down_proj(model.up_proj(model.q_proj(model.norm(model.embed(tokens)))))).sum().backward()
    optimizer.step()


def test_full_v_recipe():
    groups = roles(param_groups_by_module(Block(), full_v_extra_decay(lambda_v=1e-4, heads=2)))
    assert groups["q"]["heads"] == 2 and groups["v"]["heads"] is None
    assert groups["v"]["p"] == 2 and groups["v"]["spectral_weight_decay"] == 1e-4
    assert groups["v"]["weight_decay"] == 0.1 and groups["v"]["convention"] == "decoupled"
    SpectralMuon(list(groups.values()), lr=1e-2)


def test_width_scaled_hyperparameters():
    lr, wd = width_scaled_hyperparameters(1e-2, 0.1, 256, 1024)
    assert math.isclose(lr, 1e-2 / 4) and math.isclose(wd, 0.1 * 2)
    assert width_scaled_hyperparameters(1e-2, 0.1, 256, 1024, kind="vector") == (1e-2, 0.0)
    with pytest.raises(ValueError, match="kind must be"):
        width_scaled_hyperparameters(1e-2, 0.1, 256, 1024, kind="tensor")
    lr, wd = width_scaled_hyperparameters(1e-2, 0.1, 256, 1024, convention="independent")
    assert math.isclose(lr, 1e-2 / 4) and math.isclose(wd, 0.1 / 2)


def test_width_decay_factor_keeps_the_per_step_shrink_at_d_to_the_minus_half():
    # decoupled: shrink lr * lambda with lr ~ 1/d, so lambda ~ sqrt(d); independent: shrink lambda alone.
    assert math.isclose(width_decay_factor(64, 256, "decoupled"), 2.0)
    assert math.isclose(width_decay_factor(64, 256, "independent"), 0.5)
    for convention in ("decoupled", "independent"):
        lr_factor = 64 / 256 if convention == "decoupled" else 1.0  # the lr in the shrink, or none
        assert math.isclose(lr_factor * width_decay_factor(64, 256, convention), (256 / 64) ** -0.5)
    with pytest.raises(ValueError, match="convention must be"):
        width_decay_factor(64, 256, "coupled")
    with pytest.raises(ValueError, match="widths must be positive"):
        width_decay_factor(0, 256)


def test_width_transfer():
    groups = param_groups_by_module(Block(), {"attention": {"lr": 0.02, "weight_decay": 0.1},
                                              "mlp": {"lr": 0.02, "weight_decay": 0.1},
                                              "matrix": {"lr": 0.02, "weight_decay": 0.1}},
                                    non_matrix={"lr": 0.003, "weight_decay": 0.05})
    wide = roles(width_transfer(groups, base_width=256, width=1024))
    assert wide["q"]["lr"] == pytest.approx(0.02 / 4) and wide["q"]["weight_decay"] == pytest.approx(0.1 * 2)
    assert wide["vector"]["lr"] == 0.003 and wide["vector"]["weight_decay"] == 0.0
    assert roles(groups)["q"]["lr"] == 0.02, "the input groups are not modified"
    SpectralAdamW(list(wide.values()))
    with pytest.raises(ValueError, match="explicit lr"):
        width_transfer(param_groups_by_module(Block()), 256, 512)
    assert math.isclose(wide["mlp_in"]["weight_decay"], 0.2)


def test_an_override_for_an_unknown_role_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"unknown roles \['atention'\]"):
        param_groups_by_module(model, {"atention": {"p": 0}})
    # A known role the model happens not to have is fine (e.g. no separate head).
    param_groups_by_module(model, {"head": {"p": 0}})


def decayed_by_one_step(group: dict) -> torch.Tensor:
    """The weight after one SpectralAdamW step with a zero gradient: Adam's direction is 0, so only the decay
    (ordinary and spectral) moves it."""
    weight = group["params"][0]
    weight.grad = torch.zeros_like(weight)
    SpectralAdamW([group], stability="raise").step()
    return weight.detach()


@pytest.mark.parametrize("p", [1, 2])
def test_both_conventions_transfer_to_the_same_step(p):
    """Decoupled (lr 0.02, lambda 0.1) and independent (lambda 0.02 x 0.1) coefficients decay alike at the base
    width; after the width rule they still do, at the decoupled rule's shrink lr lambda (base/width)^1/2."""
    start = torch.linspace(-1, 1, 48, dtype=torch.float64).reshape(6, 8)
    lr, lam, base, width = 0.02, 0.1, 8, 32
    conventions = {"decoupled": lam, "independent": lr * lam}
    steps = {}
    for convention, coefficient in conventions.items():
        group = {"params": [torch.nn.Parameter(start.clone())], "role": "mlp_in", "lr": lr, "convention": convention,
                 "weight_decay": coefficient if p == 1 else 0.0, "p": p,
                 "spectral_weight_decay": coefficient if p != 1 else 0.0}
        steps[convention] = decayed_by_one_step(width_transfer([group], base, width)[0])
    shrink = lr * lam * (base / width) ** 0.5
    U, s, Vh = torch.linalg.svd(start, full_matrices=False)
    expected = U @ torch.diag(s - shrink * s**p) @ Vh
    # float64 throughout: only round-off of the polar iteration (p = 2) and of the SVD separates them.
    for convention in conventions:
        assert torch.allclose(steps[convention], expected, rtol=0, atol=1e-10), convention


def test_width_transfer_scales_peak_lr_with_lr():
    """Under the independent convention the decay is scaled by eta_t = lr / peak_lr: both move together, so
    eta_t is unchanged (0.5 here) and the decay is lambda x eta_t x (base/width)^1/2."""
    start = torch.eye(4, dtype=torch.float64)
    group = {"params": [torch.nn.Parameter(start.clone())], "role": "matrix", "lr": 0.01, "peak_lr": 0.02,
             "weight_decay": 0.2, "convention": "independent"}
    wide = width_transfer([group], 4, 16)[0]
    assert wide["lr"] / wide["peak_lr"] == pytest.approx(0.5)
    assert torch.allclose(decayed_by_one_step(wide), start * (1 - 0.5 * 0.2 * 0.5), rtol=0, atol=1e-15)


def test_width_transfer_scales_every_decay_coefficient_by_the_groups_convention():
    band = Band(tau=0.5, mode="two_band", p_bot=0, spectral_weight_decay_bot=0.4)
    options = {"lr": 0.02, "weight_decay": 0.1, "p": 2, "spectral_weight_decay": 0.3}
    groups = param_groups_by_module(Block(), {"mlp": {**options, "convention": "independent", "band": band},
                                              "attention": options, "matrix": options},
                                    non_matrix={"lr": 0.003, "spectral_weight_decay": 0.05})
    wide = roles(width_transfer(groups, base_width=16, width=64, convention="decoupled"))
    assert wide["q"]["spectral_weight_decay"] == pytest.approx(0.3 * 2), "no convention in the group: the argument's"
    assert wide["mlp_in"]["weight_decay"] == pytest.approx(0.1 / 2)
    assert wide["mlp_in"]["spectral_weight_decay"] == pytest.approx(0.3 / 2)
    assert wide["mlp_in"]["band"].spectral_weight_decay_bot == pytest.approx(0.4 / 2)
    assert wide["mlp_in"]["band"].tau == 0.5, "tau is a singular value, which the rule keeps Theta(1)"
    independent = roles(width_transfer(groups, 16, 64, convention="independent"))
    assert independent["q"]["weight_decay"] == pytest.approx(0.1 / 2)
    for role in ("embedding", "vector", "head"):  # vector-like: no decay, not even the optimizer's default
        assert wide[role]["weight_decay"] == 0.0 and wide[role]["spectral_weight_decay"] == 0.0
    SpectralAdamW(list(wide.values()))


@pytest.mark.parametrize("base_width, width", [(8, 0), (0, 8), (-8, 8)])
def test_width_transfer_refuses_widths_that_are_not_positive(base_width, width):
    """Checked before any group is touched, vector-like groups included (which need no factor)."""
    with pytest.raises(ValueError, match="widths must be positive"):
        width_transfer([{"params": [], "role": "vector", "lr": 1e-3}], base_width, width)


def test_the_former_name_polar_steps_sets_decay_steps_and_states_saved_under_it_load():
    W, V = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(3, 3))
    with pytest.warns(DeprecationWarning, match="decay_steps"):
        optimizer = SpectralAdamW([W], p=2, spectral_weight_decay=0.1, polar_steps=5)
    with pytest.warns(DeprecationWarning, match="decay_steps"):
        optimizer.add_param_group({"params": [V], "polar_steps": 4})
    assert [group["decay_steps"] for group in optimizer.param_groups] == [5, 4]
    assert all("polar_steps" not in group for group in optimizer.param_groups)
    state = optimizer.state_dict()
    for group in state["param_groups"]:  # as an earlier release saved it
        group["polar_steps"] = group.pop("decay_steps")
    fresh = SpectralAdamW([{"params": [W]}, {"params": [V]}], p=2, spectral_weight_decay=0.1)
    fresh.load_state_dict(state)
    assert [group["decay_steps"] for group in fresh.param_groups] == [5, 4]
    assert all("polar_steps" not in group for group in fresh.param_groups)
    with pytest.raises(TypeError, match="both decay_steps and polar_steps"):
        SpectralAdamW([W], decay_steps=5, polar_steps=5)
