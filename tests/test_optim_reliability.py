"""A step either updates a parameter from finite values or leaves it alone, and a step that raises
changes nothing: the reliability promises of the optimizer family (docs/guarantees.md).

Every comparison here is bitwise (``torch.equal``): skipping or refusing must leave the exact bits,
and the parameters that are updated must get exactly what a step without the bad parameter gives.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import spectral_ops as so
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD, param_groups_by_module

from optim_models import batch, tiny_model


def _muon(params, **options):
    matrices = [p for p in params if p.ndim == 2]
    vectors = [p for p in params if p.ndim < 2]
    return SpectralMuon([{"params": matrices}, {"params": vectors, "algorithm": "adamw", "weight_decay": 0.0}],
                        lr=2e-2, precision="fp32", **options)


def _attached(params, **options):
    host = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, foreach=False)
    SpectralDecay([p for p in params if p.ndim == 2], **options).attach(host)
    return host


# Every optimizer, with a spectral decay (p = 2: the Gram, the polar iteration and the epilogue all run).
OPTIMIZERS = {
    "adamw": lambda params, **o: SpectralAdamW(params, lr=1e-2, p=2, spectral_weight_decay=0.5, **o),
    "sgd": lambda params, **o: SpectralSGD(params, lr=5e-2, momentum=0.9, p=2, spectral_weight_decay=0.5, **o),
    "muon": lambda params, **o: _muon(params, p=2, spectral_weight_decay=0.5, **o),
    "attached": lambda params, **o: _attached(params, p=2, spectral_weight_decay=0.5, **o),
}


def _gradients(model, step=0):
    inputs, targets = batch(step)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def _snapshot(model, optimizer):
    """Every parameter and every state tensor, copied."""
    state = [{key: value.clone() if torch.is_tensor(value) else value for key, value in s.items()}
             for s in optimizer.state.values()]
    return [p.detach().clone() for p in model.parameters()], state


def _assert_unchanged(before, after):
    (params_a, state_a), (params_b, state_b) = before, after
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert len(state_a) == len(state_b)
    for a, b in zip(state_a, state_b):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _name(optimizer, param):
    """How the optimizer names ``param`` (its position differs between the optimizers' groupings)."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    return optimizer.parameter_name(group, param)


def _run(name, steps=2, **options):
    """A model after ``steps`` steps (so that the state exists), its optimizer, and fresh gradients."""
    model = tiny_model()
    optimizer = OPTIMIZERS[name](list(model.parameters()), **options)
    for step in range(steps):
        _gradients(model, step)
        optimizer.step()
    _gradients(model, steps)
    return model, optimizer


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("primitive", ["symmetric", "product", "poly_step", "decay_epilogue_"])
def test_a_failing_primitive_leaves_every_weight_and_state_unchanged(monkeypatch, name, primitive):
    """Fault injection: the primitive fails at its last call of the step (after earlier matrices and
    groups were computed), so a step that wrote as it went would be caught half-way. The decay runs
    the Gram route, whose primitives the faults go into (a CPU's "auto" factorises S_2)."""
    with so.use_backend("torch"):
        model, optimizer = _run(name, decay_method="gram")
        calls = []
        original = getattr(TorchBackend, primitive)
        monkeypatch.setattr(TorchBackend, primitive, lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
        optimizer.step()  # count the calls of one step, on a copy of the same situation
        total = len(calls)
        assert total, f"{primitive} is not used by {name}'s step"

        model, optimizer = _run(name, decay_method="gram")
        before = _snapshot(model, optimizer)
        count = iter(range(total))

        def failing(self, *args, **kwargs):
            if next(count) == total - 1:
                raise RuntimeError("injected fault")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(TorchBackend, primitive, failing)
        with pytest.raises(RuntimeError, match="injected fault"):
            optimizer.step()
        _assert_unchanged(before, _snapshot(model, optimizer))


def _two_groups(name):
    """The tiny model's layers as two decay groups, and the group dict holding the second one's lambda_p."""
    model = tiny_model()
    first, second = [model[0].weight, model[0].bias], [model[2].weight, model[2].bias]
    if name == "attached":
        host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
        decay = SpectralDecay([{"params": [model[0].weight]}, {"params": [model[2].weight]}], p=2,
                              spectral_weight_decay=0.5).attach(host)
        return model, host, decay.param_groups[1]
    optimizer = OPTIMIZERS[name](first)
    optimizer.add_param_group({"params": second, **({"algorithm": "adamw"} if name == "muon" else {})})
    return model, optimizer, optimizer.param_groups[-1]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_unstable_second_group_raises_before_the_first_is_written(name):
    """The stability guard of a later group fails: nothing is written, and a retry with a stable
    coefficient gives exactly the step of a run that never failed (the first group applied once)."""
    model, optimizer, second = _two_groups(name)
    reference_model, reference, _ = _two_groups(name)
    for m in (model, reference_model):
        _gradients(m)
    second["spectral_weight_decay"] = 1e3  # lr * 1e3 * s_max >= 1
    second["stability"] = "raise"  # the optimizers' default clamps instead
    before = _snapshot(model, optimizer)
    with pytest.raises(so.SpectralStabilityError):
        optimizer.step()
    _assert_unchanged(before, _snapshot(model, optimizer))

    second["spectral_weight_decay"] = 0.5
    optimizer.step()
    reference.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference_model.parameters()))


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
@pytest.mark.parametrize("where", ["gradient", "weight", "intermediate"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_matrix_is_skipped_counted_and_the_others_updated(monkeypatch, name, where, bad):
    """NaN/Inf in one matrix's gradient, weight, or a product computed for it: that parameter and its
    state keep their bits, the skip is counted, the other parameters get exactly the step they get
    when the bad parameter has no gradient at all, and the next finite step is normal. A bad weight
    takes the factorised route a CPU's "auto" runs (LAPACK must not fail the whole step); a bad product
    is injected into the Gram route's."""
    options = {"decay_method": "gram"} if where == "intermediate" else {}
    with so.use_backend("torch"):
        model, optimizer = _run(name, **options)
        reference_model, reference = _run(name, **options)
        target = model[2].weight  # 4 x 16: a shape no other matrix has
        reference_model[2].weight.grad = None
        if where == "gradient":
            target.grad[1, 3] = bad
        elif where == "weight":
            with torch.no_grad():
                target[1, 3] = bad
                reference_model[2].weight[1, 3] = bad
        else:
            original = TorchBackend.product

            def poisoned(self, M, Z, *args, **kwargs):
                result = original(self, M, Z, *args, **kwargs)
                return result.fill_(bad) if Z.shape[-2:] == (4, 16) else result

            monkeypatch.setattr(TorchBackend, "product", poisoned)
        before = target.detach().clone()
        state_before = {k: v.clone() for k, v in optimizer.state[target].items()}
        with pytest.warns(RuntimeWarning, match=re.escape(f"skipped the update of {_name(optimizer, target)}:")):
            optimizer.step()
        reference.step()
        monkeypatch.undo()

        assert torch.equal(target, before) or (where == "weight" and torch.equal(target.isnan(), before.isnan()))
        assert all(torch.equal(v, state_before[k]) for k, v in optimizer.state[target].items())
        # Every stepped parameter has a count (0: never skipped).
        skipped = {name: int(count) for name, count in optimizer.skipped.items() if int(count)}
        assert skipped == {_name(optimizer, target): 1}
        others = [(p, q) for p, q in zip(model.parameters(), reference_model.parameters()) if p is not target]
        assert all(torch.equal(p, q) for p, q in others)

        if where == "weight":
            return  # the weight itself stays non-finite: every later step skips it
        _gradients(model, 5)
        _gradients(reference_model, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a finite step is normal, and warns about nothing
            optimizer.step()
        reference.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference_model.parameters()))


def test_a_nan_gradient_does_not_poison_muons_momentum():
    model, optimizer = _run("muon")
    model[2].weight.grad.fill_(float("nan"))
    with pytest.warns(RuntimeWarning):
        optimizer.step()
    for step in range(3):
        _gradients(model, 10 + step)
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(s["momentum_buffer"]).all() for s in optimizer.state.values() if "momentum_buffer" in s)


