"""The decay's options, declared once (spectral_ops/decay_options.py): an option added to the table is taken
by every optimizer of the family and the attached decay, and the docs show the table as it is."""

from __future__ import annotations

import inspect

import pytest
import torch

from spectral_ops import decay_options
from spectral_ops.decay_options import DecayOption
from spectral_ops.optim import SpectralDecay
from spectral_ops.optim.base import SpectralOptimizer

from generated_docs import generated_section


def family() -> list[type]:
    """Every optimizer class of the package: the subclasses of its optimizer base."""
    found, pending = [], [SpectralOptimizer]
    while pending:
        for cls in pending.pop().__subclasses__():
            pending.append(cls)
            if cls.__module__.startswith("spectral_ops."):
                found.append(cls)
    return found


@pytest.fixture
def dummy_option(monkeypatch) -> list:
    """A new option, ``dummy_option`` (``"a"`` or ``"b"``, default ``"a"``), added to the table alone; the
    values its check was called with."""
    checked = []

    def check(value, name, sync):
        checked.append(value)
        if value not in ("a", "b"):
            raise ValueError(f"{name} must be 'a' or 'b', got {value!r}")
        return value

    option = DecayOption("dummy_option", "a", "str", "a test's option", check)
    monkeypatch.setattr(decay_options, "DECAY_OPTIONS", (*decay_options.DECAY_OPTIONS, option))
    return checked


def weight() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))


def test_the_family_is_every_optimizer_of_the_package():
    assert {cls.__name__ for cls in family()} >= {"SpectralAdamW", "SpectralSGD", "SpectralMuon", "SpectralDecay"}


@pytest.mark.parametrize("optimizer", family(), ids=lambda cls: cls.__name__)
def test_an_option_added_to_the_table_is_taken_by_every_optimizer(dummy_option, optimizer):
    assert optimizer([weight()], lr=1e-2, dummy_option="b").param_groups[0]["dummy_option"] == "b"
    W, V = weight(), weight()
    made = optimizer([{"params": [W], "dummy_option": "b"}], lr=1e-2)
    made.add_param_group({"params": [V]})
    assert [group["dummy_option"] for group in made.param_groups] == ["b", "a"]  # a group's, and the default
    assert "b" in dummy_option and "a" in dummy_option  # validated, group by group
    with pytest.raises(ValueError, match="dummy_option must be 'a' or 'b', got 'c'"):
        optimizer([weight()], lr=1e-2, dummy_option="c")
    with pytest.raises(ValueError, match="dummy_option must be"):
        made.add_param_group({"params": [weight()], "dummy_option": "c"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'dummy_optoin'"):
        optimizer([weight()], lr=1e-2, dummy_optoin="b")
    W.grad, V.grad = torch.ones_like(W), torch.ones_like(V)
    made.step()
    resumed = optimizer([{"params": [W]}, {"params": [V]}], lr=1e-2)
    resumed.load_state_dict(made.state_dict())
    assert [group["dummy_option"] for group in resumed.param_groups] == ["b", "a"]
    resumed.param_groups[0]["dummy_option"] = "c"  # a changed option is validated again at the next step
    with pytest.raises(ValueError, match="dummy_option must be"):
        resumed.step()


def test_an_option_added_to_the_table_is_taken_by_the_attached_decay(dummy_option):
    model = torch.nn.Linear(4, 6, bias=False)
    host = torch.optim.SGD(model.parameters(), lr=0.1)
    decay = SpectralDecay(model.parameters(), p=2, spectral_weight_decay=0.1, dummy_option="b").attach(host)
    assert decay.param_groups[0]["dummy_option"] == "b" and "b" in dummy_option
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    host.step()
    assert not torch.equal(model.weight, before)
    with pytest.raises(ValueError, match="dummy_option must be"):
        SpectralDecay(model.parameters(), p=2, spectral_weight_decay=0.1, dummy_option="c")


def test_the_signatures_show_the_options_with_their_defaults():
    """help() and inspect.signature show every option as a parameter, the table's default or the
    optimizer's own (SpectralDecay's lambda_p is required where a spectral direction is), and the
    deprecated names."""
    for optimizer in family():
        parameters = inspect.signature(optimizer).parameters
        own = {"spectral_weight_decay": None} if issubclass(optimizer, SpectralDecay) else {}
        assert {option.key: parameters[option.key].default for option in decay_options.DECAY_OPTIONS} == \
            {option.key: own.get(option.key, option.default) for option in decay_options.DECAY_OPTIONS}
        assert "polar_steps" in parameters and "decay" not in parameters


def test_positional_options_keep_their_places():
    W = weight()
    decay = SpectralDecay([W], 2, 0.3, "independent", lr=0.1)
    assert (decay.defaults["p"], decay.defaults["spectral_weight_decay"], decay.defaults["convention"]) == \
        (2, 0.3, "independent")
    adamw = family()[[cls.__name__ for cls in family()].index("SpectralAdamW")]
    made = adamw([W], 1e-3, (0.9, 0.99), 1e-8, 0.0, 2, 0.5)
    assert (made.defaults["p"], made.defaults["spectral_weight_decay"]) == (2, 0.5)


def test_a_misspelled_option_is_refused_by_name_with_the_closest_option():
    """The generated signature binds the arguments itself: its TypeError names the optimizer, as
    Python's own does, and suggests the option a misspelling is closest to."""
    for optimizer in family():
        with pytest.raises(TypeError, match=rf"^{optimizer.__name__}\.__init__\(\) got an unexpected keyword "
                           r"argument 'spectral_weight_decy'; did you mean 'spectral_weight_decay'"):
            optimizer([weight()], spectral_weight_decy=0.1)
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'$"):
            optimizer([weight()], bogus=1)


def test_the_docs_show_the_option_table():
    assert generated_section("optimizers.md", "spectral_ops.decay_options.markdown_table()") == \
        decay_options.markdown_table()
