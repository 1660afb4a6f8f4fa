"""The default step (``capturable=False``) compiled as torch's tutorial compiles an optimizer: a
``torch.compile``-d function that calls ``optimizer.step()``, 20 steps, with an LR scheduler that
changes a Python lr every step and without.

Dynamo's counters are compared with those of torch's own AdamW and Muon, compiled the same way in the
same test: the family may have no more graphs (a recompile is one more) and no more graph breaks.
Dynamo traces every step as capturable (it sets the group key), so the compiled step is the
capturable one: it reads nothing back, counts skips and clamps on the device, and takes a Python lr
as a symbolic value (the first change of lr compiles once more, as torch's AdamW does; later ones
do not). Every compiled trajectory is checked against eager.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import spectral_ops as so
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD

from optim_models import batch, tiny_model

STEPS = 20


def matrices(model):
    return [param for param in model.parameters() if param.ndim == 2]


def _attached(host, model, **options):
    SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.5, **options).attach(host)
    return host


# name -> (the family's optimizer, torch's optimizer it is compared with, model has biases)
CASES = {
    "adamw-default": (lambda m, lr: SpectralAdamW(m.parameters(), lr=lr), "adamw", True),
    "adamw-p2": (lambda m, lr: SpectralAdamW(m.parameters(), lr=lr, p=2, spectral_weight_decay=0.5), "adamw", True),
    "sgd-p2": (lambda m, lr: SpectralSGD(m.parameters(), lr=lr, momentum=0.9, p=2, spectral_weight_decay=0.5),
               "adamw", True),
    "muon-p2": (lambda m, lr: SpectralMuon(matrices(m), lr=lr, p=2, spectral_weight_decay=0.5, precision="fp32"),
                "muon", False),
    # DynMuon's schedule, shifted to change sign within the run: traced as capturable, the count is a device
    # tensor and so is the power (the floored construction, its coefficients computed in the graph).
    "muon-update-power": (lambda m, lr: SpectralMuon(matrices(m), lr=lr, precision="fp32", update_power=lambda step:
                                                     0.25 - 0.5 * torch.sigmoid(torch.as_tensor(step - 10.0) / 4)),
                          "muon", False),
    "attached-adamw": (lambda m, lr: _attached(torch.optim.AdamW(m.parameters(), lr=lr), m), "adamw", True),
    "attached-muon": (lambda m, lr: _attached(torch.optim.Muon(matrices(m), lr=lr), m), "muon", False),
}
TORCH = {
    "adamw": lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr),
    "muon": lambda m, lr: torch.optim.Muon(matrices(m), lr=lr),
}


def run(build, bias: bool, *, compiled: bool, scheduled: bool, tensor_lr: bool = False, backend: str = "inductor",
        steps: int = STEPS):
    """``steps`` steps of ``build(model, lr)``: the final parameters, and Dynamo's graphs and graph
    breaks where ``compiled`` (with ``backend``).

    Dynamo's profile-guided dynamism (``automatic_dynamic_local_pgo``) is off: it keeps what earlier
    compiles of a frame found dynamic, on disk in Inductor's cache, keyed by file, line and function,
    and every case here compiles the same ``step`` frame, so a case's count would depend on the cases,
    tests and runs before it. Without it each case starts from nothing, as torch's does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(bias=bias)
    optimizer = build(model, torch.tensor(1e-2) if tensor_lr else 1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step) if scheduled else None

    def step():
        optimizer.step()

    step = torch.compile(step, backend=backend) if compiled else step
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        for index in range(steps):
            inputs, targets = batch(index)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            step()
            if scheduler is not None:
                scheduler.step()
    counts = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    return [param.detach().clone() for param in model.parameters()], counts


@functools.cache
def torch_counts(name: str, scheduled: bool, tensor_lr: bool):
    """torch's optimizer's graphs and breaks. Dynamo decides both before any backend sees a graph (the
    counts are the same under Inductor: checked for these five runs when this was written), and nothing
    else of torch's run is read, so its graphs go to the eager backend: Inductor's code generation and
    C++ builds of torch's own steps would cost a new machine seconds per graph and check nothing."""
    return run(TORCH[name], name == "adamw", compiled=True, scheduled=scheduled, tensor_lr=tensor_lr,
               backend="eager")[1]


# With a scheduler, torch's own Muon specialises its lr (``p.add_(update, alpha=-adjusted_lr)``): compiled
# from the hook's frame, it compiles again for new lrs, which is torch's count, not the decay's.
RUNS = [(name, True) for name in CASES if name != "attached-muon"]
RUNS += [(name, False) for name in ("adamw-default", "sgd-p2", "attached-adamw", "attached-muon")]


