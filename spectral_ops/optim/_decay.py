"""The decay half of every optimizer step (SPEC 1.5), shared by the whole family.

Per parameter group: matrices (``ndim >= 2``; conv-style ``ndim > 2`` weights are viewed as
``(shape[0], -1)``, as Muon does) get ``lambda_p * S_p(W)`` plus the ordinary ``lambda_1 * W`` in one
batched :func:`spectral_ops.spectral_decay_` call per group (same shapes share a batch); vectors
(biases, norm gains) get only the ordinary term, since ``S_p`` is defined for matrices.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.optim import Optimizer

from .._checks import check_coefficient, check_finite, check_same_device
from ..decay import Band, DecayOptions, apply_decay_, check_decay_options, multiply_

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
    "capturable": False,
}


def is_zero(value) -> bool:
    """A Python zero (a tensor coefficient is never assumed to be zero: that would need a sync)."""
    return not isinstance(value, torch.Tensor) and value == 0


def scalar(value) -> float:
    """A Python number from a float or a 0-d tensor (torch's optimizers do the same)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def step_scalar(value, group: dict):
    """A coefficient as a step uses it: read on the host, unless the group is capturable, where a 0-d
    tensor stays on the device (a scheduler may change it inside a captured graph)."""
    return value if group["capturable"] else scalar(value)


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
        capturable=group["capturable"],
        names=(spectral, ordinary),
    )
    for param in group["params"]:
        if param.ndim > 2 and not param.is_contiguous():
            raise ValueError(f"a {param.ndim}-d parameter must be contiguous to be decayed as a matrix view")
    check_same_device([param for param in group["params"] if param.ndim >= 2], "a parameter group's matrices")
    return options


def _option_key(value):
    """A comparable stand-in for an option's value: a tensor by identity (its value may change in
    place without needing validation again), a dict by its items."""
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


def matrix_view(param: torch.Tensor) -> torch.Tensor:
    return param if param.ndim == 2 else param.view(param.shape[0], -1)


@torch.no_grad()
def decay_parameters(params, group: dict, options: DecayOptions, *, lr, peak_lr, spectral, ordinary) -> None:
    """Apply the group's decay to ``params`` in place, from their current (pre-update) values, with the
    group's ``options`` validated beforehand.

    ``params`` may include views (e.g. the Q/K/V blocks of a fused projection): each is decayed as
    its own matrix.
    """
    schedule = schedule_multiplier(lr, peak_lr) if group["convention"] == "independent" else None
    scale = lr if schedule is None else schedule
    matrices = [matrix_view(p) for p in params if p.ndim >= 2]
    if matrices and not (is_zero(spectral) and is_zero(ordinary) and group["band"] is None):
        spectral_direction = options.band is not None or (options.p != 1 and not is_zero(spectral))
        if spectral_direction and not group["capturable"]:
            # Refuse to compute a spectral direction from a non-finite weight. A plain scaling (p = 1)
            # is not checked, as torch's AdamW does not check (it is a fifth of a p = 1 step).
            check_finite(matrices, "W")
        apply_decay_(matrices, options, scale=scale, spectral_weight_decay=spectral, ordinary_weight_decay=ordinary,
                     capturable=group["capturable"])
    vectors = [p for p in params if p.ndim < 2]
    if vectors and not is_zero(ordinary):
        multiply_(vectors, 1 - scale * ordinary)


class SpectralOptimizer(Optimizer):
    """Shared construction for the family: defaults, validation and the ``peak_lr`` of each group.

    Subclasses implement :meth:`step_group` (decay, then their update), set
    ``spectral_key``/``ordinary_key`` (the group keys of ``lambda_p``/``lambda_1``) and may extend
    :meth:`check_group`.
    """

    spectral_key = "spectral_weight_decay"
    ordinary_key = "weight_decay"
    # SpectralDecay attached to another optimizer takes that one's lr.
    lr_optional = False

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

    def __setstate__(self, state: dict) -> None:
        # load_state_dict lands here. A state saved by an earlier release lacks the group keys added
        # since (they take this optimizer's defaults), and a converted or old Adam state may hold its
        # step count as a plain number (made a tensor, as torch's Adam does).
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for param in group["params"]:
                param_state = self.state.get(param, {})
                if "step" in param_state and not torch.is_tensor(param_state["step"]):
                    device = param.device if group["capturable"] else "cpu"
                    param_state["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32, device=device)

    def check_group(self, group: dict) -> None:
        if not isinstance(group["capturable"], bool):
            raise TypeError(f"capturable must be True or False, got {group['capturable']!r}")
        if group["lr"] is not None or not self.lr_optional:
            check_coefficient(group["lr"], "lr")
        self.decay_options(group)
        if group["capturable"]:
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

    def decay_group(self, params, group: dict) -> None:
        decay_parameters(
            params,
            group,
            self.decay_options(group),
            lr=group["lr"],
            peak_lr=group.get("initial_lr", group["peak_lr"]),
            spectral=group[self.spectral_key],
            ordinary=group[self.ordinary_key],
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every group: :meth:`step_group` on its parameters that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = list(self.params_with_grad(group))
            if params:
                self.step_group(params, group)
        return loss

    def step_group(self, params, group: dict) -> None:
        raise NotImplementedError

    @staticmethod
    def params_with_grad(group: dict):
        for param in group["params"]:
            if param.grad is not None:
                if param.grad.is_sparse:
                    raise RuntimeError("spectral_ops optimizers do not support sparse gradients")
                yield param
