"""docs/integrations.md's PyTorch Lightning section, run against Lightning on a CPU: its two modules
(SpectralMuon in automatic optimization; torch's Muon with the decay attached, and AdamW, in manual
optimization) and its ``fit``, checked for the decay against the FP64 SVD, a bitwise resume through
``Trainer.fit(ckpt_path=...)``, and one decay per step Lightning takes, none per step it skips."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from spectral_ops import reference
from spectral_ops.linalg import relative_error
from spectral_ops.optim import SpectralDecay, param_groups_by_module

from integration_recipes import assert_bitwise_equal, framework, run_recipe

L = framework("lightning")
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402  (after the import-or-skip)

SECTION = "PyTorch Lightning"
POWER, LAMBDA = 2, 0.1  # the recipes' p and spectral_weight_decay
LR = 0.05  # the tests' lr: one decay then moves a hidden matrix by about 5e-3 of its norm
MANUAL_ACCUMULATE = 2  # MuonAttachedModule's default: one step per two batches

# A relative error of a decayed fp32 matrix against the FP64 SVD: the fp32 weight's own rounding (2^-24 =
# 6e-8 of an entry), plus the decay's fp32 error scaled down by the step's size (a step moves the weight by
# ~5e-3 of its norm): 2e-8 to 5e-8 measured over up to three steps. 1e-6 leaves 20x; one decay too many or
# too few is off by ~5e-3.
TOLERANCE = 1e-6


class Net(torch.nn.Module):
    """The user's model: named as param_groups_by_module reads it, fc1 and fc2 are the hidden matrices
    (Muon and the decay); the head and the biases take AdamW."""

    def __init__(self, seed=0):
        super().__init__()
        with torch.random.fork_rng():  # the global generator as it was, for the tests after
            torch.manual_seed(seed)
            self.fc1, self.fc2, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, inputs):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(inputs)))))


class ZeroGradient(torch.nn.Module):
    """Net with its output multiplied by 0: every gradient is 0 (NaN for an input of Inf), so Muon's and
    Adam's updates stay 0 from their empty state and each step is the decay alone. Records the dtype its
    forward ran in."""

    def __init__(self, net):
        super().__init__()
        self.net, self.forward_dtypes = net, set()

    def forward(self, inputs):
        outputs = self.net(inputs)
        self.forward_dtypes.add(outputs.dtype)
        return outputs * 0.0


def hidden_matrices(net: Net) -> dict[str, torch.Tensor]:
    return {"fc1": net.fc1.weight, "fc2": net.fc2.weight}


def shuffled_batches(count=16, seed=0):
    """The user's data: shuffled by a sampler that Lightning sets the epoch of (the section's advice), so
    that a resumed epoch draws the order the uninterrupted run drew."""
    generator = torch.Generator().manual_seed(seed)
    dataset = torch.utils.data.TensorDataset(torch.randn(count, 8, generator=generator),
                                             torch.randn(count, 4, generator=generator))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The section's blocks, run once as written (they train and resume both modules), with the user's
    model, data and checkpoint folder. Lightning's deterministic=True switches torch's deterministic
    algorithms on for the whole process, and sets CUBLAS_WORKSPACE_CONFIG: put back for the tests after."""
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark, workspace = torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield run_recipe(SECTION, model=Net(), train_data=shuffled_batches(),
                     checkpoint_dir=tmp_path_factory.mktemp("lightning"))
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    torch.backends.cudnn.benchmark = benchmark
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


# The precisions a run takes. "16-mixed" on a CPU is turned into "bf16-mixed" by Lightning, which has no
# GradScaler: the plugin keeps fp16 autocast and a GradScaler, the one AMP that skips a step on a CPU.
PRECISIONS = {"32": lambda: {"precision": "32"}, "bf16-mixed": lambda: {"precision": "bf16-mixed"},
              "16-mixed GradScaler": lambda: {"plugins": [MixedPrecision("16-mixed", "cpu")]}}