@pytest.mark.parametrize("name, scheduled", RUNS,
                         ids=[f"{name}-{'scheduled' if scheduled else 'constant'}-lr" for name, scheduled in RUNS])
def test_a_compiled_default_step_has_no_more_graphs_or_breaks_than_torchs(name, scheduled):
    build, reference, bias = CASES[name]
    eager, _ = run(build, bias, compiled=False, scheduled=scheduled)
    compiled, (graphs, breaks) = run(build, bias, compiled=True, scheduled=scheduled)
    most_graphs, most_breaks = allowed(name, torch_counts(reference, scheduled, tensor_lr=False), scheduled)
    assert graphs <= most_graphs and breaks <= most_breaks
    if reference == "muon" and name.startswith("attached"):
        return  # torch's Muon iterates in bf16: compiled, its own trajectory leaves eager's by ~1e-2
    # Inductor fuses and reorders fp32 element-wise work (a few ulps per step on weights of ~0.3),
    # and Adam divides by the root of a second moment that is small for some entries: 20 steps stay
    # within 1e-5. A stale lr (one step behind) would be off by lr * (1 - 0.9) ~ 1e-3 per step.
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def allowed(name: str, torch_counts: tuple, scheduled: bool) -> tuple:
    """The most graphs and graph breaks a case may have, given its torch optimizer's.

    torch's AdamW graph-breaks on purpose around its update (torch/optim/optimizer.py, _use_grad),
    and an attached decay runs before it: the decay is a graph of its own there (compiled once more
    at the first change of lr, as torch's is), and torch's first break, with a graph before it now,
    is counted. The decay itself adds no break."""
    torch_graphs, torch_breaks = torch_counts
    if name != "attached-adamw":
        return torch_graphs, torch_breaks
    return torch_graphs + 1 + scheduled, torch_breaks + 1


