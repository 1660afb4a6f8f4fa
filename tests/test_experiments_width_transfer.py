"""The width-transfer experiment (SPEC 4) at --quick settings: its files, the hyperparameters each arm
trained with, and the separation between the arms."""

import json
import math

import pytest
import torch

from spectral_ops import analysis
from spectral_ops.experiments import width_transfer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """One quick run (three widths, three arms); one thread, as tests/test_experiments.py explains."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("results")
    try:
        markdown = width_transfer.run(out, quick=True)
    finally:
        torch.set_num_threads(threads)
    return out, markdown, json.loads((out / "width-transfer.json").read_text())


def test_writes_table_json_and_figure(outputs):
    out, markdown, data = outputs
    assert (out / "width-transfer.md").read_text().strip() == markdown.strip()
    assert "|---|" in markdown and "experiments width-transfer --out" in markdown and "--quick" in markdown
    assert (out / "width-transfer.png").read_bytes().startswith(PNG_SIGNATURE)
    assert set(data["runs"]) == {arm for arm, _, _ in width_transfer.ARMS}
    assert [r["width"] for r in data["runs"]["fixed"]] == list(width_transfer.QUICK_WIDTHS)


def test_each_arm_trained_with_its_width_rule(outputs):
    _, _, data = outputs
    base, steps = width_transfer.QUICK_WIDTHS[0], width_transfer.QUICK_SETTINGS["steps"]
    for arm, p, rule in width_transfer.ARMS:
        coefficient = width_transfer.BASE_WEIGHT_DECAY if p == 1 else width_transfer.BASE_LAMBDA_P
        for record in data["runs"][arm]:
            ratio = record["width"] / base if rule else 1.0
            # The optimizer's own groups after training: lr ~ 1/d and lambda ~ sqrt(d) (decoupled) under the rule.
            assert record["lr"] == pytest.approx(width_transfer.BASE_LR / ratio, rel=1e-12)
            assert record["coefficient"] == pytest.approx(coefficient * math.sqrt(ratio), rel=1e-12)
            # SIGMA_SAMPLES samples ending at the last step, each of gate, up and down of every layer
            samples = record["sigma_1_samples"]
            assert len(samples) == width_transfer.SIGMA_SAMPLES and record["sample_steps"][-1] == steps
            assert all(len(sample) == 3 * width_transfer.QUICK_SETTINGS["n_layers"] for sample in samples)
            assert record["sigma_1"] == pytest.approx(sum(map(sum, samples)) / sum(map(len, samples)), rel=1e-12)
        scales = [r["predicted_scale"] for r in data["runs"][arm]]
        if rule:  # the rule holds SPEC 4's steady-state scale fixed across widths
            assert scales == pytest.approx([scales[0]] * len(scales), rel=1e-12)
        else:  # ... which otherwise grows like d^0.75
            assert scales[-1] / scales[0] == pytest.approx((width_transfer.QUICK_WIDTHS[-1] / base) ** 0.75, rel=1e-12)


def test_the_rule_narrows_sigma_1_across_widths(outputs):
    """At quick settings (30 steps) the weights are far from their steady state, but the rule's lr ~ 1/d
    already separates the arms (fixed minus rule: ~0.5 here; 0.69 against 0.17 at the full settings)."""
    _, _, data = outputs
    summary = data["summary"]
    assert summary["fixed"]["slope"] > summary["rule"]["slope"] + 0.2
    assert all(math.isfinite(r["final_loss"]) for records in data["runs"].values() for r in records)


def test_balance_scale_is_specs_adamw_scale_for_p_1():
    assert width_transfer.balance_scale(2e-3, 5.0, 1, 96) == pytest.approx(
        analysis.adamw_top_singular_value_scale(2e-3, 5.0, 96), rel=1e-12)
    assert width_transfer.balance_scale(2e-3, 5.0, 3, 96) == pytest.approx((2e-3 / 5.0 * 96**1.5) ** 0.25, rel=1e-12)
