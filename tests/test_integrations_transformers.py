"""docs/integrations.md's Hugging Face transformers Trainer section, run against the real Trainer on a
tiny random Llama (built from a config, nothing downloaded): SpectralAdamW and torch's AdamW with an
attached SpectralDecay, each through ``optimizers=`` (and SpectralAdamW through
``optimizer_cls_and_kwargs``); the decay of a zero-gradient Trainer step against the FP64 SVD; a run
resumed from the Trainer's own checkpoint against the uninterrupted run, bit for bit; one decay per
optimizer step, with gradient accumulation."""

from __future__ import annotations

import os

import pytest
import torch

from spectral_ops import reference
from spectral_ops.linalg import relative_error
from spectral_ops.optim import SpectralDecay, _decay

from integration_recipes import assert_bitwise_equal, framework, run_recipe

# Read when huggingface_hub is imported: no request leaves, and no progress bar is printed.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
transformers = framework("transformers")
framework("accelerate")  # the Trainer's requirement on torch, not transformers' own

SECTION = "Hugging Face transformers Trainer"
LR, SPECTRAL_WEIGHT_DECAY = 1e-3, 0.1  # the recipe's optimizers' (both, the same decay)
ROUTES = ["spectral_adamw", "adamw_with_spectral_decay"]


def make_model():
    """The same random 22,688-parameter Llama at every call: 16 matrices (embedding and head among them), 5 norms."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def synthetic_dataset(sequences=32, length=16):
    tokens = torch.randint(0, 64, (sequences, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids, "labels": ids} for ids in tokens]


class DecayCounter:
    """Counts how often each parameter is decayed, at the entry point every optimizer of the family and
    SpectralDecay compute a decay through (``prepare_decay``, once per same-shape stack and step)."""

    def __init__(self, monkeypatch):
        self.counts: dict[int, int] = {}
        prepare = _decay.prepare_decay

        def counting(tensors, *args, **kwargs):
            for tensor in tensors:
                self.counts[tensor.data_ptr()] = self.counts.get(tensor.data_ptr(), 0) + 1
            return prepare(tensors, *args, **kwargs)

        monkeypatch.setattr(_decay, "prepare_decay", counting)

    def of_matrices(self, model) -> dict[str, int]:
        return {name: self.counts.get(param.data_ptr(), 0) for name, param in model.named_parameters()
                if param.ndim == 2}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The section's blocks, run once: the SpectralAdamW run of 6 steps and its resumption from step 3,
    with every decay counted."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        counter = DecayCounter(monkeypatch)
        namespace = run_recipe(SECTION, make_model=make_model, train_dataset=synthetic_dataset(),
                               output_dir=str(tmp_path_factory.mktemp("trainer")))
    return namespace, counter


def arguments(output_dir, **options):
    """The recipe's TrainingArguments, in another folder, with ``options`` changed."""
    settings = dict(max_steps=6, save_steps=3, per_device_train_batch_size=4, seed=0, report_to="none",
                    use_cpu=True) | options
    return transformers.TrainingArguments(str(output_dir), **settings)


