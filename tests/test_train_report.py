"""The training report: SPEC 7.4's expand-matrix comparison, SPEC 7.5's fixed-input V metrics, the
per-family spectra and the probability-mass histograms.

Tolerances: D_shape and stable ranks come from float64 SVDs of exactly representable diagonal
matrices (1e-12). V activations of the tiny model are float32 inputs multiplied in float64 both by
the package and by hand, in the same order: 1e-10 leaves room for the SVD alone.
"""

import dataclasses
import functools
import json
import math

import pytest
import torch

from spectral_ops.train import Transformer, monitor, preset
from spectral_ops.train import data as data_module
from spectral_ops.train import report as report_module
from spectral_ops.train.__main__ import main, parser
from spectral_ops.train.loop import CHECKPOINT


def _diagonal_state(gate_spectra, up_spectra):
    state = {}
    for i, (gate, up) in enumerate(zip(gate_spectra, up_spectra)):
        state[f"layers.{i}.mlp.gate_proj.weight"] = torch.diag(torch.tensor(gate, dtype=torch.float64))
        state[f"layers.{i}.mlp.up_proj.weight"] = torch.diag(torch.tensor(up, dtype=torch.float64))
    return state


def test_expand_comparison_is_per_family_zero_with_itself_and_matches_a_hand_computation():
    a = _diagonal_state([[1.0, 0.1], [1.0, 1.0]], [[2.0, 1.0], [3.0, 3.0]])
    b = _diagonal_state([[2.0, 0.02], [5.0, 5.0]], [[2.0, 1.0], [3.0, 3.0]])
    same = report_module.expand_comparison(a, a)
    assert all(values == {"shape_distance": 0.0, "stable_rank_change_percent": 0.0} for values in same.values())
    compared = report_module.expand_comparison(a, b)
    assert set(compared) == {"mlp_gate", "mlp_up"}
    # gate, layer 0: r = (1, 0.1) vs (1, 0.01), |log10| differences (0, 1), mean 0.5; layer 1: flat in both, 0.
    assert math.isclose(compared["mlp_gate"]["shape_distance"], (0.5 + 0.0) / 2, rel_tol=1e-12)
    # stable ranks: layer 0 1.01 -> 1.0001, layer 1 2 -> 2.
    expected = 100 * ((1.0001 / 1.01 - 1) + 0.0) / 2
    assert math.isclose(compared["mlp_gate"]["stable_rank_change_percent"], expected, rel_tol=1e-12)
    assert compared["mlp_up"] == {"shape_distance": 0.0, "stable_rank_change_percent": 0.0}  # up did not move


def _run(name, p, coefficient, state=None):
    return {"name": name, "config": {"p": p, "spectral_weight_decay": coefficient}, "state": state}


def test_sweep_end_pairs_take_the_extreme_coefficients_at_each_power():
    runs = [_run("a", 1, 0.03), _run("b", 1, 0.01), _run("c", 1, 0.1), _run("d", 2, 0.01), _run("e", 4, 0.01),
            _run("f", 4, 0.01)]
    assert [(x["name"], y["name"]) for x, y in report_module.sweep_end_pairs(runs)] == [("b", "c")]


def test_probability_mass_sums_to_one():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    edges = torch.linspace(float(values.min()), float(values.max()), 61)
    mass = report_module.probability_mass(values, edges)
    assert mass.shape == (60,) and math.isclose(float(mass.sum()), 1.0, rel_tol=1e-12)


def _tiny_config(tmp_path, **overrides):
    return preset("tiny", n_layers=2, d_model=16, n_heads=2, seq_len=16, batch_size=4, val_batches=2,
                  data=str(tmp_path / "corpus.txt"), **overrides)


def _write_run(tmp_path, name, seed, **overrides):
    """A checkpoint in the training loop's format, with a history logged by the monitor itself."""
    config = _tiny_config(tmp_path, out_dir=str(tmp_path / name), **overrides)
    torch.manual_seed(seed)
    model = Transformer(config.model_config())
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = {"step": 1, "val_bpb": 8.0 - seed, **monitor.weight_metrics(model, optimizer),
              **monitor.activation_metrics(model, tokens)}
    (tmp_path / name).mkdir()
    torch.save({"model": model.state_dict(), "history": [record], "config": dataclasses.asdict(config)},
               tmp_path / name / CHECKPOINT)
    return tmp_path / name