def test_adam_skips_a_gradient_whose_square_overflows():
    """|g| = 1e20: finite, but g^2 overflows fp32, which would make the second moment Inf for good."""
    model, optimizer = _run("adamw")
    model[0].weight.grad[0, 0] = 1e20
    with pytest.warns(RuntimeWarning, match=r"param_groups\[0\]\['params'\]\[0\]"):
        optimizer.step()
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in optimizer.state.values())


def test_the_warning_comes_once_per_parameter_and_names_its_module_path():
    model = tiny_model()
    model.register_module("head", torch.nn.Linear(4, 4))
    optimizer = SpectralAdamW(param_groups_by_module(model, non_matrix={"weight_decay": 0.0}), lr=1e-2, p=2,
                              spectral_weight_decay=0.5)
    for step in range(3):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.head(model(inputs)), targets).backward()
        model.head.weight.grad[0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        messages = [str(w.message) for w in caught]
        assert messages == (["SpectralAdamW skipped the update of head.weight (4, 4): its gradient or update is "
                             "not finite, so its weight and optimizer state are unchanged. Later skips are counted "
                             "in optimizer.skipped without a warning; strict=True raises instead."]
                            if step == 0 else [])
    assert int(optimizer.skipped["head.weight (4, 4)"]) == 3


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
def test_strict_raises_and_writes_nothing(name):
    model, optimizer = _run(name, strict=True)
    model[2].weight.grad[0, 0] = float("nan")
    before = _snapshot(model, optimizer)
    with pytest.raises(FloatingPointError, match=re.escape(_name(optimizer, model[2].weight)) + ".*strict=True"):
        optimizer.step()
    _assert_unchanged(before, _snapshot(model, optimizer))


def test_strict_cannot_be_capturable():
    with pytest.raises(ValueError, match="strict=True .* capturable=True"):
        SpectralAdamW(tiny_model().parameters(), strict=True, capturable=True)


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
def test_a_capturable_step_skips_on_the_device_without_a_warning(name):
    """The same skip decided on the device (no host read): bits kept, the count on the device, the
    others updated as without the bad parameter."""
    options = {"capturable": True, "stability": "clamp"}
    model, optimizer = _run(name, **options)
    reference_model, reference = _run(name, **options)
    target = model[2].weight
    target.grad[0, 0] = float("nan")
    reference_model[2].weight.grad = None
    before, state_before = target.detach().clone(), {k: v.clone() for k, v in optimizer.state[target].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    reference.step()
    assert torch.equal(target, before)
    assert all(torch.equal(v, state_before[k]) for k, v in optimizer.state[target].items())
    assert {k: int(v) for k, v in optimizer.skipped.items() if int(v)} == {_name(optimizer, target): 1}
    others = [(p, q) for p, q in zip(model.parameters(), reference_model.parameters()) if p is not target]
    assert all(torch.equal(p, q) for p, q in others)


def test_skip_counts_are_saved_and_loaded():
    model, optimizer = _run("adamw")
    model[2].weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning):
        optimizer.step()
    state = optimizer.state_dict()
    fresh = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    fresh.load_state_dict(state)
    assert {k: int(v) for k, v in fresh.skipped.items() if int(v)} == {"param_groups[0]['params'][2] (4, 16)": 1}
    assert len(fresh.skipped) == len(list(model.parameters()))  # the others' counts are 0
    assert fresh.skipped["param_groups[0]['params'][2] (4, 16)"].dtype == torch.int32


def test_a_list_decay_that_would_overflow_raises_before_writing_any_weight():
    """Every weight finite, the exact result of the second one is not (it is about -9 s_max ~ -1e38 * 9,
    past fp32's 3.4e38, with stability='ignore'): refused, and the first weight is not written."""
    first = torch.randn(8, 8)
    second = matrix_with_spectrum((8, 4), [1e38, 1e37, 1e36, 1e35], dtype=torch.float32)
    weights = [first, second, torch.randn(8, 4)]
    before = [w.clone() for w in weights]
    with pytest.raises(OverflowError, match=r"W\[1\] would not be finite"):
        so.spectral_decay_(weights, 2, 1e-37, 1.0, stability="ignore")
    assert all(torch.equal(a, b) for a, b in zip(weights, before))


# ----- torch conformance: complex parameters


def _complex_parameters():
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 5, dtype=torch.complex64, generator=generator)),
            torch.nn.Parameter(torch.randn(7, dtype=torch.complex64, generator=generator))]


