"""Role-based parameter groups, the SPEC 4 recipes and the width rule."""

import math

import pytest
import torch

from spectral_ops.optim import (
    SpectralAdamW,
    SpectralMuon,
    full_v_extra_decay,
    module_wise_powers,
    param_groups_by_module,
    width_scaled_hyperparameters,
    width_transfer,
)


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
