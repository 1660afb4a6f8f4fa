"""``SpectralMonitor``: a model's spectral metrics as flat scalars, cheap enough to log every few steps.

Per matrix (a parameter of 2 or more dimensions, named by its module path, read as the matrices its
``matrix_view`` says: one per expert of a stack, one for a conv filter): ``s_max`` by warm-started power
iteration (:mod:`.power`), the Frobenius norm, the stable rank ``||W||_F^2 / s_max^2`` and the SPEC 3
effective-lr proxy ``lr / ||W||_F``. Per attention module (:func:`spectral_ops.attention_pairs`): the SPEC 11
logit bound ``s_max(W_q^h) s_max(W_k^g)`` of its worst head (and of each head with ``per_head=True``), GQA
aware. Per optimizer: the decay's counts (docs/monitoring.md says what each means).
"""

from __future__ import annotations

import numbers
import zlib

import torch

from .._checks import check_count
from ..matrix_views import matrix_view_of
from ..optim.base import SpectralOptimizer
from ..optim.hook import attached_decays
from ..precision import outside_autocast
from ..qk_cap import attention_pairs, check_heads
from .sharded import Totals, reader

# What the monitor reports, by the first part of each scalar's name: a dashboard (TensorBoard, W&B, MLflow)
# groups the scalars by it, so one panel holds one quantity for every matrix.
MATRIX_METRICS = ("s_max", "frobenius", "stable_rank", "effective_lr")


def _check_readable(name: str, param: torch.Tensor) -> None:
    """A parameter whose metrics would be wrong or unreadable is refused when the monitor is built: a complex
    one (read as real it would drop its imaginary part; the iteration's transposes are not adjoints), a
    meta-device one (a model not yet materialised: the monitor would hold the parameters ``to_empty``
    replaces)."""
    if param.is_complex():
        raise TypeError(f"{name} is {param.dtype}: the monitor reads real matrices; leave it out with "
                        "include=lambda name, param: not param.is_complex()")
    if param.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: build the monitor after the model's weights exist "
                         "(after to_empty() and loading them), as the optimizer is built")


def _path(name: str) -> str:
    """A module's or parameter's name as the user's model has it: the same for a ``torch.compile``-d model,
    which names them under its ``_orig_mod``."""
    return name.replace("_orig_mod.", "")


def _matrix_name(parameter_name: str) -> str:
    """A parameter's module path (``.weight`` dropped: the module is what a user knows a matrix by)."""
    return _path(parameter_name).removesuffix(".weight")


class _Stack:
    """One parameter's matrices, ``(B, m, n)``, and the power iteration's vectors for them."""

    def __init__(self, name: str, param: torch.Tensor, matrix_view: str | None, seed: int):
        self.name, self.param, self.matrix_view, self.seed = name, param, matrix_view, seed
        self.vectors = None  # (B, n), made at the first call (this rank's part of them: sharded.py)
        self.reader = None  # how this rank reads the matrices (sharded.reader), made at the first call

    def matrices(self, dtype: torch.dtype, gather: bool, rows: int | None = None) -> torch.Tensor:
        """The matrices this rank holds of the parameter, or its part of them (sharded.py), in ``dtype``;
        ``rows``: the matrices are blocks of that many rows (attention heads); ``gather``: whole ones."""
        if self.reader is None:
            self.reader = reader(self.param, self.matrix_view, rows, gather)
        return self.reader.matrices(dtype)

    def names(self) -> list[str]:
        shape = self.param.shape
        if self.param.ndim <= 2 or self.matrix_view != "batch":
            return [self.name]
        return [f"{self.name}.{'.'.join(map(str, index))}" for index in torch.cartesian_prod(
            *[torch.arange(size) for size in shape[:-2]]).reshape(-1, len(shape) - 2).tolist()]


