"""The decay half of every optimizer step (SPEC 1.5), shared by the whole family.

Per parameter group: matrices (``ndim >= 2``; conv-style ``ndim > 2`` weights are viewed as
``(shape[0], -1)``, as Muon does) get ``lambda_p * S_p(W)`` plus the ordinary ``lambda_1 * W`` in one
batched :func:`spectral_ops.spectral_decay_` call per group (same shapes share a batch); vectors
(biases, norm gains) get only the ordinary term, since ``S_p`` is defined for matrices.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings
from collections import defaultdict
from typing import Callable, NamedTuple

import torch
from torch.optim import Optimizer

from .._checks import check_coefficient, check_same_device
from ..decay import Band, DecayOptions, PendingDecay, check_decay_options, log_clamp, prepare_decay
from .distributed import Exchange, decay_flops, layout_of, local, local_slice

# Decay keys every optimizer of the family accepts per parameter group, with their defaults.
DECAY_DEFAULTS = {
    "p": 1,
    "spectral_weight_decay": 0.0,
    "convention": "decoupled",
    "band": None,
    "p0_mode": "explicit",
    "stability": "raise",
    "polar_steps": None,
    "decay_precision": None,
    "decay_iteration": "auto",
    "capturable": False,
    "strict": False,
}


# torch's own group keys that this family holds as torch's optimizers do. torch's load_state_dict adds
# ``differentiable`` to the defaults of any optimizer it loads into; held from construction, a group
# has the same keys before and after a round trip. The steps run without autograd, so it stays False.
TORCH_GROUP_DEFAULTS = {"differentiable": False}

# The entries of state_dict() (and of pickled or copied state) that are the family's, not torch's.
COUNT_KEYS = ("skipped", "clamped")


def is_zero(value) -> bool:
    """A Python zero (a tensor coefficient is never assumed to be zero: that would need a sync)."""
    return not isinstance(value, torch.Tensor) and value == 0


def scalar(value) -> float:
    """A Python number from a float or a 0-d tensor (torch's optimizers do the same)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def capturable(group: dict) -> bool:
    """The group's ``capturable`` as a plain bool: torch.compile from 2.15 traces it as a stand-in with a
    truth value but no ``not`` or ``==``."""
    return bool(group["capturable"])


def step_scalar(value, group: dict):
    """A coefficient as a step uses it: read on the host, unless the group is capturable, where a 0-d
    tensor stays on the device (a scheduler may change it inside a captured graph)."""
    return value if capturable(group) else scalar(value)


def add_scaled_(target: torch.Tensor, update: torch.Tensor, scale) -> None:
    """``target -= scale * update``, for a Python or a 0-d tensor ``scale`` (without reading it)."""
    if isinstance(scale, torch.Tensor):
        target.addcmul_(update, scale, value=-1)
    else:
        target.add_(update, alpha=-scale)


def detached_peak(lr):
    """The peak lr to remember: a tensor lr is copied, since schedulers change it in place."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def check_decay_group(group: dict, *, spectral: str, ordinary: str) -> DecayOptions:
    """Validate a group's decay options, naming its coefficient keys ``spectral`` and ``ordinary``."""
    options = check_decay_options(
        group["p"],
        group[spectral],
        ordinary_weight_decay=group[ordinary],
        convention=group["convention"],
        band=group["band"],
        p0_mode=group["p0_mode"],
        steps=group["polar_steps"],
        stability=group["stability"],
        precision=group["decay_precision"],
        capturable=capturable(group),
        iteration=group["decay_iteration"],
        names=(spectral, ordinary),
    )
    spectral_direction = options.band is not None or (options.p != 1 and not is_zero(group[spectral]))
    for param in group["params"]:
        if param.ndim > 2 and not param.is_contiguous():
            raise ValueError(f"a {param.ndim}-d parameter must be contiguous to be decayed as a matrix view")
        if spectral_direction and param.is_complex() and param.ndim >= 2:
            raise TypeError(f"a complex {tuple(param.shape)} parameter cannot take the spectral decay (p={options.p}"
                            f"{', band' if options.band is not None else ''}): S_p is implemented for real matrices "
                            f"only. Put it in a group with p=1 or {spectral}=0 (the ordinary decay works on it)")
    check_same_device([param for param in group["params"] if param.ndim >= 2], "a parameter group's matrices")
    return options


def _option_key(value):
    """A comparable stand-in for an option's value: a tensor by identity (its value may change in
    place without needing validation again), a dict by its items, a flag as a plain bool (torch.compile
    from 2.15 traces a group's ``capturable`` as a stand-in that has a truth value but no ``==``)."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, dict):
        return tuple(sorted((k, _option_key(v)) for k, v in value.items()))
    return value


def check_on_parameter_device(group: dict, keys) -> None:
    """A capturable group's tensor hyper-parameters live on its parameters' device: a GPU step that
    reads a CPU tensor copies it from the host, which a captured graph cannot replay."""
    devices = {param.device for param in group["params"]}
    for key in keys:
        value = group.get(key)
        if isinstance(value, torch.Tensor) and devices - {value.device}:
            raise ValueError(f"capturable=True: {key} is a tensor on {value.device} but the parameters are on "
                             f"{', '.join(sorted(map(str, devices)))}; create it on their device")


def schedule_multiplier(lr, peak_lr):
    """``eta_t = lr / peak_lr`` (0 when the peak is 0)."""
    return 0.0 if is_zero(peak_lr) else lr / peak_lr


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """A parameter's shape as a matrix: its rows by the product of its other sizes (spelt out, not
    -1, which an empty shard (no rows on this rank) leaves ambiguous)."""
    return param.shape[0], math.prod(param.shape[1:])


def matrix_view(param: torch.Tensor) -> torch.Tensor:
    return param if param.ndim == 2 else param.view(matrix_shape(param))


@dataclasses.dataclass
class DecayPart:
    """Some of a group's decay: ``pending`` holds matrices or vectors (parameters, blocks of their
    matrix views, or the rows of those on this rank), ``owners[i]`` the index of the parameter
    ``pending.tensors[i]`` belongs to, and ``rows[i]`` the block ``(start, stop)`` of that parameter's
    matrix view that entry decays as a matrix (None: the whole parameter)."""

    pending: PendingDecay
    owners: tuple
    rows: tuple


@dataclasses.dataclass
class ParameterDecay:
    """A group's decay computed but not written (see :class:`spectral_ops.decay.PendingDecay`)."""

    parts: list = dataclasses.field(default_factory=list)

    def checks(self):
        """``(parameter index, decayed value)`` for every value computed before the commit."""
        for part in self.parts:
            for index, value in part.pending.decayed.items():
                yield part.owners[index], value

    def commit(self, keep: list) -> None:
        """Write the decay of the parameters ``keep`` keeps (one entry per parameter, as in
        :meth:`PendingDecay.commit`)."""
        for part in self.parts:
            part.pending.commit([keep[owner] for owner in part.owners])


