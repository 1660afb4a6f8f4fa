"""What an optimizer counts of its bad steps: skipped updates and stability clamps, per parameter
(docs/optimizers.md, "Bad steps"), their warnings and log records, and their part of the state dict."""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

import torch

from ..decay import log_clamp, matrix_index

# The entries of state_dict() (and of pickled or copied state) that are the family's, not torch's.
COUNT_KEYS = ("skipped", "clamped")


class ClampRecord(NamedTuple):
    """The stability clamps of one parameter, as 0-d tensors on its device (updated without a host read)."""

    count: torch.Tensor  # int32: the matrices (blocks of a split parameter each) whose coefficient was reduced
    smallest_factor: torch.Tensor  # float64: the smallest factor applied to its spectral coefficient (1: none)


class StepCounts:
    """The skips and clamps of an optimizer's parameters, as 0-d tensors on their devices (counted
    without a host read), and the names already reported: a skip warns and a clamp logs a warning once
    per parameter (or matrix), the later ones only count."""

    def __init__(self):
        self.skips: dict[torch.Tensor, torch.Tensor] = {}  # int32, per parameter
        # Each smallest factor is held as a 1-element vector, shown 0-d by clamp_records(): torch.compile makes a
        # symbolic float of every 0-d float64 CPU tensor a traced step reads (FakeTensor's memo of its item()), and
        # AOTAutograd's pass over Python scalars then specialises it by tracing the whole step again.
        self.clamps: dict[torch.Tensor, ClampRecord] = {}
        self.warned_skips: set[str] = set()  # parameter names
        self.logged_clamps: set[str] = set()  # matrix names (see SpectralOptimizer.matrix_name)

    def tracks(self, param: torch.Tensor) -> bool:
        return param in self.skips

    def track(self, params: list, clamp_params: list) -> None:
        """Start the counts of ``params``, stepped for the first time, at zero: the skips of each, and
        the clamps of ``clamp_params`` (the matrices of a group whose stability clamp can act). Made
        before a step, not as it runs, so a compiled step finds them and is not compiled again."""
        for param in params:
            self.skip_count(param)
        for param in clamp_params:
            self.clamp_record(param)

    def forget(self, param: torch.Tensor) -> None:
        """Drop the counts :meth:`track` started for ``param`` (its first step failed)."""
        self.skips.pop(param, None)
        self.clamps.pop(param, None)

    def skip_count(self, param: torch.Tensor) -> torch.Tensor:
        if param not in self.skips:
            self.skips[param] = torch.zeros((), dtype=torch.int32, device=param.device)
        return self.skips[param]

    def clamp_record(self, param: torch.Tensor) -> ClampRecord:
        if param not in self.clamps:
            self.clamps[param] = ClampRecord(torch.zeros((), dtype=torch.int32, device=param.device),
                                             torch.ones(1, dtype=torch.float64, device=param.device))
        return self.clamps[param]

    def clamp_records(self) -> dict:
        """The clamps per parameter as :class:`ClampRecord` of 0-d tensors (views of the counts)."""
        return {param: ClampRecord(count, smallest.view(())) for param, (count, smallest) in self.clamps.items()}

    def of(self, param: torch.Tensor) -> list:
        """The count tensors of ``param`` (what a step's rollback record keeps)."""
        return [self.skips[param], *self.clamps.get(param, ())] if param in self.skips else []

    def count_device_skips(self, decisions: list) -> None:
        """Count the skips of ``(param, keep)`` pairs a capturable step decided on the device (``keep``
        a 0-d bool tensor), without reading them."""
        if decisions:
            torch._foreach_add_([self.skip_count(param) for param, _ in decisions],
                                [torch.logical_not(keep).to(torch.int32) for _, keep in decisions])

    def count_skips(self, params: list) -> None:
        """Count an eager step's skip of each of ``params``."""
        for param in params:
            self.skip_count(param).add_(1)

    def warn_skip(self, name: str, optimizer: str) -> None:
        """Warn of an eager step's skip of the parameter called ``name``, at its first one only."""
        if name not in self.warned_skips:
            self.warned_skips.add(name)
            warnings.warn(f"{optimizer} skipped the update of {name}: its gradient or update is not "
                          "finite, so its weight and optimizer state are unchanged. Later skips are counted in "
                          "optimizer.skipped without a warning; strict=True raises instead.", RuntimeWarning,
                          stacklevel=4)

    def clamp_updates(self, steps) -> list:
        """The clamps of a step, for each ``(write, keep, matrix_name)`` of its records: the clamps of
        ``write`` (a :class:`~spectral_ops.decay.PendingWrite` of ``write.params``) in the parameters
        ``keep`` writes (on the device). The eager ones are logged now, named by
        ``matrix_name(param, rows, index)``; the counts' new values are computed now, before the step
        writes anything, and stored by :meth:`apply_clamp_updates` with its writes."""
        totals = {}  # parameter -> [its record, clamps counted, smallest factor]
        for write, keep, matrix_name in steps:
            params = write.params
            for index, position, factor, order in write.clamped:
                owner = write.owners[index]
                if keep[owner] is True:
                    # A run clamps the same matrices step after step: each one's first clamp is a
                    # warning, the later ones are debug records (their count is in `clamped`).
                    stack = params[owner].shape[:-2] if write.tensors[index].ndim > 2 else ()
                    name = matrix_name(params[owner], write.rows[index], matrix_index(stack, position))
                    first = name not in self.logged_clamps
                    self.logged_clamps.add(name)
                    log_clamp(name, factor, order, logging.WARNING if first else logging.DEBUG,
                              "; its later clamps are logged at DEBUG and counted in optimizer.clamped"
                              if first else "")
            for index, factor in write.clamp_factors.items():
                owner = write.owners[index]
                if keep[owner] is False:
                    continue
                if keep[owner] is not True:
                    factor = torch.where(keep[owner], factor, 1.0)
                record = self.clamp_record(params[owner])
                total = totals.setdefault(params[owner], [record, record.count, record.smallest_factor])
                # A stack of matrices (matrix_view="batch") counts each of its matrices' clamps.
                total[1] = total[1] + (factor < 1).sum(dtype=torch.int32)
                total[2] = torch.minimum(total[2], factor.amin())
        return list(totals.values())

    @staticmethod
    def apply_clamp_updates(updates: list) -> None:
        """Store the counts :meth:`clamp_updates` computed (copies: no allocation)."""
        for record, count, smallest in updates:
            record.count.copy_(count)
            record.smallest_factor.copy_(smallest)

    def state(self, params: list) -> dict:
        """The counts by position in ``params`` (the optimizer's, in torch's order), keys with no count
        left out: ``{"skipped": {i: count}, "clamped": {i: [count, smallest factor]}}``, copies."""
        state = {}
        if self.skips:
            state["skipped"] = {i: self.skips[param].clone() for i, param in enumerate(params) if param in self.skips}
        if self.clamps:
            records = self.clamp_records()
            state["clamped"] = {i: [t.clone() for t in records[param]] for i, param in enumerate(params)
                                if param in records}
        return state

    def load(self, state: dict, params: list) -> None:
        """Replace the counts by copies of those of :meth:`state` (or of a whole state dict: steps update the
        counts in place, and the caller's dict keeps its own); what was reported stays."""
        self.skips = {params[int(i)]: count.to(device=params[int(i)].device, dtype=torch.int32, copy=True)
                      for i, count in state.get("skipped", {}).items()}
        self.clamps = {}
        for i, (count, smallest) in state.get("clamped", {}).items():
            device = params[int(i)].device
            smallest = smallest.to(device=device, dtype=torch.float64, copy=True).reshape(1)
            self.clamps[params[int(i)]] = ClampRecord(count.to(device=device, dtype=torch.int32, copy=True), smallest)