def assert_same_run(trainer, resumed):
    assert resumed.state.global_step == trainer.state.global_step
    assert_bitwise_equal(trainer.model.state_dict(), resumed.model.state_dict(), "weights")
    assert_bitwise_equal(trainer.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")


def test_the_resumed_spectral_adamw_run_ends_on_the_uninterrupted_runs_bits_and_takes_only_the_last_steps(recipe):
    namespace, counter = recipe
    trainer, resumed = namespace["trainer"], namespace["resumed"]
    assert trainer.state.global_step == 6
    assert_same_run(trainer, resumed)
    # 6 steps, then 3 more from checkpoint-3: a resume that started again from step 0 would end on the same
    # bits too (same seed), so count the steps the decay ran in, matrix by matrix, in each run.
    assert set(counter.of_matrices(trainer.model).values()) == {6}
    assert set(counter.of_matrices(resumed.model).values()) == {3}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_resumed_run_ends_on_the_uninterrupted_runs_bits_and_decays_once_per_optimizer_step(
        recipe, route, accumulation, tmp_path, monkeypatch):
    """Both optimizers, with and without gradient accumulation: bitwise resume from checkpoint-3, and each
    matrix decayed once per optimizer step (6 in the first run, 3 in the resumed one), never per
    micro-batch (``accumulation`` of them per step, counted on the model's forward)."""
    namespace, _ = recipe
    make_optimizer = namespace[route]
    args = arguments(tmp_path, per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation)
    counter = DecayCounter(monkeypatch)
    runs = []
    for resume_from in (None, f"{tmp_path}/checkpoint-3"):
        counter.counts.clear()
        model = make_model()
        forwards = []
        model.register_forward_hook(lambda *_: forwards.append(1))
        trainer = namespace["trainer_for"](model, args, namespace["train_dataset"], make_optimizer)
        trainer.train(resume_from_checkpoint=resume_from)
        steps = 6 if resume_from is None else 3
        assert len(forwards) == steps * accumulation
        assert set(counter.of_matrices(model).values()) == {steps}
        runs.append(trainer)
    assert_same_run(*runs)


class ZeroGradients(transformers.TrainerCallback):
    """Zero every gradient after the Trainer has clipped them, just before its optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for param in model.parameters():
            param.grad.zero_()


@pytest.mark.parametrize("route", ROUTES)
def test_a_zero_gradient_trainer_step_is_the_decay_of_the_fp64_svd(recipe, route, tmp_path):
    """From empty state a zero gradient makes AdamW's update exactly 0 (its moments stay 0), so the Trainer's
    first step moves each matrix by the decay alone, at the scheduler's first lr (the recipe's: the linear
    schedule starts at factor 1), and leaves every vector's bits."""
    namespace, _ = recipe
    model = make_model()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    trainer = namespace["trainer_for"](model, arguments(tmp_path, max_steps=1, save_strategy="no"),
                                       namespace["train_dataset"], namespace[route])
    trainer.add_callback(ZeroGradients())
    trainer.train()
    # An fp32 weight, decayed on a CPU's fp32 SVD route: the result's own rounding to fp32 (2^-24 relative per
    # entry; 2.5e-8 to 2.7e-8 seen) dominates, since the decay's error (~1e-6 of S_2) enters scaled by the
    # step's size, lr * lambda * s_max ~ 2e-5. Allow 4 roundings. A decay missed, or run twice, errs by the
    # step itself (1.4e-5 to 2.0e-5 here), checked to be 10x the tolerance at least.
    tolerance = 4 * 2.0**-24
    errors = {}
    for name, param in model.named_parameters():
        if param.ndim == 2:
            expected = reference.spectral_decay_svd(before[name], 2, LR, SPECTRAL_WEIGHT_DECAY)
            errors[name] = relative_error(param.detach(), expected)
            assert relative_error(before[name], expected) > 10 * tolerance, name
        else:
            assert torch.equal(param.detach(), before[name]), name
    assert max(errors.values()) < tolerance, errors


def test_spectral_adamw_built_by_the_trainer_trains_the_same_bits(recipe):
    """``optimizer_cls_and_kwargs``: the Trainer's own groups give the recipe's optimizer, step for step."""
    namespace, _ = recipe
    lazy = namespace["lazy"]
    lazy.train()
    assert_bitwise_equal(lazy.model.state_dict(), namespace["trainer"].model.state_dict(), "weights")


def test_a_second_decay_attached_to_a_reused_optimizer_is_refused(recipe):
    """An optimizer passed to a second Trainer with its decay attached again would decay twice: refused."""
    namespace, _ = recipe
    model = make_model()
    optimizer = namespace["adamw_with_spectral_decay"](model)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    with pytest.raises(ValueError, match="already decays"):
        SpectralDecay(matrices, p=2, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY).attach(optimizer)


def test_transformers_adafactor_with_its_own_step_size_is_refused_naming_the_fix():
    """transformers' Adafactor, by default, steps with a step size of its own (relative_step) times the
    weight's RMS (scale_parameter), not with an lr the decay can read: attach refuses it, naming the
    option; with both off it steps with its lr, and takes the decay."""
    from transformers.optimization import Adafactor

    W = torch.nn.Parameter(torch.randn(16, 8))
    decay = SpectralDecay([W], p=2, spectral_weight_decay=0.1)
    with pytest.raises(ValueError, match="relative_step=True .*pass relative_step=False and scale_parameter=False"):
        decay.attach(Adafactor([W], lr=None))
    assert decay.attach(Adafactor([W], lr=0.01, relative_step=False, scale_parameter=False))._attached
