"""Muon with spectral-power decay, head-wise or full-matrix updates, and an internal AdamW.

Muon's direction is the polar factor of the Nesterov momentum (SPEC 4, 6), computed by this
package's :func:`spectral_ops.polar`, the same kernels that serve the ``p = 0`` decay. Polar Express
is the default; ``ns_coefficients=spectral_ops.MUON_QUINTIC`` with ``ns_steps=5`` is
``torch.optim.Muon``'s iteration.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from .._checks import check_choice, check_steps
from ..coefficients import polar_express_coefficients, resolve_polar_coefficients, without_normalization_margin
from ..ops import check_precision, polar
from ..plan import OPERAND_DTYPES, resolve_precision
from ..decay import as_matrices, batched, matrix_dims
from ._decay import capturable, check_matrices_said
from .adamw import adam_update_, check_adam_options, init_adam_state, prepare_adam_step
from .base import PreparedStep, SpectralOptimizer, add_scaled_, commit_element_wise, device_masks, scalar, step_scalar
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
    """The polar iteration a Muon group uses: Polar Express (8 steps) or the given quintics
    (5 steps by default), the latter normalised by ``||G||_F`` as torch.optim.Muon does."""
    if group["ns_coefficients"] is None:
        return polar_express_coefficients(group["ns_steps"] or 8)
    steps = group["ns_steps"] if group["ns_steps"] is not None else 5
    return without_normalization_margin(resolve_polar_coefficients(steps, group["ns_coefficients"]))


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


@dataclasses.dataclass
class MuonStep(PreparedStep):
    """A Muon group's step: ``directions[i]``, the polar factors the commit adds to ``params[i]`` (this
    rank's rows; ``checked[i]`` is the same, as the checks read it), filled in when they are computed."""

    directions: list = ()


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
      finite momentum on the host).
    """

    def __init__(self, params, lr=1e-3, momentum=0.95, nesterov=True, ns_coefficients=None, ns_steps=None,
                 adjust_lr_fn="match_rms_adamw", weight_decay=0.1, p=1, spectral_weight_decay=0.0,
                 convention="decoupled", band=None, p0_mode="explicit", stability="clamp", decay_steps=None,
                 decay_precision=None, decay_iteration="auto", decay_method="auto", matrix_view=None,
                 rounding="nearest", precision="bf16",
                 heads=None, splits=None, recipe=None, algorithm="muon", betas=(0.9, 0.95), eps=1e-8,
                 capturable=False, strict=False, process_group=None, polar_steps=None):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        weight_decay=weight_decay, p=p, spectral_weight_decay=spectral_weight_decay,
                        convention=convention, band=band, p0_mode=p0_mode, stability=stability,
                        decay_steps=decay_steps, polar_steps=polar_steps, decay_precision=decay_precision,
                        decay_iteration=decay_iteration, decay_method=decay_method, matrix_view=matrix_view,
                        rounding=rounding, precision=precision,
                        heads=heads, splits=splits, recipe=recipe,
                        algorithm=algorithm, betas=betas, eps=eps, capturable=capturable, strict=strict)
        super().__init__(params, defaults, process_group=process_group)

    def check_group(self, group: dict) -> None:
        super().check_group(group)
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
            self._check_blocks(matrix_dims(param.shape, group["matrix_view"])[0], group)

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

    def init_state(self, params: list, group: dict) -> None:
        if group["algorithm"] == "adamw":
            init_adam_state(params, group, self.state)
            return
        for param in params:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def prepare_group(self, params, group: dict) -> PreparedStep:
        if group["algorithm"] == "adamw":
            return prepare_adam_step(self, params, group)
        updates = [self._update(param, group) for param in params]
        directions, checked = self._directions(params, updates, group)
        decay = self.prepare_decay(params, group, blocks=self._decay_blocks(group))
        return MuonStep(group, params, self.gradient_checks(params), decay, checked, directions)

    def commit_group(self, step: PreparedStep, keep: list) -> None:
        if step.group["algorithm"] == "adamw":
            commit_element_wise(adam_update_, step, keep, self.state)
            return
        group = step.group
        masks = device_masks(keep) if capturable(group) else None
        for index, param in enumerate(step.params):
            if keep[index] is not False:
                self._advance_momentum(param, group, None if masks is None else masks[index])
        step.decay.commit(keep)
        lr = step_scalar(group["lr"], group)
        for index, (param, direction) in enumerate(zip(step.params, step.directions)):
            if keep[index] is False:
                continue
            if masks is not None:
                direction = torch.where(masks[index], direction, 0)
            view = group["matrix_view"]
            target = as_matrices(local(param), view)
            # Each matrix's, whole (a DTensor's shape is the global one).
            rows, cols = matrix_dims(param.shape, view)
            layout = self.layout(param)
            span = (0, param.shape[0]) if layout is None else layout.local_rows
            stacked = batched(param.shape, view)
            for start, size, _ in row_blocks(rows, group):
                scale = adjusted_lr(lr, group["adjust_lr_fn"], (size, cols))
                add_scaled_(local_block(target, start, start + size, span, stacked),
                            local_block(direction, start, start + size, span, stacked), scale)

    def _update(self, param, group) -> torch.Tensor:
        """Muon's update (this rank's shard) in a temporary of its own: the momentum buffer after this
        step (an EMA of the gradients, as torch.optim.Muon keeps it), then, in place, Nesterov's lerp of
        the gradient towards it. The state's buffer is advanced only when the step commits, in place
        and to the same numbers (:meth:`_advance_momentum`): a skipped step leaves it as it was, and it
        keeps its address, so that a step allocates one full-size temporary here, as torch's does."""
        grad = local(param.grad)
        update = local(self.state[param]["momentum_buffer"]).lerp(grad, 1 - group["momentum"])
        if group["nesterov"]:
            torch.lerp(grad, update, group["momentum"], out=update)
        # A copy only where the update's layout has no view of its matrices (a channels-last filter).
        return as_matrices(update.contiguous(), group["matrix_view"])

    def _advance_momentum(self, param, group, mask) -> None:
        """Store the momentum buffer after this step, in place (a captured graph replays into the
        addresses it captured); ``mask``, a capturable step's device decision, keeps the old one where
        it is False."""
        grad, buffer = local(param.grad), local(self.state[param]["momentum_buffer"])
        if mask is None:
            buffer.lerp_(grad, 1 - group["momentum"])
        else:
            buffer.copy_(torch.where(mask, buffer.lerp(grad, 1 - group["momentum"]), buffer))

    @staticmethod
    def _decay_blocks(group):
        """The rows the decay takes as matrices of their own, the update's: each head of a head-wise
        block, each full block of a fused projection."""
        if not group["splits"] and not group["heads"]:
            return None

        def blocks(param):
            rows = matrix_dims(param.shape, group["matrix_view"])[0]
            return [(start + head * (size // count), size // count) for start, size, letter in row_blocks(rows, group)
                    for count in [group["heads"] if letter == "H" else 1] for head in range(count)]
        return blocks

    def _directions(self, params, updates, group) -> tuple[list, list]:
        """Each update's polar factors (this rank's rows of them): computed here, or, for a spread
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
        keep(alone, self._orthogonalize([updates[i] for i in alone], group))
        if spread:
            costs = [direction_flops(matrix_dims(params[i].shape, group["matrix_view"]), group)
                     * (params[i].shape[:-2].numel() if batched(params[i].shape, group["matrix_view"]) else 1)
                     for i in spread]
            self.exchange.map(lambda positions, matrices: self._orthogonalize(matrices, group),
                              [updates[i] for i in spread], [layouts[i] for i in spread], costs,
                              lambda results: keep(spread, results))
        return directions, checked

    @staticmethod
    def _orthogonalize(updates, group):
        """Polar factors of every head or full block, one batched call per block shape.

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
        jobs = defaultdict(list)  # (block shape, dtype) -> [(update index, start, size, source (batch, r, c))]
        for index, update in enumerate(updates):
            matrices = update.shape[:-2].numel()  # a stack's (matrix_view="batch"), 1 for one matrix
            for start, size, letter in blocks[index]:
                count = group["heads"] if letter == "H" else 1
                shape = (matrices * count, size // count, update.shape[-1])
                jobs[(*shape[1:], update.dtype)].append((index, start, size,
                                                         update[..., start:start + size, :].reshape(shape)))
        directions = [None if len(b) == 1 else torch.empty_like(u, dtype=dtype)
                      for u, b, dtype in zip(updates, blocks, operand_dtypes)]
        for (_, cols, _), members in jobs.items():
            sources = [source for *_, source in members]
            batch = sources[0] if len(sources) == 1 else torch.cat(sources)
            # Not checked for NaN/Inf here (capturable=True skips that check, and the host read): the
            # step checks each direction it computed, and skips its parameter rather than raise.
            result = _polar_as_laid_out(batch[0] if len(batch) == 1 else batch, coefficients, precision,
                                        operand_dtypes[members[0][0]])
            result = result.view(batch.shape)
            for (index, start, size, _), piece in zip(members, result.split([s.shape[0] for s in sources])):
                piece = piece.reshape(*updates[index].shape[:-2], size, cols)
                if directions[index] is None:
                    directions[index] = piece
                else:
                    directions[index][..., start:start + size, :].copy_(piece)
        return directions


def _polar_as_laid_out(X, coefficients, precision, dtype):
    """``polar(X, dtype=dtype)`` (capturable), iterated on a square ``X`` as it is laid out.

    torch.optim.Muon transposes only a tall matrix; :func:`~spectral_ops.polar` counts a square one as
    tall too and iterates on its transpose, a strided view, whose result comes out strided. Given a
    square ``X``'s transpose instead, it iterates on ``X`` itself (Gram ``X X^T``, as torch's does), and
    the result, transposed back, has ``X``'s layout: adding it to the weight is no strided pass."""
    # X is the step's own update: the normalisation may overwrite it rather than copy it.
    options = dict(coefficients=coefficients, precision=precision, capturable=True, dtype=dtype, overwrite_input=True)
    if X.shape[-2] != X.shape[-1]:
        return polar(X, **options)
    return polar(X.mT, **options).mT
