"""The decay's options, declared once: for each, its group key (the optimizers' keyword), its keyword in
:func:`spectral_ops.spectral_decay_`, the optimizers' default, its type, its check and what it means.

Everything else reads :data:`DECAY_OPTIONS` when it runs: the optimizers' signatures and defaults
(:func:`spectral_ops.optim._decay.decay_keywords`), the checks of a group
(:func:`spectral_ops.optim._decay.check_decay_group`) and of the op
(:func:`spectral_ops.decay.check_decay_options`), and the option table of docs/optimizers.md
(:func:`markdown_table`; tests/test_decay_options.py holds the doc equal to it). An option added here is
taken by every optimizer of the family and by :class:`~spectral_ops.optim.SpectralDecay`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import plan
from ._checks import check_choice, check_coefficient, check_power, check_steps
from .matrix_views import check_matrix_view
from .ops import check_iteration, check_precision

CONVENTIONS = ("decoupled", "independent")
P0_MODES = ("explicit", "prox")


@dataclass(frozen=True)
class DecayOption:
    """One option of the decay.

    ``check(value, name, sync)`` refuses a bad value on its own and returns the value as the decay takes it
    (``name``: the op's keyword, as the messages name it; ``sync=False``: a 0-d tensor's value is not read,
    see :func:`~spectral_ops._checks.check_coefficient`). What depends on another option (a band against
    ``p``, a method against ``capturable``) is :func:`spectral_ops.decay.check_decay_options`' to check.
    """

    key: str  # the optimizers' keyword and group key
    default: object  # the optimizers' default
    annotation: str  # the type, as the docs show it
    doc: str  # what it means, one line of the docs' table (Markdown)
    check: Callable[[object, str, bool], object]
    argument: str = ""  # spectral_decay_'s keyword, where it differs from the key

    @property
    def op_keyword(self) -> str:
        return self.argument or self.key


def _choice(choices: tuple) -> Callable:
    return lambda value, name, sync: check_choice(value, name, choices)


def _power(value, name, sync):
    return check_power(value, name, decay=True)


def _coefficient(value, name, sync):
    return check_coefficient(value, name, sync=sync)


def _band(value, name, sync):
    return plan.Band.coerce(value)


def _steps(value, name, sync):
    return check_steps(value, name)


def _precision(value, name, sync):
    return check_precision(value)


def _iteration(value, name, sync):
    return check_iteration(value)


def _matrix_view(value, name, sync):
    return check_matrix_view(value, optional=True)


DECAY_OPTIONS: tuple[DecayOption, ...] = (
    DecayOption("p", 1, "float", "the power (real >= 0: [real-powers.md](real-powers.md)); `p=1` is the ordinary "
                "decay", _power),
    DecayOption("spectral_weight_decay", 0.0, "float or 0-d tensor", "`lambda_p`, stacked with the ordinary `lambda_1`",
                _coefficient),
    DecayOption("convention", "decoupled", "str", "`\"decoupled\"`: scaled by the lr; `\"independent\"`: by `eta_t` = "
                "lr / `peak_lr`, a group key that defaults to the group's starting lr (an LR scheduler's "
                "`initial_lr` takes precedence)", _choice(CONVENTIONS)),
    DecayOption("band", None, "Band, dict or None", "a `so.Band` or dict (`tau`, `mode`, `p_bot`, "
                "`spectral_weight_decay_bot`); `mode=\"clip\"` with `p=1` is the clipped decay "
                "`s -> s - lr lambda_p (s - tau)_+`", _band),
    DecayOption("p0_mode", "explicit", "str", "`\"explicit\"` or `\"prox\"` (exact soft-thresholding at `p = 0`)",
                _choice(P0_MODES)),
    DecayOption("stability", "clamp", "str", "`\"clamp\"`, `\"raise\"`, `\"warn\"` or `\"ignore\"`: the stability "
                "guard of [api.md](api.md); the optimizers clamp (a long run should not die at its first aggressive "
                "step), warn at a matrix's first clamp and count every one, where the op `spectral_decay_` raises",
                _choice(plan.STABILITY_POLICIES)),
    DecayOption("decay_steps", None, "int or None", "the decay's Polar Express steps (None: 8, or designed for a "
                "band's threshold)", _steps, argument="steps"),
    DecayOption("decay_precision", None, "str or None", "the operands of the decay's iteration (see the precision "
                "policy; None: the op default)", _precision, argument="precision"),
    DecayOption("decay_iteration", "auto", "str", "`\"auto\"`, `\"rectangle\"` or `\"gram_space\"`: see \"Iterating "
                "in Gram space\"", _iteration, argument="iteration"),
    DecayOption("decay_method", "auto", "str", "`\"auto\"`, `\"gram\"`, `\"svd\"` or `\"eigh\"`: see \"Methods\" in "
                "[api.md](api.md); \"auto\" iterates on a GPU and factorises on a CPU where that is faster, compiled "
                "or not; `\"gram\"` for a CPU run that must match a GPU's arithmetic",
                _choice(plan.METHODS), argument="method"),
    DecayOption("matrix_view", None, "str or None", "`\"batch\"` or `\"flatten\"`: the matrices a parameter of more "
                "than two dimensions holds; None is refused for one wherever the reading matters (see \"Weights of "
                "more than two dimensions\")", _matrix_view),
    DecayOption("rounding", "nearest", "str", "`\"nearest\"` or `\"stochastic\"` for bf16/fp16 weights: see \"bf16 "
                "weights\"", _choice(plan.ROUNDINGS)),
)


def decay_option_keys() -> tuple[str, ...]:
    """The group keys of the decay's options, in the table's order."""
    return tuple(option.key for option in DECAY_OPTIONS)


def checked_decay_options(values: dict, *, sync: bool = True, names: dict | None = None) -> dict:
    """``values`` (by the op's keyword; one left out takes the optimizers' default) checked one by one, as the
    decay takes them; ``names``: a keyword's name in the messages where it is not the keyword itself."""
    unknown = set(values) - {option.op_keyword for option in DECAY_OPTIONS}
    if unknown:
        raise TypeError(f"unknown decay options {sorted(unknown)}")
    names = names or {}
    return {option.op_keyword: option.check(values.get(option.op_keyword, option.default),
                                            names.get(option.op_keyword, option.op_keyword), sync)
            for option in DECAY_OPTIONS}


def markdown_table() -> str:
    """The options as docs/optimizers.md shows them."""
    rows = ["| group key (keyword) | default | type | meaning | `spectral_decay_` keyword |", "|---|---|---|---|---|"]
    rows += [f"| `{option.key}` | `{option.default!r}` | `{option.annotation}` | {option.doc} | `{option.op_keyword}` |"
             for option in DECAY_OPTIONS]
    return "\n".join(rows)
