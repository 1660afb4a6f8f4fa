"""A step that raises changes nothing (#43): everything a step can fail on is checked before its first
write, and an eager step with ``rollback=True`` keeps a record of what it writes, so that a fault inside
any write leaves every weight, state tensor and count bitwise as it was, and a retry gives the step a
clean run gives.

The faults are injected where the writes happen: a dispatch mode sees every aten op (multi-tensor ops
included) that writes into the storage of a parameter, a state tensor or a count, and raises at the
k-th of one step, for every k. Every comparison is bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spectral_ops.decay import PendingWrite
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD

from optim_models import batch, tiny_model


class InjectedFault(RuntimeError):
    pass


class FaultAtWrite(TorchDispatchMode):
    """Counts the aten ops that write into any of ``watched`` (tensors, by storage) and raises
    ``fault`` at the ``fail_at``-th of them (1-based; None: counts only), before it runs. Writes
    are the arguments an op's schema marks as written (in-place and ``out=`` arguments, the lists of
    the multi-tensor ops)."""

    def __init__(self, watched, fail_at=None, fault=InjectedFault):
        super().__init__()
        self.storages = {tensor.untyped_storage().data_ptr() for tensor in watched if tensor.numel()}
        self.fail_at, self.fault, self.writes = fail_at, fault, 0
        self.armed = True  # whether writes are counted now

    def _written(self, func, args, kwargs):
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            yield from value if isinstance(value, (list, tuple)) else [value]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.armed and any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
                              for t in self._written(func, args, kwargs)):
            self.writes += 1
            if self.writes == self.fail_at:
                raise self.fault("injected fault")
        return func(*args, **kwargs)


def _gradients(model, step):
    inputs, targets = batch(step)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def _muon(params, **options):
    matrices = [p for p in params if p.ndim == 2]
    vectors = [p for p in params if p.ndim < 2]
    return SpectralMuon([{"params": matrices}, {"params": vectors, "algorithm": "adamw", "weight_decay": 0.1}],
                        lr=2e-2, precision="fp32", **options)


# Each optimizer with a spectral decay clamped on some matrices (lambda_p large enough: the clamp counts
# are written too) and an ordinary one on the vectors.
SPECTRAL = dict(p=2, spectral_weight_decay=40.0, stability="clamp", decay_method="gram")
# The rollback record (opt-in: it costs a copy of what a step writes) undoes a fault inside a write.
RECORDED = dict(SPECTRAL, rollback=True)
OPTIMIZERS = {
    "adamw": lambda params: SpectralAdamW(params, lr=1e-2, weight_decay=0.1, **RECORDED),
    "sgd-nesterov": lambda params: SpectralSGD(params, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.1,
                                               **RECORDED),
    # With dampening, a first step creates the momentum buffer as it writes.
    "sgd-dampening": lambda params: SpectralSGD(params, lr=5e-2, momentum=0.9, dampening=0.5, weight_decay=0.1,
                                                **RECORDED),
    "muon": lambda params: _muon(params, **RECORDED),
    "decay": lambda params: SpectralDecay(params, lr=1e-2, ordinary_weight_decay=0.1, **RECORDED),
    # Cautious (SPEC 11): the decay's increments, masked by the update, added after it.
    "adamw-cautious": lambda params: SpectralAdamW(params, lr=1e-2, weight_decay=0.1, cautious=True, **RECORDED),
    # rollback asked by the second group only (#52): a step is one unit, recorded whole, the first
    # group's writes included (the record used to restore the second group's alone).
    "adamw-mixed": lambda params: SpectralAdamW([{"params": params[:2], "rollback": False},
                                                 {"params": params[2:], "rollback": True}],
                                                lr=1e-2, weight_decay=0.1, **SPECTRAL),
}


def _situation(name, steps, skip=False):
    """A model after ``steps`` steps of optimizer ``name``, and the gradients of the next one (with a NaN
    in the second matrix's where ``skip``: a skip count is written too)."""
    model = tiny_model()
    optimizer = OPTIMIZERS[name](list(model.parameters()))
    for step in range(steps):
        _gradients(model, step)
        optimizer.step()
    _gradients(model, steps)
    if skip:
        model[2].weight.grad[0, 0] = float("nan")
    return model, optimizer


def _everything(model, optimizer) -> list:
    """Every parameter, state entry and count, copied (state and counts by parameter position)."""
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(params)}
    state = [(position[id(p)], key, value.clone() if torch.is_tensor(value) else value)
             for p, entries in optimizer.state.items() for key, value in entries.items()]
    counts = optimizer.count_state()
    return [[p.detach().clone() for p in params], sorted(state, key=lambda entry: entry[:2]),
            {kind: {i: [t.clone() for t in (v if isinstance(v, list) else [v])] for i, v in by.items()}
             for kind, by in counts.items()}]