@pytest.fixture
def runs(tmp_path, monkeypatch):
    words = ["alpha", "beta", "gamma", "spectral", "decay", "matrix"]
    picks = torch.randint(0, len(words), (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "corpus.txt").write_text(" ".join(words[i] for i in picks))
    monkeypatch.setattr(report_module, "load_corpus",
                        functools.partial(data_module.load_corpus, cache_dir=tmp_path / "cache"))
    return [_write_run(tmp_path, "p1_lam0.01", 0, p=1, spectral_weight_decay=0.01),
            _write_run(tmp_path, "p1_lam0.1", 1, p=1, spectral_weight_decay=0.1),
            _write_run(tmp_path, "p2_lam0.01", 2, p=2, spectral_weight_decay=0.01)]


def _hand_erank(inputs, weight):
    """SPEC 3: centre over tokens, singular values, q = s / sum s, exp H(q)."""
    Z = inputs.reshape(-1, inputs.shape[-1]).double() @ weight.double().T
    s = torch.linalg.svdvals(Z - Z.mean(0))
    q = s / s.sum()
    return math.exp(-float((q * q.log()).sum()))


def test_fixed_input_v_metrics_apply_each_checkpoint_to_the_reference_inputs(runs):
    loaded = [report_module.load_run(d) for d in runs]
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(5))  # 128 tokens: no sampling
    rows = report_module.v_activation_rows(loaded, tokens)
    reference = report_module.run_model(loaded[0])
    reference_inputs = report_module._v_inputs(reference, tokens)
    for run, row in zip(loaded, rows):
        weights = [run["state"][f"layers.{i}.attention.v_proj.weight"] for i in range(2)]
        by_hand = sum(_hand_erank(x, W) for x, W in zip(reference_inputs, weights)) / 2
        assert math.isclose(row["v_activation_effective_rank_fixed_inputs"], by_hand, rel_tol=1e-10)
        own = report_module._v_inputs(report_module.run_model(run), tokens)
        assert math.isclose(row["v_activation_effective_rank"],
                            sum(_hand_erank(x, W) for x, W in zip(own, weights)) / 2, rel_tol=1e-10)
    # The reference measured on its own inputs is the same measurement; the others see other inputs.
    assert rows[0]["v_activation_effective_rank"] == rows[0]["v_activation_effective_rank_fixed_inputs"]
    assert rows[0]["cross_head_cka"] == rows[0]["cross_head_cka_fixed_inputs"]
    assert rows[1]["v_activation_effective_rank"] != rows[1]["v_activation_effective_rank_fixed_inputs"]


def test_report_writes_its_files_with_per_family_spectra_and_the_protocol_tables(runs, tmp_path):
    text = report_module.report(runs, tmp_path / "report")
    for name in ("spectra.png", "spectra.md", "spectra.json", "histograms.png", "validation.png",
                 "coefficients.png", "pure_decay.png", "pure_decay.md", "pure_decay.json"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    data = json.loads((tmp_path / "report" / "spectra.json").read_text())
    assert [(r["p"], r["from"], r["to"], r["family"]) for r in data["expand_comparisons"]] == [
        (1, "p1_lam0.01", "p1_lam0.1", "mlp_gate"), (1, "p1_lam0.01", "p1_lam0.1", "mlp_up")]
    assert [r["run"] for r in data["v_projections"]] == ["p1_lam0.01", "p1_lam0.1", "p2_lam0.01"]
    assert "fixed inputs" in text and "D_shape" in text


def test_spectra_have_one_panel_per_family_and_histograms_one_unit_of_mass_per_run(runs):
    loaded = [report_module.load_run(d) for d in runs]
    figure, axes = report_module.plt.subplots(2, 4)
    report_module._spectra_panels(axes, loaded)
    assert [axis.get_title() for axis in axes.flat if axis.get_visible()] == list(monitor.MODULE_TYPES.values())
    figure, axes = report_module.plt.subplots(1, 2)
    report_module._histograms(axes, loaded)
    for axis in axes:
        masses = [patch.get_data().values.sum() for patch in axis.patches]
        assert len(masses) == len(loaded) and all(math.isclose(m, 1.0, rel_tol=1e-12) for m in masses)
    report_module.plt.close("all")


def test_report_has_help_and_parses_its_runs(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "--out" in capsys.readouterr().out
    assert parser().parse_args(["report", "run_a", "--out", "x"]).runs[0].name == "run_a"