def _complex_steps(optimizer, params, steps=4):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, dtype=param.dtype, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("build, torch_build", [
    (lambda ps: SpectralAdamW(ps, lr=1e-2, weight_decay=0.1),
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
    (lambda ps: SpectralSGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
     lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True)),
    (lambda ps: SpectralMuon([{"params": ps, "algorithm": "adamw"}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999)),
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
], ids=["adamw", "sgd", "muon-adamw"])
def test_complex_parameters_follow_torch(build, torch_build):
    """Element-wise updates of complex parameters are torch's, bit for bit: Adam's moments are those of
    the real and imaginary parts (view_as_real), not of g * g."""
    ours, theirs = _complex_parameters(), _complex_parameters()
    _complex_steps(build(ours), ours)
    _complex_steps(torch_build(theirs), theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_complex_matrix_is_refused_the_spectral_decay_when_the_optimizer_is_built():
    matrix, vector = _complex_parameters()
    with pytest.raises(TypeError, match=r"complex \(6, 5\) parameter cannot take the spectral decay"):
        SpectralAdamW([matrix, vector], p=2, spectral_weight_decay=0.1)
    with pytest.raises(TypeError, match="Muon's polar factor is implemented for real matrices only"):
        SpectralMuon([matrix])
    SpectralAdamW([matrix, vector], p=2, spectral_weight_decay=0.0, weight_decay=0.1)  # ordinary decay only


def test_a_group_can_decay_in_gram_space():
    """decay_iteration reaches the decay: the step equals spectral_decay_ with iteration='gram_space'
    (SGD without momentum, so the update is the decay and lr * g)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 16) / 8)
    expected = weight.detach().clone()
    weight.grad = torch.zeros_like(weight)
    SpectralSGD([weight], lr=0.1, momentum=0.0, p=2, spectral_weight_decay=0.5, decay_iteration="gram_space").step()
    so.spectral_decay_(expected, 2, 0.1, 0.5, iteration="gram_space")
    assert torch.equal(weight.detach(), expected)
    with pytest.raises(ValueError, match="iteration must be one of"):
        SpectralSGD([weight], p=2, spectral_weight_decay=0.5, decay_iteration="gram")


@pytest.mark.parametrize("method", ["gram", "svd", "eigh"])
def test_a_group_chooses_how_its_decay_is_computed(method):
    """decay_method reaches the decay as spectral_decay_'s method (SGD without momentum: the update is
    the decay and lr * g); a factorisation is refused at construction where the step is capturable."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 16) / 8)
    expected = weight.detach().clone()
    weight.grad = torch.zeros_like(weight)
    SpectralSGD([weight], lr=0.1, momentum=0.0, p=2, spectral_weight_decay=0.5, decay_method=method).step()
    so.spectral_decay_(expected, 2, 0.1, 0.5, method=method)
    assert torch.equal(weight.detach(), expected)
    if method != "gram":
        with pytest.raises(ValueError, match="capturable=True needs method='gram' or 'auto'"):
            SpectralSGD([weight], p=2, spectral_weight_decay=0.5, decay_method=method, capturable=True)


# The stability clamp, counted and logged per parameter (SPEC 1.5; the op itself: test_decay.py).


def test_the_optimizers_count_and_log_their_clamps(caplog):
    big = matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10) * 10, torch.float64, seed=4)
    counts = {}
    for capturable in (False, True):
        param = torch.nn.Parameter(big.clone())
        param.grad = torch.zeros_like(big)
        optimizer = SpectralAdamW([param], lr=0.1, p=2, spectral_weight_decay=2.0, weight_decay=0.0,
                                  stability="clamp", capturable=capturable)
        caplog.clear()
        with caplog.at_level("DEBUG", logger="spectral_ops.decay"):
            optimizer.step()
            optimizer.step()
        counts[capturable] = optimizer.clamped["param_groups[0]['params'][0] (12, 8)"]
        named = "of param_groups[0]['params'][0] (12, 8) by a factor"
        # The first clamp of a matrix warns (and says where the later ones go); a run would otherwise
        # repeat the warning for every matrix at every step.
        logged = [(r.levelname, named in r.getMessage(), "later clamps are logged at DEBUG" in r.getMessage())
                  for r in caplog.records]
        assert logged == ([] if capturable else [("WARNING", True, True), ("DEBUG", True, False)])
    assert int(counts[False].count) == int(counts[True].count) == 2
    assert torch.equal(counts[False].smallest_factor, counts[True].smallest_factor)
    assert float(counts[False].smallest_factor) < 1

    # Muon's Q/K/V blocks are clamped one by one, and named by their rows.
    fused = torch.nn.Parameter(torch.cat([big[:4], big[:4] * 0.01, big[:4] * 0.01]))
    fused.grad = torch.zeros_like(fused)
    muon = SpectralMuon([{"params": [fused], "splits": (4, 4, 4), "param_names": ["attn.qkv"]}], lr=0.1, p=2,
                        spectral_weight_decay=2.0, stability="clamp")
    caplog.clear()
    with caplog.at_level("WARNING", logger="spectral_ops.decay"):
        muon.step()
    assert [r.getMessage().split(" by ")[0] for r in caplog.records] == [
        "stability='clamp' reduced the spectral coefficient of attn.qkv (12, 8) rows 0:4"]
    assert int(muon.clamped["attn.qkv (12, 8)"].count) == 1


