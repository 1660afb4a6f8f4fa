"""AdamW with spectral-power decay: ``W <- W - lr * (Adam(g) + lambda_1 W + lambda_p S_p(W))``."""

from __future__ import annotations

import functools

import torch

from .._checks import check_coefficient, real_view
from ..decay import PendingWrite, UpdateWrite
from ._decay import capturable, decay_keywords
from .base import CheckedUpdate, SpectralOptimizer, device_masks, largest_magnitudes, scalar, step_scalar
from .distributed import local


def adam_gradient_checks(params) -> list:
    """Adam skips a parameter whose gradient is not finite or whose square overflows the second moment's
    dtype (which would make it Inf for good and freeze the parameter)."""
    return [(i, local(param.grad), torch.finfo(param.dtype).max ** 0.5) for i, param in enumerate(params)]


def init_adam_state(params, group: dict, state) -> None:
    """Adam's state for ``params``: a step count (on the parameters' device when the group is
    capturable, else on the CPU, as torch's) and both moments, at zero."""
    for param in params:
        state[param]["step"] = torch.zeros((), dtype=torch.float32, device=param.device if capturable(group) else "cpu")
        state[param]["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state[param]["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _adam_views(params, state) -> tuple:
    """The step counts, and the real views of the gradients, moments and parameters Adam's arithmetic
    reads: a DTensor's moments are DTensors sharded like it (for torch.distributed.checkpoint), and the
    update is element-wise, so each rank runs it on its own shards."""
    grads = [real_view(local(param.grad)) for param in params]  # before the state: SpectralOptimizer.check_step
    return ([state[param]["step"] for param in params], grads,
            [real_view(local(state[param]["exp_avg"])) for param in params],
            [real_view(local(state[param]["exp_avg_sq"])) for param in params],
            [real_view(local(param)) for param in params])


def steps_on_device(group: dict) -> bool:
    """Whether a step keeps its counts, bias corrections and step sizes on the device: a capturable group's,
    and any step torch.compile traces. Dynamo treats a traced group as capturable, but a frame it resumes
    after a graph break (``stability="raise"`` reads the host) sees the group's own key, False where the
    parameters are on a CPU; a step size made on the host there is a constant of that frame's graph, which
    then compiled again at every step until Dynamo's recompile limit."""
    return capturable(group) or torch.compiler.is_compiling()


def adam_denominators(params, group: dict, state, on_device: bool) -> tuple[list, list]:
    """Before any write, each parameter's denominator after this step, ``sqrt(v_t) / sqrt(1 - beta2^t) +
    eps`` (in a tensor of its own, from the second moment ``v_t`` this step will write), and its step
    size ``-lr / (1 - beta1^t)``: the numbers :func:`adam_update_` adds with, operation for operation
    as torch's AdamW forms them. Eager: the bias corrections computed on the host from the CPU step
    counts; ``on_device`` (:func:`steps_on_device`): on the device, the step sizes 0-d tensors."""
    beta1, beta2 = group["betas"]
    steps, grads, _, exp_avg_sqs, _ = _adam_views(params, state)
    denominators = [torch.empty_like(exp_avg_sq) for exp_avg_sq in exp_avg_sqs]
    torch._foreach_copy_(denominators, exp_avg_sqs)
    torch._foreach_mul_(denominators, beta2)
    torch._foreach_addcmul_(denominators, grads, grads, value=1 - beta2)
    torch._foreach_sqrt_(denominators)
    counts = torch._foreach_add(steps, 1)
    if on_device:
        counts = [count.to(param.device) for count, param in zip(counts, params)]
        corrections = torch._foreach_sqrt(torch._foreach_neg(torch._foreach_sub(torch._foreach_pow(beta2, counts), 1)))
        lr = step_scalar(group["lr"], group)
        step_sizes = [-lr / (1 - beta1**count) for count in counts]
    else:
        counts = [count.item() for count in counts]
        corrections = [(1 - beta2**count) ** 0.5 for count in counts]
        step_sizes = [-scalar(group["lr"]) / (1 - beta1**count) for count in counts]
    torch._foreach_div_(denominators, corrections)
    torch._foreach_add_(denominators, group["eps"])
    return denominators, step_sizes


class AdamUpdate(CheckedUpdate):
    """Adam's update of a group (:func:`adam_update_`), bounded by ``|lr / (1 - beta1^t)| max(|m|, |g|) /
    min(D)`` for each parameter (``|m_t| <= max(|m|, |g|)``: a convex combination), its denominators
    ``D`` (:func:`adam_denominators`) formed first. A zero denominator (``eps = 0``, or an ``eps``
    below the dtype's range, where the second moment is 0: fp16 underflows ``g^2`` below ``|g|`` about
    5e-3) makes the bound NaN or Inf, as it makes the update. An eager step keeps its denominators
    for the commit (the one full-size temporary torch's AdamW allocates); a capturable one forms them
    again there, with its device decisions."""

    def __init__(self, params, group: dict, state):
        super().__init__(params, group, state)
        self.denominators = self.step_sizes = None
        # Decided once, where the step is prepared: its commit may run in another frame, compiled or not.
        self.on_device = steps_on_device(group)

    def magnitudes(self) -> list:
        if not self.params:
            return []
        denominators, step_sizes = adam_denominators(self.params, self.group, self.state, self.on_device)
        if not self.on_device:
            self.denominators, self.step_sizes = denominators, step_sizes
        _, grads, exp_avgs, _, _ = _adam_views(self.params, self.state)
        bounds = []
        for denominator, step_size, moment, grad in zip(denominators, step_sizes, largest_magnitudes(exp_avgs),
                                                       largest_magnitudes(grads)):
            if moment is None:  # an empty parameter
                bounds.append((None, None))
                continue
            smallest = torch.amin(denominator).float()
            bounds.append((abs(step_size) * torch.maximum(moment, grad) / smallest, None))
        return bounds

    def __call__(self, keep):
        # The directions: the first moments, which the update divides by positive denominators (a
        # skipped parameter's is left as it was, and so is its weight).
        def directions():
            return [(local(param), local(self.state[param]["exp_avg"])) for param in self.params]

        if self.on_device:
            return UpdateWrite(functools.partial(adam_update_, self.params, self.group, self.state,
                                                 device_masks(keep), on_device=True), directions)
        kept = [i for i, kept in enumerate(keep) if kept is not False]
        return UpdateWrite(functools.partial(adam_update_, [self.params[i] for i in kept], self.group, self.state,
                                             denominators=[self.denominators[i] for i in kept],
                                             step_sizes=[self.step_sizes[i] for i in kept]), directions)


@torch.no_grad()
def adam_update_(params, group: dict, state, masks=None, denominators=None, step_sizes=None,
                 on_device: bool = False) -> None:
    """One Adam step (no weight decay) for a group, with torch's multi-tensor (``_foreach``) ops.

    Eager (``on_device=False``): operation for operation as torch's AdamW, with the ``denominators``
    and ``step_sizes`` of :func:`adam_denominators`, formed before the first write. ``on_device``
    (:func:`steps_on_device`: capturable, or traced): the step counts live on the
    parameters' device and the bias corrections are device tensors, as in torch's capturable Adam, so
    nothing is read back; ``lr`` may be a 0-d device tensor. ``masks`` (on the device only): one 0-d
    bool per parameter; a False one leaves the parameter and its state unchanged.

    Everything that allocates runs before the first write (the capturable denominators are allocated
    empty and filled in place), so that running out of memory cannot stop the update half-way.
    """
    if not params:
        return
    beta1, beta2 = group["betas"]
    for param in params:
        param_state = state[param]
        if on_device and param_state["step"].device != param.device:  # capturable switched on later, or compiled
            param_state["step"] = param_state["step"].to(param.device)
    steps, grads, exp_avgs, exp_avg_sqs, params = _adam_views(params, state)
    if on_device:
        denominators = [torch.empty_like(exp_avg_sq) for exp_avg_sq in exp_avg_sqs]
        _capturable_adam_update_(params, grads, exp_avgs, exp_avg_sqs, steps, denominators, group, masks)
        return
    torch._foreach_add_(steps, 1)  # the first write
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)


