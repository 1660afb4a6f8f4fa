"""SpectralDecay: spectral-power decay for any optimizer (torch's AdamW, a user's Muon, ...).

``SpectralDecay(params, p=2, spectral_weight_decay=0.1).attach(optimizer)`` registers a step pre-hook
and a step post-hook: just before each ``optimizer.step()``, the decay of the listed parameters (those
with a gradient) is computed and checked from their pre-update values, with the host optimizer's
*current* lr (or ``eta_t`` = lr / peak_lr under the independent convention, the peak being the host
group's starting lr or its scheduler's ``initial_lr``; a host that steps with an lr of its own is
refused, :data:`HOST_LR_OPTIONS`); once the host's step has returned, it is added
to the weights (SPEC 1.5's decoupled decay: ``W <- W - lr (update(W) + lambda_p S_p(W))``, both
terms of the pre-step ``W``); a step given a closure plans it once the closure has made the gradients,
before the host's update. A host step that raises leaves the decay unwritten. It can also run on
its own: ``SpectralDecay(params, ..., lr=0.01).step()`` decays every parameter it holds, gradient or
not.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..decay import PendingWrite
from ..plan import needs_direction
from ._decay import decay_keywords
from .base import SpectralOptimizer, detached_peak
from .distributed import local

# The host group key holding its starting lr, the peak of the independent convention (unless an LR
# scheduler records initial_lr). In the group, like initial_lr, it is saved and loaded with the host's
# state_dict; a group added after attach gets it at the first step.
HOST_PEAK_KEY = "spectral_decay_peak_lr"

# Parameter -> (a weak reference to the standalone SpectralDecay that last decayed it spectrally, the
# version counter of its storage just after): see SpectralDecay._check_not_decayed_twice.
_last_standalone_decay = WeakIdKeyDictionary()

# The live attached SpectralDecays: attach looks here for one attached to another optimizer over the same
# param_groups list, which a wrapper shares with the optimizer it wraps (pytorch-optimizer's Lookahead, OrthoGrad).
_attached_decays = weakref.WeakSet()


@dataclass(frozen=True)
class HostLrOption:
    """A host option under which the host steps with an lr other than its group's ``lr`` as it stands
    before the step, which is the lr the decay reads (the pre-hook runs before the host's step): the decay
    cannot follow it, so ``attach`` refuses it, and so does every step where it was set after ``attach``.
    ``modules``: where the host's class (or a base of it) is defined, as module names or their packages
    (empty: any host whose groups hold the option); ``active(host, group)``: whether it is on."""

    modules: tuple[str, ...]
    option: str
    active: Callable[[torch.optim.Optimizer, dict], bool]
    does: str  # what the host does with the lr
    fix: str


def _positive(option: str) -> Callable[[torch.optim.Optimizer, dict], bool]:
    return lambda host, group: (group.get(option) or 0) > 0


_WARM_UP_OUTSIDE = ("and warm the lr up with a torch LR scheduler on the optimizer "
                    "(torch.optim.lr_scheduler.LinearLR), whose lr the decay follows")
_DECAY_BY_HAND = ("call spectral_ops.spectral_decay_(matrices, p, lr, spectral_weight_decay, stability='clamp') "
                  "yourself with the lr it steps with (docs/optimizers.md, 'Optimizers that are not "
                  "torch.optim.Optimizer'), or use an optimizer that steps with its lr")

# The one place that says which hosts step with an lr the decay cannot read. Hosts that scale their update
# alone and decay the weights at the group's lr (torch's Muon by the matrix's shape, its Adafactor), or take
# a schedule through their group's lr (an LR scheduler), step at the lr the decay reads, and are not listed.
HOST_LR_OPTIONS = (
    HostLrOption(("heavyball",), "warmup_steps", _positive("warmup_steps"),
                 "multiplies the lr by step / (warmup_steps + 1) inside its step over its first warmup_steps steps, "
                 "and puts the group's lr back after it", f"pass warmup_steps=0 {_WARM_UP_OUTSIDE}"),
    HostLrOption(("pytorch_optimizer.optimizer.schedulefree",), "warmup_steps", _positive("warmup_steps"),
                 "multiplies the lr by step / warmup_steps inside its step over its first warmup_steps steps",
                 f"pass warmup_steps=0 {_WARM_UP_OUTSIDE}"),
    HostLrOption(("pytorch_optimizer.optimizer.apollo",), "warmup_steps",
                 lambda host, group: "init_lr" in group and (getattr(host, "warmup_steps", 0) or 0) > 0,
                 "warms the lr up from init_lr to lr inside its step over its first warmup_steps steps",
                 f"pass warmup_steps=0 {_WARM_UP_OUTSIDE}"),
    HostLrOption(("pytorch_optimizer.optimizer.ranger21",), "disable_lr_scheduler",
                 lambda host, group: not getattr(host, "disable_lr_scheduler", True),
                 "warms the lr up and down inside its step", f"pass disable_lr_scheduler=True {_WARM_UP_OUTSIDE}"),
    HostLrOption((), "relative_step", lambda host, group: bool(group.get("relative_step")),
                 "steps with a step size of its own, computed from the step count, not with the lr (Adafactor's "
                 "relative step)", "pass relative_step=False and scale_parameter=False, with an lr"),
    HostLrOption((), "scale_parameter", lambda host, group: bool(group.get("scale_parameter")),
                 "multiplies the lr by each weight's RMS inside its step (Adafactor's parameter scaling)",
                 "pass scale_parameter=False and relative_step=False"),
    HostLrOption(("pytorch_optimizer.optimizer.prodigy", "pytorch_optimizer.optimizer.dadapt"), "d",
                 lambda host, group: "d" in group,
                 "multiplies the lr by its estimate d, which it updates inside its step (learning-rate-free)",
                 _DECAY_BY_HAND),
)


def _defined_in(host, modules: tuple[str, ...]) -> bool:
    """Whether ``host``'s class, or a base of it, is defined in one of ``modules`` or a module under them."""
    return any(cls.__module__ == module or cls.__module__.startswith(module + ".")
               for cls in type(host).__mro__ for module in modules)


def check_host_lr(host, group: dict) -> None:
    """Refuse a host ``group`` whose options make the host step with an lr other than ``group["lr"]`` as
    it stands before the step (:data:`HOST_LR_OPTIONS`), naming the option and the fix."""
    for rule in HOST_LR_OPTIONS:
        if (not rule.modules or _defined_in(host, rule.modules)) and rule.active(host, group):
            value = group.get(rule.option, getattr(host, rule.option, None))
            name = f"{type(host).__module__}.{type(host).__qualname__}"
            raise ValueError(f"{name} with {rule.option}={value!r} {rule.does}, and the attached SpectralDecay "
                             "cannot follow that lr: it decays with the group's lr as it stands before the step. "
                             f"To decay at the lr the weights are stepped with, {rule.fix}")


def _held_optimizers(host) -> list[tuple[str, torch.optim.Optimizer]]:
    """The torch optimizers ``host`` holds in its attributes, one or a list of them, each with where it is
    (``.optimizer``, ``.optimizers[1]``): a wrapper's optimizer, a container's (torchtitan's
    OptimizersContainer, heavyball's SplitOpt)."""
    held = []
    for attribute, value in getattr(host, "__dict__", {}).items():
        if isinstance(value, torch.optim.Optimizer) and value is not host:
            held.append((f".{attribute}", value))
        elif isinstance(value, (list, tuple)):
            held += [(f".{attribute}[{index}]", item) for index, item in enumerate(value)
                     if isinstance(item, torch.optim.Optimizer) and item is not host]
    return held


def attached_decays(host: torch.optim.Optimizer) -> list:
    """The SpectralDecays attached to ``host`` or to an optimizer it holds (a container's, a wrapper's), in
    that order: whose counts a monitor reports for ``host``."""
    found = []
    for optimizer in [host, *(value for _, value in _held_optimizers(host))]:
        found += [decay for decay in _decays_on(optimizer) if decay not in found]
    return found


def _decays_on(optimizer: torch.optim.Optimizer) -> list:
    """The SpectralDecays attached to ``optimizer`` itself (its step pre-hooks)."""
    return [hook.__self__ for hook in getattr(optimizer, "_optimizer_step_pre_hooks", {}).values()
            if isinstance(getattr(hook, "__self__", None), SpectralDecay)]


def lr_groups(host: torch.optim.Optimizer) -> dict[int, tuple]:
    """Parameter id -> ``(the optimizer whose group it is, the group)``, for the groups that hold the lr
    each parameter of ``host`` is stepped with: ``host``'s own, and where one holds no ``lr``, as a
    container's groups do (torchtitan's OptimizersContainer, heavyball's SplitOpt: their step steps the
    optimizers they hold), the groups of the optimizers it holds."""
    own = [(host, group) for group in host.param_groups]
    held = [(optimizer, group) for _, optimizer in _held_optimizers(host) for group in optimizer.param_groups] \
        if any("lr" not in group for _, group in own) else []
    return {id(param): (optimizer, group) for optimizer, group in held + own if "lr" in group
            for param in group["params"]}


def _remember_peak(host_group: dict):
    if HOST_PEAK_KEY not in host_group:
        host_group[HOST_PEAK_KEY] = detached_peak(host_group["lr"])
    return host_group[HOST_PEAK_KEY]


def spectrally_decayed(optimizer: SpectralOptimizer) -> set[int]:
    """The ids of the parameters ``optimizer``'s groups decay along a spectral direction."""
    return {id(param) for group in optimizer.param_groups for param in group["params"]
            if needs_direction(group["p"], group[optimizer.spectral_key], group["band"])}


def _cannot_attach(optimizer) -> str:
    """Why ``attach`` refuses ``optimizer`` (no step hooks), and the fixes: the torch optimizer it wraps,
    if it holds one (a wrapper such as pytorch-optimizer's SafeFP16Optimizer or CPUOffloadOptimizer), else the op."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Optimizer):  # a subclass that never ran Optimizer.__init__
        why = (f"{name} is a torch.optim.Optimizer without step hooks (it never ran Optimizer.__init__), so "
               "SpectralDecay.attach has nothing to register")
    else:
        why = f"SpectralDecay.attach needs a torch.optim.Optimizer (it registers a step pre-hook), got {name}"
    wrapped = [(where, value) for where, value in _held_optimizers(optimizer)
               if hasattr(value, "_optimizer_step_pre_hooks")]
    inner = "".join(f". It wraps an optimizer in {where} ({type(value).__name__}): attach to that one, with the "
                    f"parameters it updates (those in {where}.param_groups)" for where, value in wrapped)
    return (f"{why}{inner}. {'Or, f' if wrapped else 'F'}or another optimizer class, call "
            "spectral_ops.spectral_decay_(matrices, p, lr, spectral_weight_decay, stability='clamp') at the start "
            "of its step, with its lr (docs/optimizers.md, 'Optimizers that are not torch.optim.Optimizer')")


class SpectralDecay(SpectralOptimizer):
    """Decay only: ``spectral_weight_decay`` is the spectral coefficient ``lambda_p`` (required where
    ``p != 1`` or a band is set) and ``ordinary_weight_decay`` the ordinary ``lambda_1``; every option
    can be set per group.

    ``capturable=True``: as in :class:`SpectralAdamW`; attached, the host optimizer's lr is used as
    it is (a 0-d tensor stays on the device), so the host should be capturable too.

    ``weight_decay`` (an argument or a group key) is a deprecated alias of ``spectral_weight_decay``.
    """

    ordinary_key = "ordinary_weight_decay"
    lr_optional = True  # lr=None: attached use, where the host optimizer supplies the lr
    reads_gradients = False  # a gradient belongs to whichever optimizer uses it

    # spectral_weight_decay=None: not given, which a group that needs a spectral direction refuses (check_group).
    @decay_keywords(after="params", positional=3, spectral_weight_decay=None)
    def __init__(self, params, *, ordinary_weight_decay=0.0, lr=None, capturable=False, strict=False, rollback=False,
                 process_group=None, cautious=False, **decay):
        super().__init__(params, dict(ordinary_weight_decay=ordinary_weight_decay, **decay, lr=lr,
                                      capturable=capturable, strict=strict, rollback=rollback, cautious=cautious),
                         process_group=process_group)
        self._handles = ()  # attached: the removable handles of the host's step pre- and post-hook
        self._attached = False  # a plain flag, which torch.compile reads where it cannot read a handle
        self._planned = None  # attached: the decay planned before the host's step, written after it
        self._host = None  # attached: a weak reference to the host optimizer

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # A copy is not attached.
        for key, value in (("_handles", ()), ("_attached", False), ("_planned", None), ("_host", None)):
            self.__dict__.setdefault(key, value)

    def check_group(self, group: dict) -> None:
        if group["spectral_weight_decay"] is None:
            if needs_direction(group["p"], 1.0, group["band"]):
                raise TypeError(f"SpectralDecay with p={group['p']} needs spectral_weight_decay (lambda_p): "
                                "without it the decay would do nothing")
            group["spectral_weight_decay"] = 0.0  # p = 1: the ordinary lambda_1 alone
        super().check_group(group)

    def stepped_params(self, group: dict):
        """Attached, the parameters the host optimizer steps (those with a gradient); standalone,
        :meth:`step` decays every parameter it holds: a decay needs no gradient."""
        return list(self.params_with_grad(group) if self._attached else group["params"])

    def attach(self, optimizer: torch.optim.Optimizer) -> "SpectralDecay":
        """Decay at every ``optimizer.step()``, following that optimizer's current lr: computed from the
        pre-step weights before the host's step (a step pre-hook, which raises before the host's step
        runs where the decay cannot be computed), added to the weights after it (a step post-hook, which
        the host's step skips when it raises). Each parameter's lr is read in the host group that holds
        it, or, in a container whose groups hold no lr (torchtitan's OptimizersContainer, heavyball's
        SplitOpt), in the group of the optimizer inside it that steps it (:func:`lr_groups`).

        Refused where a parameter would be decayed spectrally twice: by another SpectralDecay attached
        to ``optimizer``, to an optimizer sharing its ``param_groups`` (a wrapper such as
        pytorch-optimizer's Lookahead and the optimizer it wraps), or to a container holding it or an
        optimizer it holds, or by ``optimizer`` (or one it holds) itself (a family optimizer with a
        spectral decay); where ``optimizer`` has no step hooks to attach to: not a
        ``torch.optim.Optimizer``, or a subclass that never ran ``Optimizer.__init__`` (the error names
        the torch optimizer it wraps, if any); where a parameter's lr cannot be read; and where the host
        steps with an lr of its own (:data:`HOST_LR_OPTIONS`)."""
        if not isinstance(optimizer, torch.optim.Optimizer) or not hasattr(optimizer, "_optimizer_step_pre_hooks"):
            raise TypeError(_cannot_attach(optimizer))
        if self._attached:
            raise RuntimeError("this SpectralDecay is already attached; call detach() first")
        self._check_no_second_decay(optimizer)
        groups = lr_groups(optimizer)
        self._check_host_lrs(optimizer, groups)
        for _, group in groups.values():
            _remember_peak(group)
        self._handles = (optimizer.register_step_pre_hook(self._before_host_step),
                         optimizer.register_step_post_hook(self._after_host_step))
        self._attached, self._host = True, weakref.ref(optimizer)
        _attached_decays.add(self)
        return self

    def _check_host_lrs(self, optimizer: torch.optim.Optimizer, groups: dict) -> None:
        """Refuse, before anything is registered, a parameter whose lr the decay cannot read: one in a group
        of ``optimizer`` without an ``lr`` that no optimizer it holds steps, or one whose host group's options
        make the host step with another lr than the group's (:func:`check_host_lr`)."""
        lr_less = {id(param) for group in optimizer.param_groups if "lr" not in group for param in group["params"]}
        mine = [param for group in self.param_groups for param in group["params"]]
        unread = [param for param in mine if id(param) not in groups and id(param) in lr_less]
        if unread:
            raise ValueError(f"{type(optimizer).__name__}'s param_groups hold no 'lr' for {len(unread)} of these "
                             "parameters, and no torch optimizer it holds (in an attribute, or a list of them) steps "
                             "them: the decay cannot read the lr they are stepped with. Attach to the optimizer whose "
                             "param_groups hold their lr (the one that steps them)")
        for host, group in {id(group): (host, group) for host, group in
                            (groups[id(param)] for param in mine if id(param) in groups)}.values():
            check_host_lr(host, group)

    def _check_no_second_decay(self, optimizer: torch.optim.Optimizer) -> None:
        mine = spectrally_decayed(self)
        for other in _decays_on(optimizer):
            if mine & spectrally_decayed(other):
                raise ValueError("another SpectralDecay attached to this optimizer already decays some of these "
                                 "parameters; each parameter may take one spectral decay (detach the other, or "
                                 "give each its own parameters)")
        held = [value for _, value in _held_optimizers(optimizer)]
        for other in list(_attached_decays):
            host = other._host() if other._host is not None else None
            if not other._attached or host is None or host is optimizer or not mine & spectrally_decayed(other):
                continue
            if host.param_groups is optimizer.param_groups:
                how = ("share their param_groups (one wraps the other, as Lookahead wraps its optimizer)",
                       "to the optimizer that updates the weights (the wrapped one)")
            elif any(host is value for value in held) or any(optimizer is value for _, value in _held_optimizers(host)):
                how = ("are one inside the other (a container steps the optimizers it holds, as torchtitan's "
                       "OptimizersContainer does)", "to the container or to the optimizers it holds")
            else:
                continue
            raise ValueError(f"a SpectralDecay attached to the {type(host).__name__} already decays some of these "
                             f"parameters, and that optimizer and this {type(optimizer).__name__} {how[0]}: both "
                             f"would decay them at each step. Attach once, {how[1]}")
        for stepper in [optimizer, *held]:
            if isinstance(stepper, SpectralOptimizer) and not isinstance(stepper, SpectralDecay) and \
                    mine & spectrally_decayed(stepper):
                raise ValueError(f"{type(stepper).__name__} already decays some of these parameters spectrally "
                                 "(p and spectral_weight_decay of its groups); set the spectral decay in one "
                                 "place: the optimizer's groups, or this SpectralDecay")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._attached, self._planned, self._host = (), False, None, None
        _attached_decays.discard(self)

    def _before_host_step(self, optimizer, args, kwargs):
        """Plan the decay of every group before the host's step, with its lr: computed from the pre-step
        weights and checked, nothing written (a failure raises, and the host's step does not run).

        A step given a closure (``step(closure)``: Lightning's automatic optimization, LBFGS) gets its
        gradients from it, inside the host's step: the decay is then planned when the closure first
        returns, before the host's update, so that it takes the parameters that have a gradient now,
        not those that had one at the last step (which missed the first step, and decayed a step whose
        closure skipped the backward).

        A step torch.compile traces writes it here instead, as new values: the plan would have to
        cross the host's own graph break (torch's AdamW breaks around its update), which Dynamo does
        not carry reliably, and a compiled step is not rolled back anyway."""
        stale, self._planned = self._planned, None
        if stale is not None:  # the host's last step raised: its decay was never written
            self._forget(stale.created)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the host itself
        if closure is None:
            self._plan_decay(optimizer)
            return None
        planned = False

        def closure_then_plan():
            nonlocal planned
            loss = closure()
            if not planned:  # LBFGS calls it again after its own writes: the decay reads the pre-step weights
                planned = True
                self._plan_decay(optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_plan}
        return (args[0], closure_then_plan, *args[2:]), kwargs

    @torch.no_grad()
    def _plan_decay(self, optimizer) -> None:
        """The pre-hook's plan (or, compiled, its write) of the decay, with the host's current lr."""
        compiled = torch.compiler.is_compiling()
        host_group_of = lr_groups(optimizer)

        def prepare(params, group):
            by_host = {}
            for param in params:
                found = host_group_of.get(id(param))
                if found is None:
                    raise ValueError("SpectralDecay holds a parameter that the attached optimizer does not optimise")
                by_host.setdefault(id(found[1]), (*found, []))[2].append(param)
            for owner, host, _ in by_host.values():  # an option set since attach: refused before any write
                check_host_lr(owner, host)
            if compiled and group["cautious"]:
                raise ValueError("cautious=True attached reads the host's update from the weights its step writes, "
                                 "after that step; a step torch.compile traces writes the decay before it (see "
                                 "SpectralDecay._before_host_step). Compile a family optimizer with cautious=True "
                                 "(SpectralAdamW, SpectralMuon, SpectralSGD), or step the host eagerly")
            return [self._prepare_decay_step(params, group, increments=not compiled, lr=host["lr"],
                                             peak_lr=host.get("initial_lr", _remember_peak(host)))
                    for _, host, params in by_host.values()]

        if compiled:
            self.run_step(prepare)
        else:
            self._planned = self.plan_step(prepare)

    @torch.no_grad()
    def _after_host_step(self, optimizer, args, kwargs) -> None:
        """Add the planned decay to the weights the host's step has written (see :meth:`commit_steps`)."""
        planned, self._planned = self._planned, None
        if planned is not None:
            self.commit_steps(planned)

    def prepare_group(self, params, group: dict) -> PendingWrite:
        """Standalone use (``.step()``): decay with this object's own lr."""
        if group["lr"] is None:
            raise ValueError("SpectralDecay.step() needs lr= (or attach it to an optimizer)")
        if group["cautious"]:
            raise ValueError("cautious=True decays only where the decay agrees in sign with the step's update, and "
                             "SpectralDecay.step() on its own has no update: attach it to the optimizer that steps "
                             "these parameters (SpectralDecay(...).attach(optimizer)), or pass cautious=False")
        self._check_not_decayed_twice(params, group)
        return self._prepare_decay_step(params, group)

    def _check_not_decayed_twice(self, params, group: dict) -> None:
        """Refuse to decay a parameter spectrally that another live standalone SpectralDecay decayed
        last, with no write to it since (no optimizer step in between): two of them over the same
        parameters would decay it twice per training step. Checked at the step, not at construction,
        so that a SpectralDecay made again for the same parameters (a resumed run, a re-run notebook
        cell) is not refused while the old one is still referenced: only one of them steps."""
        if torch.compiler.is_compiling() or self._attached or \
                not needs_direction(group["p"], group[self.spectral_key], group["band"]):
            return
        for param in params:
            last = _last_standalone_decay.get(param)
            if last is not None and last[0]() not in (None, self) and local(param)._version == last[1]:
                raise ValueError(f"another SpectralDecay decayed this {tuple(param.shape)} parameter last, and "
                                 "nothing has written it since: two standalone SpectralDecays over the same "
                                 "parameters decay them twice per step. Step one of them (delete the other), or "
                                 "give each its own parameters")

    def _prepare_decay_step(self, params, group: dict, increments=False, **lrs) -> PendingWrite:
        """The decay alone: a weight is skipped when its decayed value is not finite (the gradient
        belongs to whichever optimizer uses it). Attached, with the host's lr (read again here: a step
        never writes with a NaN lr); ``increments``: as the increments the post-hook adds."""
        if self._attached:
            self.check_coefficients(group, **lrs)
        write = self.prepare_write(params, group, increments=increments, **lrs)
        if write.cautious:  # u is the host's step, read from the weights it changes (see PendingWrite)
            write.keep_before()
        return write

    def commit_group(self, step: PendingWrite, keep: list) -> None:
        super().commit_group(step, keep)
        group = step.group
        # Not traced: Dynamo cannot represent the hook's handle, and reads no version counters.
        if not torch.compiler.is_compiling() and not self._attached and \
                needs_direction(group["p"], group[self.spectral_key], group["band"]):
            for param, kept in zip(step.params, keep):
                if kept is not False:
                    _last_standalone_decay[param] = (weakref.ref(self), local(param)._version)