def needs_spectral_direction(options: DecayOptions, spectral) -> bool:
    """Whether the decay computes ``S_p`` (or a band's direction), which needs each whole matrix: not
    for ``p = 1`` or a zero ``lambda_p``, which decay element-wise."""
    return options.band is not None or (options.p != 1 and not is_zero(spectral))


def row_blocks_of(param: torch.Tensor, blocks) -> list:
    """The ``(start, stop)`` rows of each matrix the decay sees in ``param``'s matrix view: ``blocks``
    (a function of the parameter giving ``(start, size)`` pairs, or None) splits it, as Muon's fused
    projections are; else the whole view (None)."""
    splits = blocks(param) if blocks is not None else None
    return [None] if not splits else [(start, start + size) for start, size in splits]


@torch.no_grad()
def prepare_parameter_decay(params, group: dict, options: DecayOptions, *, lr, peak_lr, spectral, ordinary,
                            blocks=None, layouts=None, exchange=None) -> ParameterDecay:
    """The group's decay of ``params``, computed from their current values but not written, with the
    group's ``options`` validated beforehand. ``blocks``: see :func:`row_blocks_of`. ``layouts``: each
    parameter's :class:`~spectral_ops.optim.distributed.Layout` (None: computed here alone); the
    spectral direction of a spread matrix is computed on its owner through ``exchange``."""
    schedule = schedule_multiplier(lr, peak_lr) if group["convention"] == "independent" else None
    scale = lr if schedule is None else schedule
    layouts = layouts or [None] * len(params)
    decay = ParameterDecay()
    matrices = [i for i, param in enumerate(params) if param.ndim >= 2]
    if matrices and not (is_zero(spectral) and is_zero(ordinary) and group["band"] is None):
        arguments = dict(scale=scale, spectral_weight_decay=spectral, ordinary_weight_decay=ordinary,
                         capturable=capturable(group))
        spread = [i for i in matrices if layouts[i] is not None]
        if spread and needs_spectral_direction(options, spectral):
            decay.parts.append(_owner_computed_decay([params[i] for i in spread], spread, [layouts[i] for i in spread],
                                                     group, options, arguments, blocks, exchange))
            matrices = [i for i in matrices if layouts[i] is None]
        entries = [(i, rows) for i in matrices for rows in row_blocks_of(params[i], blocks)]
        if entries:
            views = [matrix_view(local(params[i])) for i, _ in entries]
            tensors = [view if rows is None else view[rows[0]:rows[1]] for view, (_, rows) in zip(views, entries)]
            decay.parts.append(DecayPart(prepare_decay(tensors, options, **arguments),
                                         tuple(i for i, _ in entries), tuple(rows for _, rows in entries)))
    vectors = [i for i, param in enumerate(params) if param.ndim < 2]
    if vectors and not is_zero(ordinary):
        pending = PendingDecay([local(params[i]) for i in vectors], list(range(len(vectors))), 1 - scale * ordinary, {})
        decay.parts.append(DecayPart(pending, tuple(vectors), (None,) * len(vectors)))
    return decay