def _attached_decay(param):
    host = torch.optim.SGD([param], lr=0.1)
    SpectralDecay([param], p=2, spectral_weight_decay=2.0).attach(host)
    return host, "param_groups[0]['params'][0] (12, 8)"


DEFAULT_STABILITY = {
    "SpectralAdamW": lambda param: (SpectralAdamW([param], lr=0.1, p=2, spectral_weight_decay=2.0, weight_decay=0.0),
                                    "param_groups[0]['params'][0] (12, 8)"),
    "SpectralDecay attached": _attached_decay,
}


@pytest.mark.parametrize("name", DEFAULT_STABILITY)
def test_the_default_stability_clamps_and_warns_once_per_matrix(caplog, name):
    """No stability= given: a step that would reorder the singular values (p * kappa >= 1) is clamped,
    not raised, and the matrix's first clamp warns once; the training loop's behaviour."""
    big = matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10) * 10, torch.float64, seed=4)
    param = torch.nn.Parameter(big.clone())
    param.grad = torch.zeros_like(big)
    stepper, matrix = DEFAULT_STABILITY[name](param)
    with caplog.at_level("DEBUG", logger="spectral_ops.decay"):
        stepper.step()
        stepper.step()
    levels = [r.levelname for r in caplog.records if f"of {matrix} by a factor" in r.getMessage()]
    assert levels == ["WARNING", "DEBUG"]
    # Clamped to p * kappa = 1/2, a step takes at most kappa = 1/(2p) = 1/4 of the top mode (unclamped,
    # kappa is far above 1 here and would flip it through zero); no mode grows.
    s_before, s_after = torch.linalg.svdvals(big), torch.linalg.svdvals(param.detach())
    assert s_after[0] >= (1 - 1 / 4) ** 2 * s_before[0] and torch.all(s_after <= s_before)


