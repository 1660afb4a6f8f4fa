"""SGD with momentum plus spectral-power decay (decoupled, like SGDW)."""

from __future__ import annotations

import math

import torch

from ..decay import PendingWrite, UpdateWrite
from ._decay import decay_keywords
from .base import ElementWiseUpdate, SpectralOptimizer, add_scaled_, largest_magnitudes, scalar, step_scalar
from .distributed import local, state_like


class SpectralSGD(SpectralOptimizer):
    """SGD with (Nesterov) momentum, as torch.optim.SGD, plus the decay of SPEC 1.5.

    Unlike torch's SGD, ``weight_decay`` here is *decoupled* (``lambda_1 W`` is subtracted from the
    weights, scaled by the lr, not added to the gradient and fed through the momentum).
    ``capturable=True``: as in :class:`SpectralAdamW`.
    """

    # The momentum buffer takes a gradient of another dtype in place, and may hold one (torch's SGD
    # takes it too: a first step with dampening makes the buffer the gradient).
    inputs_in_parameter_dtype = False

    @decay_keywords(after="weight_decay")
    def __init__(self, params, lr=1e-3, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0,
                 capturable=False, strict=False, rollback=False, process_group=None, cautious=False, **decay):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                        **decay, capturable=capturable, strict=strict, rollback=rollback, cautious=cautious)
        super().__init__(params, defaults, process_group=process_group)

    def check_options(self, group: dict) -> None:
        super().check_options(group)
        if not 0.0 <= scalar(group["momentum"]) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
        if not math.isfinite(scalar(group["dampening"])):
            raise ValueError(f"dampening must be a finite number, got {group['dampening']}")
        if group["nesterov"] and (group["momentum"] == 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")

    def init_state(self, params: list, group: dict) -> None:
        """A zero momentum buffer where the first step then makes it the gradient, bit for bit, as
        torch's SGD does (``0 * momentum + g``); with dampening torch's first buffer is the undamped
        gradient, so it is made as the step runs (:func:`momentum_update`), as torch's is."""
        if group["momentum"] != 0 and group["dampening"] == 0:
            for param in params:
                self.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def prepare_group(self, params, group: dict) -> PendingWrite:
        return self.prepare_write(params, group, checks=self.gradient_checks(params),
                                  update=MomentumUpdate(params, group, self.state))


def momentum_update(params, group: dict, state, masks=None) -> UpdateWrite:
    """torch.optim.SGD's update (no weight decay) for a group, everything it allocates (a first step's
    buffers, the masked gradients, the Nesterov sums) allocated now, before its first write, so that
    running out of memory cannot stop it half-way: calling the result writes it. ``masks`` (capturable
    only): a False one makes every operation an exact identity on its parameter (a buffer created then
    starts at zero rather than at the gradient; its lr is taken as 0, so that a NaN lr adds nothing).
    Its directions (:class:`~spectral_ops.decay.UpdateWrite`) are what it adds times the lr: the
    gradient, the momentum buffer or the Nesterov sum."""
    momentum, dampening, nesterov = group["momentum"], group["dampening"], group["nesterov"]
    lr = step_scalar(group["lr"], group)
    updates = []
    for index, param in enumerate(params):
        mask = None if masks is None else masks[index]
        direction = local(param.grad) if mask is None else torch.where(mask, local(param.grad), 0)
        scale = lr if mask is None or not torch.is_tensor(lr) else torch.where(mask, lr, 0.0)
        buffer = state[param].get("momentum_buffer") if momentum != 0 else None
        created = state_like(param, direction.detach().clone()) if momentum != 0 and buffer is None else None
        factor = momentum if mask is None else torch.where(mask, momentum, 1.0)
        # Where the direction is not the buffer itself: the Nesterov sum, or the masked buffer.
        scratch = torch.empty_like(direction) if momentum != 0 and (nesterov or mask is not None) else None
        zero = None if mask is None else direction.new_zeros(())
        updates.append((param, mask, direction, scale, buffer, created, factor, scratch, zero))

    def write():
        for param, mask, direction, scale, buffer, created, factor, scratch, zero in updates:
            if momentum != 0:
                if created is not None:
                    state[param]["momentum_buffer"] = created
                    buffer = created
                else:
                    local(buffer).mul_(factor).add_(direction, alpha=1 - dampening)
                buffer = local(buffer)
                if nesterov:
                    direction = torch.add(direction, buffer, alpha=momentum, out=scratch)
                else:
                    direction = buffer
                if mask is not None:
                    direction = torch.where(mask, direction, zero, out=scratch)
            add_scaled_(local(param), direction, scale)

    def directions():
        return [(local(param), direction if momentum == 0 else scratch if scratch is not None
                 else local(buffer if created is None else created))
                for param, _, direction, _, buffer, created, _, scratch, _ in updates]
    return UpdateWrite(write, directions)


class MomentumUpdate(ElementWiseUpdate):
    """SGD's update (:func:`momentum_update`), bounded from the gradient's and the buffer's largest
    magnitudes: the new buffer ``momentum buf + (1 - dampening) g`` (the gradient itself where a first
    step creates it), the direction (that buffer, plus ``g`` with Nesterov's ``g + momentum buf``), and
    ``lr`` times the direction added to the weight."""

    update_ = staticmethod(momentum_update)

    def magnitudes(self) -> list:
        group = self.group
        momentum, dampening = abs(group["momentum"]), abs(1 - group["dampening"])
        lr = abs(step_scalar(group["lr"], group))
        buffers = [self.state[param].get("momentum_buffer") if momentum != 0 else None for param in self.params]
        largest = largest_magnitudes([buffer for buffer in buffers if buffer is not None])[::-1]
        bounds = []
        for grad, buffer in zip(largest_magnitudes([param.grad for param in self.params]), buffers):
            held = None if buffer is None else largest.pop()
            if grad is None:  # an empty parameter
                bounds.append((None, None))
            elif momentum == 0:
                bounds.append((lr * grad, None))
            else:
                new_buffer = grad if held is None else momentum * held + dampening * grad
                direction = grad + momentum * new_buffer if group["nesterov"] else new_buffer
                bounds.append((lr * direction, new_buffer))
        return bounds