def _assert_same(a, b):
    (params_a, state_a, counts_a), (params_b, state_b, counts_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
    assert [entry[:2] for entry in state_a] == [entry[:2] for entry in state_b]
    assert all(torch.equal(x[2], y[2]) if torch.is_tensor(x[2]) else x[2] == y[2] for x, y in zip(state_a, state_b))
    assert counts_a.keys() == counts_b.keys()
    for kind in counts_a:
        assert counts_a[kind].keys() == counts_b[kind].keys()
        assert all(torch.equal(x, y) for i in counts_a[kind] for x, y in zip(counts_a[kind][i], counts_b[kind][i]))


def _watched(model, optimizer) -> list:
    counts = [t for by in (optimizer._counts.skips, optimizer._counts.clamps) for value in by.values()
              for t in (value if isinstance(value, tuple) else [value])]
    state = [value for entries in optimizer.state.values() for value in entries.values() if torch.is_tensor(value)]
    return [*model.parameters(), *state, *counts]


def _writes_of_a_step(name, steps, skip) -> tuple:
    """The writes of one clean step from the situation, and what it leaves."""
    model, optimizer = _situation(name, steps, skip)
    with FaultAtWrite(_watched(model, optimizer)) as mode:
        optimizer.step()
    return mode.writes, _everything(model, optimizer)


CASES = [(name, 1, False) for name in OPTIMIZERS] + [
    ("adamw", 0, False), ("sgd-dampening", 0, False), ("muon", 0, False),  # the step that creates the state
    ("adamw", 1, True), ("muon", 1, True), ("adamw-cautious", 1, True),  # a skipped parameter: its count is written
]


@pytest.mark.filterwarnings("ignore:.*skipped the update")
@pytest.mark.parametrize("name, steps, skip", CASES, ids=[f"{n}-after-{s}{'-skip' if k else ''}" for n, s, k in CASES])
def test_a_fault_at_any_write_changes_nothing_and_a_retry_is_a_clean_step(name, steps, skip):
    total, clean = _writes_of_a_step(name, steps, skip)
    assert total >= 3, f"{name}: only {total} writes seen"
    for fail_at in range(1, total + 1):
        model, optimizer = _situation(name, steps, skip)
        before = _everything(model, optimizer)
        with FaultAtWrite(_watched(model, optimizer), fail_at), pytest.raises(InjectedFault):
            optimizer.step()
        _assert_same(_everything(model, optimizer), before)
        optimizer.step()
        _assert_same(_everything(model, optimizer), clean)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_write_of_a_step_into_a_weight_or_its_state_is_its_records_commit(monkeypatch, name):
    """One record of a pending write, one commit (#45): outside ``PendingWrite.commit`` a step writes no
    parameter and no state tensor (a write there raises), and inside it it writes them all."""
    model, optimizer = _situation(name, 1, skip=False)
    state = [value for entries in optimizer.state.values() for value in entries.values() if torch.is_tensor(value)]
    outside = FaultAtWrite([*model.parameters(), *state], fail_at=1)
    commit = PendingWrite.commit

    def commit_unwatched(self, keep=None):
        outside.armed = False
        try:
            commit(self, keep)
        finally:
            outside.armed = True

    monkeypatch.setattr(PendingWrite, "commit", commit_unwatched)
    params = list(model.parameters())
    before = [tensor.clone() for tensor in params + state]
    with outside:
        optimizer.step()
    assert outside.writes == 0
    changed = [not torch.equal(old, new) for old, new in zip(before, params + state)]
    assert all(changed[:len(params)]) and all(changed[len(params):])


# ----- the reproductions: inputs a step used to fail on half-way, now refused before its first write


def _bf16_with_fp32_gradient():
    param = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).bfloat16())
    param.grad_dtype = torch.float32
    param.grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    return param