def _owner_computed_decay(params, owners, layouts, group, options, arguments, blocks, exchange) -> DecayPart:
    """The decay of spread matrices: each whole matrix decayed on its owner (its blocks as matrices of
    their own) when the step's exchange runs, and this rank's rows of the result kept to commit."""
    entries = [(k, rows) for k, param in enumerate(params) for rows in row_blocks_of(param, blocks)]
    views = [matrix_view(local(param)) for param in params]
    spans = [layout.local_rows for layout in layouts]
    entry_rows = [rows if rows is not None else (0, layouts[k].rows) for k, rows in entries]
    # This rank's rows of each entry (maybe none of them).
    pieces = [local_slice(start, stop, spans[k]) for (k, _), (start, stop) in zip(entries, entry_rows)]
    tensors = [views[k][piece] for (k, _), piece in zip(entries, pieces)]
    pending = PendingDecay(tensors, [], 1.0, {})
    eager = not capturable(group)
    slot_of = {}  # entry index -> (its group's clamp factors, its position there)
    if options.stability == "clamp":
        by_group = defaultdict(list)
        for index, (k, _) in enumerate(entries):
            by_group[layouts[k].group].append(index)
        for group_of_ranks, members in by_group.items():
            factors = exchange.clamp_slots(group_of_ranks, pending, members, eager, views[0].device)
            slot_of.update((index, (factors, position)) for position, index in enumerate(members))
    entries_of = defaultdict(list)
    for index, (k, _) in enumerate(entries):
        entries_of[k].append(index)

    def decay_whole(positions, matrices):
        indices = [index for k in positions for index in entries_of[k]]
        whole = prepare_decay([matrix[slice(*entry_rows[index])] for k, matrix in zip(positions, matrices)
                               for index in entries_of[k]], options, **arguments)
        values = whole.new_values()
        for position, factor in whole.clamp_factors.items():
            factors, slot = slot_of[indices[position]]
            factors[slot] = factor
        pending.clamped.extend((indices[position], *report) for position, *report in whole.clamped)
        value_of = dict(zip(indices, values))
        blocks = [[value_of[index] for index in entries_of[k]] for k in positions]
        return [block[0] if len(block) == 1 else torch.cat(block) for block in blocks]

    costs = [0.0] * len(params)
    for (k, _), (start, stop) in zip(entries, entry_rows):
        costs[k] += decay_flops((stop - start, views[k].shape[1]), options)

    def keep_rows(results):
        for index, ((k, _), piece) in enumerate(zip(entries, pieces)):
            pending.decayed[index] = results[k][piece]

    exchange.map(decay_whole, views, layouts, costs, keep_rows)
    return DecayPart(pending, tuple(owners[k] for k, _ in entries), tuple(rows for _, rows in entries))


