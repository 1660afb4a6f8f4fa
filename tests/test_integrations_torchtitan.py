"""docs/integrations.md's torchtitan section, run against the real torchtitan on a CPU: its
OptimizersContainer subclass with a SpectralDecay attached to each optimizer, stepped in torchtitan's
order over a tiny model of two parts named as torchtitan's decoder names its parameters, and
checkpointed by torchtitan's CheckpointManager (DCP), in one process and on 2 gloo ranks under FSDP2;
the section's config function and its torchrun flags, parsed by torchtitan's ConfigManager."""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
import types

import pytest
import torch

import spectral_ops.plan
from spectral_ops import reference
from spectral_ops.linalg import relative_error
from spectral_ops.optim import SpectralDecay

from integration_recipes import INTEGRATIONS, framework, run_recipe, sections
from process_results import run_ranks

optimizer_module = framework("torchtitan.components.optimizer")
LRSchedulersContainer = optimizer_module.LRSchedulersContainer
OptimizersContainer = optimizer_module.OptimizersContainer

SECTION = "torchtitan"
STEPS, STOP_AT = 5, 3  # the resumed run stops after step 3 and resumes from the checkpoint of step 2
WIDTH, BLOCKS_PER_PART = 16, 2
# The blocks' matrices: attention.wq, attention.wo, feed_forward.w1, feed_forward.w2 in each block.
MATRICES = 2 * BLOCKS_PER_PART * 4
ROUNDOFF_FP32 = 2.0**-24


class Block(torch.nn.Module):
    """A decoder block's parameters under torchtitan's names (attention.wq, feed_forward.w1, ...)."""

    def __init__(self):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(WIDTH)
        self.attention = torch.nn.ModuleDict({"wq": torch.nn.Linear(WIDTH, WIDTH), "wo": torch.nn.Linear(WIDTH, WIDTH)})
        self.feed_forward = torch.nn.ModuleDict({"w1": torch.nn.Linear(WIDTH, 2 * WIDTH),
                                                 "w2": torch.nn.Linear(2 * WIDTH, WIDTH)})

    def forward(self, x):
        x = x + self.attention["wo"](torch.tanh(self.attention["wq"](self.attention_norm(x))))
        return x + self.feed_forward["w2"](torch.nn.functional.gelu(self.feed_forward["w1"](x)))


class Part(torch.nn.Module):
    """A pipeline stage as torchtitan splits a decoder: its blocks keep their FQNs (layers.2, ...), and
    the last stage holds the final norm (FQNs are unique over the parts: the checkpoint is keyed by them)."""

    def __init__(self, first: int, last: bool):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(first + i): Block() for i in range(BLOCKS_PER_PART)})
        self.norm = torch.nn.LayerNorm(WIDTH) if last else torch.nn.Identity()

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return self.norm(x)


def tiny_model_parts() -> list:
    torch.manual_seed(0)
    return [Part(0, last=False), Part(BLOCKS_PER_PART, last=True)]


def loss_of(model_parts, step: int) -> torch.Tensor:
    """The same batch for a step on every rank (so FSDP2's mean of the ranks' gradients is each one's)."""
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
    for part in model_parts:
        x = part(x)
    return x.square().mean()


def optimizer_config(recipe: dict, **changes):
    """The section's config for a real run (llama3_8b_spectral), with a larger lr and lambda_p here so
    that one decay more or less is far above the FP64 check's tolerance; ``changes`` to its fields."""
    config = recipe["llama3_8b_spectral"]().optimizer
    groups = [dataclasses.replace(group, optimizer_kwargs={**group.optimizer_kwargs, "lr": 1e-2})
              for group in config.param_groups]
    return dataclasses.replace(config, param_groups=groups, **{"spectral_weight_decay": 0.1, **changes})


def parameters(model_parts) -> dict:
    return {name: param for part in model_parts for name, param in part.named_parameters()}


def run_section() -> dict:
    """The section's blocks. run_recipe compiles them under its own module's ``from __future__ import
    annotations``, so the section's dataclass gets string annotations, which ``dataclasses`` looks up
    in the class's module, ``recipe``: an empty stand-in while the blocks run (a user's module is real)."""
    stand_in = types.ModuleType("recipe")
    sys.modules.setdefault("recipe", stand_in)
    try:
        return run_recipe(SECTION)
    finally:
        if sys.modules.get("recipe") is stand_in:
            del sys.modules["recipe"]


@pytest.fixture(scope="module")
def recipe():
    return run_section()


def recording_decays(calls: list):
    """A spy on the plan's decay of a stack (spectral_ops.plan.decay_), which every spectral decay goes
    through: it appends (the matrices in the stack, the step size) to ``calls``."""
    decay_ = spectral_ops.plan.decay_

    def spy(kernels, W, request):
        calls.append((W.shape[:-2].numel(), float(request.scale)))
        return decay_(kernels, W, request)

    return spy