@pytest.mark.parametrize("build", [
    lambda P: SpectralAdamW([P], lr=0.05, weight_decay=0.0, p=2, spectral_weight_decay=0.5),
    lambda P: SpectralMuon([P], lr=0.05, weight_decay=0.0, p=2, spectral_weight_decay=0.5),
], ids=["adamw", "muon"])
def test_an_fp32_gradient_of_a_bf16_weight_is_refused_before_the_decay_is_written(build):
    """The issue's reproduction: the decay was written, then Adam's lerp raised (and a retry decayed
    again, the weight moving 0.46, then 0.88). Now a TypeError names the fix, and nothing moves."""
    P = _bf16_with_fp32_gradient()
    optimizer, before = build(P), P.detach().clone()
    for _ in range(2):  # a retry is refused the same way, and still writes nothing
        with pytest.raises(TypeError, match=r"gradient of .*\(64, 32\) is a \(64, 32\) torch.float32 tensor.*"
                                            r"bfloat16.*nothing was written.*grad_dtype"):
            optimizer.step()
        assert torch.equal(P.detach(), before) and not optimizer.state


def test_attached_a_host_that_raises_leaves_the_decay_unwritten():
    """The issue's reproduction with attach on torch's AdamW: the decay was applied before the host
    raised. Now it is added only after the host's step has returned."""
    P = _bf16_with_fp32_gradient()
    host = torch.optim.AdamW([P], lr=0.05, weight_decay=0.0)
    SpectralDecay([P], p=2, spectral_weight_decay=0.5).attach(host)
    before = P.detach().clone()
    with pytest.raises(RuntimeError, match="expected dtype"):  # torch's own error
        host.step()
    assert torch.equal(P.detach(), before)


@pytest.mark.parametrize("what", ["shape", "dtype", "state shape"])
def test_a_bad_input_of_a_later_group_is_refused_before_the_first_group_is_written(what):
    """A gradient of the wrong shape or dtype (``.grad.data`` swapped, which torch's setter does not see),
    or a state of another model's shape, in the second group: the first group's decay and update and
    the second group's decay used to be written, then the step raised."""
    model = tiny_model()
    optimizer = SpectralAdamW([{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}],
                              lr=1e-2, weight_decay=0.1, p=2, spectral_weight_decay=0.5)
    for step in range(2):
        _gradients(model, step)
        optimizer.step()
    _gradients(model, 2)
    second = model[2].weight
    if what == "shape":
        second.grad.data = torch.randn(16, 4)
    elif what == "dtype":
        second.grad.data = second.grad.data.double()
    else:
        optimizer.state[second]["exp_avg"] = torch.zeros(16, 4)
    before = _everything(model, optimizer)
    error = TypeError if what == "dtype" else ValueError
    with pytest.raises(error, match=r"param_groups\[1\]\['params'\]\[0\] \(4, 16\).*nothing was written"):
        optimizer.step()
    _assert_same(_everything(model, optimizer), before)