@dataclasses.dataclass
class PreparedStep:
    """One group's step, computed but not written.

    The parameter ``params[i]`` is updated only if every entry of each tensor checked for it is at
    most its limit in magnitude (NaN never is): ``checks`` holds ``(i, tensor, limit)`` triples known
    when the step is prepared (the gradients), and the values of ``decay`` and ``directions[i]`` (Muon's
    update directions) are checked too, once the step's whole-matrix work is done (see
    :meth:`Exchange.run <spectral_ops.optim.distributed.Exchange.run>`). ``commit(keep)`` writes the
    step of the parameters ``keep`` keeps: one entry per parameter, ``True``/``False`` decided on the
    host, or a 0-d bool tensor decided on the device (capturable steps).
    """

    group: dict
    params: list
    checks: list
    commit: Callable[[list], None]
    decay: ParameterDecay
    directions: list = ()

    def all_checks(self) -> list:
        return (self.checks + [(i, d, finite_limit(d)) for i, d in enumerate(self.directions)]
                + [(i, value, finite_limit(value)) for i, value in self.decay.checks()])


class ClampRecord(NamedTuple):
    """The stability clamps of one parameter, as 0-d tensors on its device (updated without a host read)."""

    count: torch.Tensor  # int32: the matrices (blocks of a split parameter each) whose coefficient was reduced
    smallest_factor: torch.Tensor  # float64: the smallest factor applied to its spectral coefficient (1: none)


def kept(params, keep) -> list:
    """The parameters an eager step writes: those the host decided to keep."""
    return [param for param, kept in zip(params, keep) if kept is not False]


def device_masks(keep) -> list | None:
    """A capturable step's per-parameter device decisions, or None when every parameter is written."""
    return None if all(k is True for k in keep) else [torch.as_tensor(k) for k in keep]


def finite_limit(tensor: torch.Tensor) -> float:
    """The largest finite magnitude of ``tensor``'s dtype: the limit of a check for NaN and Inf."""
    return torch.finfo(tensor.dtype).max


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as two real ones, as torch's Adam treats it: the moments are those of the real
    and the imaginary parts, never ``g * g`` of the complex values."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _largest_magnitudes(tensors) -> list:
    """The largest magnitude of each tensor (NaN when it holds one), as 0-d tensors on its device."""
    if tensors[0].device.type == "cpu":
        # torch's multi-tensor infinity norm is not vectorised on a CPU: aminmax is ~10x faster.
        pairs = [torch.aminmax(real_view(tensor)) for tensor in tensors]
        return [torch.maximum(high, -low) for low, high in pairs]
    return list(torch._foreach_norm(tensors, float("inf")))


def _within_limits(checks, on_host: list) -> list:
    """Whether each check's tensor is within its limit (NaN never is): a Python bool where ``on_host``
    says so (one read per device for all of them), else a 0-d bool tensor on its device, computed
    without copying a host value to the device (a captured graph could not replay that)."""
    results = [True] * len(checks)
    by_device = defaultdict(list)
    for position, (_, tensor, _) in enumerate(checks):
        if tensor.numel():
            by_device[tensor.device].append(position)
    for positions in by_device.values():
        largest = _largest_magnitudes([checks[i][1] for i in positions])
        within = torch.stack(torch._foreach_div(largest, [checks[i][2] for i in positions])) <= 1
        values = within.tolist() if any(on_host[i] for i in positions) else None
        for index, (position, flag) in enumerate(zip(positions, within.unbind(0))):
            results[position] = values[index] if on_host[position] else flag
    return results


