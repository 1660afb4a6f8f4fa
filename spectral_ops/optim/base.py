"""The base of the family, :class:`SpectralOptimizer`: construction and validation of the groups, and a
step that writes nothing until every group's step is computed and checked.

A step has two phases. The plan (:meth:`~SpectralOptimizer.plan_step`) gathers each group's parameters
(:meth:`~SpectralOptimizer.stepped_params`: those with a gradient), checks everything the writes could
fail on (:meth:`~SpectralOptimizer.check_step`: the options, lr and coefficients, and the shapes,
dtypes and devices of the gradients and the state), prepares them
(:meth:`~SpectralOptimizer.prepare_group`: the decay, and the part of the update that needs whole
matrices, computed but not written, in a :class:`~spectral_ops.decay.PendingWrite` record), runs the
step's whole-matrix work (:class:`~spectral_ops.optim.distributed.Exchange`), checks every record and
agrees on the decisions with the other ranks. The commit (:meth:`~SpectralOptimizer.commit_steps`)
then writes each record for the parameters it keeps (:meth:`PendingWrite.commit
<spectral_ops.decay.PendingWrite.commit>`: the decay, then the optimizer's update, a functional core
such as :func:`~spectral_ops.optim.adamw.adam_update_`).

A failure of the plan leaves everything as it was: nothing has been written. An eager step in which any
group has ``rollback=True`` (off by default: it costs a copy of what the step writes) also keeps a
:class:`~spectral_ops.optim.rollback.Rollback` record of everything its commit writes, every group's,
so that a failure inside a write (an interrupt, a fault in an op) is undone too; see docs/optimizers.md,
"Bad steps".
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from torch.optim import Optimizer

from .._checks import (
    check_coefficient,
    conjunction,
    finite_limit,
    largest_magnitude_each,
    overlaps_itself,
    real_view,
    shared_memory_error,
    within_limits,
)
from ..decay import Band, DecayOptions, PendingWrite, UpdateWrite
from ..deprecations import renamed_group_keys
from ..plan import stability_terms
from ..precision import outside_autocast
from ._decay import (
    capturable,
    check_cautious,
    check_decay_group,
    check_replicas_round_alike,
    decay_scale,
    forbids_host_reads,
    prepare_parameter_decay,
)
from .counts import COUNT_KEYS, StepCounts
from .distributed import Exchange, layout_of, local
from .rollback import rollback_record

# torch's own group keys that this family holds as torch's optimizers do. torch's load_state_dict adds
# ``differentiable`` to the defaults of any optimizer it loads into; held from construction, a group
# has the same keys before and after a round trip. The steps run without autograd, so it stays False.
TORCH_GROUP_DEFAULTS = {"differentiable": False}


def scalar(value) -> float:
    """A Python number from a float or a 0-d tensor (torch's optimizers do the same)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def step_scalar(value, group: dict):
    """A coefficient as a step uses it: read on the host, unless the group is capturable, where a 0-d
    tensor stays on the device (a scheduler may change it inside a captured graph).

    torch.compile traces every step as capturable (Dynamo sets the key, for torch's optimizers and
    ours). There a Python number becomes a 0-d float32 tensor on the parameters' device, through a
    multiply: Dynamo keeps a number symbolic only where it meets a tensor in arithmetic, and
    specialises one that reaches a multi-tensor op as a scalar, which would compile the step again
    for every new lr a scheduler sets."""
    if not capturable(group):
        return scalar(value)
    if torch.compiler.is_dynamo_compiling() and not isinstance(value, torch.Tensor):
        return torch.ones((), dtype=torch.float32, device=group["params"][0].device) * value
    return value


def add_scaled_(target: torch.Tensor, update: torch.Tensor, scale) -> None:
    """``target -= scale * update``, for a Python or a 0-d tensor ``scale`` (without reading it)."""
    if isinstance(scale, torch.Tensor):
        target.addcmul_(update, scale, value=-1)
    else:
        target.add_(update, alpha=-scale)


def detached_peak(lr):
    """The peak lr to remember: a tensor lr is copied, since schedulers change it in place."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _option_key(value, identity: bool = True):
    """A comparable stand-in for an option's value: a tensor by identity (its value may change in
    place without needing validation again; ``identity=False``: any tensor, as a trace compares them),
    a dict by its items, a flag as a plain bool (torch.compile from 2.15 traces a group's
    ``capturable`` as a stand-in that has a truth value but no ``==``)."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value)) if identity else ("tensor",)
    if isinstance(value, dict):
        return tuple(sorted((k, _option_key(v, identity)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):  # betas: a pair that may hold tensors
        return tuple(_option_key(v, identity) for v in value)
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


def device_masks(keep) -> list | None:
    """A capturable step's per-parameter device decisions, or None when every parameter is written."""
    return None if all(k is True for k in keep) else [torch.as_tensor(k) for k in keep]


class CheckedUpdate:
    """An optimizer's own update of a record's parameters (its :class:`~spectral_ops.decay.PendingWrite`'s
    ``update``), checked before any write: once every group's step is prepared, :meth:`magnitudes`
    bound what it adds to each weight and what it writes into the state, and the step skips a
    parameter that either could make non-finite (:meth:`SpectralOptimizer.update_checks`).
    ``update(keep)`` allocates what the writes need and returns the
    :class:`~spectral_ops.decay.UpdateWrite` that writes them."""

    def __init__(self, params, group: dict, state):
        self.params, self.group, self.state = list(params), group, state

    def magnitudes(self) -> list:
        """Per parameter, ``(added, written)``: 0-d float32 tensors at least the magnitude of every entry
        the update adds to the weight and of every state entry it writes (NaN or Inf where one may not
        be finite), or None where nothing needs checking (a state entry that is a convex combination
        of finite ones)."""
        raise NotImplementedError

    def __call__(self, keep):
        raise NotImplementedError


def at_positions(update: UpdateWrite, positions: list, count: int) -> UpdateWrite:
    """``update``, which writes the parameters at ``positions`` of a record of ``count``, with its
    directions at those positions (None at the others)."""
    def directions():
        placed = [None] * count
        for position, direction in zip(positions, update.directions()):
            placed[position] = direction
        return placed
    return UpdateWrite(update.write, directions)


class ElementWiseUpdate(CheckedUpdate):
    """The update of an element-wise optimizer, ``update_(params, group, state, masks=None)`` (SGD's,
    which allocates and returns the :class:`~spectral_ops.decay.UpdateWrite` that writes): computed as it
    is written (a copy of the state would be the price of computing it first), for the parameters an
    eager step keeps, or for all of a capturable step's, masked by its device decisions."""

    update_ = None  # a staticmethod of the subclass

    def __call__(self, keep):
        if capturable(self.group):
            return self.update_(self.params, self.group, self.state, device_masks(keep))
        kept = [i for i, kept in enumerate(keep) if kept is not False]
        return at_positions(self.update_([self.params[i] for i in kept], self.group, self.state), kept,
                            len(self.params))


def largest_magnitudes(tensors) -> list:
    """The largest magnitude of each tensor as a 0-d float32 tensor on its device (NaN where it holds
    one), None for an empty one."""
    tensors = [real_view(local(tensor)) for tensor in tensors]
    filled = [i for i, tensor in enumerate(tensors) if tensor.numel()]
    largest = [None] * len(tensors)
    for i, value in zip(filled, largest_magnitude_each([tensors[i] for i in filled]) if filled else []):
        largest[i] = value.float()
    return largest


def weight_magnitudes(step: PendingWrite) -> list:
    """Per parameter of an optimizer's record, a 0-d float32 tensor at least the magnitude of every
    entry of its weight once the record's decay is written (the weight's own, a multiplied target's
    times its factor, a decayed value's, the weight's plus its increments'), or None for an empty one."""
    bounds = largest_magnitudes(step.params)
    before = list(bounds)
    decayed = [i for i in step.decayed if bounds[step.owners[i]] is not None]
    for i, largest in zip(decayed, largest_magnitudes([step.decayed[i] for i in decayed])):
        if largest is not None:  # rows of a spread matrix this rank holds none of
            owner = step.owners[i]
            # An increment (a cautious decay's, added after the update) adds at most its magnitude.
            bounds[owner] = bounds[owner] + largest if step.increments else torch.maximum(bounds[owner], largest)
    for i, factor in step.factors.items():
        owner = step.owners[i]
        if bounds[owner] is not None:
            bounds[owner] = torch.maximum(bounds[owner], before[owner] * abs(factor))
    return bounds


def within_range(param: torch.Tensor) -> float:
    """The limit of a bound on the magnitude of ``param``'s new entries: its dtype's largest finite
    number times ``1 - 16 eps`` (``eps`` its machine epsilon), a margin for the roundings between the
    bound's terms and the written value (each at most a relative ``eps / 2``, a few of them per entry)."""
    dtype = real_view(local(param)).dtype
    return torch.finfo(dtype).max * (1 - 16 * torch.finfo(dtype).eps)


# torch.compiler.disable, as torch's optimizers apply it to their own methods: it imports Dynamo at the first
# call, not at `import spectral_ops` (tests/test_compile.py).
@torch._disable_dynamo
def _check_groups_eagerly(optimizer) -> None:
    """Raise the error of a group whose options _init_group found invalid while torch.compile ran it:
    run outside the trace, the package's own ValueError or TypeError."""
    for group in optimizer.param_groups:
        optimizer.decay_options(group)
        optimizer.check_materialised(group)
        if next(iter(optimizer.stepped_params(group)), None) is not None:
            optimizer.check_coefficients(group, numbers_only=True)


@dataclasses.dataclass
class StepPlan:
    """A step computed, checked and decided, nothing written yet: what :meth:`SpectralOptimizer.plan_step`
    returns and :meth:`SpectralOptimizer.commit_steps` writes. ``prepared``: the step's
    :class:`~spectral_ops.decay.PendingWrite` records; ``keeps``: per record, one decision per
    parameter; ``skipped``: the ``(record, parameter)`` pairs an eager step skips; ``created``:
    ``(parameter, whether it had a state, whether it had counts)`` for those the step created either of."""

    prepared: list
    keeps: list
    skipped: list
    created: list


# The state entries of the family that have their parameter's shape (Adam's moments, the momentum of
# Muon and SGD), which a step updates in place.
PARAMETER_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")

# How to materialise a model built on the meta device, for the optimizers' errors.
MATERIALISE = ("Materialise the model (module.to_empty(device=...), then initialise it, as FSDP2's meta-device "
               "recipe does) and build the optimizer after that: to_empty replaces each Parameter, so an "
               "optimizer built before it holds the old meta ones and would step nothing. Or call "
               "torch.__future__.set_swap_module_params_on_conversion(True) before to_empty, which keeps the "
               "Parameter objects the optimizer holds")

# The fix of a gradient (True) or a state tensor (False) that does not fit its parameter.
MISMATCH_FIXES = {
    True: "Give each parameter a gradient of its own shape, dtype and device (Adam's moments and Muon's momentum "
          "are held in the parameter's dtype: an fp32 gradient of a bf16 parameter, param.grad_dtype, is refused)",
    False: "The state was loaded from another model, or the parameter changed since: load the state of this "
           "model, or build the optimizer again",
}


# What a state dict holds in place of a callable group option (see SpectralOptimizer.state_dict).
CALLABLE_OPTION = "<callable: the optimizer's own, kept on load>"


class SpectralOptimizer(Optimizer):
    """Shared construction for the family: defaults, validation and the ``peak_lr`` of each group; and
    the step (see the module's docstring).

    Subclasses implement :meth:`prepare_group` (their decay and update, computed but not written) and
    :meth:`commit_group` (writing them), set ``spectral_key``/``ordinary_key`` (the group keys of
    ``lambda_p``/``lambda_1``) and may extend :meth:`check_group`. Their ``__init__`` takes the decay's options
    from :func:`~spectral_ops.optim._decay.decay_keywords` and passes them on in ``defaults``.
    """

    spectral_key = "spectral_weight_decay"
    ordinary_key = "weight_decay"
    # SpectralDecay attached to another optimizer takes that one's lr.
    lr_optional = False

    def __init__(self, params, defaults: dict, process_group=None):
        # Not a group option: a process group cannot be saved in a state dict.
        self.process_group = process_group
        self._start_bookkeeping()
        if not isinstance(params, torch.Tensor):  # torch's own check refuses a bare tensor
            # Renamed here, not only in add_param_group, so that a warning points at the caller, not at torch.
            params = [renamed_group_keys(dict(group), type(self)) if isinstance(group, dict) else group
                      for group in params]
        super().__init__(params, {**renamed_group_keys(defaults, type(self)), **TORCH_GROUP_DEFAULTS})

    def _start_bookkeeping(self) -> None:
        """What the family keeps besides torch's state; torch's pickled state does not hold it, so an
        unpickled or copied optimizer starts it afresh (with the counts its state carries)."""
        self._layouts = {}  # parameter -> its Layout or None, found once
        self._validated_options = []  # (group, its options' keys, DecayOptions)
        self._exchange = None  # the step's Exchange, from the first group that asks for it
        self._counts = StepCounts()
        self._created = []  # (parameter, whether it had a state, whether it had counts) for those this step
        # created a state or counts of

    def layout(self, param: torch.Tensor):
        """How ``param`` is spread over the ranks (see :mod:`spectral_ops.optim.distributed`), or None:
        found when its group is added, then looked up (a parameter keeps its layout)."""
        if param not in self._layouts:
            self._layouts[param] = layout_of(param, self.process_group)
        return self._layouts[param]

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(renamed_group_keys(dict(param_group), type(self)))
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
        # load_state_dict, pickle and deepcopy land here. A state saved by an earlier release may hold
        # renamed group keys, lacks the keys added since (they take this optimizer's defaults), and a
        # converted or old Adam state may hold its step count as a plain number (made a tensor, as torch's
        # Adam does).
        counts = {key: state[key] for key in COUNT_KEYS if key in state}
        for group in state["param_groups"]:
            renamed_group_keys(group, type(self), loading=True)
        super().__setstate__({key: value for key, value in state.items() if key not in COUNT_KEYS})
        self.__dict__.setdefault("process_group", None)
        if "_counts" not in self.__dict__:  # unpickled or copied: built without __init__
            self._start_bookkeeping()
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
        """Validate a group as it is added: its options (:meth:`decay_options`, which
        :meth:`check_options` are part of), lr and the coefficients, and how its parameters are laid out."""
        self.decay_options(group)
        if group["strict"] and capturable(group):
            raise ValueError("strict=True raises on a non-finite update, which needs the host to read it; "
                             "capturable=True forbids that (skips are still counted in optimizer.skipped)")
        if group["lr"] is not None or not self.lr_optional:
            check_coefficient(group["lr"], "lr")
        # layout() refuses a DTensor layout the owner compute does not handle.
        check_replicas_round_alike(group, group["params"], [self.layout(param) for param in group["params"]],
                                   group[self.ordinary_key])
        if capturable(group):
            check_on_parameter_device(group, ("lr", self.spectral_key, self.ordinary_key, "peak_lr"))

    def check_options(self, group: dict) -> None:
        """Validate the group's options besides lr, the coefficients and the decay's (subclasses add
        their own: Adam's betas and eps, the momentum): when the group is added, and again before a
        step wherever one of them changed since (:meth:`decay_options`)."""
        for key in ("capturable", "strict", "rollback"):
            if not isinstance(group[key], bool):
                raise TypeError(f"{key} must be True or False, got {group[key]!r}")
        check_cautious(group)
        if group["differentiable"] is not False:
            raise ValueError(f"differentiable={group['differentiable']!r}: spectral_ops optimizers step without "
                             "autograd (no gradient flows through a step); leave differentiable=False")

    # Group keys left out of the options decay_options compares: lr, read again by every step
    # (check_coefficients), and capturable, which Dynamo sets while it traces a step (its effect on the
    # decay's validation is compared as forbids_host_reads).
    UNCOMPARED_KEYS = ("lr", "capturable")

    def decay_options(self, group: dict) -> DecayOptions:
        """The group's validated decay options: every option of the group (those of the decay and the
        optimizer's own, :meth:`check_options`) is validated again only when one of them changes, so a
        step does not re-check what construction did, and an option set on a group after construction
        (``param_groups[0]["eps"] = nan``) raises before the step writes anything.

        torch.compile runs _init_group in Python before it traces a step (and again when a changed
        option fails a guard), where this validates as an eager step does. Where it traces _init_group
        instead (a frame resumed after a graph break), the options are compared without the tensors'
        identities, which a trace cannot read, and a changed one is validated in the trace."""
        cached = None
        for entry in self._validated_options:  # by identity: Dynamo cannot look a dict up by id()
            if entry[0] is group:
                cached = entry
        # The group's capturable key as validation reads it: traced, the key says True (see forbids_host_reads).
        keys = [key for key in self.defaults if key not in self.UNCOMPARED_KEYS]
        traced = torch.compiler.is_dynamo_compiling()
        key = (*(_option_key(group[k], identity=not traced) for k in keys), forbids_host_reads(group))
        if cached is not None and cached[3 if traced else 1] == key:
            return cached[2]
        options = check_decay_group(group, spectral=self.spectral_key, ordinary=self.ordinary_key)
        self.check_options(group)
        if not traced:
            cached = (group, key, options, (*(_option_key(group[k], identity=False) for k in keys), key[-1]))
            # Entries of groups the optimizer no longer has (load_state_dict replaces them) are dropped.
            self._validated_options = [entry for entry in self._validated_options if entry[0] is not group and
                                       any(entry[0] is live for live in self.param_groups)] + [cached]
        return options

    def prepare_write(self, params, group: dict, *, checks=(), checked=(), update=None, lr=None, peak_lr=None,
                      blocks=None, increments=False) -> PendingWrite:
        """The group's step of ``params``, computed but not written: its decay (see
        :func:`~spectral_ops.optim._decay.prepare_parameter_decay`; with the group's own lr and peak lr
        unless given), the ``checks`` and ``checked`` values, and the optimizer's ``update`` (see
        :class:`~spectral_ops.decay.PendingWrite`).

        A capturable step checks its tensor lr and coefficients on the device (an eager one read them,
        :meth:`check_coefficients`): a NaN or Inf one skips every parameter of the group, whose masked
        writes then add exact zeros."""
        lr = step_scalar(group["lr"] if lr is None else lr, group)
        peak_lr = step_scalar(group.get("initial_lr", group["peak_lr"]) if peak_lr is None else peak_lr, group)
        spectral, ordinary = group[self.spectral_key], group[self.ordinary_key]
        write = prepare_parameter_decay(params, group, self.decay_options(group),
                                        scale=decay_scale(lr, peak_lr, group["convention"]), spectral=spectral,
                                        ordinary=ordinary, blocks=blocks, layouts=[self.layout(p) for p in params],
                                        exchange=self.exchange, increments=increments)
        write.checks, write.checked, write.update = list(checks), checked, update
        if capturable(group):
            write.coefficients = [value for value in (lr, peak_lr, spectral, ordinary) if torch.is_tensor(value)]
        return write

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every group with a gradient: every group's step is computed first, then the
        parameters whose gradient and update are finite are written (see :meth:`commit_steps`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.run_step(lambda params, group: [self.prepare_group(params, group)])
        return loss

    def run_step(self, prepare) -> None:
        """Plan the step (:meth:`plan_step`), with ``prepare(params, group)`` giving a list of
        :class:`~spectral_ops.decay.PendingWrite` records for the group's :meth:`stepped_params`, then commit it
        (:meth:`commit_steps`)."""
        self.commit_steps(self.plan_step(prepare))

    @outside_autocast
    def plan_step(self, prepare) -> StepPlan:
        """Everything a step does before its first write: each group's state and counts created
        (:meth:`_init_group`), its inputs checked (:meth:`check_step`), its records prepared, the
        whole-matrix work run, every record checked, and the decisions made and agreed. A failure
        forgets the state and counts it created: the optimizer is as it was before the step."""
        self.begin_step()
        created = self._created = []
        if torch.compiler.is_dynamo_compiling():  # a compiled step replays no _init_group: nothing to forget
            return self._plan(prepare, created)
        try:
            return self._plan(prepare, created)
        except BaseException:
            self._forget(created)
            raise

    def _plan(self, prepare, created: list) -> StepPlan:
        stepped = [[] for _ in self.param_groups]
        valid = [self._init_group(group, params) for group, params in zip(self.param_groups, stepped)]
        if not all(valid):  # only where torch.compile ran _init_group. Outside the loop over the groups:
            _check_groups_eagerly(self)  # Dynamo gives up on a frame that breaks its graph in a loop
        prepared = []
        for group, params in zip(self.param_groups, stepped):
            if params:
                self.check_step(params, group)
                prepared.extend(prepare(params, group))
        if self._exchange is not None:
            self._exchange.run()
        for step in prepared:
            step.checks.extend(self.update_checks(step))
        checks = [step.all_checks() for step in prepared]
        on_host = [not capturable(step.group) for step, step_checks in zip(prepared, checks) for _ in step_checks]
        flags = iter(within_limits([check for step_checks in checks for check in step_checks], on_host))
        keeps = []
        for step, step_checks in zip(prepared, checks):
            flags_of = [[] for _ in step.params]
            for index, _, _ in step_checks:
                flag = next(flags)
                for of in flags_of if index is None else [flags_of[index]]:
                    of.append(flag)
            keeps.append([conjunction(f) for f in flags_of])
        self._agree(prepared, keeps)
        skipped = []
        for step, keep in zip(prepared, keeps):
            if not capturable(step.group):
                skipped.extend((step, param) for param, kept in zip(step.params, keep) if not kept)
        strict = [self.parameter_name(step.group, param) for step, param in skipped if step.group["strict"]]
        if strict:
            raise FloatingPointError(f"{type(self).__name__}: the gradient or the update of {', '.join(strict)} "
                                     "is not finite; nothing was written (strict=True)")
        return StepPlan(prepared, keeps, skipped, created)

    @staticmethod
    def update_checks(step: PendingWrite) -> list:
        """The checks, ``(owner, tensor, limit)``, that the optimizer's own update of a record
        (:class:`CheckedUpdate`) leaves every weight and state entry it writes finite: the magnitude
        of the weight after the decay plus a bound on what the update adds to it, and a bound on what
        it writes into the state, within the dtype's range (:func:`within_range`). Made once every
        group's step is prepared (a spread matrix's decay and direction are computed by then), from
        0-d tensors on the parameters' devices, decided with the other checks."""
        if not isinstance(step.update, CheckedUpdate):
            return []
        checks = []
        for owner, (param, weight, (added, written)) in enumerate(zip(step.params, weight_magnitudes(step),
                                                                      step.update.magnitudes())):
            if weight is None:  # an empty parameter
                continue
            if added is not None:
                checks.append((owner, weight + added, within_range(param)))
            if written is not None:
                checks.append((owner, written, within_range(param)))
        return checks

    def _forget(self, created: list) -> None:
        """Drop the state and counts a failed step created."""
        for param, had_state, had_counts in created:
            if not had_state:
                self.state.pop(param, None)
            if not had_counts:
                self._counts.forget(param)

    def _init_group(self, group: dict, params: list) -> bool:
        """Append the parameters a step updates (:meth:`stepped_params`) to ``params``, and create the
        state (:meth:`init_state`) and counts of those stepped for the first time.

        torch's own optimizers' name and signature, which torch.compile recognises: it runs this in
        Python instead of tracing it, marks the state as static (CUDA graphs keep its addresses) and
        guards on it, so the first compiled step is not compiled again once the state exists.

        Returns whether the group's options are valid: an invalid one raises here, except while
        torch.compile runs this, where an error would surface as Dynamo's internal error (or, in a
        frame resumed after a graph break, be lost); the step then raises it outside the trace
        (:func:`_check_groups_eagerly`)."""
        try:
            options = self.decay_options(group)  # validated here, in Python, when the step is compiled
            self.check_materialised(group)
            params.extend(self.stepped_params(group))
            if params:
                self.check_coefficients(group, numbers_only=True)
        except (TypeError, ValueError):
            # torch 2.12 runs this with is_compiling() False: its tracing context says it is compiling.
            if not torch.compiler.is_compiling() and torch._guards.TracingContext.try_get() is None:
                raise
            return False
        # A parameter without state gets it here, whether it is stepped for the first time or its state
        # was dropped since (optimizer.state.clear(), as frameworks reset an optimizer): torch's
        # optimizers create their state lazily too. Its counts are the run's, and stay.
        had_state = [bool(self.state.get(param)) for param in params]
        tracked = [self._counts.tracks(param) for param in params]
        stateless = [param for param, had in zip(params, had_state) if not had]
        fresh = [param for param, known in zip(params, tracked) if not known]
        if stateless:
            self.init_state(stateless, group)
        if fresh:
            clamps = group["stability"] == "clamp" and stability_terms(options.p, group[self.spectral_key],
                                                                       options.band)
            self._counts.track(fresh, [param for param in fresh if clamps and param.ndim >= 2])
        self._created.extend(entry for entry in zip(params, had_state, tracked) if not all(entry[1:]))
        return True

    def check_materialised(self, group: dict) -> None:
        """Refuse a group that holds a meta-device parameter (no values), whether or not it has a
        gradient: stepped, it has nothing to compute with; without a gradient, it is most likely the
        optimizer's stale copy of a parameter ``module.to_empty()`` replaced, which a step would skip
        in silence for good."""
        meta = next((param for param in group["params"] if param.is_meta), None)
        if meta is None:
            return
        name = self.parameter_name(group, meta)
        if meta.grad is not None:
            raise ValueError(f"{type(self).__name__} was asked to step the meta-device parameter {name}, which has no "
                             f"values. {MATERIALISE}")
        raise ValueError(f"{type(self).__name__} holds the meta-device parameter {name}: {MATERIALISE}")

    def init_state(self, params: list, group: dict) -> None:
        """Create the state of ``params``, which have none (none by default: it may also be created as
        the step runs, as torch's SGD creates its momentum from the first gradient)."""

    # Whether the optimizer reads the gradients; and whether they and the state must have their
    # parameter's dtype, as the in-place updates of Adam's moments and Muon's momentum need.
    reads_gradients = True
    inputs_in_parameter_dtype = True

    def check_step(self, params: list, group: dict) -> None:
        """Check, before anything is written, what the commit of ``params``' step could fail on: an
        eager step reads lr and the coefficients again (a scheduler or a user may have set them, a
        tensor's value changes in place); every step checks each gradient's and each state tensor's
        shape, device and dtype against its parameter (a loaded state or a swapped ``.grad.data`` can
        differ)."""
        if group["lr"] is not None:  # an attached SpectralDecay's lr is the host's: checked as it prepares
            self.check_coefficients(group)
        # Every parameter through ``params`` before any through the state: Dynamo guards an object that it
        # reaches through a dict's keys (``self.state``'s) by identity, and what it reaches from it too, so a
        # gradient would be guarded by identity, and ``zero_grad()``, which drops it, would make every step
        # compile the frame again (a frame of its own after ``stability="raise"``'s graph breaks).
        weights = [local(param) for param in params]
        for param, weight in zip(params, weights):
            name = None
            if overlaps_itself(weight):  # a step writes the parameter in place
                raise shared_memory_error(weight, f"{type(self).__name__}: {self.parameter_name(group, param)}",
                                          "Give the parameter memory of its own: param.data = param.data.contiguous()")
            state = self.state.get(param, {})
            expected = [("the gradient", param.grad)] if self.reads_gradients else []
            expected += [(f"the state's {key!r}", state[key]) for key in PARAMETER_SHAPED_STATE if key in state]
            for what, tensor in expected:
                tensor = local(tensor)
                dtype_differs = tensor.dtype != weight.dtype and self.inputs_in_parameter_dtype
                misplaced = tensor.shape != weight.shape or tensor.device != weight.device
                if misplaced or dtype_differs:
                    name = name or self.parameter_name(group, param)
                    raise (ValueError if misplaced else TypeError)(
                        f"{type(self).__name__}: {what} of {name} is a {tuple(tensor.shape)} {tensor.dtype} tensor "
                        f"on {tensor.device}, and the parameter a {tuple(weight.shape)} {weight.dtype} one on "
                        f"{weight.device}; nothing was written. {MISMATCH_FIXES[what == 'the gradient']}")

    def check_coefficients(self, group: dict, lr=None, peak_lr=None, numbers_only=False) -> None:
        """lr (the group's, or the given one), the two decay coefficients and the peak lr, as the step
        reads them now: a step never writes with a NaN lr. A capturable step reads no tensor's value
        here (its device checks skip the group instead: :meth:`prepare_decay`), and a traced one reads
        none (a Python lr is a symbolic number there).

        ``numbers_only``: those that are Python numbers, as :meth:`_init_group` checks them where
        torch.compile runs it in Python, before the trace: a NaN would reach Inductor, which refuses
        to compile it with an error of its own ("The argument 'nan' is not comparable")."""
        if torch.compiler.is_compiling() and not numbers_only:
            return
        values = {"lr": group["lr"] if lr is None else lr, self.spectral_key: group[self.spectral_key],
                  self.ordinary_key: group[self.ordinary_key],
                  "peak_lr": group.get("peak_lr") if peak_lr is None else peak_lr,
                  "initial_lr": group.get("initial_lr")}
        for key, value in values.items():
            if value is not None and not (numbers_only and torch.is_tensor(value)):
                check_coefficient(value, key, sync=not capturable(group))

    @outside_autocast
    @torch.no_grad()
    def commit_steps(self, plan: StepPlan) -> None:
        """Write a planned step (:meth:`plan_step`), skipping each parameter whose checks failed: its
        weight and its state stay unchanged, and the skip is counted in :attr:`skipped`.

        Eager groups decided on the host (one read per device for the whole step): each skip warns
        once per parameter, before anything is written (``strict=True`` raised instead when the step
        was planned). Capturable groups decided on the device, without a host read, and count there.
        Then the stability clamps of the written parameters are counted in :attr:`clamped`, and each
        eager one is logged with its factor (see :func:`spectral_ops.decay.log_clamp`): a matrix's
        first clamp as a warning, its later ones at DEBUG.

        Every temporary is allocated before the first write. Where any group of an eager step has
        ``rollback=True`` (not the default), a copy of everything the commit writes, in every group, is
        taken first (:class:`~spectral_ops.optim.rollback.Rollback`): a failure of any write restores
        everything, forgets what the step created, and raises.
        """
        record = rollback_record(plan.prepared, plan.keeps, self._counts, self.state)
        if record is None:  # no try block either: torch.compile traces this path
            self._write(plan)
            return
        try:
            self._write(plan)
        except BaseException:
            record.restore()
            self._forget(plan.created)
            raise

    def _write(self, plan: StepPlan) -> None:
        prepared, keeps = plan.prepared, plan.keeps
        for step, param in plan.skipped:
            self._counts.warn_skip(self.parameter_name(step.group, param), type(self).__name__)
        clamp_updates = self._counts.clamp_updates([
            (step, keep, functools.partial(self.matrix_name, step.group))
            for step, keep in zip(prepared, keeps)])
        # The first write.
        self._counts.count_skips([param for _, param in plan.skipped])
        self._counts.count_device_skips([(param, kept) for step, keep in zip(prepared, keeps) if capturable(step.group)
                                         for param, kept in zip(step.params, keep) if kept is not True])
        for step, keep in zip(prepared, keeps):
            self.commit_group(step, keep)
        self._counts.apply_clamp_updates(clamp_updates)

    def _agree(self, prepared: list[PendingWrite], keeps: list) -> None:
        """Make the decisions about spread parameters those of every rank (see :meth:`Exchange.agree`),
        in place; raise, on every rank, what an owner raised."""
        exchange, self._exchange = self._exchange, None
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
        if self._exchange is None:
            self._exchange = Exchange()
        return self._exchange

    def begin_step(self) -> None:
        """Forget the exchange of a step that failed while being prepared: called before the groups of
        a step are prepared."""
        self._exchange = None

    @property
    def clamped(self) -> dict:
        """The stability clamps per parameter name, as :class:`~spectral_ops.optim.counts.ClampRecord`
        (0-d tensors on the parameters' devices, updated without a host read: under ``capturable`` this
        is where the clamps are read, when convenient). Every matrix stepped in a group whose
        stability clamp can act appears from its first step on; a count of 0 means that it never was
        clamped."""
        return self._by_name(self._counts.clamp_records())

    @property
    def skipped(self) -> dict:
        """Skipped updates per parameter name, as 0-d int32 tensors on the parameters' devices (read
        them when convenient: they are updated without a host read). Every parameter appears from its
        first step on; a count of 0 means that it never was skipped."""
        return self._by_name(self._counts.skips)

    def _by_name(self, per_parameter: dict) -> dict:
        return {self.parameter_name(group, param): per_parameter[param] for group in self.param_groups
                for param in group["params"] if param in per_parameter}

    def matrix_name(self, group: dict, param: torch.Tensor, rows, index=None) -> str:
        """:meth:`parameter_name`, with the ``index`` of the matrix in a stack (``matrix_view="batch"``;
        None: the parameter is one matrix) and the ``rows = (start, stop)`` of the block of it that was
        decayed as a matrix (Muon's Q/K/V splits; None: all its rows)."""
        name = self.parameter_name(group, param)
        name = name if index is None else f"{name} matrix {list(index)}"
        return name if rows is None else f"{name} rows {rows[0]}:{rows[1]}"

    def parameter_name(self, group: dict, param: torch.Tensor) -> str:
        """``param_names`` as torch records them (``named_parameters()``, or
        :func:`param_groups_by_module`), else the position ``param_groups[g]['params'][i]``, with the shape."""
        g = next(i for i, candidate in enumerate(self.param_groups) if candidate is group)
        i = next(i for i, candidate in enumerate(group["params"]) if candidate is param)
        names = group.get("param_names")
        where = names[i] if names else f"param_groups[{g}]['params'][{i}]"
        return f"{where} {tuple(param.shape)}"

    def state_dict(self) -> dict:
        """torch's state, plus the skip and clamp counts (:meth:`count_state`), so that a resumed run
        keeps counting from where it stopped. A callable group option (Muon's ``update_power`` schedule,
        ``adjust_lr_fn``) is code, not state: it is saved as :data:`CALLABLE_OPTION`, as LambdaLR leaves
        its lambdas out, so that the state pickles (``torch.save``), and loading keeps the callable the
        optimizer was built with."""
        state = {**super().state_dict(), **self.count_state()}
        state["param_groups"] = [{key: CALLABLE_OPTION if callable(value) else value for key, value in group.items()}
                                 for group in state["param_groups"]]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) == len(self.param_groups):  # else torch's own check refuses it
            restored = []
            for saved, current in zip(groups, self.param_groups):
                saved = dict(saved)
                for key, value in saved.items():
                    if isinstance(value, str) and value == CALLABLE_OPTION:
                        if not callable(current.get(key)):
                            raise ValueError(f"the state's {key!r} was a callable, which a state dict does not hold: "
                                             f"build the optimizer with it ({key}=...) before loading the state")
                        saved[key] = current[key]
                restored.append(saved)
            state_dict = {**state_dict, "param_groups": restored}
        super().load_state_dict(state_dict)
        self.load_count_state(state_dict)

    def count_state(self) -> dict:
        """The skip and clamp counts, ``{"skipped": ..., "clamped": ...}`` (keys with no count left out),
        by parameter position as torch numbers the state. Part of :meth:`state_dict`; saved on its own
        where a checkpoint keeps only torch's keys (``torch.distributed.checkpoint``'s
        ``get_optimizer_state_dict`` does): the counts are the same on every rank."""
        return self._counts.state(self._parameters())

    def load_count_state(self, state: dict) -> None:
        """Restore the counts of :meth:`count_state` (or of a whole :meth:`state_dict`)."""
        self._counts.load(state, self._parameters())

    def _parameters(self) -> list:
        return [param for group in self.param_groups for param in group["params"]]

    def prepare_group(self, params, group: dict) -> PendingWrite:
        """Compute the group's step for ``params`` (those with a gradient) without writing anything."""
        raise NotImplementedError

    def commit_group(self, step: PendingWrite, keep: list) -> None:
        """Write the prepared ``step`` of the parameters ``keep`` keeps (see :class:`PendingWrite`)."""
        step.commit(keep)

    def gradient_checks(self, params) -> list:
        """A parameter is skipped when its gradient is not finite."""
        return [(i, local(param.grad), finite_limit(param.grad)) for i, param in enumerate(params)]

    def stepped_params(self, group: dict):
        """The parameters :meth:`step` updates: those with a gradient, as in torch's optimizers."""
        return self.params_with_grad(group)

    @staticmethod
    def params_with_grad(group: dict):
        for param in group["params"]:
            if param.grad is not None:
                if param.grad.is_sparse:
                    raise RuntimeError("spectral_ops optimizers do not support sparse gradients")
                yield param
