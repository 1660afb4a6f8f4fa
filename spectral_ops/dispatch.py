"""The single point that decides which backend runs each primitive: never slower than cuBLAS by construction.

An op call gets a :class:`RoutedKernels` object (:func:`kernels_for`) and hands it to the plan; every
primitive call the plan makes goes through it, and is routed per call from the operand's device,
dtype and shape:

* a backend must be available on the device and *able* to run the primitive (its ``supports``);
* it must be *routable* there: the CUDA extension's products (``symmetric``, ``product``,
  ``poly_step``, ``sign_step``) issue ``mma.sync``, which cannot reach cuBLAS's wgmma on Hopper, so
  on sm90 and newer they are never routed to (forcing the backend still runs them);
* it must have passed its first-use self-check for that primitive and dtype (below);
* among the backends left, it must be the fastest **by measurement**. On a GPU
  (:mod:`spectral_ops.tuning`) the first call of each primitive, dtype, precision and shape bucket
  times every one of them, torch/cuBLAS included, and the composed chain against every fused one,
  on scratch copies of the operands; the choice is kept in memory and on disk.
* Where nothing was measured on this machine (``SPECTRAL_OPS_AUTOTUNE=0``, a new shape bucket met
  while a CUDA graph is captured or torch.compile traces, CPU tensors), the GPU cost model
  (:mod:`spectral_ops.gpu_model`) chooses, and it predicts a time only for torch and for the
  providers that a GPU check has **measured** on this GPU model (its ``MEASURED_EFFICIENCY`` table).
  A kernel no GPU has timed is never the default: with that table empty, every such call runs on
  torch (cuBLAS), and a fused chain only where the model, from measurements, predicts it faster
  than the composed one.

``SPECTRAL_OPS_BACKEND=cuda|triton|torch`` or :func:`use_backend` force one backend for every
primitive, whatever the sizes; forcing one that cannot run a call raises
:class:`BackendUnavailableError` with the reason. A fused small chain is optional: without one the
plan composes the other primitives.

**Self-checks.** The first time a backend is about to run a primitive for a dtype, it runs the
inputs of :mod:`spectral_ops.selfcheck` and is compared with the reference. If they disagree (or it
raises) that primitive is disabled for the backend for the process, with a warning naming both, and
the call goes to the next backend: a wrong kernel never reaches a user's weights. A backend whose
kernels could fault the device (``self_check_in_child``: the CUDA extension, whose memory faults are
sticky and would end the caller's process) is checked in a child process, every primitive and dtype
at once; if the child dies, the backend is disabled with that reason and the caller goes on.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import warnings

import torch

from . import environment, gpu_model, selfcheck
from ._compile import constant_when_traced
from .backends.counting import Work
from .backends.cuda_backend import CudaBackend
from .backends.torch_backend import TorchBackend
from .backends.triton_backend import TritonBackend
from .linalg import wide
from .precision import OPERAND_DTYPES, resolve_precision
from .selfcheck import EXACT_PRECISION, self_check_error, self_check_tolerance
from .tuning import Autotuner, routing_key

logger = logging.getLogger("spectral_ops")

BACKEND_NAMES = ("cuda", "triton", "torch")

# The pseudo-provider of a small chain that no fused kernel runs: the plan composes the other primitives.
COMPOSED = "composed"
# The CUDA extension's products issue mma.sync; Hopper's tensor cores reach their rate only through
# wgmma, which cuBLAS uses: these are never routed to from this compute capability on.
CUDA_MMA_SYNC_PRODUCTS = ("symmetric", "product", "poly_step", "sign_step")
CUDA_PRODUCTS_UNROUTED_FROM = (9, 0)


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run the call; the message says why."""


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("spectral_ops_backend", default=None)
_backends: dict[str, object] = {}
_self_check_passed: dict[tuple, bool] = {}
_self_check_failure: dict[tuple, str] = {}
_child_errors: dict[tuple, float] = {}
_logged_choices: set[tuple] = set()
_last_choice: dict[str, set[str]] = {}
_autotuner = Autotuner()


