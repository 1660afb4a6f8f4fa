"""Tuning a training step ahead of time (:func:`tune`, the public ``spectral_ops.tune``): the calls a step over
an optimizer's or a module's matrices will make, run once now, so that measured routing
(:mod:`spectral_ops.tuning`) times each of them before the step is compiled or captured, which never times.

It sits in the API layer, beside the ops and the decay it runs: it calls them as a user would, on random
weights of the target's shapes, dtypes and devices. An optimizer is read only as torch's param groups.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_choice
from .decay import spectral_decay_
from .dispatch import measured_routing_applies
from .matrix_views import matrix_dims, matrix_view_of, unambiguous_view
from .ops import polar, spectral_power
from .precision import PRECISIONS
from .progress import progress

TUNE_OPS = ("decay", "polar", "spectral_power")


def _tune_calls() -> dict:
    """What each of :data:`TUNE_OPS` runs on a weight: the decay and ``S_p`` at the group's ``p``, Muon's
    polar factor."""
    # W: a stack of the group's matrices, which may be vectors (an op reads those only as said).
    return {"decay": lambda W, p, precision: spectral_decay_(W, p, 1e-3, 0.1, precision=precision,
                                                             matrix_view="batch"),
            "polar": lambda W, p, precision: polar(W, precision=precision, matrix_view="batch"),
            "spectral_power": lambda W, p, precision: spectral_power(W, p, method="gram", precision=precision,
                                                                     matrix_view="batch")}


def tune(target, *, ops=("decay", "polar"), precision: str | None = None) -> list[tuple]:
    """Measure now the routing of the calls that a training step over ``target``'s matrices makes, so
    that a compiled or CUDA-graph-captured step, which never times, finds every choice measured.

    ``target``: an optimizer (each param group's matrices, read by its ``matrix_view``, same shapes
    stacked as the decay stacks them, at the group's ``p``), a module (its parameters, conv filters
    flattened), a tensor, or any iterable of tensors (``model.parameters()``, consumed once, as torch's
    optimizers take it). ``ops``: an op name from :data:`TUNE_OPS`, or several. Every argument is
    checked first, on every device. Each call runs once on random weights of the same shape, dtype
    and device: the target's weights are never touched. Returns the ``(shape, dtype, p)`` stacks it
    ran; none where routing is not measured (CPU tensors, or ``SPECTRAL_OPS_AUTOTUNE=0``).
    """
    ops = _tune_ops(ops)
    if precision is not None:
        check_choice(precision, "tune(precision=...)", PRECISIONS)
    stacks: dict[tuple, int] = {}
    for group in _groups_of(target):
        for param in group["params"]:
            if param.ndim < 2:
                continue
            if param.dtype not in FLOAT_DTYPES:
                raise TypeError(f"tune() measures floating weights; a {tuple(param.shape)} tensor has dtype "
                                f"{param.dtype}: leave it out")
            view = group.get("matrix_view") or unambiguous_view(param.shape) or "batch"
            rows, cols = matrix_dims(param.shape, view)
            key = ((rows, cols), param.dtype, param.device, group.get("p", 2))
            stacks[key] = stacks.get(key, 0) + param.numel() // (rows * cols)
    stacks = {key: count for key, count in stacks.items() if measured_routing_applies(key[2])}
    if not stacks:
        return []
    calls = _tune_calls()
    tuned = []
    for ((rows, cols), dtype, device, p), count in progress(list(stacks.items()), desc="tuning", unit="stack"):
        W = torch.randn((count, rows, cols) if count > 1 else (rows, cols), dtype=dtype, device=device)
        for op in ops:
            calls[op](W, p, precision)
        tuned.append((tuple(W.shape), dtype, p))
    return tuned


def _tune_ops(ops) -> tuple[str, ...]:
    """``tune``'s ``ops``: one name or an iterable of names (each run once), all from :data:`TUNE_OPS`."""
    names = (ops,) if isinstance(ops, str) else ops  # a string is one name, not its letters
    try:
        names = tuple(dict.fromkeys(names))
    except TypeError:  # not iterable, or holding unhashable items
        raise TypeError(f"tune(ops=...) takes an op name or a sequence of them ({', '.join(TUNE_OPS)}), "
                        f"got {ops!r}") from None
    unknown = [name for name in names if name not in TUNE_OPS]
    if unknown or not names:
        raise ValueError(f"tune(ops=...) takes {', '.join(TUNE_OPS)} (one name or several); got "
                         f"{unknown if unknown else 'none'}")
    return names


def _groups_of(target) -> list[dict]:
    """``target``'s parameters as param groups (a module's with each parameter's own ``matrix_view``)."""
    if isinstance(target, torch.optim.Optimizer):
        return target.param_groups
    if isinstance(target, torch.nn.Module):
        seen: set[int] = set()
        return [{"params": [param], "matrix_view": matrix_view_of(module, param)}
                for module in target.modules() for param in module.parameters(recurse=False)
                if id(param) not in seen and not seen.add(id(param))]
    if isinstance(target, torch.Tensor):
        tensors = [target]
    else:
        try:
            tensors = list(target)  # any iterable, consumed once (a generator such as model.parameters())
        except TypeError:
            tensors = None
    kinds = "an optimizer, a module, a tensor, or an iterable of tensors (such as model.parameters())"
    if tensors is None:
        raise TypeError(f"tune() takes {kinds}, got {type(target).__name__}")
    others = [type(item).__name__ for item in tensors if not isinstance(item, torch.Tensor)]
    if others or not tensors:
        found = (f"a {type(target).__name__} holding {others[0]}" if others
                 else f"an empty {type(target).__name__} (an exhausted generator?)")
        raise TypeError(f"tune() takes {kinds}, got {found}")
    return [{"params": tensors}]