class LrAtEachBatch(L.Callback):
    """The lr the hidden matrices' optimizer holds as each batch starts, the one its step decays with."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def run_batches(module, batches, precision, tmp_path, clip=None):
    """One epoch of ``module`` over ``batches`` (each ``(inputs, targets)``) under a precision of
    PRECISIONS; returns the trainer and the lr at each batch."""
    lrs = LrAtEachBatch()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[lrs], **PRECISIONS[precision]())
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer, lrs.lrs


def zero_gradient_batches(kinds, seed=1):
    """A batch per kind: "zero" (finite inputs: a zero gradient), "inf" (an Inf input: NaN gradients),
    "none" (finite, and the test's training_step returns None for it)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for kind in kinds:
        inputs = torch.randn(4, 8, generator=generator)
        if kind == "inf":
            inputs[0, 0] = float("inf")
        batches.append((inputs, torch.randn(4, 4, generator=generator)))
    return batches


def decayed_by_svd(initial: dict, lrs) -> dict:
    """The hidden matrices after one FP64-SVD decay per lr, in order."""
    expected = {}
    for name, W in initial.items():
        for lr in lrs:
            W = reference.spectral_decay_svd(W, POWER, lr, LAMBDA)
        expected[name] = W
    return expected


def adamw_attached_module(recipe):
    """What the section says works too: one torch optimizer with the decay attached, returned from
    configure_optimizers in automatic optimization (AdamW over every parameter)."""
    class AdamWAttachedModule(recipe["SpectralMuonModule"]):
        def configure_optimizers(self):
            adamw = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)
            groups = param_groups_by_module(self.model)
            hidden = [p for group in groups if "algorithm" not in group for p in group["params"]]
            SpectralDecay(hidden, p=POWER, spectral_weight_decay=LAMBDA).attach(adamw)
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=self.total_steps)
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return AdamWAttachedModule


def skipping_module(module_class, kinds):
    """``module_class`` whose training_step returns None for the batches of kind "none" (a skipped step,
    in automatic optimization)."""

    class Skipping(module_class):
        def training_step(self, batch, batch_idx):
            return None if kinds[batch_idx] == "none" else super().training_step(batch, batch_idx)

    return Skipping


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("module_class", ["SpectralMuonModule", "MuonAttachedModule"])
def test_a_zero_gradient_step_from_empty_state_is_the_fp64_svd_decay(recipe, module_class, precision, tmp_path):
    """Muon's update of a zero gradient from an empty momentum is 0 (Adam's too), so the step is the
    decay alone, at the step's lr. Under bf16-mixed the forward runs in bf16 and the weights stay fp32,
    and the decay is the fp32 one: autocast does not reach the optimizer's step."""
    net = Net(seed=2)
    initial = {name: W.detach().clone() for name, W in hidden_matrices(net).items()}
    model = ZeroGradient(net)
    steps_at = MANUAL_ACCUMULATE if module_class == "MuonAttachedModule" else 1
    _, lrs = run_batches(recipe[module_class](model, lr=LR), zero_gradient_batches(["zero"] * steps_at), precision,
                         tmp_path)
    assert model.forward_dtypes == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
    expected = decayed_by_svd(initial, lrs[-1:])
    for name, W in hidden_matrices(net).items():
        assert W.dtype == torch.float32
        assert relative_error(W.detach(), expected[name]) < TOLERANCE, name


# The skip test's runs: the module (the recipe's two, and AdamW attached in automatic optimization), a
# precision, the kind of each batch, and the batches whose step decays. Automatic optimization steps at
# every batch but where the training_step returns None (32 and bf16-mixed: step() is called with no
# gradient; GradScaler: it is not called) or the gradient is not finite (SpectralMuon skips the
# parameter; the GradScaler skips step(); torch's AdamW would write NaN, so it gets no Inf without a
# GradScaler). Manual optimization steps at every second batch (Muon would write NaN too).
RUNS = [
    ("SpectralMuonModule", "32", ["zero", "none", "inf", "zero", "zero"], [0, 3, 4]),
    ("SpectralMuonModule", "bf16-mixed", ["zero", "none", "inf", "zero", "zero"], [0, 3, 4]),
    ("SpectralMuonModule", "16-mixed GradScaler", ["zero", "none", "inf", "zero", "zero"], [0, 3, 4]),
    ("AdamWAttachedModule", "32", ["zero", "none", "zero"], [0, 2]),
    ("AdamWAttachedModule", "16-mixed GradScaler", ["zero", "inf", "none", "zero"], [0, 3]),
    ("MuonAttachedModule", "bf16-mixed", ["zero"] * 4, [1, 3]),
    ("MuonAttachedModule", "16-mixed GradScaler", ["zero", "zero", "inf", "zero", "zero", "zero"], [1, 5]),
]


@pytest.mark.parametrize("module_class, precision, kinds, decayed", RUNS,
                         ids=[f"{module}-{precision}-{'-'.join(kinds)}" for module, precision, kinds, _ in RUNS])
