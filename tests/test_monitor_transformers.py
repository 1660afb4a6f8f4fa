"""docs/monitoring.md's Hugging Face Trainer section, run against the real Trainer on a tiny Llama with
gapped spectra (tests/monitor_checks.py): the event file TensorBoard's integration wrote holds, at every
log step, every matrix's and attention module's scalars, matching an FP64 SVD of the checkpoint saved at that
step, the decay counts, and the Trainer's own loss log at the steps the two share."""

from __future__ import annotations

import os

import pytest

from integration_recipes import MONITORING, framework, run_recipe
from monitor_checks import assert_matches_fp64, decay_counts, read_scalars, spectral_tags, with_spectral_gaps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
transformers = framework("transformers")
framework("accelerate")
from safetensors.torch import load_file  # noqa: E402  (transformers' requirement, after the import-or-skip)
from test_integrations_transformers import make_model, synthetic_dataset  # noqa: E402

from spectral_ops.monitor import SpectralMonitor  # noqa: E402
from spectral_ops.monitor.transformers import SpectralMonitorCallback, monitor_trainer  # noqa: E402

SECTION = "Hugging Face transformers Trainer"
LR, EVERY, STEPS = 1e-3, 2, 6  # the recipe's
TAG = "train/"  # the Trainer's integrations prefix every training value with it


def gapped_model():
    return with_spectral_gaps(make_model())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("trainer")
    namespace = run_recipe(SECTION, document=MONITORING, make_model=gapped_model,
                           train_dataset=synthetic_dataset(), output_dir=str(output_dir))
    return namespace, output_dir, read_scalars(output_dir / "runs")


def test_the_event_file_matches_the_fp64_svd_of_each_checkpoint(run):
    namespace, output_dir, scalars = run
    assert namespace["trainer"].state.global_step == STEPS
    weights = {0: gapped_model().state_dict()}
    weights |= {step: load_file(output_dir / f"checkpoint-{step}" / "model.safetensors")
                for step in range(EVERY, STEPS + 1, EVERY)}
    assert_matches_fp64(scalars, weights, namespace["model"], LR, first_iterations=30, iterations=2, tag_prefix=TAG)
    # Nothing logged between the monitor's steps, nothing but its names.
    assert {step for tag in spectral_tags(scalars, TAG) for step in scalars[tag]} == set(weights)
    monitor = SpectralMonitor(namespace["model"], namespace["optimizer"])
    assert spectral_tags(scalars, TAG) == {TAG + name for name in monitor.compute()}


def test_the_decay_counts_are_logged_and_the_trainers_loss_log_is_kept(run):
    _, _, scalars = run
    for step in range(0, STEPS + 1, EVERY):
        assert decay_counts(scalars, step, TAG) == {"skipped": 0.0, "clamped": 0.0, "smallest_clamp_factor": 1.0,
                                                    "decays": float(step)}
    # logging_steps == every: the monitor's log at those steps must not have cleared the Trainer's.
    assert sorted(scalars[TAG + "loss"]) == list(range(EVERY, STEPS + 1, EVERY))


def test_a_callback_added_to_another_trainer_raises_when_training_begins(tmp_path):
    args = transformers.TrainingArguments(str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainers = [transformers.Trainer(model=make_model(), args=args, train_dataset=synthetic_dataset(4))
                for _ in range(2)]
    trainers[1].add_callback(SpectralMonitorCallback(trainers[0], every=1))
    with pytest.raises(ValueError, match="monitor_trainer"):
        trainers[1].train()


def test_a_wrong_monitor_option_raises_when_the_callback_is_made(tmp_path):
    args = transformers.TrainingArguments(str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = transformers.Trainer(model=make_model(), args=args, train_dataset=synthetic_dataset(4))
    with pytest.raises(ValueError, match="every"):
        monitor_trainer(trainer, every=0)
    with pytest.raises(TypeError):
        monitor_trainer(trainer, iteration=3)
    assert not any(isinstance(callback, SpectralMonitorCallback) for callback in trainer.callback_handler.callbacks)