class SpectralMonitor:
    """A model's spectral metrics (module docstring), as ``{name: float}``, every ``every`` steps.

    ``optimizers``: an optimizer, a list of them, or ``{label: optimizer}``; their groups give each matrix's lr
    (the effective-lr proxy), and their decay counts are reported (a family optimizer's own, or those of the
    ``SpectralDecay`` attached to it). Each call runs ``iterations`` power iterations per matrix from the
    vectors the last call ended with (``first_iterations`` at the first call, from random vectors), then more
    rounds of ``iterations`` while an estimate still rose by more than ``tolerance`` (relative) in a round, up
    to ``max_iterations`` in all (docs/monitoring.md, "Accuracy"; one host read per round). ``exact=True``:
    each matrix's ``s_max`` by an FP64 SVD instead (an ``O(mn min(m, n))`` factorisation per matrix: small
    models, checks).
    ``include(name, param)``: which matrices to report (all of 2 or more dimensions by default).
    ``prefix`` begins every name. ``attention``: the attention pairs whose logit bound is reported, ``"auto"``
    (:func:`~spectral_ops.attention_pairs` of ``model``), None (none), or ``{path: (q_weight, k_weight,
    num_heads, num_kv_heads)}``. ``per_head``: the bound of every head, not only each module's largest.
    """

    def __init__(self, model: torch.nn.Module, optimizers=None, *, every: int = 50, iterations: int = 2,
                 first_iterations: int = 30, tolerance: float = 1e-5, max_iterations: int = 100, exact: bool = False,
                 attention="auto", per_head: bool = False, include=None, prefix: str = "spectral"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.every = check_count(every, "every")
        self.iterations = check_count(iterations, "iterations")
        self.first_iterations = check_count(first_iterations, "first_iterations")
        self.max_iterations = check_count(max_iterations, "max_iterations")
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be a number in [0, 1) (0: no rounds past the first), got {tolerance!r}")
        self.tolerance = float(tolerance)
        self.exact, self.per_head, self.prefix = bool(exact), bool(per_head), str(prefix)
        self.optimizers = _labelled(optimizers)
        self.stacks, seen = [], set()
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if param.ndim < 2 or id(param) in seen or (include is not None and not include(name, param)):
                    continue  # a tied weight (an embedding and its head) is reported once, by its first name
                seen.add(id(param))
                _check_readable(name, param)
                # Seeded by the reported name: the same start vectors under torch.compile's renaming.
                self.stacks.append(_Stack(_matrix_name(name), param, matrix_view_of(module, param),
                                          zlib.crc32(_matrix_name(name).encode())))
        self.attention = {}  # module path -> (its q heads' stack, its k heads', heads, kv heads)
        for path, (q, k, heads, kv_heads) in _attention(model, attention).items():
            names = [f"{_path(path)}.{side}" for side in ("q", "k")]
            for name, weight in zip(names, (q, k)):
                _check_readable(name, weight)
            self.attention[_path(path)] = (*(_Stack(name, weight, "batch", zlib.crc32(name.encode()))
                                             for name, weight in zip(names, (q, k))), heads, kv_heads)

        # The decay steps each optimizer with a spectral decay has taken since now (a step post-hook: a step
        # that raised took none), for its `decays` count.
        self.steps = {label: 0 for label, optimizer in self.optimizers.items() if decay_counts(optimizer)}
        self._handles = [self.optimizers[label].register_step_post_hook(self._counter(label)) for label in self.steps]

    def _counter(self, label: str):
        def count(optimizer, args, kwargs):
            self.steps[label] += 1
        return count

    def close(self) -> None:
        """Stop counting the optimizers' steps (remove the monitor's step hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def due(self, step: int) -> bool:
        """Whether ``step`` is a log step: every ``every``-th, from step 0."""
        return step % self.every == 0

    def _key(self, metric: str, name: str) -> str:
        return f"{self.prefix}.{metric}/{name}" if self.prefix else f"{metric}/{name}"

    def _s_max(self, stack: _Stack, matrices: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return torch.linalg.matrix_norm(matrices.to(torch.float64), ord=2)
        if stack.vectors is None:
            stack.vectors = stack.reader.start(stack.seed, matrices.dtype, matrices.device)
            iterations = self.first_iterations
        else:
            iterations = self.iterations
        estimate, vectors = stack.reader.iterate(matrices, stack.vectors.to(matrices.dtype), iterations)
        done = iterations
        # Rounds of `iterations` until no estimate of the stack moved by more than `tolerance` (relative) in the
        # last one: the top direction can turn between two log steps (early in training, fast), more than a
        # fixed count can follow. Every rank that shares the stack's collectives decides alike (any_rank).
        while self.tolerance and done < self.max_iterations:
            previous = estimate
            rounds = min(self.iterations, self.max_iterations - done)
            estimate, vectors = stack.reader.iterate(matrices, vectors, rounds)
            done += rounds
            if not stack.reader.any_rank((estimate - previous > self.tolerance * estimate).any()):
                break
        stack.vectors = vectors
        return estimate

    @outside_autocast  # a callback may run inside the host's autocast: its products would run in bf16
    @torch.no_grad()
    def compute(self) -> dict[str, float]:
        """The metrics now, as ``{name: float}`` (one host read at the end).

        Where parameters are spread over processes (FSDP2, tensor parallelism: docs/monitoring.md,
        "Distributed"), this is a collective: every rank calls it, at the same step, and every rank gets the
        same values."""
        lr_of = {id(param): group["lr"] for optimizer in self.optimizers.values() for group in optimizer.param_groups
                 for param in group["params"] if "lr" in group}
        # Each rank's part of the sums over ranks, all summed at once (sharded.Totals), then read.
        totals, pending = Totals(), []
        for stack in self.stacks:
            matrices = stack.matrices(self._dtype(stack.param.dtype), self.exact)
            pending.append((stack, stack.reader.s_max(totals, self._s_max(stack, matrices)),
                         stack.reader.frobenius(totals, matrices)))
        head_bounds = {path: self._head_bounds(*pair, totals) for path, pair in self.attention.items()}
        totals.reduce()
        values = {}  # name -> 0-d tensor, read once at the end
        for stack, s_max, frobenius in pending:
            s_max, frobenius = s_max(), frobenius()
            # 0 for a zero matrix; a NaN weight's NaN stays NaN.
            stable_rank = torch.where(s_max == 0, 0, frobenius**2 / s_max.clamp_min(torch.finfo(s_max.dtype).tiny)**2)
            lr = lr_of.get(id(stack.param))
            for i, name in enumerate(stack.names()):
                values[self._key("s_max", name)] = s_max[i]
                values[self._key("frobenius", name)] = frobenius[i]
                values[self._key("stable_rank", name)] = stable_rank[i]
                if lr is not None:  # SPEC 3's proxy (metrics.effective_lr's), of the norm summed over ranks
                    values[self._key("effective_lr", name)] = lr / frobenius[i].to(torch.float64)
        for path, bounds in head_bounds.items():
            bounds = bounds()
            values[self._key("qk_bound", path)] = bounds.max()
            if self.per_head:
                for head, bound in enumerate(bounds):
                    values[self._key("qk_bound", f"{path}.h{head}")] = bound
        for label, optimizer in self.optimizers.items():
            counts = decay_counts(optimizer)
            if counts:
                counts["decays"] = torch.tensor(float(self.steps.get(label, 0)))
            values.update({self._key("decay", f"{label}.{count}"): value for count, value in counts.items()})
        # One read: every value stacked where the weights are, then one copy to the host.
        device = next((value.device for value in values.values() if torch.is_tensor(value)
                       and value.device.type != "cpu"), torch.device("cpu"))
        read = torch.stack([torch.as_tensor(value, dtype=torch.float64).to(device) for value in values.values()]) \
            if values else torch.zeros(0)
        return dict(zip(values, read.tolist()))

    def _head_bounds(self, q_stack: _Stack, k_stack: _Stack, heads: int, kv_heads: int, totals: Totals):
        """Each q head's bound, as a function to call once ``totals`` are reduced."""
        dtype, head_dim = self._dtype(q_stack.param.dtype), q_stack.param.shape[0] // heads
        s_max = []
        for stack in (q_stack, k_stack):
            matrices = stack.matrices(dtype, self.exact, head_dim)
            s_max.append(stack.reader.s_max(totals, self._s_max(stack, matrices)))
        s_q, s_k = s_max
        return lambda: s_q() * s_k().repeat_interleave(heads // kv_heads)

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        """fp64 where ``exact`` (every value to fp64's rounding); else fp32 for every floating dtype below fp64
        (bf16 and fp16 weights are read once, widened)."""
        return torch.float64 if self.exact or dtype == torch.float64 else torch.float32

    def metrics_at(self, step: int) -> dict[str, float] | None:
        """:meth:`compute` where ``step`` is :meth:`due`, else None."""
        return self.compute() if self.due(step) else None


def _attention(model: torch.nn.Module, attention) -> dict:
    if attention is None:
        return {}
    if isinstance(attention, str) and attention == "auto":
        return attention_pairs(model, required=False)  # a model without attention has no bound to report
    if not isinstance(attention, dict):
        raise TypeError(f'attention must be "auto", None or {{path: (q_weight, k_weight, num_heads, num_kv_heads)}}, '
                        f"got {type(attention).__name__}")
    pairs = {}
    for path, pair in attention.items():
        q, k, heads, kv_heads = pair
        heads, kv_heads, _ = check_heads(q, k, heads, kv_heads)
        pairs[path] = (q, k, heads, kv_heads)
    return pairs


def _labelled(optimizers) -> dict:
    if optimizers is None:
        return {}
    if isinstance(optimizers, torch.optim.Optimizer):
        return {"optimizer": optimizers}
    if isinstance(optimizers, dict):
        labelled = dict(optimizers)
    else:
        optimizers = list(optimizers)
        labelled = {"optimizer" if len(optimizers) == 1 else f"optimizer{i}": o for i, o in enumerate(optimizers)}
    for label, optimizer in labelled.items():
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{label!r}] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return labelled


def decay_counts(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The spectral decay's counts of ``optimizer`` (a family optimizer, or one a ``SpectralDecay`` is attached
    to or to an optimizer it holds), over all its parameters, as 0-d tensors (no host read): ``skipped``
    updates, ``clamped`` matrix decays (the stability guard reduced the coefficient) and
    ``smallest_clamp_factor`` (1: never clamped). Empty for an optimizer without a spectral decay."""
    owners = [optimizer] if isinstance(optimizer, SpectralOptimizer) else attached_decays(optimizer)
    if not owners:
        return {}
    skips = [count for owner in owners for count in owner.skipped.values()]
    clamps = [record for owner in owners for record in owner.clamped.values()]
    device = (skips + [record.count for record in clamps] + [torch.zeros(())])[0].device

    def total(tensors, dtype=torch.float64):
        return torch.stack([t.to(device, dtype) for t in tensors]).sum() if tensors else torch.zeros((), dtype=dtype)

    smallest = torch.stack([r.smallest_factor.to(device) for r in clamps]).amin() if clamps else torch.ones(())
    return {"skipped": total(skips), "clamped": total([r.count for r in clamps]), "smallest_clamp_factor": smallest}