def test_clamp_counts_are_saved_and_loaded(tmp_path):
    """A resumed run keeps counting its clamps (the training loop's clamped_updates is "so far"): the
    records go into state_dict by parameter position, and survive torch.save/load(weights_only=True)."""
    param = torch.nn.Parameter(matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10) * 10, torch.float64, seed=4))
    param.grad = torch.zeros_like(param)
    optimizer = SpectralAdamW([param], lr=0.1, p=2, spectral_weight_decay=2.0, weight_decay=0.0, stability="clamp")
    optimizer.step()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "state.pt")
    fresh = SpectralAdamW([param], lr=0.1, p=2, spectral_weight_decay=2.0, weight_decay=0.0, stability="clamp")
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    (name, saved), = optimizer.clamped.items()
    loaded = fresh.clamped[name]
    assert int(saved.count) == int(loaded.count) == 2 and loaded.count.dtype == torch.int32
    assert torch.equal(saved.smallest_factor, loaded.smallest_factor)
    fresh.step()
    assert int(fresh.clamped[name].count) == 3


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_meta_parameters_build_and_their_step_is_refused_before_any_state(name):
    """A model on the meta device (FSDP2's initialisation, before to_empty) builds every optimizer; a
    step before the weights are materialised raises a precise error and creates no state."""
    model = tiny_model().to("meta")
    optimizer = OPTIMIZERS[name](list(model.parameters()))
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    with pytest.raises(ValueError, match=r"meta-device parameter .*, which has no values\. Materialise the model"):
        optimizer.step()
    assert not optimizer.state