def _capturable_adam_update_(params, grads, exp_avgs, exp_avg_sqs, steps, denom, group: dict, masks) -> None:
    """:func:`adam_update_` on the device, without a host read.

    ``p <- p + m / D`` with ``D = (sqrt(v) / sqrt(1 - beta2^t) + eps) / (-lr / (1 - beta1^t))``: the
    step size folded into the denominator (addcdiv then needs no scalar on the host). ``D`` is formed
    from its positive part (at least ``eps``) divided by the step size last, so that ``lr = 0`` makes
    it infinite and the update exactly zero, where folding the step size into each term would make a
    zero second moment ``0 / 0``, NaN. A masked-out parameter's step size is replaced by -1, its first
    moment by zeros and its denominator by 1: its update is an exact zero whatever the lr (NaN
    included) and eps (0 included)."""
    beta1, beta2 = group["betas"]
    lr = step_scalar(group["lr"], group)
    if masks is None:
        counts = torch._foreach_add(steps, 1)
        numerators = exp_avgs
    else:
        # Each operation is an exact identity on a masked-out parameter, whose gradient is replaced by
        # zeros: the step count adds 0, the first moment lerps with weight 0, the second is multiplied
        # by 1 and adds 0 (its count is at least 1 in the bias corrections, so those stay finite).
        counts = torch._foreach_add(steps, [mask.to(torch.float32) for mask in masks])
        grads = [torch.where(mask, grad, 0) for mask, grad in zip(masks, grads)]
        lerp_weights = [torch.where(mask, 1 - beta1, 0.0) for mask in masks]
        factors = [torch.where(mask, beta2, 1.0) for mask in masks]
        numerators = [torch.empty_like(exp_avg) for exp_avg in exp_avgs]
        zeros = [exp_avg.new_zeros(()) for exp_avg in exp_avgs]
        ones = [exp_avg.new_ones(()) for exp_avg in exp_avgs]
    corrected = counts if masks is None else torch._foreach_clamp_min(counts, 1)
    # -lr / (1 - beta1^t) and sqrt(1 - beta2^t), all on the device.
    bias_correction1 = torch._foreach_neg(torch._foreach_sub(torch._foreach_pow(beta1, corrected), 1))
    bias_correction2 = torch._foreach_sqrt(torch._foreach_neg(torch._foreach_sub(torch._foreach_pow(beta2, corrected),
                                                                                 1)))
    step_size = torch._foreach_div(bias_correction1, lr)
    torch._foreach_reciprocal_(step_size)
    torch._foreach_neg_(step_size)
    if masks is not None:
        step_size = [torch.where(mask, size, -1.0) for mask, size in zip(masks, step_size)]
    torch._foreach_copy_(steps, counts)  # the first write
    if masks is None:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
    else:
        torch._foreach_lerp_(exp_avgs, grads, lerp_weights)
        torch._foreach_mul_(exp_avg_sqs, factors)
        for mask, exp_avg, zero, numerator in zip(masks, exp_avgs, zeros, numerators):
            torch.where(mask, exp_avg, zero, out=numerator)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    torch._foreach_copy_(denom, exp_avg_sqs)
    torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, bias_correction2)
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_div_(denom, step_size)
    if masks is not None:  # a masked-out parameter adds 0 / 1, not 0 / 0 where its denominator is 0 (eps = 0)
        for mask, denominator, one in zip(masks, denom, ones):
            torch.where(mask, denominator, one, out=denominator)
    torch._foreach_addcdiv_(params, numerators, denom)