@pytest.fixture
def decays(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(spectral_ops.plan, "decay_", recording_decays(calls))
    return calls


def decayed_matrices(optimizers) -> list:
    return [param for decay in optimizers.spectral_decays for group in decay.param_groups for param in group["params"]]


def uninterrupted_and_resumed(recipe, config, folder) -> list:
    """``(model parts, optimizers)`` of the recipe's run of STEPS steps, and of the same run stopped after
    STOP_AT steps and resumed, in a fresh model and container, from its last checkpoint."""
    uninterrupted = tiny_model_parts()
    runs = [(uninterrupted, recipe["train"](uninterrupted, loss_of, config, folder / "uninterrupted", STEPS))]
    recipe["train"](tiny_model_parts(), loss_of, config, folder / "resumed", STEPS, stop_at=STOP_AT)
    resumed = tiny_model_parts()
    return runs + [(resumed, recipe["train"](resumed, loss_of, config, folder / "resumed", STEPS))]


def test_each_parameter_is_in_one_optimizer_and_each_matrix_in_one_decay(recipe):
    optimizers = optimizer_config(recipe).build(model_parts=tiny_model_parts())
    # One AdamW per model part (both param groups of the config are AdamW's), each with its decay.
    assert [type(optimizer).__name__ for optimizer in optimizers] == ["AdamW", "AdamW"]
    assert len(optimizers.spectral_decays) == 2
    decayed = decayed_matrices(optimizers)
    assert len(decayed) == len({id(param) for param in decayed}) == MATRICES


def test_resume_through_the_checkpoint_manager_is_bitwise(recipe, tmp_path):
    (expected_parts, expected), (actual_parts, actual) = uninterrupted_and_resumed(
        recipe, optimizer_config(recipe), tmp_path)
    for (name, weight), resumed in zip(parameters(expected_parts).items(), parameters(actual_parts).values()):
        assert torch.equal(resumed, weight), name
    # The container's state dict, as its checkpoint holds it: every optimizer's state tensors and group
    # options (lr included) by FQN, and the decays' counts.
    torch.testing.assert_close(actual.state_dict(), expected.state_dict(), rtol=0, atol=0)


def test_the_decays_counts_resume_with_the_checkpoint(recipe, tmp_path):
    """lambda_p far too large for the lr: the stability guard clamps every matrix's decay at every step,
    and the resumed run's clamp counts go on from those its checkpoint holds."""
    (_, expected), (_, actual) = uninterrupted_and_resumed(
        recipe, optimizer_config(recipe, spectral_weight_decay=1000.0), tmp_path)
    for uninterrupted, resumed in zip(expected.spectral_decays, actual.spectral_decays):
        counts = uninterrupted.count_state()
        assert [int(count) for count, _ in counts["clamped"].values()] == [STEPS] * (MATRICES // 2)
        assert all(int(count) == 0 for count in counts["skipped"].values())
        torch.testing.assert_close(resumed.count_state(), counts, rtol=0, atol=0)


def scheduled_lrs(config) -> list:
    """The lr of each of the STEPS steps, as the recipe's LR schedulers set it (2 warmup steps)."""
    optimizers = config.build(model_parts=tiny_model_parts())
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    lrs = []
    for _ in range(STEPS):
        lrs.append(optimizers.optimizers[0].param_groups[0]["lr"])
        schedulers.step()
    return lrs


def test_one_decay_per_matrix_per_step_at_the_scheduled_lr(recipe, tmp_path, decays):
    config = optimizer_config(recipe)

    def marking_loss(model_parts, step):  # marks where each step's decays begin
        decays.append(("step", step))
        return loss_of(model_parts, step)

    recipe["train"](tiny_model_parts(), marking_loss, config, tmp_path, STEPS)
    steps = [[]]
    for entry in decays[1:]:
        steps.append([]) if entry[0] == "step" else steps[-1].append(entry)
    assert decays[0] == ("step", 1) and len(steps) == STEPS, decays
    # Each matrix once per step (a double decay, or one per optimizer per part, would count more), at
    # the lr the scheduler set for that step.
    for step, (step_decays, lr) in enumerate(zip(steps, scheduled_lrs(config)), 1):
        assert sum(count for count, _ in step_decays) == MATRICES, (step, step_decays)
        assert {scale for _, scale in step_decays} == {lr} and lr > 0, (step, step_decays)


def test_the_decay_against_the_fp64_svd_on_a_zero_gradient_step(recipe, tmp_path):
    config = optimizer_config(recipe)
    model_parts = tiny_model_parts()
    # Stopped before the schedule's end, where the lr decays to 0.
    optimizers = recipe["train"](model_parts, loss_of, config, tmp_path, STEPS, stop_at=STOP_AT)
    # From an empty AdamW state a zero gradient makes AdamW's update zero (and the blocks' AdamW has no
    # weight decay of its own), so the step is the decay alone, at each optimizer's current lr.
    for optimizer in optimizers:
        optimizer.state.clear()
    decayed = {id(param) for param in decayed_matrices(optimizers)}
    lrs = {id(param): group["lr"] for optimizer in optimizers for group in optimizer.param_groups
           for param in group["params"]}
    before = {name: param.detach().clone() for name, param in parameters(model_parts).items()}
    for param in parameters(model_parts).values():
        param.grad = torch.zeros_like(param)
    optimizers.step()  # the embeddings' and norms' AdamW still applies its own weight decay: not checked
    # Tolerance: on a CPU the decay factorises its fp32 matrix (SVD): S_2 to a few fp32 ulps of its
    # norm, scaled by lr lambda_p ~ 1e-3 relative to W; the new weight then rounds once to fp32, so the
    # error is within a few units of fp32 roundoff of W. A second decay would be off by lr lambda_p
    # ||S_2(W)|| / ||W||, above 1e-4 here.
    tolerance = 8 * ROUNDOFF_FP32
    checked = 0
    for name, param in parameters(model_parts).items():
        if id(param) in decayed:
            W = before[name]
            expected = reference.spectral_decay_svd(W, 2, lrs[id(param)], 0.1)
            assert relative_error(param.detach(), expected) < tolerance, name
            assert relative_error(W, expected) > 100 * tolerance, name  # the decay is there to see
            checked += 1
    assert checked == MATRICES


def test_torchtitans_zero_lr_state_step_changes_no_weight(recipe, decays):
    model_parts = tiny_model_parts()
    before = {name: param.detach().clone() for name, param in parameters(model_parts).items()}
    optimizers = optimizer_config(recipe).build(model_parts=model_parts)
    optimizers.state_dict()  # before a first step: init_optim_state's zero-gradient step at lr 0
    # It counts as AdamW's first step (torchtitan's own doing, with or without the decay).
    assert all(int(state["step"]) == 1 for optimizer in optimizers for state in optimizer.state.values())
    assert len([state for optimizer in optimizers for state in optimizer.state.values()]) == len(
        parameters(model_parts))
    assert decays and {scale for _, scale in decays} == {0.0}  # the decay ran in it, at lr 0
    for name, param in parameters(model_parts).items():
        assert torch.equal(param.detach(), before[name]), name


def test_a_checkpoint_without_the_decay_does_not_load_into_a_container_with_it(recipe):
    config = optimizer_config(recipe)
    plain = OptimizersContainer.Config(param_groups=config.param_groups).build(model_parts=tiny_model_parts())
    spectral = config.build(model_parts=tiny_model_parts())
    with pytest.raises(KeyError, match="spectral_decay_peak_lr"):
        spectral.load_state_dict(plain.state_dict())


@dataclasses.dataclass
class AttachedToThePlainContainer:
    """A config whose ``build`` is torchtitan's own OptimizersContainer, with one SpectralDecay over the
    section's matrices attached to the container itself (not the section's subclass, which attaches one
    to each optimizer the container holds)."""

    section: OptimizersContainer.Config

    def build(self, *, model_parts):
        container = OptimizersContainer.Config(param_groups=self.section.param_groups).build(model_parts=model_parts)
        pattern = re.compile(self.section.spectral_pattern)
        matrices = [param for name, param in parameters(model_parts).items()
                    if param.ndim >= 2 and pattern.search(name)]
        SpectralDecay(matrices, p=self.section.spectral_p, matrix_view="batch",
                      spectral_weight_decay=self.section.spectral_weight_decay).attach(container)
        return container


def test_attached_to_the_container_torchtitan_builds_the_run_is_the_sections(recipe, tmp_path):
    """attach(container) (before: KeyError: 'lr', the container's own group holds none) decays each
    matrix at the lr of the optimizer the container steps it with: a run stopped and resumed through the
    CheckpointManager (the container's state dict, with the peak lr in those optimizers' groups) ends
    bit for bit where the section's subclass ends uninterrupted, weights and optimizer state."""
    section = optimizer_config(recipe)
    expected_parts = tiny_model_parts()
    expected = recipe["train"](expected_parts, loss_of, section, tmp_path / "section", STEPS)
    attached = AttachedToThePlainContainer(section)
    recipe["train"](tiny_model_parts(), loss_of, attached, tmp_path / "container", STEPS, stop_at=STOP_AT)
    resumed_parts = tiny_model_parts()
    resumed = recipe["train"](resumed_parts, loss_of, attached, tmp_path / "container", STEPS)
    for (name, weight), actual in zip(parameters(expected_parts).items(), parameters(resumed_parts).values()):
        assert torch.equal(actual, weight), name
    state = expected.state_dict()
    del state["spectral_decay_counts"]  # the subclass's own key: the plain container saves no counts
    torch.testing.assert_close(resumed.state_dict(), state, rtol=0, atol=0)


def test_the_real_runs_flags_parse_into_the_containers_config(tmp_path, monkeypatch):
    """The section's torchrun line, parsed by torchtitan's ConfigManager as torchtitan.train parses it,
    with my_spectral.py holding the section's first two blocks (the class and the config function)."""
    class_and_config = sections()[SECTION][:2]
    (tmp_path / "my_spectral.py").write_text("\n\n".join(class_and_config))
    monkeypatch.syspath_prepend(str(tmp_path))
    command = re.search(r"^```bash\n(.*?)^```", section_text(), flags=re.DOTALL | re.MULTILINE).group(1)
    words = shlex.split(command.replace("\\\n", " "))
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(words[words.index("torchtitan.train") + 1:])
    assert type(config.optimizer).__qualname__ == "SpectralOptimizersContainer.Config"
    assert (config.optimizer.spectral_p, config.optimizer.spectral_weight_decay) == (2.0, 0.05)
    assert config.optimizer.spectral_pattern == sys.modules["my_spectral"].BLOCK_MATRICES
    assert (config.parallelism.data_parallel_shard_degree, config.parallelism.tensor_parallel_degree) == (4, 2)
    assert config.checkpoint.enable


def section_text() -> str:
    """The torchtitan section of docs/integrations.md."""
    text = INTEGRATIONS.read_text()
    return text[text.index(f"## {SECTION}\n"):].split("\n## ", 1)[0]


# ----------------------------------------------------------------------------- 2 gloo ranks, FSDP2


def _fsdp_worker(rank: int, world_size: int, folder: str) -> dict:
    """On each rank: the recipe over the tiny model under FSDP2 (each block, then each part, sharded
    over the ranks), uninterrupted and resumed through the CheckpointManager in a folder the ranks
    share. Returns whether this rank's shards of the two ended bit for bit alike, the whole weights of
    the uninterrupted run, and the matrices this rank decayed in it (as their owner)."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    recipe = run_section()
    config = optimizer_config(recipe)
    mesh = init_device_mesh("cpu", (world_size,))

    def sharded_model_parts():
        model_parts = tiny_model_parts()
        for part in model_parts:
            for block in part.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(part, mesh=mesh)
        return model_parts

    decays, decay_ = [], spectral_ops.plan.decay_
    spectral_ops.plan.decay_ = recording_decays(decays)
    uninterrupted = sharded_model_parts()
    recipe["train"](uninterrupted, loss_of, config, Path(folder, "uninterrupted"), STEPS)
    spectral_ops.plan.decay_ = decay_
    recipe["train"](sharded_model_parts(), loss_of, config, Path(folder, "resumed"), STEPS, stop_at=STOP_AT)
    resumed = sharded_model_parts()
    recipe["train"](resumed, loss_of, config, Path(folder, "resumed"), STEPS)
    alike = all(torch.equal(a.to_local(), b.to_local())
                for a, b in zip(parameters(uninterrupted).values(), parameters(resumed).values()))
    weights = {name: param.full_tensor().flatten().tolist() for name, param in parameters(uninterrupted).items()}
    return {"resumed_equals_uninterrupted": alike, "weights": weights,
            "decayed": sum(count for count, scale in decays if scale > 0)}


def test_fsdp2_on_two_gloo_ranks_resumes_bitwise_and_matches_one_process(recipe, tmp_path):
    ranks = run_ranks(_fsdp_worker, 2, str(tmp_path / "ranks"))
    assert all(rank["resumed_equals_uninterrupted"] for rank in ranks)
    # Each matrix decayed once per step, on one rank (its owner): no rank decays what another did.
    assert sum(rank["decayed"] for rank in ranks) == STEPS * MATRICES
    # The same run in one process (every rank had the same batch, so FSDP2's mean gradient is each
    # one's): the same bits, as the optimizer's owner computes each whole matrix as one process does.
    # On one thread, as each rank runs (process_results): a CPU kernel's sums may split another way on more.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_parts = tiny_model_parts()
        recipe["train"](model_parts, loss_of, optimizer_config(recipe), tmp_path / "one", STEPS)
    finally:
        torch.set_num_threads(threads)
    for name, param in parameters(model_parts).items():
        expected = param.detach().flatten().tolist()
        assert ranks[0]["weights"][name] == ranks[1]["weights"][name] == expected, name