def _check_name(name: str, source: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Force a backend inside a ``with`` block (takes precedence over the environment)."""
    token = _forced.set(_check_name(name, "use_backend(name)"))
    try:
        yield
    finally:
        _forced.reset(token)


def forced_backend() -> str | None:
    name = _forced.get()
    if name is not None:
        return name
    env = environment.setting(environment.BACKEND)
    return _check_name(env, environment.BACKEND) if env else None


def get_backend(name: str):
    """The backend instance for ``name`` (created on first use)."""
    if name not in _backends:
        factory = {"cuda": CudaBackend, "triton": TritonBackend, "torch": TorchBackend}[_check_name(name, "name")]
        _backends[name] = factory()
    return _backends[name]


def register_backend(backend) -> None:
    """Replace the backend called ``backend.name`` (for tests and out-of-tree backends)."""
    _backends[_check_name(backend.name, "backend.name")] = backend
    for table in (_self_check_passed, _self_check_failure, _child_errors):
        for key in [k for k in table if k[0] == backend.name]:
            del table[key]


def reset() -> None:
    """Forget backend instances, self-check results, recorded choices and measurements held in memory
    (the on-disk routing cache stays)."""
    _autotuner.forget()
    _backends.clear()
    _self_check_passed.clear()
    _self_check_failure.clear()
    _child_errors.clear()
    _logged_choices.clear()
    _last_choice.clear()


def backend_status(device: torch.device | None = None) -> list[tuple[str, str | None]]:
    """``(name, None if available else the reason)`` for each backend, in dispatch order."""
    return [(name, get_backend(name).unavailable_reason(device)) for name in BACKEND_NAMES]


def _unrouted(name: str, primitive: str, device) -> str | None:
    """Why a backend that can run ``primitive`` is still never routed to there (None: it may be)."""
    device = torch.device(device)
    if (name == "cuda" and primitive in CUDA_MMA_SYNC_PRODUCTS and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= CUDA_PRODUCTS_UNROUTED_FROM):
        return (f"the cuda backend's {primitive} (mma.sync) is not routed to on sm90 and newer, where cuBLAS "
                "runs wgmma; force the backend to run it")
    return None


def _why_not(backend, primitive: str, device, dtype, shape, precision, forced: bool, steps: int) -> str | None:
    reason = backend.unavailable_reason(device, forced)
    if reason is not None:
        return reason
    if not backend.supports(primitive, device, dtype, shape, steps=steps):
        return f"the {backend.name} backend has no {primitive} for {dtype} operands of shape {shape} on {device}"
    if not forced:
        reason = _unrouted(backend.name, primitive, device)
        if reason is not None:
            return reason
    if not _passes_self_check(backend, primitive, dtype, precision, device):
        failure = _self_check_failure.get(_self_check_key(backend, primitive, dtype, precision, device), "")
        return f"the {backend.name} backend failed its {primitive} self-check for {dtype} and is disabled{failure}"
    return None


def _select(op: str, primitive: str, operand: torch.Tensor, precision: str | None = None, *,
            optional: bool = False, steps: int = 0, trial=None):
    """The backend for one primitive call on ``operand`` (None for an optional one that none runs)."""
    return _select_for(op, primitive, operand.device, operand.dtype, tuple(operand.shape), precision, optional,
                       steps, trial)


def _select_for(op: str, primitive: str, device, dtype, shape, precision=None, optional: bool = False,
                steps: int = 0, trial=None):
    """``trial(names)``, when given, returns a zero-argument call per backend name (and :data:`COMPOSED`
    for a small chain) on scratch copies of the operands, for the autotuner to time."""
    forced = forced_backend()
    if forced is not None:
        backend = get_backend(forced)
        reason = _why_not(backend, primitive, device, dtype, shape, precision, True, steps)
        if reason is None:
            return backend
        if optional:
            return None
        raise BackendUnavailableError(f"backend {forced!r} was forced for {op}, but {reason}")
    if _autotuner.applies(device):
        measured = _measured(primitive, device, dtype, shape, precision, steps, trial)
        if measured is not None:
            return None if measured == COMPOSED else get_backend(measured)
    for name in _modelled_order(primitive, device, dtype, shape, precision, steps):
        if name == COMPOSED:
            return None
        if _why_not(get_backend(name), primitive, device, dtype, shape, precision, False, steps) is None:
            return get_backend(name)
    if optional:
        return None
    raise BackendUnavailableError(f"no backend can run {primitive} for {op} on {dtype} {device}")


def _arch_of(device):
    """The cost model's GPU for ``device`` (None for a CPU, or a GPU the model does not know)."""
    device = torch.device(device)
    return gpu_model.arch_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def _modelled_order(primitive: str, device, dtype, shape, precision, steps: int) -> list[str]:
    """The backends to try, in the cost model's order, where nothing was measured: those with a
    predicted time (torch, and what a GPU check measured on this GPU model) fastest first, torch
    last among equals; :data:`COMPOSED` where a small chain is better composed. Without a model of
    this device, torch alone (CPU tensors: the torch backend is the one that serves them)."""
    arch = _arch_of(device)
    if arch is None:
        return [] if primitive == "small_chain" else ["torch"]
    precision = precision or EXACT_PRECISION[dtype]
    able = [name for name in BACKEND_NAMES
            if get_backend(name).unavailable_reason(device) is None
            and get_backend(name).supports(primitive, device, dtype, shape, steps=steps)
            and _unrouted(name, primitive, device) is None]
    predicted = {}
    for name in able:
        work = gpu_model.primitive_work(primitive, shape, dtype, precision, name, compose=_compose_small_chain,
                                        steps=steps)
        predicted[name] = gpu_model.predict_ms(arch, name, work, precision)
    if primitive == "small_chain":
        # The composed chain: the fused one's FLOPs and traffic, in one launch per product of its steps.
        fused = gpu_model.primitive_work(primitive, shape, dtype, precision, "torch", compose=_compose_small_chain,
                                         steps=steps)
        launches = gpu_model.composed_chain_work(_compose_small_chain, tuple(shape), dtype, precision, "torch",
                                                 steps).launches  # the count just made for `fused`, cached
        predicted[COMPOSED] = gpu_model.predict_ms(arch, "torch", Work(fused.flops, fused.bytes, launches), precision)
    ranked = sorted((ms, name not in ("torch", COMPOSED), name) for name, ms in predicted.items() if ms is not None)
    return [name for _, _, name in ranked]


def _measured(primitive: str, device, dtype, shape, precision, steps: int, trial) -> str | None:
    """The name of the fastest eligible backend (or :data:`COMPOSED`) by measurement (timed now if
    ``trial`` is given and this kind of call never was), or None where nothing is measured. Eligible:
    available, capable, routable and past its self-check. A remembered ranking is walked fastest
    first, so that a new process self-checks only the backend it is going to use."""
    def eligible(name) -> bool:
        return name == COMPOSED or _why_not(get_backend(name), primitive, device, dtype, shape, precision, False,
                                            steps) is None

    names = [*BACKEND_NAMES, COMPOSED] if primitive == "small_chain" else list(BACKEND_NAMES)
    key = routing_key(primitive, dtype, precision, shape, steps)
    for name in _autotuner.ranking(device, key):
        if name in names and eligible(name):
            return name
    if trial is None or not _autotuner.can_time(device):
        return None
    candidates = [name for name in names if eligible(name)]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    return _autotuner.measure(device, key, trial(candidates))


def _scratch(value, copies: dict):
    """``value`` with every tensor replaced by a copy; a tensor passed twice is copied once, so that
    aliased operands (``product(M, Z, Y=Z)``) stay aliased."""
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.clone()
        return copies[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_scratch(item, copies) for item in value)
    if isinstance(value, dict):
        return {key: _scratch(item, copies) for key, item in value.items()}
    return value


def _trial(primitive: str, args: tuple, kwargs: dict, kernels=None):
    """Calls of ``primitive`` on each named backend, all on one scratch copy of the operands: timing
    never touches the caller's tensors (``decay_epilogue_`` writes its operand). :data:`COMPOSED` runs
    the plan's composition of a small chain on ``kernels``, as a call without a fused chain would."""
    def runs(names):
        scratch_args, scratch_kwargs = _scratch((args, kwargs), {})
        return {name: functools.partial(_composed_chain, kernels, *scratch_args, **scratch_kwargs) if name == COMPOSED
                else functools.partial(getattr(get_backend(name), primitive), *scratch_args, **scratch_kwargs)
                for name in names}
    return runs


class _WithoutChain:
    """A :class:`RoutedKernels` whose small chain always composes: what the plan runs when none is fused."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, primitive: str):
        return getattr(self.kernels, primitive)

    def small_chain(self, X, p, coefficients, precision, sign=False):
        return None


# The plan's composed form of a small chain, ``compose(kernels, X, p, coefficients, precision, sign)``: set by
# spectral_ops.ops (:func:`composes_small_chains_by`), as dispatch sits below the plan and imports nothing of it.
_compose_small_chain = None


def composes_small_chains_by(compose) -> None:
    """Time :data:`COMPOSED` small chains with ``compose``, the plan's composition of one."""
    global _compose_small_chain
    _compose_small_chain = compose


def _composed_chain(kernels, X, p, coefficients, precision, sign=False):
    """The plan's composed form of a small chain on ``X`` (its ``sign`` iteration, or ``S_p``)."""
    return _compose_small_chain(_WithoutChain(kernels), X, p, coefficients, precision, sign)


@constant_when_traced
def _traced_choice(op, primitive, device, dtype, shape, precision, optional, steps) -> str:
    """The backend's name ("" for none) while torch.compile traces an op: decided when the graph is
    traced, by the same rules, and baked into it (Triton's and CUDA's primitives are opaque custom
    ops in the graph). Routing reads context variables, the environment, caches and runs
    self-checks, none of which belongs in a graph; a graph keeps its backends until it is retraced."""
    backend = _select_for(op, primitive, device, dtype, shape, precision, optional, steps)
    return "" if backend is None else backend.name


class RoutedKernels:
    """The primitives for one op call, each routed to a backend per call (see the module docstring)."""

    def __init__(self, op: str, W: torch.Tensor):
        self.op = op
        self.used: set[str] = set()
        self._device = W.device
        self._described = (W.device.type, W.dtype)
        # Nothing that decides a choice changes within one op call, and an iteration repeats a few
        # operand shapes many times: each is routed once.
        self._choices: dict[tuple, object] = {}
        _last_choice[op] = self.used

    def _backend(self, primitive: str, operand: torch.Tensor, precision: str | None = None, optional: bool = False,
                 steps: int = 0, call: tuple = ((), {})):
        """The backend for ``primitive`` on ``operand``; ``call`` (its arguments) lets the autotuner time
        the candidates the first time this kind of call is seen."""
        if torch.compiler.is_compiling():
            name = _traced_choice(self.op, primitive, operand.device, operand.dtype, tuple(operand.shape), precision,
                                  optional, steps)
            return get_backend(name) if name else None
        key = (primitive, operand.dtype, operand.shape, precision, steps)  # operands all share W's device
        if key not in self._choices:
            self._choices[key] = _select(self.op, primitive, operand, precision, optional=optional, steps=steps,
                                         trial=_trial(primitive, *call, kernels=self))
            if self._choices[key] is not None:
                self._record(self._choices[key].name)
        return self._choices[key]

    def _record(self, name: str) -> None:
        self.used.add(name)
        key = (self.op, name, *self._described)
        if key not in _logged_choices:
            _logged_choices.add(key)
            logger.debug("spectral_ops: %s on %s %s runs on the %s backend", self.op, *self._described, name)

    def provider_of(self, primitive: str, dtype: torch.dtype, shape, precision: str | None = None) -> str | None:
        """The name of the backend that would run ``primitive`` on ``dtype`` operands of ``shape`` (None:
        none can): the plan's question before it weighs a factorisation against the composed products."""
        if torch.compiler.is_compiling():
            return _traced_choice(self.op, primitive, self._device, dtype, tuple(shape), precision, True, 0) or None
        backend = _select_for(self.op, primitive, self._device, dtype, tuple(shape), precision, optional=True)
        return None if backend is None else backend.name

    def symmetric(self, L, R, precision):
        return self._backend("symmetric", L, precision, call=((L, R, precision), {})).symmetric(L, R, precision)

    def product(self, M, Z, precision, *, alpha=1.0, Y=None, beta=1.0):
        epilogue = {"alpha": alpha, "Y": Y, "beta": beta}
        return self._backend("product", Z, precision, call=((M, Z, precision), epilogue)).product(
            M, Z, precision, **epilogue)

    def poly_step(self, A, b, c, precision):
        return self._backend("poly_step", A, precision, call=((A, b, c, precision), {})).poly_step(A, b, c, precision)

    def sign_step(self, Z, coefficient, precision):
        return self._backend("sign_step", Z, precision, call=((Z, coefficient, precision), {})).sign_step(
            Z, coefficient, precision)

    def small_chain(self, X, p, coefficients, precision, sign=False):
        """``S_p(X)`` (or ``msign``) by a fused chain, or None when no backend has one for ``X``."""
        call = ((X, p, coefficients, precision), {"sign": sign})
        backend = self._backend("small_chain", X, precision, optional=True, steps=len(coefficients), call=call)
        return None if backend is None else backend.small_chain(X, p, coefficients, precision, sign=sign)

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        return self._backend("decay_epilogue_", W, call=((W, D, keep, step), {"noise": noise})).decay_epilogue_(
            W, D, keep, step, noise=noise)


class PinnedKernels:
    """Every primitive on one backend, without routing or self-checks: for the tests and benchmarks
    that run or time one backend's kernels (e.g. the CUDA kernels under CPU emulation).
    ``small_chain=False`` makes the plan compose the other primitives instead of the fused chain."""

    def __init__(self, backend, *, small_chain: bool = True):
        self.backend = backend
        self.chain = small_chain

    def provider_of(self, primitive: str, dtype: torch.dtype, shape, precision: str | None = None) -> str:
        return self.backend.name

    def __getattr__(self, primitive: str):
        return getattr(self.backend, primitive)

    def small_chain(self, X, p, coefficients, precision, sign=False):
        usable = self.chain and self.backend.supports("small_chain", X.device, X.dtype, tuple(X.shape),
                                                      steps=len(coefficients))
        return self.backend.small_chain(X, p, coefficients, precision, sign=sign) if usable else None


def kernels_for(op: str, W: torch.Tensor) -> RoutedKernels:
    """The primitives for one call of ``op`` on ``W``; what they run on is kept for :func:`last_backend`."""
    return RoutedKernels(op, W)


def backend_for(op: str, W: torch.Tensor) -> str:
    """The backend that would run ``op``'s rectangular products on ``W`` now: the bulk of its work.

    For small matrices a backend's fused chain may run the whole op instead; :func:`last_backend`
    reports what did run.
    """
    precision = resolve_precision(None, W.dtype)
    return _select_for(op, "product", W.device, OPERAND_DTYPES[precision], tuple(wide(W).shape), precision).name


def measured_routing_applies(device) -> bool:
    """Whether calls on ``device`` are routed by measurement (a GPU, unless ``SPECTRAL_OPS_AUTOTUNE=0``)."""
    return _autotuner.applies(torch.device(device))


def provider_for(primitive: str, device, dtype: torch.dtype, shape, precision: str | None = None,
                 steps: int = 0) -> str | None:
    """The backend that a call of ``primitive`` on ``dtype`` operands of ``shape`` on ``device`` would run
    on now, by the same rules as a call (None: none can), without timing anything: for reports (the GPU
    check prints it next to what it measured) and tests."""
    backend = _select_for("provider_for", primitive, torch.device(device), dtype, tuple(shape), precision,
                          optional=True, steps=steps)
    return None if backend is None else backend.name


def last_backend(op: str) -> str | None:
    """The backend(s) the most recent call of ``op`` ran on (``"triton+torch"`` for a mix), or None."""
    used = _last_choice.get(op)
    if not used:
        return None
    return "+".join(name for name in BACKEND_NAMES if name in used)


def _self_check_key(backend, primitive: str, dtype: torch.dtype, precision, device) -> tuple:
    """A self-check's key: ``precision`` None is the dtype's own, as the check runs it."""
    return backend.name, primitive, dtype, precision or EXACT_PRECISION[dtype], torch.device(device).type


def _passes_self_check(backend, primitive: str, dtype: torch.dtype, precision, device: torch.device) -> bool:
    if not backend.needs_self_check:
        return True
    key = _self_check_key(backend, primitive, dtype, precision, device)
    if key not in _self_check_passed:
        if getattr(backend, "self_check_in_child", False):
            error = _child_self_check_error(backend, key, device)
        else:
            error = self_check_error(backend, primitive, dtype, device, precision)
        tolerance = self_check_tolerance(dtype, precision)
        _self_check_passed[key] = error <= tolerance
        if not _self_check_passed[key]:
            failure = _self_check_failure.get(key)
            if failure is None:
                failure = f"relative error {error:.3g} > {tolerance:.1g}"
                _self_check_failure[key] = f" ({failure})"
            warnings.warn(
                f"spectral_ops: the {backend.name} backend's {primitive} disagrees with the reference for "
                f"{dtype} ({failure.strip(' ()')}); it is disabled for this process and the next backend is "
                "used instead",
                RuntimeWarning,
                stacklevel=6,
            )
    return _self_check_passed[key]


def _child_self_check_error(backend, key: tuple, device) -> float:
    """``key``'s self-check error, from a child process that checks every primitive and dtype of
    ``backend`` at once, the first time any is needed. A child that dies (a sticky device fault, a
    crash) or hangs fails every check it was given, with its reason kept for the messages."""
    if key not in _child_errors:
        checks = {*selfcheck.all_checks(), key[1:4]}
        errors, reason = selfcheck.errors_in_child(backend, device, sorted(checks, key=str))
        for check in checks:
            child_key = (backend.name, *check, key[4])
            _child_errors[child_key] = errors.get(check, float("inf"))
            if reason is not None:
                _self_check_failure[child_key] = f" ({reason})"
    return _child_errors[key]
