"""docs/monitoring.md's plain loop, run on the reference Transformer (gapped, tests/monitor_checks.py):
the event file and the CSV hold exactly what the monitor computed at each log step (the event file in
fp32), which matches an FP64 SVD of the weights at that step; MetricsWriter's rules (stable columns, a
resumed CSV, bad input refused before a write); and ``python -m spectral_ops.monitor plot`` on the run."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectral_ops.monitor import MetricsWriter, SpectralMonitor
from spectral_ops.monitor.__main__ import main
from spectral_ops.monitor.plot import read_events

from integration_recipes import MONITORING, run_recipe
from monitor_checks import assert_matches_fp64, read_scalars, reference_model, spectral_tags, token_batches

ROOT = Path(__file__).resolve().parent.parent
SECTION = "A plain loop: TensorBoard and CSV"
LR, EVERY, STEPS = 1e-3, 2, 6  # the recipe's


def recording_weights(batches, model, weights: dict):
    """``batches``, keeping the model's weights each time the loop asks for the next batch: those after as
    many steps as it took (the loop logs before it asks)."""
    for step, batch in enumerate(batches):
        weights[step] = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        yield batch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("plain")
    model, weights, computed = reference_model(), {}, []
    compute = SpectralMonitor.compute
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(SpectralMonitor, "compute", lambda self: computed.append(compute(self)) or computed[-1])
        run_recipe(SECTION, document=MONITORING, model=model, log_dir=str(log_dir),
                   batches=recording_weights(token_batches(STEPS), model, weights))
    weights[STEPS] = model.state_dict()
    return model, log_dir, dict(zip(range(0, STEPS + 1, EVERY), computed, strict=True)), weights


def read_csv(path) -> tuple[list[str], dict[int, dict[str, float]]]:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    return rows[0], {int(row[0]): dict(zip(rows[0][1:], map(float, row[1:]))) for row in rows[1:]}


def test_the_csv_and_the_event_file_hold_what_the_monitor_computed(run):
    _, log_dir, computed, _ = run
    header, rows = read_csv(log_dir / "metrics.csv")
    assert header == ["step", *computed[0]]  # the monitor's order
    assert rows == computed  # exactly: the CSV holds each float's shortest repr
    scalars = read_scalars(log_dir)
    assert spectral_tags(scalars) == set(scalars) == set(computed[0])
    fp32 = {step: {name: torch.tensor(value, dtype=torch.float32).item() for name, value in metrics.items()}
            for step, metrics in computed.items()}
    assert {step: {tag: scalars[tag][step] for tag in scalars} for step in computed} == fp32


def test_the_logged_spectra_match_the_fp64_svd_of_the_weights_at_each_log_step(run):
    model, log_dir, _, weights = run
    logged = {step: weights[step] for step in range(0, STEPS + 1, EVERY)}
    assert_matches_fp64(read_scalars(log_dir), logged, model, LR, first_iterations=30, iterations=2)


def test_every_row_has_the_first_rows_columns_and_a_resumed_csv_is_appended_to(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(0, {"a": 1.0, "b": 2.0})
        with pytest.raises(ValueError, match=r"lacks \['b'\] and adds \['c'\]"):
            writer.write(1, {"a": 1.0, "c": 3.0})
        writer.write(1, {"b": 4.0, "a": 3.0})  # the same names in another order: the columns' order
    with MetricsWriter(tmp_path) as writer:  # a resumed run
        with pytest.raises(ValueError, match=r"lacks \['b'\]"):
            writer.write(2, {"a": 5.0})
        writer.write(2, {"a": 5.0, "b": 6.0})
    assert read_csv(tmp_path / "metrics.csv") == (["step", "a", "b"], {0: {"a": 1.0, "b": 2.0}, 1: {"a": 3.0, "b": 4.0},
                                                                       2: {"a": 5.0, "b": 6.0}})
    assert read_scalars(tmp_path)  # each writer's own event file: the reader finds the one folder's two files


@pytest.mark.parametrize("step, metrics, error", [(-1, {"a": 1.0}, ValueError), (1.0, {"a": 1.0}, ValueError),
                                                  (True, {"a": 1.0}, ValueError), (0, {"a": "1"}, TypeError),
                                                  (0, {"a": None}, TypeError), (0, {1: 1.0}, TypeError)])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, step, metrics, error):
    with MetricsWriter(tmp_path) as writer:
        with pytest.raises(error):
            writer.write(step, metrics)
    assert (tmp_path / "metrics.csv").read_text() == ""


def test_a_file_that_is_not_a_metrics_csv_is_not_appended_to(tmp_path):
    (tmp_path / "metrics.csv").write_text("loss,accuracy\n1,2\n")
    with pytest.raises(ValueError, match="not a metrics CSV"):
        MetricsWriter(tmp_path)


def test_the_plot_command_draws_the_runs_event_file(run, tmp_path, capsys):
    _, log_dir, computed, _ = run
    series = read_events(log_dir)
    assert series["qk_bound"]["layers.0.attention"] == [
        (step, pytest.approx(metrics["spectral.qk_bound/layers.0.attention"], rel=1e-6))
        for step, metrics in computed.items()]
    out = tmp_path / "figures" / "spectra.png"
    main(["plot", str(log_dir), "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_reads_the_trainers_prefixed_tags_and_says_what_is_missing(tmp_path):
    with MetricsWriter(tmp_path / "runs" / "one") as writer:
        writer.write(0, {"train/spectral.s_max/head": 2.0, "train/loss": 1.0})
    assert read_events(tmp_path) == {"s_max": {"head": [(0, 2.0)]}}
    with pytest.raises(ValueError, match=r"none of \['qk_bound'\] was logged; it holds \['s_max'\]"):
        main(["plot", str(tmp_path), "--out", str(tmp_path / "a.png"), "--metrics", "qk_bound"])
    with pytest.raises(ValueError, match="prefix='other'"):
        read_events(tmp_path, prefix="other")
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / "absent")


def test_the_plot_commands_help_names_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    help_text = capsys.readouterr().out
    assert all(flag in help_text for flag in ("LOG_DIR", "--out", "--metrics", "--prefix"))


def test_importing_the_monitor_imports_no_framework_and_no_tensorboard():
    """The hosts' frameworks load with their submodules only, tensorboard with the first MetricsWriter."""
    code = ("import sys, spectral_ops.monitor; "
            "print(sorted({'transformers', 'lightning', 'tensorboard', 'matplotlib'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout.strip() == "[]"