def test_an_interrupt_is_rolled_back_too():
    """KeyboardInterrupt (a BaseException) in the middle of a commit: restored, then raised as it came."""
    total, _ = _writes_of_a_step("adamw", 1, False)
    model, optimizer = _situation("adamw", 1)
    before = _everything(model, optimizer)
    with FaultAtWrite(_watched(model, optimizer), total // 2, KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        optimizer.step()
    _assert_same(_everything(model, optimizer), before)


def test_without_a_rollback_record_a_fault_inside_a_write_is_not_undone():
    """rollback=False: the step keeps its checks and writes nothing before them, but a fault inside
    its writes leaves the writes made before it (what the record costs and what it buys)."""
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, rollback=False, **SPECTRAL)
    _gradients(model, 0)
    optimizer.step()
    _gradients(model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    state = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with FaultAtWrite(_watched(model, optimizer), 5), pytest.raises(InjectedFault):
        optimizer.step()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    changed += [not torch.equal(a, s["exp_avg"]) for a, s in zip(state, optimizer.state.values())]
    assert any(changed)


# ----- attach: the decay is planned before the host's step and written after it


def _attached(decay_attached=True, cautious=False):
    """A tiny model whose torch AdamW has a SpectralDecay attached, after two steps, and the gradients
    of the next (``decay_attached=False``: detached then, the host's step alone)."""
    model = tiny_model()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    decay = SpectralDecay([p for p in model.parameters() if p.ndim == 2], cautious=cautious, **RECORDED).attach(host)
    for step in range(2):
        _gradients(model, step)
        host.step()
    _gradients(model, 2)
    if not decay_attached:
        decay.detach()
    return model, host, decay


def _host_state(host) -> list:
    return [value.clone() for entries in host.state.values() for value in entries.values()]


def _watching_the_decay(model, host, decay, fail_at=None, decays=True):
    """A fault mode over the weights, the host's state and the decay's counts that counts the writes
    made while the decay writes (``decays``) or while it does not (the host's)."""
    mode = FaultAtWrite([*model.parameters(), *(v for s in host.state.values() for v in s.values()),
                         *_watched(model, decay)], fail_at)
    mode.armed = not decays
    commit = decay.commit_steps

    def armed_commit(plan):
        mode.armed = decays
        try:
            commit(plan)
        finally:
            mode.armed = not decays

    decay.commit_steps = armed_commit
    return mode


@pytest.mark.parametrize("cautious", [False, True], ids=["plain", "cautious"])
def test_attached_a_fault_in_the_decays_write_restores_it_and_leaves_the_hosts_step(cautious):
    """The decay's writes come after the host's step has returned: a fault at any of them restores the
    weights to what the host's step made them and the decay's counts to what they were, and raises."""
    model, host, decay = _attached(cautious=cautious)
    with _watching_the_decay(model, host, decay) as mode:
        host.step()
    total = mode.writes
    assert total >= 2  # an addition per matrix, and the counts that change
    reference_model, reference_host, _ = _attached(decay_attached=False, cautious=cautious)
    reference_host.step()
    for fail_at in range(1, total + 1):
        model, host, decay = _attached(cautious=cautious)
        counts = decay.count_state()
        with _watching_the_decay(model, host, decay, fail_at), pytest.raises(InjectedFault):
            host.step()
        assert all(torch.equal(a, b) for a, b in zip(reference_model.parameters(), model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(_host_state(reference_host), _host_state(host)))
        assert all(torch.equal(a, b)
                   for a, b in zip(counts["skipped"].values(), decay.count_state()["skipped"].values()))


def test_attached_a_fault_in_the_hosts_step_leaves_the_decay_unwritten():
    """The host raises at one of its writes: the decay is never written. At its first write nothing is
    written at all, and a retry is the clean step; at its last, the weights are what the host's own
    partial writes made them, exactly as without the decay."""
    model, host, decay = _attached()
    with _watching_the_decay(model, host, decay, decays=False) as mode:
        host.step()
    clean, total = [p.detach().clone() for p in model.parameters()], mode.writes
    for fail_at in (1, total):
        model, host, decay = _attached()
        before = [p.detach().clone() for p in model.parameters()], _host_state(host)
        with _watching_the_decay(model, host, decay, fail_at, decays=False), pytest.raises(InjectedFault):
            host.step()
        plain_model, plain, plain_decay = _attached(decay_attached=False)
        with _watching_the_decay(plain_model, plain, plain_decay, fail_at, decays=False), \
                pytest.raises(InjectedFault):
            plain.step()
        assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters()))
        if fail_at == 1:
            assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(before[1], _host_state(host)))
            host.step()
            assert all(torch.equal(a, b) for a, b in zip(clean, model.parameters()))
