"""Every deprecated name of the package, in one table: the old name, its name now, what takes it, and the
release that removes it.

An old name still works, with a DeprecationWarning that points at the user's line; both names at once
are a TypeError. An optimizer's old group key is renamed wherever a group arrives: its constructor's
keywords (which :func:`spectral_ops.optim._decay.decay_keywords` takes from here), the groups it is given
or later added, and a state dict saved under the old key (renamed silently, unless the rename says to
warn), so that old checkpoints load.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ._checks import user_stacklevel

# The release that removes the names deprecated in 0.1.x.
REMOVED_IN = "0.2.0"

# The family's optimizers: a rename whose caller this is applies to every one of them.
OPTIMIZER_FAMILY = "SpectralOptimizer"


@dataclass(frozen=True)
class Rename:
    """``old`` is the former name of ``new`` in ``caller`` (a function, a class, or an optimizer class whose
    keyword and group key it is), until the release ``removed_in``."""

    caller: str
    old: str
    new: str
    removed_in: str = REMOVED_IN
    advice: str = ""  # what the warning tells the user to do (default: pass the new name)
    kind: str = "name"  # the old name is the new one's deprecated name, or alias
    warns_on_load: bool = False  # a state dict saved under the old group key warns as it loads
    note: str = ""  # for the docs' table: where the old name means the new one only in part

    def warning(self, caller: str) -> str:
        return f"{caller}'s {self.old} is deprecated: {self.advice or f'pass {self.new}'}"

    def both(self, caller: str) -> str:
        return f"{caller} got both {self.new} and {self.old}, its deprecated {self.kind}; pass {self.new} only"


# lambda_p was once called weight_decay, which is lambda_1 in every optimizer.
SPECTRAL_COEFFICIENT = ("pass the spectral coefficient lambda_p as spectral_weight_decay, as in SpectralAdamW, "
                        "SpectralSGD and SpectralMuon (the ordinary lambda_1 is ordinary_weight_decay)")

RENAMES = (
    Rename(OPTIMIZER_FAMILY, "polar_steps", "decay_steps"),
    Rename("SpectralDecay", "weight_decay", "spectral_weight_decay", advice=SPECTRAL_COEFFICIENT, kind="alias",
           warns_on_load=True),
    Rename("spectral_decay_", "weight_decay", "spectral_weight_decay", advice=SPECTRAL_COEFFICIENT, kind="alias"),
    Rename("Band", "weight_decay_bot", "spectral_weight_decay_bot"),
    Rename("band_projectors", "steps", "sign_steps"),
    Rename("band_projectors", "method", "sign_method", note="a sign method given as `method`, now the route's name"),
)

_BY_CALL = {(rename.caller, rename.new, rename.old): rename for rename in RENAMES}


def _taken(rename: Rename, caller: str, value, old_value, unset=None):
    if old_value is unset:
        return value
    if value is not unset:
        raise TypeError(rename.both(caller))
    warnings.warn(rename.warning(caller), DeprecationWarning, stacklevel=user_stacklevel())
    return old_value


def renamed_argument(caller: str, new: str, value, old: str, old_value, unset=None):
    """``value``, or ``old_value`` given under ``old``, the deprecated name of ``new`` in ``caller`` (one of
    :data:`RENAMES`): a DeprecationWarning names ``new``; both at once is a TypeError. ``unset``: the value
    meaning "not given"."""
    return _taken(_BY_CALL[caller, new, old], caller, value, old_value, unset)


def optimizer_renames(names) -> list[Rename]:
    """The renamed group keys of an optimizer whose class and bases are called ``names``."""
    return [rename for rename in RENAMES if rename.caller in names]


def class_names(optimizer: type) -> set[str]:
    return {cls.__name__ for cls in optimizer.__mro__}


def renamed_group_keys(group: dict, optimizer: type, *, loading: bool = False) -> dict:
    """``group`` with each deprecated key of the optimizer class ``optimizer`` under its new name (in place;
    an old key set to None is dropped). ``loading``: a saved state's group, renamed silently unless the
    rename warns on load."""
    for rename in optimizer_renames(class_names(optimizer)):
        old_value = group.pop(rename.old, None)
        if old_value is None:
            continue
        if loading and not rename.warns_on_load:
            group[rename.new] = old_value
        else:
            group[rename.new] = _taken(rename, optimizer.__name__, group.get(rename.new), old_value)
    return group


def markdown_table() -> str:
    """The deprecated names as docs/api.md shows them."""
    rows = ["| old name | new name | taken by | removed in | note |", "|---|---|---|---|---|"]
    rows += [f"| `{rename.old}` | `{rename.new}` | "
             f"{'every optimizer' if rename.caller == OPTIMIZER_FAMILY else f'`{rename.caller}`'} | "
             f"{rename.removed_in} | {rename.note} |" for rename in RENAMES]
    return "\n".join(rows)