@pytest.mark.parametrize("name", ["adamw-p2", "attached-adamw"])
def test_a_tensor_lr_compiles_once(name):
    build, reference, bias = CASES[name]
    eager, _ = run(build, bias, compiled=False, scheduled=True, tensor_lr=True)
    compiled, (graphs, breaks) = run(build, bias, compiled=True, scheduled=True, tensor_lr=True)
    # A tensor lr is never specialised: no recompile when it changes.
    most_graphs, most_breaks = allowed(name, torch_counts(reference, scheduled=True, tensor_lr=True), False)
    assert graphs <= most_graphs and breaks <= most_breaks
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_stability_raise_reads_the_host_and_raises_from_a_compiled_step(caplog):
    """The one host read of a compiled step: the guard of ``stability="raise"`` (not the default). It
    splits the step at graph breaks (docs/optimizers.md), gives eager's numbers, and raises before
    any weight is written.

    The frames that resume after those breaks reach the gradients, which ``zero_grad()`` drops at every
    step, through their parameters: reached first through the state's keys, a gradient was guarded by its
    identity, and every step compiled them again (18 graphs in 20 steps, 11 now)."""
    def build(model, lr):
        return SpectralAdamW(model.parameters(), lr=lr, p=2, spectral_weight_decay=0.5, stability="raise")

    eager, _ = run(build, True, compiled=False, scheduled=False)
    (compiled, (_, breaks)), invalidated = recompiles_for_dropped_objects(caplog, build, True)
    assert breaks >= 1
    assert not invalidated, invalidated
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    torch._dynamo.reset()
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1.0, p=2, spectral_weight_decay=1e3, stability="raise")
    inputs, targets = batch(0)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    before = [param.detach().clone() for param in model.parameters()]
    with pytest.raises(so.SpectralStabilityError, match="p \\* kappa"):
        torch.compile(optimizer.step)()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Compiled, a failed first step may keep the state it created before the step, at its start
    # (eager, it forgets it): step 0 and zero moments, so the next step is still the first.
    for state in optimizer.state.values():
        assert int(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def recompiles_for_dropped_objects(caplog, build, bias: bool, **options) -> tuple:
    """A compiled :func:`run` of ``build`` with Dynamo's recompile log on: what it returned, and the
    recompiles of a frame whose guards held an object that has since been freed (a gradient that
    ``zero_grad()`` dropped, guarded by its identity)."""
    caplog.set_level(logging.DEBUG, logger="torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    try:
        result = run(build, bias, compiled=True, scheduled=False, **options)
    finally:
        torch._logging.set_logs()
    assert any("Recompiling function" in record.getMessage() for record in caplog.records)  # the log is read
    return result, {record.getMessage() for record in caplog.records if "got deallocated" in record.getMessage()}


def test_muons_frames_after_the_raise_guards_breaks_compile_no_more_as_gradients_are_dropped(caplog):
    """As AdamW's above: SpectralMuon's frames after ``stability="raise"``'s breaks reach the gradients
    through the parameters they are given (from the second step on, two of them compiled again at every
    step before: 25 graphs in 20 steps, 13 now). The second step shows it. The graphs go to the eager
    backend: the guards are Dynamo's, whatever compiles the graphs."""
    def build(model, lr):
        return SpectralMuon(matrices(model), lr=lr, p=2, spectral_weight_decay=0.5, precision="fp32",
                            stability="raise")

    _, invalidated = recompiles_for_dropped_objects(caplog, build, False, backend="eager", steps=2)
    assert not invalidated, invalidated


def test_an_invalid_option_set_on_a_group_raises_its_own_error_from_a_compiled_step():
    """Options set on a group after construction are validated when the step is traced (in _init_group,
    which torch.compile runs in Python): the error used to surface as Dynamo's InternalTorchDynamoError,
    or not at all. In one process, as the probe ran them, each raises the package's error, writes
    nothing, and the step compiles and runs again once the option is valid."""
    torch._dynamo.reset()
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    step = torch.compile(optimizer.step)
    inputs, targets = batch(0)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    step()
    group = optimizer.param_groups[0]
    for key, value, error, message in [("p", -0.5, ValueError, "p=-0.5 < 0 cannot be a decay"),
                                       ("rounding", "bogus", ValueError, "rounding must be one of"),
                                       ("spectral_weight_decay", "0.5", TypeError, "must be a real number"),
                                       ("stability", "nope", ValueError, "stability must be one of"),
                                       # The optimizer's own options were never checked again (#52).
                                       ("eps", float("nan"), ValueError, "eps must be finite"),
                                       ("betas", (0.9, 1.5), ValueError, r"betas\[1\] must be in \[0, 1\)"),
                                       # A Python NaN lr reached Inductor: "The argument 'nan' is not
                                       # comparable" (#52). A 0-d tensor's NaN skips on the device instead.
                                       ("lr", float("nan"), ValueError, "lr must be finite, got nan")]:
        valid, group[key] = group[key], value
        before = [param.detach().clone() for param in model.parameters()]
        with pytest.raises(error, match=message):
            step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        group[key] = valid
    step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_traced_adamw_step_keeps_its_step_sizes_on_the_device():
    """Dynamo treats a traced group as capturable, but a frame it resumes after a graph break sees the group's
    own key, False on a CPU. Step sizes made there on the host (``count.item()``) were constants of that
    frame's graph: ``stability="raise"``, whose guard breaks the step, compiled 40 graphs in 20 steps, again at
    every step until the recompile limit. Traced, they are device tensors, made without a host read."""
    from spectral_ops.optim.adamw import adam_denominators, steps_on_device

    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    inputs, targets = batch(0)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()  # the state exists, its step counts on the CPU, as an eager group's
    group = optimizer.param_groups[0]
    assert not group["capturable"] and not steps_on_device(group)

    def step_sizes():
        return adam_denominators(group["params"], group, optimizer.state, steps_on_device(group))[1]

    torch._dynamo.reset()
    traced = torch.compile(step_sizes, backend="eager", fullgraph=True)()  # a host read would break the graph
    assert all(isinstance(size, torch.Tensor) and size.ndim == 0 for size in traced)
    torch.testing.assert_close(torch.stack(traced), torch.tensor(step_sizes(), dtype=torch.float32))


def test_a_compiled_cpu_step_is_traced_once(caplog):
    """A traced step reads the clamp counts, and no 0-d float64 CPU tensor among them: Dynamo gives every such
    input a symbolic float (FakeTensor's memo of its ``item()``), which AOTAutograd's pass over Python scalars
    then specialises by tracing the whole step again. A compiled CPU step whose stability clamp can act was
    traced twice (a third of its compile time)."""
    caplog.set_level(logging.INFO, logger="torch._dynamo")
    torch._dynamo.reset()
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    assert optimizer.param_groups[0]["stability"] == "clamp"
    inputs, targets = batch(0)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):  # as run() says why
        torch.compile(optimizer.step, backend="aot_eager")()
    assert any("torchdynamo done tracing" in record.getMessage() for record in caplog.records)
    restarts = [record.getMessage() for record in caplog.records if "Restarting analysis" in record.getMessage()]
    assert not restarts, restarts