def _materialised(model):
    """What FSDP2's meta-device recipe does after building the optimizer: to_empty, then initialise."""
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    _gradients(model)
    return model


@pytest.mark.parametrize("name", ["adamw", "attached"])
def test_an_optimizer_built_before_to_empty_refuses_to_step_and_names_the_fixes(name):
    """Under torch's default (swap off) to_empty replaces each Parameter: an optimizer built on the meta
    model holds the old meta ones, which get no gradient, so its steps decayed nothing, in silence. Now
    its step raises and names both fixes; with swapping on, the same flow trains."""
    model = tiny_model().to("meta")
    optimizer = OPTIMIZERS[name](list(model.parameters()))
    _materialised(model)
    before = [param.detach().clone() for param in model.parameters()]
    with pytest.raises(ValueError, match=r"holds the meta-device parameter .*build the optimizer after that.*"
                                         r"set_swap_module_params_on_conversion\(True\)"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    swapped = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = tiny_model().to("meta")
        optimizer = OPTIMIZERS[name](list(model.parameters()))
        _materialised(model)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapped)
    before = [param.detach().clone() for param in model.parameters()]
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if a.ndim == 2)


# ----- the optimizer's own update is checked too (#52): a finite weight never turns non-finite


def _unit_weight(shape, dtype, seed=0):
    W = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter((W / W.norm()).to(dtype))


@pytest.mark.filterwarnings("ignore:.*skipped the update")
@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
@pytest.mark.parametrize("build", [
    *(lambda P, p=p, **o: SpectralAdamW([P], lr=1e-3, p=p, spectral_weight_decay=0.1, **o) for p in (0, 1, 2, 3)),
    lambda P, **o: SpectralMuon([{"params": [P], "algorithm": "adamw"}], lr=1e-3, **o),
], ids=["adamw-p0", "adamw-p1", "adamw-p2", "adamw-p3", "muon-adamw"])
def test_an_fp16_adam_step_whose_second_moment_underflows_is_skipped(build, capturable):
    """The issue's reproduction: gradients of 1e-3 square to 1e-9 (times 1 - beta2), below fp16's range,
    so the second moment and the denominator (eps = 1e-8 rounds to 0 in fp16) are 0, and m / 0 wrote
    Inf into every entry, skipped 0. Now the update is checked: skipped, counted, bits kept."""
    P = _unit_weight((64, 32), torch.float16)
    optimizer = build(P, capturable=capturable, stability="clamp")
    P.grad = torch.randn(P.shape, generator=torch.Generator().manual_seed(1)).half() * 1e-3
    before = P.detach().clone()
    optimizer.step()
    assert torch.equal(P.detach(), before)
    assert [int(count) for count in optimizer.skipped.values()] == [1]


@pytest.mark.filterwarnings("ignore:.*skipped the update")
@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_eps_zero_with_a_zero_gradient_is_skipped_not_written_nan(capturable):
    """eps = 0 and a second moment of 0: 0 / 0 made every entry NaN. The other matrix steps as usual."""
    P, Q = torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(32, 16))
    optimizer = SpectralAdamW([P, Q], lr=1e-2, eps=0.0, capturable=capturable)
    P.grad, Q.grad = torch.zeros_like(P), torch.ones_like(Q)
    before = P.detach().clone(), Q.detach().clone()
    optimizer.step()
    assert torch.equal(P.detach(), before[0]) and torch.isfinite(Q).all() and not torch.equal(Q.detach(), before[1])
    assert [int(count) for count in optimizer.skipped.values()] == [1, 0]


@pytest.mark.filterwarnings("ignore:.*skipped the update")
@pytest.mark.parametrize("name", ["sgd", "sgd-nesterov", "muon", "adamw"])
def test_an_update_that_overflows_the_weight_is_skipped(name):
    """Finite weights near the dtype's largest number, a finite update that carries them past it."""
    P = torch.nn.Parameter(torch.full((8, 6), 3e38))
    build = {"sgd": lambda: SpectralSGD([P], lr=1e30, momentum=0.9),
             "sgd-nesterov": lambda: SpectralSGD([P], lr=1e30, momentum=0.9, nesterov=True),
             "muon": lambda: SpectralMuon([P], lr=1e39, weight_decay=0.0),
             "adamw": lambda: SpectralAdamW([P], lr=1e38, weight_decay=0.0)}[name]
    optimizer = build()
    P.grad = -torch.ones_like(P) * 1e9
    before = P.detach().clone()
    optimizer.step()
    assert torch.equal(P.detach(), before)
    assert [int(count) for count in optimizer.skipped.values()] == [1]


