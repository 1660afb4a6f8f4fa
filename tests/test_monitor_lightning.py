"""docs/monitoring.md's PyTorch Lightning section, run against Lightning on a CPU with the reference
Transformer, gapped (tests/monitor_checks.py): the TensorBoardLogger's event file holds, at every log step,
every matrix's and attention module's scalars, matching an FP64 SVD of the ModelCheckpoint saved at that
step, the decay counts, nothing between the monitor's steps; the values reach ``trainer.callback_metrics``;
under gradient accumulation it logs once per optimizer step."""

from __future__ import annotations

import csv

import pytest
import torch

from integration_recipes import MONITORING, framework, run_recipe
from monitor_checks import (
    assert_matches_fp64,
    decay_counts,
    read_scalars,
    reference_model,
    spectral_tags,
    token_batches,
)

L = framework("lightning")
from spectral_ops.monitor.lightning import SpectralMonitorCallback  # noqa: E402  (after the import-or-skip)

SECTION = "PyTorch Lightning"
LR, EVERY, STEPS = 1e-3, 2, 6  # the recipe's


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("lightning")
    namespace = run_recipe(SECTION, document=MONITORING, model=reference_model(), train_data=token_batches(STEPS),
                           log_dir=str(log_dir))
    return namespace, log_dir, read_scalars(log_dir)


def checkpointed_weights(log_dir) -> dict[int, dict[str, torch.Tensor]]:
    """ModelCheckpoint's files by their global step (``epoch=0-step=N.ckpt``), the initial weights at 0."""
    weights = {0: {f"model.{name}": tensor for name, tensor in reference_model().state_dict().items()}}
    for path in (log_dir / "checkpoints").glob("*.ckpt"):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # Lightning's own file
        weights[checkpoint["global_step"]] = checkpoint["state_dict"]
    return weights


def test_the_event_file_matches_the_fp64_svd_of_each_checkpoint(run):
    namespace, log_dir, scalars = run
    assert namespace["trainer"].global_step == STEPS
    weights = checkpointed_weights(log_dir)
    assert sorted(weights) == list(range(0, STEPS + 1, EVERY))
    module = namespace["trainer"].lightning_module
    assert_matches_fp64(scalars, weights, module, LR, first_iterations=30, iterations=2)
    assert {step for tag in spectral_tags(scalars) for step in scalars[tag]} == set(weights)
    for step in weights:
        assert decay_counts(scalars, step) == {"skipped": 0.0, "clamped": 0.0, "smallest_clamp_factor": 1.0,
                                               "decays": float(step)}


def test_the_values_reach_the_callback_metrics(run):
    """For EarlyStopping and ModelCheckpoint(monitor=...): the last log step's values."""
    namespace, _, scalars = run
    metrics = namespace["trainer"].callback_metrics
    tags = spectral_tags(scalars)
    assert tags <= set(metrics)
    assert all(metrics[tag].item() == pytest.approx(scalars[tag][STEPS], rel=1e-6) for tag in tags)


def test_under_gradient_accumulation_it_logs_once_per_optimizer_step(run, tmp_path):
    """Two batches per optimizer step: the batches between two steps end at the same global step. Each
    log_metrics call is a row of a CSVLogger's file."""
    from lightning.pytorch.loggers import CSVLogger

    namespace, _, _ = run
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = L.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=2, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, logger=logger,
                        callbacks=[SpectralMonitorCallback(every=1)])
    trainer.fit(namespace["LanguageModel"](reference_model()), token_batches(6))
    with open(tmp_path / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["spectral.s_max/model.lm_head"]]
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3]
    assert [float(row["spectral.decay/optimizer.decays"]) for row in rows] == [0, 1, 2, 3]