def test_each_step_lightning_takes_decays_once_and_a_skipped_one_not_at_all(recipe, module_class, precision, kinds,
                                                                             decayed, tmp_path):
    """Zero gradients make each step the decay alone: after the run each hidden matrix is the FP64-SVD
    decay applied once per step taken, at that step's lr, and at no other batch. One decay too many (a
    skipped step decayed, or a step decayed twice) or too few fails by 1000x the tolerance. With gradient
    clipping on in automatic optimization (manual clips in its training_step)."""
    net = Net(seed=3)
    initial = {name: W.detach().clone() for name, W in hidden_matrices(net).items()}
    base = adamw_attached_module(recipe) if module_class == "AdamWAttachedModule" else recipe[module_class]
    module = skipping_module(base, kinds)(ZeroGradient(net), lr=LR)
    trainer, lrs = run_batches(module, zero_gradient_batches(kinds), precision, tmp_path,
                               clip=1.0 if module.automatic_optimization else None)
    expected = decayed_by_svd(initial, [lrs[batch] for batch in decayed])
    for name, W in hidden_matrices(net).items():
        assert relative_error(W.detach(), expected[name]) < TOLERANCE, name
    # Which skip it was. An Inf input makes fc1's weight gradient NaN (tanh keeps it from the later
    # layers): the GradScaler halves its scale at the step it skips, of the one optimizer holding fc1;
    # without one, SpectralMuon skips and counts every parameter, since clipping multiplied each
    # gradient by the NaN total norm.
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        assert scaler.get_scale() == 2.0**16 * 0.5 ** kinds.count("inf")
    if module_class == "SpectralMuonModule":
        skipped = trainer.optimizers[0].skipped
        assert all(int(count) == (scaler is None) * kinds.count("inf") for count in skipped.values()), skipped


def fitted_state(trainer) -> dict:
    """What a resume must reproduce: the weights, every optimizer's and scheduler's state, the step."""
    return {"weights": trainer.lightning_module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step}


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("module_class", ["SpectralMuonModule", "MuonAttachedModule"])
def test_a_resume_through_fit_ckpt_path_is_bitwise(recipe, module_class, precision, tmp_path):
    """The recipe's fit: 4 epochs in one run, against 2 epochs, then a new module (of other weights,
    which the checkpoint replaces) resumed to 4 from the last checkpoint, at an epoch's end, over
    shuffled data: the weights, both optimizers' and schedulers' states and the step are bitwise those
    of the uninterrupted run."""
    fit, module_of = recipe["fit"], recipe[module_class]
    straight = fit(module_of(Net(seed=4)), 4, tmp_path / "straight", precision)
    stopped = fit(module_of(Net(seed=4)), 2, tmp_path / "stopped", precision)
    halfway = copy.deepcopy(fitted_state(stopped))
    resumed = fit(module_of(Net(seed=5)), 4, tmp_path / "stopped", precision, resume=True)
    assert_bitwise_equal(fitted_state(resumed), fitted_state(straight))
    # Lightning counts each optimizer's step: 16 batches, a step per batch or per two, one or two optimizers.
    steps = 16 // (MANUAL_ACCUMULATE if module_class == "MuonAttachedModule" else 1)
    assert straight.global_step == steps * len(straight.optimizers)
    assert resumed.global_step > halfway["global_step"]
    assert not torch.equal(resumed.lightning_module.model.fc1.weight, halfway["weights"]["model.fc1.weight"])


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_a_clipped_step_is_the_step_of_a_plain_loop(recipe, precision, tmp_path):
    """Real gradients, clipped by Lightning (gradient_clip_val well below their norm): the weights are
    bitwise those of a plain loop that clips the same gradients (in the optimizer's parameter order, as
    Lightning does) and steps SpectralMuon once per batch, whose step decays once (the test above). A
    decay run twice, or at a clipped step's unscale, would differ."""
    batches = list(shuffled_batches(count=12, seed=6))
    clip = 0.01
    lightning_module = recipe["SpectralMuonModule"](Net(seed=7), lr=LR)
    run_batches(lightning_module, batches, precision, tmp_path, clip=clip)

    plain = recipe["SpectralMuonModule"](Net(seed=7), lr=LR)
    configured = plain.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norms = []
    for batch_idx, batch in enumerate(batches):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = plain.training_step(batch, batch_idx)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        optimizer.step()
        scheduler.step()
    assert min(norms) > 10 * clip  # every step clipped
    assert_bitwise_equal(lightning_module.model.state_dict(), plain.model.state_dict())