OPTIONS_SET_LATER = [("adamw", 0, "eps", float("nan")), ("adamw", 0, "betas", (0.9, float("nan"))),
                     ("sgd", 0, "momentum", float("nan")), ("sgd", 0, "dampening", float("inf")),
                     ("muon", 0, "momentum", float("nan")), ("muon", 1, "eps", float("nan")),
                     ("muon", 1, "betas", (1.5, 0.95)), ("adamw", 0, "strict", "yes")]


@pytest.mark.parametrize("name, group, key, value", OPTIONS_SET_LATER,
                         ids=[f"{n}-{g}-{k}" for n, g, k, _ in OPTIONS_SET_LATER])
def test_an_option_set_on_a_group_after_construction_is_checked_before_any_write(name, group, key, value):
    """``param_groups[0]["eps"] = nan`` was never checked again (every entry NaN), nor SGD's or Muon's
    momentum: every option of a group is validated again once it changed, before the step writes."""
    model, optimizer = _run(name)
    optimizer.param_groups[group][key] = value
    before = _snapshot(model, optimizer)
    with pytest.raises((ValueError, TypeError), match=re.escape(key.split("[")[0])):
        optimizer.step()
    _assert_unchanged(before, _snapshot(model, optimizer))


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

STEPPERS = {
    "adamw": lambda params, p, eps, lr, **o: SpectralAdamW(params, lr=lr, eps=eps, p=p, spectral_weight_decay=0.1,
                                                           **o),
    "sgd": lambda params, p, eps, lr, **o: SpectralSGD(params, lr=lr, momentum=0.9, nesterov=True, p=p,
                                                       spectral_weight_decay=0.1, **o),
    "muon": lambda params, p, eps, lr, **o: SpectralMuon(
        [{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw", "eps": eps}], lr=lr, p=p,
        spectral_weight_decay=0.1, **o),
}


@pytest.mark.filterwarnings("ignore:.*skipped the update")
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(STEPPERS)), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       p=st.sampled_from([0, 1, 2, 3]), eps=st.sampled_from([0.0, 1e-8, 1e-4]), capturable=st.booleans(),
       weight=st.floats(0, 1), gradient=st.floats(-8, 2), lr=st.floats(-4, 2), zeros=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_step_never_turns_a_finite_weight_non_finite(name, dtype, p, eps, capturable, weight, gradient, lr,
                                                        zeros, seed):
    """In every dtype (fp16 included), at any scale of weights (up to the dtype's largest numbers),
    gradients and lr, with eps = 0 and gradients that are 0 in some entries: after each step every
    weight and state tensor is finite, or the parameter was skipped, counted, its bits kept."""
    generator = torch.Generator().manual_seed(seed)
    largest = torch.finfo(dtype).max ** weight  # from 1 to the dtype's largest number
    params = [torch.nn.Parameter((torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul(largest)
                                 .to(dtype)) for shape in ((12, 8), (8,))]
    optimizer = STEPPERS[name](params, p, eps, 10.0**lr, capturable=capturable, stability="clamp")
    for _ in range(2):
        for param in params:
            param.grad = (torch.randn(param.shape, generator=generator, dtype=torch.float64) * 10.0**gradient).to(dtype)
            if zeros:
                param.grad[..., :2] = 0
        before = [param.detach().clone() for param in params]
        counts = [int(count) for count in optimizer.skipped.values()] or [0] * len(params)
        optimizer.step()
        for param, old, count, new in zip(params, before, counts, optimizer.skipped.values()):
            state = [value for value in optimizer.state[param].values() if torch.is_tensor(value)]
            if int(new) > count:
                assert torch.equal(param.detach(), old)
            else:
                assert torch.isfinite(param).all() and all(torch.isfinite(value).all() for value in state)
