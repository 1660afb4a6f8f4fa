"""The rollback record of a step (``rollback=True``): a copy of everything its commit writes, so that a
failure inside a write (an interrupt, a fault in an op) is undone too; see docs/optimizers.md, "Bad steps"."""

from __future__ import annotations

import torch

from .distributed import local


class Rollback:
    """A copy of everything a step's commit writes, taken just before its first write and dropped after
    its last (the cost: one copy of the parameters and state tensors it writes): :meth:`restore` puts
    every tensor, state entry and reported name back as it was, whichever write failed."""

    def __init__(self):
        self.tensors = []  # (tensor, its copy)
        self.states = []  # (the optimizer's state, a parameter, its state dict or None, that dict's items)
        self.sets = []  # (set, its members)

    def keep_tensor(self, tensor: torch.Tensor) -> None:
        tensor = local(tensor)
        self.tensors.append((tensor, tensor.clone()))

    def keep_state(self, state: dict, param: torch.Tensor) -> None:
        """``state[param]``, which the commit may create, fill, or update in place."""
        entries = state.get(param)
        self.states.append((state, param, entries, dict(entries or {})))
        for value in (entries or {}).values():
            if torch.is_tensor(value):
                self.keep_tensor(value)

    def keep_set(self, members: set) -> None:
        self.sets.append((members, set(members)))

    def restore(self) -> None:
        for tensor, saved in self.tensors:
            tensor.copy_(saved)
        for state, param, entries, saved in self.states:
            if entries is None:
                state.pop(param, None)
                continue
            entries.clear()
            entries.update(saved)
            state[param] = entries
        for members, saved in self.sets:
            members.clear()
            members.update(saved)


def records(groups) -> bool:
    """Whether a step of ``groups`` keeps a :class:`Rollback` record: where any of them asks for one
    (``rollback=True``), for all of them, since a step is one unit (a record of some groups only would
    restore those and leave the others written); never in a step torch.compile traces or a CUDA graph
    captures, which could not restore it (a replayed graph allocates nothing and runs whole)."""
    if not any(group["rollback"] for group in groups) or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def rollback_record(prepared: list, keeps: list, counts, state: dict) -> Rollback | None:
    """The :class:`Rollback` record of a step's records (:class:`~spectral_ops.decay.PendingWrite`),
    ``prepared``, if it keeps one (:func:`records`; None if not), ``keeps`` their decisions: each
    stepped parameter's counts and reported names (``counts``, the optimizer's
    :class:`~spectral_ops.optim.counts.StepCounts`), and each written parameter and its ``state``."""
    if not records([step.group for step in prepared]):
        return None
    record = Rollback()
    record.keep_set(counts.warned_skips)
    record.keep_set(counts.logged_clamps)
    for step, keep in zip(prepared, keeps):
        for param, written in zip(step.params, keep):
            for count in counts.of(param):
                record.keep_tensor(count)
            if written is not False:
                record.keep_tensor(param)
                record.keep_state(state, param)
    return record
