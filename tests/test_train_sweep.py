"""Sweep grids: SPEC 7.6's 3 x 3 x 3 per recipe, the recipes' optimizer groups, the matched-loss pair."""

import json
from pathlib import Path

import pytest
import torch

from spectral_ops.optim import SpectralMuon
from spectral_ops.train import Transformer, preset
from spectral_ops.train.__main__ import main, parser, sweep_plan
from spectral_ops.train.optimizers import param_groups
from spectral_ops.train.sweep import MODULE_WISE_STEPS, closest_loss_pair, grid

# SPEC 7.6 as printed (7 significant digits).
SPEC_LRS = (8e-4, 2.529822e-3, 8e-3)
SPEC_COEFFICIENTS = (8e-5, 2.529822e-4, 8e-4)
# Half a unit in the 7th printed digit of 2.529822: the SPEC's rounding of the computed midpoints.
PRINTED = 0.5e-6 / 2.529822


def plan(*flags):
    return sweep_plan(parser().parse_args(["sweep", *flags]))


def test_module_wise_protocol_is_27_distinct_spec_configurations_per_recipe():
    base, axes = plan("--protocol", "module-wise")
    configs = grid(base, Path("out"), **axes)
    assert base.steps == MODULE_WISE_STEPS == 7268
    by_recipe = {}
    for config in configs:
        by_recipe.setdefault(config.notes["recipe"], []).append(config)
    assert {name: len(runs) for name, runs in by_recipe.items()} == {"p1": 27, "pA0pM2": 27}
    for name, powers in (("p1", (1, 1)), ("pA0pM2", (0, 2))):
        runs = by_recipe[name]
        points = {(c.lr, c.lambda_attention, c.lambda_mlp) for c in runs}
        assert len(points) == 27 and len({c.out_dir for c in runs}) == 27
        for axis, spec in zip(zip(*sorted(points)), (SPEC_LRS, SPEC_COEFFICIENTS, SPEC_COEFFICIENTS)):
            assert sorted(set(axis)) == pytest.approx(spec, rel=PRINTED)
        for c in runs:
            assert (c.optimizer, c.convention, c.weight_decay, (c.p_attention, c.p_mlp)) == \
                ("muon", "independent", 0.0, powers)


def test_protocol_defaults_yield_to_flags():
    base, axes = plan("--protocol", "module-wise", "--steps", "5", "--lrs", "0.01", "--recipes", "p1")
    assert base.steps == 5 and len(grid(base, Path("out"), **axes)) == 9
    base, axes = plan("--protocol", "coefficient-response", "--preset", "paper8")
    # SPEC 7.4's grid; the protocol sets no config field, so the preset's steps stand.
    assert (axes["powers"], axes["coefficients"], base.steps) == ((0, 1, 2, 4), (0.003, 0.01, 0.03),
                                                                  preset("paper8").steps)


def test_p1_recipe_decays_attention_and_mlp_like_ordinary_decay_with_their_own_coefficients():
    base = preset("tiny", n_layers=1, d_model=32, n_heads=2)
    (config,) = grid(base, Path("out"), recipes=["p1"], attention_coefficients=[0.03], mlp_coefficients=[0.3])
    torch.manual_seed(0)
    model = Transformer(config.model_config())
    groups = [g for g in param_groups(model, config) if g.get("algorithm") != "adamw"]
    expected = {"q": 0.03, "k": 0.03, "v": 0.03, "o": 0.03, "mlp_in": 0.3, "mlp_out": 0.3}
    assert {g["role"]: g["spectral_weight_decay"] for g in groups} == expected
    ordinary = [{**g, "p": 1, "spectral_weight_decay": 0.0, "weight_decay": expected[g["role"]]} for g in groups]
    weights = [p.detach().clone() for g in groups for p in g["params"]]
    gradients = [torch.randn_like(w) for w in weights]
    results = []
    for recipe_groups in (groups, ordinary):
        parameters = [torch.nn.Parameter(w.clone()) for w in weights]
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient
        chunks = iter(parameters)
        optimizer = SpectralMuon([{**g, "params": [next(chunks) for _ in g["params"]]} for g in recipe_groups],
                                 lr=config.lr, precision="fp32")
        optimizer.step()
        results.append(parameters)
    # S_1(W) = W: the same multiply by (1 - eta_t lambda) either way, so the weights agree bitwise.
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not any(torch.equal(a, w) for a, w in zip(results[0], weights))


def test_v_recipes_run_lambda_free_recipes_once():
    configs = grid(preset("tiny"), Path("out"), recipes=["HHH", "HHF+p2V"], coefficients=[1e-5, 5e-4])
    assert [Path(c.out_dir).name for c in configs] == ["HHH", "HHF+p2V_lam1e-05", "HHF+p2V_lam0.0005"]
    assert [c.lambda_v for c in configs] == [None, 1e-5, 5e-4]


def test_closest_loss_pair_crosses_recipes():
    rows = [{"run": "a", "recipe": "p1", "val_bpb": 2.0}, {"run": "b", "recipe": "p1", "val_bpb": 2.01},
            {"run": "c", "recipe": "pA0pM2", "val_bpb": 2.1}, {"run": "d", "recipe": "pA0pM2", "val_bpb": 2.5}]
    assert [row["run"] for row in closest_loss_pair(rows)] == ["b", "c"]
    assert closest_loss_pair(rows[:2]) is None


def test_a_reduced_module_wise_sweep_writes_its_summary_and_matched_pair(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("spectral decay shapes the singular values of every matrix. " * 400)
    main(["sweep", "--protocol", "module-wise", "--n-layers", "1", "--d-model", "32", "--n-heads", "2",
          "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--log-every", "2", "--val-batches", "1",
          "--data", str(corpus), "--lrs", "0.01", "--attention-coefficients", "0.001",
          "--mlp-coefficients", "0.002", "--out", str(tmp_path / "sweep")])
    rows = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert [(row["recipe"], row["lambda_A"], row["lambda_M"], row["lr"]) for row in rows] == \
        [("p1", 0.001, 0.002, 0.01), ("pA0pM2", 0.001, 0.002, 0.01)]
    matched = json.loads((tmp_path / "sweep" / "matched_loss.json").read_text())
    assert {run["recipe"] for run in matched["runs"]} == {"p1", "pA0pM2"}
    assert "Matched loss" in (tmp_path / "sweep" / "matched_loss.md").read_text()
