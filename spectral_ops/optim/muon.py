"""Muon with spectral-power decay, head-wise or full-matrix updates, and an internal AdamW.

Muon's direction is the polar factor of the Nesterov momentum (SPEC 4, 6), computed by this
package's :func:`spectral_ops.polar`, the same kernels that serve the ``p = 0`` decay. Polar Express
is the default; ``ns_coefficients=spectral_ops.MUON_QUINTIC`` with ``ns_steps=5`` is
``torch.optim.Muon``'s iteration. ``update_power=q`` makes it ``U Sigma^q V^T`` of the momentum
(:func:`spectral_ops.power_update`, renormalised to the polar factor's Frobenius norm).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import defaultdict

import torch

from .. import plan
from .._checks import check_choice, check_eps, check_power, check_steps
from ..decay import PendingWrite, UpdateWrite
from ..matrix_views import as_matrices, batched, matrix_dims
from ..ops import check_precision, power_update
from ..plan import OPERAND_DTYPES, UPDATE_FLOOR, UPDATE_SCALES, resolve_precision
from ._decay import capturable, check_matrices_said, decay_keywords, matrix_view_of_parameter
from .adamw import check_adam_options, init_adam_state, prepare_adam_step
from .base import CheckedUpdate, SpectralOptimizer, add_scaled_, device_masks, largest_magnitudes, scalar, step_scalar
from .distributed import local, local_block, polar_blocks_flops

ALGORITHMS = ("muon", "adamw")
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral")


def adjusted_lr(lr: float, adjust_lr_fn, shape) -> float:
    """Muon's per-matrix lr: ``"original"`` ``sqrt(max(1, rows/cols))`` (torch's default),
    ``"match_rms_adamw"`` ``0.2 sqrt(max(rows, cols))`` (SPEC 4), ``"spectral"`` ``sqrt(rows/cols)``,
    or a callable ``(lr, shape)``.

    ``"spectral"`` is the modular norm's dual scale (SPEC 6): a linear layer's natural norm is
    ``sqrt(fan_in/fan_out) ||W||_2``, with ``fan_out = rows`` and ``fan_in = cols`` of a torch weight,
    so a polar factor (spectral norm 1) of unit natural norm is ``sqrt(fan_out/fan_in) U V^T``.
    """
    rows, cols = shape
    if callable(adjust_lr_fn):
        return adjust_lr_fn(lr, shape)
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "spectral":
        return lr * math.sqrt(rows / cols)
    return lr * 0.2 * math.sqrt(max(rows, cols))


def orthogonalization_coefficients(group: dict) -> tuple:
    """The polar iteration a Muon group uses (:func:`spectral_ops.plan.orthogonalization_coefficients`)."""
    return plan.orthogonalization_coefficients(group["ns_steps"], group["ns_coefficients"])


def row_blocks(rows: int, group: dict):
    """``(start, size, letter)`` per block: the fused-projection splits, each "H" (head-wise) or "F"."""
    sizes = group["splits"] or (rows,)
    recipe = group["recipe"] or ("H" if group["heads"] else "F") * len(sizes)
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    return list(zip(starts, sizes, recipe))


def direction_flops(shape, group: dict) -> float:
    """The plan's FLOPs of one matrix's Muon direction: a polar factor per head or full block."""
    rows, cols = shape
    steps = len(orthogonalization_coefficients(group))
    return sum(polar_blocks_flops((size // count, cols), count, steps) for _, size, letter in row_blocks(rows, group)
               for count in [group["heads"] if letter == "H" else 1])


class MuonUpdate(CheckedUpdate):
    """Muon's update of a group (:meth:`SpectralMuon._muon_update`): each block's direction, checked finite
    with the step's checks, times its adjusted lr, added to the weight; bounded by the largest of those
    lrs times the direction's largest magnitude. The momentum it writes is a convex combination of
    finite ones."""

    def __init__(self, optimizer: "SpectralMuon", params, group: dict, directions: list, checked: list):
        super().__init__(params, group, optimizer.state)
        # checked: the directions as the step's checks read them (see SpectralMuon._directions)
        self.write, self.checked = functools.partial(optimizer._muon_update, self.params, group, directions), checked

    def magnitudes(self) -> list:
        group = self.group
        lr = step_scalar(group["lr"], group)
        bounds = []
        for param, direction in zip(self.params, largest_magnitudes(self.checked)):
            rows, cols = matrix_dims(param.shape, matrix_view_of_parameter(param, group))
            scales = [abs(adjusted_lr(lr, group["adjust_lr_fn"], (size, cols)))
                      for _, size, _ in row_blocks(rows, group)]
            scale = functools.reduce(torch.maximum if torch.is_tensor(scales[0]) else max, scales)
            bounds.append((None if direction is None else scale * direction, None))
        return bounds

    def __call__(self, keep):
        return self.write(keep)


class SpectralMuon(SpectralOptimizer):
    """Muon plus the spectral term of SPEC 1.5, with AdamW for non-matrix parameters.

    Per group:

    * ``algorithm``: ``"muon"`` (default; matrices only) or ``"adamw"`` (embeddings, norms, biases,
      the output head), which uses ``betas``/``eps`` and the same decay options;
    * ``heads``: split each row block into this many heads and orthogonalise each head's
      ``(rows / heads) x cols`` block separately; ``splits`` gives the row sizes of a fused
      projection (e.g. ``(d, d, d)`` for fused QKV) and ``recipe`` marks each block head-wise
      ``"H"`` or full-matrix ``"F"`` (``"HHF"``). Head-wise blocks keep the full block's
      ``adjust_lr_fn`` scale. The spectral decay takes the same matrices as the update: each head
      of a head-wise block, each full block (a fused QKV with ``"HHF"``: the heads of Q and K, and V);
    * ``weight_decay`` (``lambda_1``), ``p``, ``spectral_weight_decay`` (``lambda_p``),
      ``convention``, ``band``, ``p0_mode``, ``stability``, ``decay_precision``: as in
      :class:`SpectralAdamW`. Decay uses the unadjusted lr, as torch.optim.Muon does;
    * ``precision``: the operands of the orthogonalisation, ``"bf16"`` by default as in
      torch.optim.Muon (fp32 accumulation); ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"fp64"`` or None (the
      op default: follow the update's dtype and ``torch.get_float32_matmul_precision()``);
    * ``capturable``: as in :class:`SpectralAdamW` (the polar factor is then not checked for a
      finite momentum on the host);
    * ``update_power`` (``q``, 0 by default: Muon): the update is ``U diag((s^2 + (update_eps
      s_max)^2)^(q/2)) V^T`` of the (Nesterov) momentum ``U diag(s) V^T`` instead of its polar factor,
      by :func:`spectral_ops.power_update` on the same Polar Express iteration (docs/real-powers.md),
      renormalised to the polar factor's Frobenius norm ``sqrt(min(rows, cols))`` per matrix or head,
      so that ``adjust_lr_fn`` and ``lr`` mean what they mean for Muon. A number, or a callable of the
      parameter's step count (0 at its first step; DynMuon's sigmoid schedule is one), or, in a
      capturable group, a 0-d tensor (a scheduler's, on the device: at most 1 in magnitude, NaN and a
      skipped step beyond; a callable then gets the count as a device tensor, as it does in a step
      torch.compile traces: write it with torch ops). ``q = 0`` (a number) is
      Muon's step, bit for bit. The floor ``update_eps`` (1e-2 by default; at least the iterate's
      resolution, 2^-6 in bf16, :data:`spectral_ops.plan.RESOLUTION`) is ``s^q`` on the modes above
      it and keeps those below it, mostly noise, from dominating a negative ``q``. It needs the
      default Polar Express iteration: a fixed quintic (``ns_coefficients``) does not converge, and
      ``|X| = X Q^T`` would not be ``X``'s. ``update_scale="raw"`` takes the power as it is, not
      renormalised: DynMuon's update, whose norm follows the momentum's (``||X||^q``; docs/real-powers.md,
      "Porting from DynMuon").
    """

    @decay_keywords(after="weight_decay")
    def __init__(self, params, lr=1e-3, momentum=0.95, nesterov=True, ns_coefficients=None, ns_steps=None,
                 adjust_lr_fn="match_rms_adamw", weight_decay=0.1, precision="bf16", heads=None, splits=None,
                 recipe=None, algorithm="muon", betas=(0.9, 0.95), eps=1e-8, capturable=False, strict=False,
                 rollback=False, process_group=None, update_power=0, update_eps=UPDATE_FLOOR, update_scale="polar",
                 cautious=False, **decay):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        weight_decay=weight_decay, **decay, precision=precision,
                        heads=heads, splits=splits, recipe=recipe, update_power=update_power,
                        update_eps=update_eps, update_scale=update_scale, algorithm=algorithm, betas=betas, eps=eps,
                        capturable=capturable, strict=strict, rollback=rollback, cautious=cautious)
        super().__init__(params, defaults, process_group=process_group)

    def check_options(self, group: dict) -> None:
        super().check_options(group)
        check_choice(group["algorithm"], "algorithm", ALGORITHMS)
        if group["algorithm"] == "adamw":
            check_adam_options(group)
            return
        if not 0.0 <= scalar(group["momentum"]) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
        if not (group["adjust_lr_fn"] in (None, *ADJUST_LR_FNS) or callable(group["adjust_lr_fn"])):
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, None or a callable, "
                             f"got {group['adjust_lr_fn']!r}")
        check_steps(group["ns_steps"], "ns_steps")
        check_precision(group["precision"])
        orthogonalization_coefficients(group)
        self._check_update_power(group)
        heads = group["heads"]
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(f"heads must be a positive integer or None, got {heads!r}")
        for index, param in enumerate(group["params"]):
            if param.ndim < 2:
                raise ValueError(f"Muon updates matrices; put the {tuple(param.shape)} parameter in a group "
                                 "with algorithm='adamw'")
            if param.is_complex():
                raise TypeError(f"Muon's polar factor is implemented for real matrices only; put the complex "
                                f"{tuple(param.shape)} parameter in a group with algorithm='adamw'")
            check_matrices_said(param, group, index, "Muon's update")
            self._check_blocks(matrix_dims(param.shape, matrix_view_of_parameter(param, group))[0], group)

    @staticmethod
    def _check_update_power(group) -> None:
        power, eps = group["update_power"], group["update_eps"]
        check_eps(eps, "update_eps")
        check_choice(group["update_scale"], "update_scale", UPDATE_SCALES)
        if not callable(power):
            power = check_power(power, "update_power", eps=eps, capturable=True, eps_name="update_eps")
        if (not isinstance(power, numbers.Real) or power != 0) and group["ns_coefficients"] is not None:
            raise ValueError("update_power needs a converged polar factor (|X| = X Q^T): use the default Polar "
                             "Express iteration (ns_coefficients=None), not a fixed quintic")

    @staticmethod
    def update_power_at(group, count):
        """The update power of a parameter whose step count is ``count`` (its state's 0-d tensor): a
        number as :func:`~spectral_ops._checks.check_power` makes it (0 for Muon's polar factor), or,
        in a capturable or compiled step, a 0-d tensor, which stays on its device (a callable then gets
        the count as a tensor too)."""
        power, on_device = group["update_power"], capturable(group) or torch.compiler.is_compiling()
        if callable(power):
            # Read only for a schedule, and not where the step may not read the host: a compiled step
            # would break its graph there, and compile again for each new Python power.
            power = power(count if on_device else int(count))
        return check_power(power, "update_power", eps=group["update_eps"], capturable=on_device, eps_name="update_eps")

    @staticmethod
    def _check_blocks(rows: int, group) -> None:
        splits, recipe, heads = group["splits"], group["recipe"], group["heads"]
        if splits is not None and (sum(splits) != rows or any(s < 1 for s in splits)):
            raise ValueError(f"splits {tuple(splits)} must be positive and sum to the {rows} rows of the parameter")
        blocks = len(splits) if splits else 1
        if recipe is not None:
            if len(recipe) != blocks or set(recipe) - {"H", "F"}:
                raise ValueError(f"recipe must have one letter H or F per block ({blocks}), got {recipe!r}")
            if "H" in recipe and heads is None:
                raise ValueError(f"recipe {recipe!r} has head-wise blocks but heads is not set")
        for _, size, letter in row_blocks(rows, group):
            if letter == "H" and size % heads:
                raise ValueError(f"a head-wise block of {size} rows does not split into {heads} heads")

    def check_step(self, params: list, group: dict) -> None:
        super().check_step(params, group)
        for param in params:
            if group["algorithm"] == "muon" and self.layout(param) is not None and param.ndim > 2 and \
                    matrix_view_of_parameter(param, group) == "flatten" and not local(param).is_contiguous():
                raise ValueError(f"SpectralMuon: {self.parameter_name(group, param)} is spread over ranks and read "
                                 "with matrix_view='flatten', and its layout (channels-last?) has no view of its "
                                 "matrix: make it contiguous (module.to(memory_format=torch.contiguous_format))")

    def init_state(self, params: list, group: dict) -> None:
        if group["algorithm"] == "adamw":
            init_adam_state(params, group, self.state)
            return
        for param in params:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            self.state[param]["step"] = self._zero_count(param, group)

    @staticmethod
    def _zero_count(param, group) -> torch.Tensor:
        """A step count as Adam's: a float32 0-d tensor on the parameter's device when the group is
        capturable (a captured step advances it in place), else on the CPU."""
        return torch.zeros((), dtype=torch.float32, device=param.device if capturable(group) else "cpu")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # A state saved before update_power counted no steps: a schedule restarts from 0.
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                for param in group["params"]:
                    if "momentum_buffer" in self.state.get(param, {}):
                        self.state[param].setdefault("step", self._zero_count(param, group))

    def prepare_group(self, params, group: dict) -> PendingWrite:
        if group["algorithm"] == "adamw":
            return prepare_adam_step(self, params, group)
        grads = [local(param.grad) for param in params]  # before the state: SpectralOptimizer.check_step
        updates = [self._update(param, grad, group) for param, grad in zip(params, grads)]
        powers = [self.update_power_at(group, self.state[param]["step"]) for param in params]
        # directions[i]: the polar factors the commit adds to params[i] (this rank's rows; checked[i] is
        # the same, as the checks read it), filled in when they are computed.
        directions, checked = self._directions(params, updates, powers, group)
        return self.prepare_write(params, group, checks=self.gradient_checks(params), checked=checked,
                                  update=MuonUpdate(self, params, group, directions, checked),
                                  blocks=self._decay_blocks(group))

    def _muon_update(self, params, group, directions, keep):
        """The :class:`~spectral_ops.decay.PendingWrite` ``update`` of a Muon group: allocates
        everything first (the momenta of a capturable step, its masked directions and lrs: a skipped
        parameter adds an exact zero, whatever the lr; the directions of a filter whose matrix is no
        view of it), and returns the :class:`~spectral_ops.decay.UpdateWrite` that writes the momenta
        and adds the directions."""
        masks = device_masks(keep) if capturable(group) else None
        lr = step_scalar(group["lr"], group)
        momenta, additions = [], []
        targets = [local(param) for param in params]  # before self.layout's dict: SpectralOptimizer.check_step
        for index, (param, direction) in enumerate(zip(params, directions)):
            if keep[index] is False:
                continue
            mask = None if masks is None else masks[index]
            momenta.append((param, *self._next_momentum(param, group, mask)))
            lr_of = lr
            if mask is not None:
                direction = torch.where(mask, direction, 0)
                lr_of = torch.where(mask, lr, 0.0) if torch.is_tensor(lr) else lr
            view = matrix_view_of_parameter(param, group)
            # Each matrix's, whole (a DTensor's shape is the global one).
            rows, cols = matrix_dims(param.shape, view)
            layout = self.layout(param)
            held = None if layout is None else layout.local_rows(view)
            target = targets[index]
            if view != "flatten" or target.ndim <= 2 or target.is_contiguous():
                target = as_matrices(target, view)
                blocks = [(local_block(target, start, start + size, held), local_block(direction, start, start + size,
                                                                                       held), size)
                          for start, size, _ in row_blocks(rows, group)]
            else:  # a channels-last filter: its rows are dim 0's, its direction takes its shape
                direction = direction.reshape(target.shape)
                blocks = [(target[start:start + size], direction[start:start + size], size)
                          for start, size, _ in row_blocks(rows, group)]
            additions.extend((target_block, direction_block, adjusted_lr(lr_of, group["adjust_lr_fn"], (size, cols)))
                             for target_block, direction_block, size in blocks)

        def write():
            for param, buffer_value, count_value in momenta:
                self._store_momentum(param, group, buffer_value, count_value)
            for target, direction, scale in additions:
                add_scaled_(target, direction, scale)

        def param_directions():  # each polar factor in its parameter's shape (a copy where it is no view)
            return [None if kept is False else (local(param), direction.reshape(local(param).shape))
                    for param, direction, kept in zip(params, directions, keep)]
        return UpdateWrite(write, param_directions)

    def _update(self, param, grad, group) -> torch.Tensor:
        """Muon's update (this rank's shard) in a temporary of its own: the momentum buffer after this
        step (an EMA of the gradients, as torch.optim.Muon keeps it), then, in place, Nesterov's lerp of
        the gradient towards it. The state's buffer is advanced only when the step commits, in place
        and to the same numbers (:meth:`_store_momentum`): a skipped step leaves it as it was, and it
        keeps its address, so that a step allocates one full-size temporary here, as torch's does."""
        update = local(self.state[param]["momentum_buffer"]).lerp(grad, 1 - group["momentum"])
        if group["nesterov"]:
            torch.lerp(grad, update, group["momentum"], out=update)
        # A copy only where the update's layout has no view of its matrices (a channels-last filter).
        return as_matrices(update.contiguous(), matrix_view_of_parameter(param, group))

    def _next_momentum(self, param, group, mask) -> tuple:
        """What :meth:`_store_momentum` writes, computed before any write: None where an eager step
        advances the buffer and the count in place; a capturable step's new buffer (the old one where
        its device decision ``mask`` is False) and new count (on the device)."""
        if mask is None:
            return None, None
        grad, buffer = local(param.grad), local(self.state[param]["momentum_buffer"])
        count = self.state[param]["step"]
        if count.device != mask.device:  # capturable switched on later: the count moves, as Adam's
            count = count.to(mask.device)
        return (torch.where(mask, buffer.lerp(grad, 1 - group["momentum"]), buffer),
                count + mask.to(count.dtype))

    def _store_momentum(self, param, group, buffer_value, count_value) -> None:
        """Store the momentum buffer after this step, in place (a captured graph replays into the
        addresses it captured), and advance the step count (see :meth:`_next_momentum`)."""
        state = self.state[param]
        if buffer_value is None:
            local(state["momentum_buffer"]).lerp_(local(param.grad), 1 - group["momentum"])
            state["step"].add_(1)
            return
        local(state["momentum_buffer"]).copy_(buffer_value)
        if state["step"].device == count_value.device:
            state["step"].copy_(count_value)
        else:  # capturable switched on later: the count moves to the device, as Adam's
            state["step"] = count_value

    @staticmethod
    def _decay_blocks(group):
        """The rows the decay takes as matrices of their own, the update's: each head of a head-wise
        block, each full block of a fused projection."""
        if not group["splits"] and not group["heads"]:
            return None

        def blocks(param):
            rows = matrix_dims(param.shape, matrix_view_of_parameter(param, group))[0]
            return [(start + head * (size // count), size // count) for start, size, letter in row_blocks(rows, group)
                    for count in [group["heads"] if letter == "H" else 1] for head in range(count)]
        return blocks

    def _directions(self, params, updates, powers, group) -> tuple[list, list]:
        """Each update's polar factors (this rank's part of them): computed here, or, for a spread
        matrix, on its owner when the step's exchange runs (see :mod:`spectral_ops.optim.distributed`);
        and each as the step's finiteness checks read it, filled in at the same time."""
        layouts = [self.layout(param) for param in params]
        spread = [i for i, layout in enumerate(layouts) if layout is not None]
        directions, checked = [None] * len(params), [None] * len(params)

        def keep(indices, results):
            for i, direction in zip(indices, results):
                directions[i] = direction
                # The checks read every entry, in any order: a tall matrix's direction (a transposed
                # view) is read as its transpose, which is contiguous, where a reduction over the
                # strided view would copy it first.
                checked[i] = direction.mT if direction.mT.is_contiguous() else direction

        alone = [i for i in range(len(params)) if layouts[i] is None]
        keep(alone, self._orthogonalize([updates[i] for i in alone], [powers[i] for i in alone], group))

        def orthogonalized_on_owners(alike, view):
            """The directions of the spread matrices ``alike``, read as ``view``: submitted, then kept."""
            def orthogonalize(positions, wholes):
                # The exchange moves parameter-shaped parts (a layout's parts are the parameter's).
                directions = self._orthogonalize([as_matrices(whole, view) for whole in wholes],
                                                 [powers[alike[position]] for position in positions], group)
                return [direction.reshape(whole.shape) for direction, whole in zip(directions, wholes)]

            costs = [direction_flops(matrix_dims(params[i].shape, view), group)
                     * (params[i].shape[:-2].numel() if batched(params[i].shape, view) else 1) for i in alike]
            results = yield self.exchange.submit(
                orthogonalize, [updates[i].reshape(local(params[i]).shape) for i in alike], [layouts[i] for i in alike],
                # A stack sharded by its batch (experts) holds whole matrices: computed here.
                costs, [layouts[i].holds_whole_matrices(view) for i in alike])
            keep(alike, [as_matrices(result, view) for result in results])

        views = [matrix_view_of_parameter(param, group) for param in params]
        for view in dict.fromkeys(views[i] for i in spread):
            self.exchange.wait(orthogonalized_on_owners([i for i in spread if views[i] == view], view))
        return directions, checked

    @staticmethod
    def _orthogonalize(updates, powers, group):
        """Polar factors (``U Sigma^q V^T`` for ``q = powers[i]`` not 0) of every head or full block, one
        batched call per block shape and power.

        A batch of one block (or of one matrix's heads) is the update itself, as a view, and a matrix
        that is one block keeps its rows of the batch's result as its direction: only a batch of
        several matrices is gathered (one copy), and only a matrix of several blocks assembled (one more).
        Directions stay in the iteration's operand dtype (bf16 by default), as torch.optim.Muon adds
        its iterate to the weights: the weight's arithmetic reads them exactly, and no full-size copy in
        the weight's dtype is made.
        """
        coefficients, precision = orthogonalization_coefficients(group), group["precision"]
        operand_dtypes = [OPERAND_DTYPES[resolve_precision(precision, update.dtype)] for update in updates]
        blocks = [row_blocks(update.shape[-2], group) for update in updates]
        jobs = defaultdict(list)  # (block shape, dtype, power) -> [(update index, start, size, source (b, r, c))]
        for index, update in enumerate(updates):
            matrices = update.shape[:-2].numel()  # a stack's (matrix_view="batch"), 1 for one matrix
            for start, size, letter in blocks[index]:
                count = group["heads"] if letter == "H" else 1
                shape = (matrices * count, size // count, update.shape[-1])
                jobs[(*shape[1:], update.dtype, powers[index])].append(
                    (index, start, size, update[..., start:start + size, :].reshape(shape)))
        directions = [None if len(b) == 1 else torch.empty_like(u, dtype=dtype)
                      for u, b, dtype in zip(updates, blocks, operand_dtypes)]
        for (_, cols, _, power), members in jobs.items():
            sources = [source for *_, source in members]
            batch = sources[0] if len(sources) == 1 else torch.cat(sources)
            # Not checked for NaN/Inf here (capturable=True skips that check, and the host read): the
            # step checks each direction it computed, and skips its parameter rather than raise.
            # The step's own update: the normalisation may overwrite it rather than copy it.
            result = power_update(batch[0] if len(batch) == 1 else batch, power, eps=group["update_eps"],
                                  coefficients=coefficients, precision=precision, capturable=True,
                                  dtype=operand_dtypes[members[0][0]], overwrite_input=True,
                                  scale=group["update_scale"], matrix_view="batch")
            result = result.view(batch.shape)
            for (index, start, size, _), piece in zip(members, result.split([s.shape[0] for s in sources])):
                piece = piece.reshape(*updates[index].shape[:-2], size, cols)
                if directions[index] is None:
                    directions[index] = piece
                else:
                    directions[index][..., start:start + size, :].copy_(piece)
        return directions
