"""SpectralDecay: spectral-power decay for any optimizer (torch's AdamW, a user's Muon, ...).

``SpectralDecay(params, p=2, weight_decay=0.1).attach(optimizer)`` registers a step pre-hook: just
before each ``optimizer.step()``, the listed parameters (those with a gradient) are decayed from their
pre-update values with the host optimizer's *current* lr (or ``eta_t`` = lr / peak lr under the
independent convention). It can also run on its own: ``SpectralDecay(params, ..., lr=0.01).step()``.
"""

from __future__ import annotations

import torch

from ._decay import DECAY_DEFAULTS, SpectralOptimizer, decay_parameters

class SpectralDecay(SpectralOptimizer):
    """Decay only. Here ``weight_decay`` is the spectral coefficient ``lambda_p`` and
    ``ordinary_weight_decay`` the ordinary ``lambda_1``; every option can be set per group."""

    spectral_key = "weight_decay"
    ordinary_key = "ordinary_weight_decay"

    def __init__(self, params, p=1, weight_decay=0.0, convention="decoupled", *, ordinary_weight_decay=0.0,
                 band=None, p0_mode="explicit", stability="raise", polar_steps=None, lr=None):
        defaults = dict(DECAY_DEFAULTS, p=p, weight_decay=weight_decay, ordinary_weight_decay=ordinary_weight_decay,
                        convention=convention, band=band, p0_mode=p0_mode, stability=stability,
                        polar_steps=polar_steps, lr=lr)
        defaults.pop("spectral_weight_decay")
        super().__init__(params, defaults)
        self._hook = None
        self._host_peak_lr: dict[int, object] = {}

    def check_group(self, group: dict) -> None:
        # lr=None: attached use, where the host optimizer supplies the lr.
        super().check_group(group if group["lr"] is not None else dict(group, lr=0.0))

    def attach(self, optimizer: torch.optim.Optimizer) -> "SpectralDecay":
        """Decay before every ``optimizer.step()``, following that optimizer's current lr."""
        if self._hook is not None:
            raise RuntimeError("this SpectralDecay is already attached; call detach() first")
        # The host's starting lr per group is its peak (unless an LR scheduler records initial_lr).
        self._host_peak_lr = {id(group): group["lr"] for group in optimizer.param_groups}
        self._hook = optimizer.register_step_pre_hook(self._before_host_step)
        return self

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_host_step(self, optimizer, args, kwargs) -> None:
        host_group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        for group in self.param_groups:
            by_host = {}
            for param in self.params_with_grad(group):
                host = host_group_of.get(id(param))
                if host is None:
                    raise ValueError("SpectralDecay holds a parameter that the attached optimizer does not optimise")
                by_host.setdefault(id(host), (host, []))[1].append(param)
            for host, params in by_host.values():
                peak = host.get("initial_lr", self._host_peak_lr.get(id(host), host["lr"]))
                decay_parameters(params, group, lr=host["lr"], peak_lr=peak,
                                 spectral=group["weight_decay"], ordinary=group["ordinary_weight_decay"])

    def step_group(self, params, group: dict) -> None:
        """Standalone use (``.step()``): decay with this object's own lr."""
        if group["lr"] is None:
            raise ValueError("SpectralDecay.step() needs lr= (or attach it to an optimizer)")
        self.decay_group(params, group)