def check_adam_options(group: dict) -> None:
    beta1, beta2 = group["betas"]
    for name, beta in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= scalar(beta) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    check_coefficient(group["eps"], "eps")


class SpectralAdamW(SpectralOptimizer):
    """AdamW plus the spectral term of SPEC 1.5.

    ``weight_decay`` is the ordinary coefficient ``lambda_1`` and ``spectral_weight_decay`` is
    ``lambda_p``; they stack. Both act on the weights before the Adam update, scaled by the current
    lr (``convention="decoupled"``, torch AdamW's convention) or by ``eta_t = lr / peak_lr``
    (``"independent"``; ``peak_lr`` is a group key, by default the lr the group starts with, and an LR
    scheduler's ``initial_lr`` takes precedence over it).
    With ``p = 1`` it is torch's AdamW. Every option can be set per parameter group.

    ``capturable=True`` (torch's name): no host synchronisation after the first step, so the step
    can be captured in a CUDA graph or compiled; lr and the coefficients may be 0-d device tensors
    that a scheduler changes in place. See docs/optimizers.md, "Capturable steps".
    """

    @decay_keywords(after="weight_decay")
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, capturable=False, strict=False,
                 rollback=False, process_group=None, cautious=False, **decay):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **decay, capturable=capturable,
                        strict=strict, rollback=rollback, cautious=cautious)
        super().__init__(params, defaults, process_group=process_group)

    def check_options(self, group: dict) -> None:
        super().check_options(group)
        check_adam_options(group)

    def init_state(self, params: list, group: dict) -> None:
        init_adam_state(params, group, self.state)

    def prepare_group(self, params, group: dict) -> PendingWrite:
        return prepare_adam_step(self, params, group)


def prepare_adam_step(optimizer: SpectralOptimizer, params, group: dict) -> PendingWrite:
    """An Adam group's step: its decay, computed now (the Adam update is element-wise: computed as it is
    written, by :func:`adam_update_`)."""
    return optimizer.prepare_write(params, group, checks=adam_gradient_checks(params),
                                   update=AdamUpdate(params, group, optimizer.state))
