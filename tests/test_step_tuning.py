"""``spectral_ops.tune`` (spectral_ops/step_tuning.py) and ``python -m spectral_ops tune``: a training step's
calls run ahead of a compiled one, each primitive timed by the fake backends of tests/timed_backends.py."""

import pytest
import torch
from timed_backends import install, weight

import spectral_ops as so
from spectral_ops import dispatch, environment


def test_the_tune_command_fills_the_cache_and_the_report_shows_it(tuner, clock, tmp_path, monkeypatch):
    from spectral_ops.__main__ import main, tune

    monkeypatch.setenv(environment.CACHE_DIR, str(tmp_path))
    install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    text = tune([(16, 24), (3, 8, 40)], ["fp32"], ["decay", "polar"], device="cpu")
    assert "device Fake GPU" in text
    rows = [line for line in text.splitlines() if line.startswith("| product")]
    assert any("| float32 | fp32 | 1x16x32 | triton | triton 1e+03, cuda 2e+03, torch 3e+03 |" in r for r in rows), rows
    assert any("| 4x8x64 |" in r for r in rows), rows
    # Without a GPU the command refuses, with the reason, rather than filling a CPU cache.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--shapes", "64x64"]) == 2


def test_tuning_an_optimizer_measures_what_its_compiled_step_will_route(tuner, clock, monkeypatch):
    """tune(optimizer) runs each group's matrices, stacked as the decay stacks them, at the group's p; a
    step that cannot time (compiled, captured) then finds those choices measured."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Linear(40, 24), torch.nn.Conv2d(4, 6, 3))
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    optimizer = so.optim.SpectralAdamW([{"params": matrices, "p": 2, "spectral_weight_decay": 0.1,
                                         "matrix_view": "flatten"}], lr=1e-3)
    weights = [p.detach().clone() for p in model.parameters()]
    install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    tuned = so.tune(optimizer)
    assert sorted(tuned, key=str) == sorted([((2, 24, 40), torch.float32, 2), ((6, 36), torch.float32, 2)], key=str)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # only random copies ran
    monkeypatch.setattr(tuner, "can_time", lambda device: False)
    reads = clock.reads
    kernels = dispatch.kernels_for("routing", weight())
    X = weight((2, 24, 40))
    kernels.symmetric(X, X.mT, "fp32")
    assert kernels.used == {"triton"} and clock.reads == reads
    assert so.tune(torch.nn.Linear(3, 3).to(torch.float64), ops=("polar",)) == [((3, 3), torch.float64, 2)]
    with pytest.raises(ValueError, match="decay, polar, spectral_power"):
        so.tune(optimizer, ops=("muon",))
    with pytest.raises(TypeError, match=r"an optimizer, a module, a tensor, or an iterable of tensors .*got NoneType"):
        so.tune(None)


def test_tune_takes_one_op_name_and_any_iterable_of_tensors_as_torch_optimizers_do(tuner, clock):
    """ops="decay" is the one op (not its letters), and model.parameters(), a generator, is consumed
    once: the same stacks as the list of the same tensors (issue #52, item 10)."""
    install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Linear(24, 8))
    expected = [((24, 40), torch.float32, 2), ((8, 24), torch.float32, 2)]
    assert so.tune(model.parameters(), ops="decay") == expected
    assert so.tune(list(model.parameters()), ops=["decay", "decay"]) == expected
    assert so.tune(model[0].weight, ops=iter(["polar"])) == expected[:1]


@pytest.mark.parametrize("arguments, error, message", [
    ({"precision": "bogus"}, ValueError, r"tune\(precision=...\) must be one of .*'bf16'.*got 'bogus'"),
    ({"ops": "bogus"}, ValueError, r"takes decay, polar, spectral_power \(one name or several\); got \['bogus'\]"),
    ({"ops": ()}, ValueError, "got none"),
    ({"ops": None}, TypeError, "an op name or a sequence of them"),
    ({"target": "weights"}, TypeError, "got a str holding str"),
    ({"target": iter([])}, TypeError, r"got an empty list_iterator \(an exhausted generator\?\)"),
    ({"target": [torch.zeros(3, 3, dtype=torch.int64)]}, TypeError, "dtype torch.int64"),
])
def test_every_argument_of_tune_is_checked_first_on_every_device(arguments, error, message):
    """On a CPU, where nothing is measured, a bad argument still raises (it would on a GPU), naming
    what tune takes; nothing is timed before."""
    arguments = {"target": torch.nn.Linear(3, 3), **arguments}
    with pytest.raises(error, match=message):
        so.tune(arguments.pop("target"), **arguments)