def _all(flags: list):
    """The conjunction of Python bools and 0-d bool tensors (True when there is nothing to check)."""
    result = True
    for flag in flags:
        if flag is False:
            return False
        if flag is not True:
            result = flag if result is True else result & flag
    return result


class SpectralOptimizer(Optimizer):
    """Shared construction for the family: defaults, validation and the ``peak_lr`` of each group.

    Subclasses implement :meth:`prepare_group` (their decay and update, computed but not written), set
    ``spectral_key``/``ordinary_key`` (the group keys of ``lambda_p``/``lambda_1``) and may extend
    :meth:`check_group`.
    """

    spectral_key = "spectral_weight_decay"
    ordinary_key = "weight_decay"
    # SpectralDecay attached to another optimizer takes that one's lr.
    lr_optional = False

    def __init__(self, params, defaults: dict, process_group=None):
        # Not a group option: a process group cannot be saved in a state dict.
        self.process_group = process_group
        super().__init__(params, {**defaults, **TORCH_GROUP_DEFAULTS})

    def layout(self, param: torch.Tensor):
        """How ``param`` is spread over the ranks (see :mod:`spectral_ops.optim.distributed`), or None:
        found when its group is added, then looked up (a parameter keeps its layout)."""
        layouts = self.__dict__.setdefault("_layouts", {})
        if param not in layouts:
            layouts[param] = layout_of(param, self.process_group)
        return layouts[param]

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key in ("lr", self.spectral_key, self.ordinary_key):
            value = group.get(key)
            # torch takes any 1-element lr tensor; a 0-d view of it (same storage, so in-place schedules
            # still reach it) is what the step's arithmetic broadcasts correctly.
            if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() > 0:
                group[key] = value.reshape(())
        try:
            self.check_group(group)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        # Unless the group names its peak_lr, the lr it starts with is the peak of the independent
        # convention (eta_t = lr / peak_lr); an LR scheduler's initial_lr takes precedence once it exists.
        group.setdefault("peak_lr", detached_peak(group["lr"]))
        # Held as a plain dict, so that a saved optimizer state loads with torch.load(weights_only=True).
        if isinstance(group["band"], Band):
            group["band"] = dataclasses.asdict(group["band"])

    def __getstate__(self) -> dict:
        """What pickle and :func:`copy.deepcopy` carry: torch's defaults, state and groups, and the skip
        and clamp counts (:meth:`count_state`). Not the process group, which pickle cannot carry (an
        unpickled optimizer has none: see :meth:`__deepcopy__` for copies)."""
        return {**super().__getstate__(), **self.count_state()}

    def __deepcopy__(self, memo: dict):
        # A process group is a handle on the ranks, not data: the copy uses the same one.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__({**copy.deepcopy(self.__getstate__(), memo), "process_group": self.process_group})
        return clone

    def __setstate__(self, state: dict) -> None:
        # load_state_dict, pickle and deepcopy land here. A state saved by an earlier release lacks the
        # group keys added since (they take this optimizer's defaults), and a converted or old Adam state
        # may hold its step count as a plain number (made a tensor, as torch's Adam does).
        counts = {key: state[key] for key in COUNT_KEYS if key in state}
        super().__setstate__({key: value for key, value in state.items() if key not in COUNT_KEYS})
        self.__dict__.setdefault("process_group", None)
        if counts:
            self.load_count_state(counts)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for param in group["params"]:
                param_state = self.state.get(param, {})
                if "step" in param_state and not torch.is_tensor(param_state["step"]):
                    device = param.device if capturable(group) else "cpu"
                    param_state["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32, device=device)

    def check_group(self, group: dict) -> None:
        for key in ("capturable", "strict"):
            if not isinstance(group[key], bool):
                raise TypeError(f"{key} must be True or False, got {group[key]!r}")
        if group["differentiable"] is not False:
            raise ValueError(f"differentiable={group['differentiable']!r}: spectral_ops optimizers step without "
                             "autograd (no gradient flows through a step); leave differentiable=False")
        if group["strict"] and capturable(group):
            raise ValueError("strict=True raises on a non-finite update, which needs the host to read it; "
                             "capturable=True forbids that (skips are still counted in optimizer.skipped)")
        if group["lr"] is not None or not self.lr_optional:
            check_coefficient(group["lr"], "lr")
        self.decay_options(group)
        for param in group["params"]:
            self.layout(param)  # refuses a DTensor layout the owner compute does not handle
        if capturable(group):
            check_on_parameter_device(group, ("lr", self.spectral_key, self.ordinary_key, "peak_lr"))

    def decay_options(self, group: dict) -> DecayOptions:
        """The group's validated decay options: validated again only when one of them changes, so a
        step does not re-check what construction did."""
        keys = (*DECAY_DEFAULTS, self.spectral_key, self.ordinary_key)
        key = tuple(_option_key(group[k]) for k in keys)
        validated = self.__dict__.setdefault("_validated_options", {})
        cached = validated.get(id(group))
        if cached is None or cached[0] is not group or cached[1] != key:
            cached = validated[id(group)] = (group, key, check_decay_group(group, spectral=self.spectral_key,
                                                                            ordinary=self.ordinary_key))
        return cached[2]

    def prepare_decay(self, params, group: dict, *, lr=None, peak_lr=None, blocks=None) -> ParameterDecay:
        """The group's decay of ``params`` (see :func:`prepare_parameter_decay`), with the group's own
        lr and peak lr unless given."""
        return prepare_parameter_decay(
            params,
            group,
            self.decay_options(group),
            lr=group["lr"] if lr is None else lr,
            peak_lr=group.get("initial_lr", group["peak_lr"]) if peak_lr is None else peak_lr,
            spectral=group[self.spectral_key],
            ordinary=group[self.ordinary_key],
            blocks=blocks,
            layouts=[self.layout(param) for param in params],
            exchange=self.exchange,
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every group with a gradient: every group's step is computed first, then the
        parameters whose gradient and update are finite are written (see :meth:`commit_steps`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.begin_step()
        prepared = []
        for group in self.param_groups:
            params = list(self.params_with_grad(group))
            if params:
                prepared.append(self.prepare_group(params, group))
        self.commit_steps(prepared)
        return loss

    @torch.no_grad()
    def commit_steps(self, prepared: list[PreparedStep]) -> None:
        """Write the prepared steps, skipping each parameter whose checks fail: its weight and its state
        stay unchanged, and the skip is counted in :attr:`skipped`.

        Eager groups decide on the host (one read per device for the whole step), warn once per
        parameter, and raise instead with ``strict=True``, before anything is written. Capturable
        groups decide on the device, without a host read, and count on the device.

        Then the stability clamps of the written parameters are counted in :attr:`clamped`, and each
        eager one is logged with its factor (see :func:`spectral_ops.decay.log_clamp`): a matrix's
        first clamp as a warning, its later ones at DEBUG.
        """
        exchange = self.__dict__.get("_exchange")
        if exchange is not None:
            exchange.run()
        checks = [step.all_checks() for step in prepared]
        on_host = [not capturable(step.group) for step, step_checks in zip(prepared, checks) for _ in step_checks]
        flags = iter(_within_limits([check for step_checks in checks for check in step_checks], on_host))
        keeps = []
        for step, step_checks in zip(prepared, checks):
            flags_of = [[] for _ in step.params]
            for index, _, _ in step_checks:
                flags_of[index].append(next(flags))
            keeps.append([_all(f) for f in flags_of])
        self._agree(prepared, keeps)
        skipped = []
        for step, keep in zip(prepared, keeps):
            if not capturable(step.group):
                skipped.extend((step, param) for param, kept in zip(step.params, keep) if not kept)
                continue
            checked = [(param, kept) for param, kept in zip(step.params, keep) if kept is not True]
            if checked:
                torch._foreach_add_([self._skip_count(param) for param, _ in checked],
                                    [torch.logical_not(kept).to(torch.int32) for _, kept in checked])
        strict = [self.parameter_name(step.group, param) for step, param in skipped if step.group["strict"]]
        if strict:
            raise FloatingPointError(f"{type(self).__name__}: the gradient or the update of {', '.join(strict)} "
                                     "is not finite; nothing was written (strict=True)")
        for step, param in skipped:
            self._skip_count(param).add_(1)
            self._warn_skip(self.parameter_name(step.group, param))
        for step, keep in zip(prepared, keeps):
            step.commit(keep)
        for step, keep in zip(prepared, keeps):
            self._record_clamps(step, step.decay, keep)

    def _agree(self, prepared: list[PreparedStep], keeps: list) -> None:
        """Make the decisions about spread parameters those of every rank (see :meth:`Exchange.agree`),
        in place; raise, on every rank, what an owner raised."""
        exchange = self.__dict__.pop("_exchange", None)
        spread = []
        for k, step in enumerate(prepared):
            for i, param in enumerate(step.params):
                layout = self.layout(param)
                if layout is not None:
                    spread.append((k, i, layout))
        if not spread:
            if exchange is not None and exchange.error is not None:
                raise exchange.error
            return
        decisions = (exchange or Exchange()).agree([(layout, keeps[k][i]) for k, i, layout in spread])
        for (k, i, _), decision in zip(spread, decisions):
            keeps[k][i] = decision

    @property
    def exchange(self) -> Exchange:
        """This step's :class:`~spectral_ops.optim.distributed.Exchange` (owners, errors, clamps)."""
        return self.__dict__.setdefault("_exchange", Exchange())

    def begin_step(self) -> None:
        """Forget the exchange of a step that failed while being prepared: called before the groups of
        a step are prepared."""
        self.__dict__.pop("_exchange", None)

    def _record_clamps(self, step: PreparedStep, decay: ParameterDecay, keep: list) -> None:
        """Count the clamps of the parameters ``keep`` wrote (on the device), and log the eager ones."""
        counts = self.__dict__.setdefault("_clamp_records", {})
        logged = self.__dict__.setdefault("_logged_clamps", set())
        for part in decay.parts:
            for index, _, factor, order in part.pending.clamped:
                owner = part.owners[index]
                if keep[owner] is True:
                    # A run clamps the same matrices step after step: each one's first clamp is a
                    # warning, the later ones are debug records (their count is in `clamped`).
                    name = self.matrix_name(step.group, step.params[owner], part.rows[index])
                    first = name not in logged
                    logged.add(name)
                    log_clamp(name, factor, order, logging.WARNING if first else logging.DEBUG,
                              "; its later clamps are logged at DEBUG and counted in optimizer.clamped" if first else "")
            for index, factor in part.pending.clamp_factors.items():
                owner = part.owners[index]
                if keep[owner] is False:
                    continue
                param = step.params[owner]
                if keep[owner] is not True:
                    factor = torch.where(keep[owner], factor, 1.0)
                if param not in counts:
                    counts[param] = ClampRecord(torch.zeros((), dtype=torch.int32, device=param.device),
                                                torch.ones((), dtype=torch.float64, device=param.device))
                counts[param].count.add_((factor < 1).to(torch.int32))
                counts[param].smallest_factor.copy_(torch.minimum(counts[param].smallest_factor, factor))

    @property
    def clamped(self) -> dict:
        """The stability clamps per parameter name, as :class:`ClampRecord` (0-d tensors on the
        parameters' devices, updated without a host read: under ``capturable`` this is where the
        clamps are read, when convenient). Only parameters whose spectral coefficient a clamp could
        have reduced appear (a capturable clamp group's matrices, or an eager group's that were
        clamped at least once); a count of 0 means that it never was."""
        records = self.__dict__.get("_clamp_records", {})
        return {self.parameter_name(group, param): records[param] for group in self.param_groups
                for param in group["params"] if param in records}

    def matrix_name(self, group: dict, param: torch.Tensor, rows) -> str:
        """:meth:`parameter_name`, with the ``rows = (start, stop)`` of the block of the parameter's
        matrix view that was decayed as a matrix (Muon's Q/K/V splits; None: the whole parameter)."""
        name = self.parameter_name(group, param)
        return name if rows is None else f"{name} rows {rows[0]}:{rows[1]}"

    @property
    def skipped(self) -> dict:
        """Skipped updates per parameter name, as 0-d int32 tensors on the parameters' devices (read
        them when convenient: they are updated without a host read). Only parameters that were
        skipped at least once, or that belong to a capturable group, appear."""
        counts = self.__dict__.get("_skip_counts", {})
        return {self.parameter_name(group, param): counts[param] for group in self.param_groups
                for param in group["params"] if param in counts}

    def parameter_name(self, group: dict, param: torch.Tensor) -> str:
        """``param_names`` as torch records them (``named_parameters()``, or
        :func:`param_groups_by_module`), else the position ``param_groups[g]['params'][i]``, with the shape."""
        g = next(i for i, candidate in enumerate(self.param_groups) if candidate is group)
        i = next(i for i, candidate in enumerate(group["params"]) if candidate is param)
        names = group.get("param_names")
        where = names[i] if names else f"param_groups[{g}]['params'][{i}]"
        return f"{where} {tuple(param.shape)}"

    def _skip_count(self, param: torch.Tensor) -> torch.Tensor:
        counts = self.__dict__.setdefault("_skip_counts", {})
        if param not in counts:
            counts[param] = torch.zeros((), dtype=torch.int32, device=param.device)
        return counts[param]

    def _warn_skip(self, name: str) -> None:
        warned = self.__dict__.setdefault("_warned_skips", set())
        if name not in warned:
            warned.add(name)
            warnings.warn(f"{type(self).__name__} skipped the update of {name}: its gradient or update is not "
                          "finite, so its weight and optimizer state are unchanged. Later skips are counted in "
                          "optimizer.skipped without a warning; strict=True raises instead.", RuntimeWarning,
                          stacklevel=4)

    def state_dict(self) -> dict:
        """torch's state, plus the skip and clamp counts (:meth:`count_state`), so that a resumed run
        keeps counting from where it stopped."""
        return {**super().state_dict(), **self.count_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.load_count_state(state_dict)

    def count_state(self) -> dict:
        """The skip and clamp counts, ``{"skipped": ..., "clamped": ...}`` (keys with no count left out),
        by parameter position as torch numbers the state. Part of :meth:`state_dict`; saved on its own
        where a checkpoint keeps only torch's keys (``torch.distributed.checkpoint``'s
        ``get_optimizer_state_dict`` does): the counts are the same on every rank."""
        params = [param for group in self.param_groups for param in group["params"]]
        counts, clamps = self.__dict__.get("_skip_counts", {}), self.__dict__.get("_clamp_records", {})
        state = {}
        if counts:
            state["skipped"] = {i: counts[param].clone() for i, param in enumerate(params) if param in counts}
        if clamps:
            state["clamped"] = {i: [t.clone() for t in clamps[param]] for i, param in enumerate(params)
                                if param in clamps}
        return state

    def load_count_state(self, state: dict) -> None:
        """Restore the counts of :meth:`count_state` (or of a whole :meth:`state_dict`)."""
        params = [param for group in self.param_groups for param in group["params"]]
        self.__dict__["_skip_counts"] = {params[int(i)]: count.to(device=params[int(i)].device, dtype=torch.int32)
                                         for i, count in state.get("skipped", {}).items()}
        self.__dict__["_clamp_records"] = {
            params[int(i)]: ClampRecord(count.to(device=params[int(i)].device, dtype=torch.int32),
                                        smallest.to(device=params[int(i)].device, dtype=torch.float64))
            for i, (count, smallest) in state.get("clamped", {}).items()}

    def prepare_group(self, params, group: dict) -> PreparedStep:
        """Compute the group's step for ``params`` (those with a gradient) without writing anything."""
        raise NotImplementedError

    def gradient_checks(self, params) -> list:
        """A parameter is skipped when its gradient is not finite."""
        return [(i, local(param.grad), finite_limit(param.grad)) for i, param in enumerate(params)]

    @staticmethod
    def params_with_grad(group: dict):
        for param in group["params"]:
            if param.grad is not None:
                if param.grad.is_sparse:
                    raise RuntimeError("spectral_ops optimizers do not support sparse gradients")
                yield param
