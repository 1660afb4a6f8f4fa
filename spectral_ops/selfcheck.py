"""Fixed small inputs on which a backend's primitives must agree with the reference, a backend's error on
them (:func:`self_check_error`, in this process or in a child) and the error it may have: the check itself.
:mod:`spectral_ops.dispatch`, above it, decides when a check runs and what a failure disables.

Each primitive is exercised in every form the plan calls it with (transposed views of a tall weight,
batches, odd sizes, the ``Y is Z`` update, per-matrix scales, a weight written in place), so that a
backend that passes can run any op. The reference is the torch backend, except for the fused small
chain, which torch does not have: it is compared with the FP64 SVD and eigendecomposition.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys

import torch

from .backends.base import PRIMITIVES
from .backends.torch_backend import TorchBackend
from .coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from .linalg import compute_dtype, matrix_with_spectrum, normalized_wide, relative_error, wide
from .reference import msign_eigh, spectral_power_svd

logger = logging.getLogger("spectral_ops")

# Relative Frobenius error allowed between a backend and the reference on the self-check inputs.
# They are well conditioned (singular values in [0.5, 1]), so the only differences are summation
# order and the final rounding to the dtype; a wrong kernel is off by O(1).
SELF_CHECK_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
# Single-pass TF32 products of fp32 operands: a 10-bit mantissa, u = 2^-11, a few u per product.
TF32_SELF_CHECK_TOLERANCE = 5e-3


def self_check_tolerance(dtype: torch.dtype, precision: str | None) -> float:
    """The largest :func:`self_check_error` a backend may have for operands of ``dtype`` at ``precision``."""
    return TF32_SELF_CHECK_TOLERANCE if precision == "tf32" else SELF_CHECK_TOLERANCE[dtype]


# A child process checking a backend gets this long; one that runs longer is taken as hung.
CHILD_TIMEOUT_S = 300.0
# The dtypes and precisions a GPU backend's kernels are called with (fp32 operands also as one TF32 pass).
KERNEL_CHECKS = ((torch.float32, "fp32"), (torch.float32, "tf32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"))

# Singular values sit in two clusters around TAU, so the sign iterations converge well inside the
# default number of steps and the checks compare converged outputs.
TAU = 0.75


# The precision a check runs at when none is asked for: the dtype's own.
EXACT_PRECISION = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _inputs(dtype: torch.dtype, device):
    """A batched, tall, odd-sized weight (two clusters of singular values) of ``dtype``, and what the
    plan derives from it, as operands of ``dtype``."""
    r = 24
    spectrum = torch.cat([torch.linspace(0.5, 0.65, r // 2), torch.linspace(0.85, 1.0, r - r // 2)])
    W = matrix_with_spectrum((2, 40, r), spectrum, dtype, device, seed=1234)
    _, scale, Xn = normalized_wide(W, torch.float64)
    G = Xn @ Xn.mT
    shifted = G - (TAU / scale) ** 2 * torch.eye(r, dtype=Xn.dtype, device=device)
    Z = shifted / torch.linalg.matrix_norm(shifted)[..., None, None]
    return W, Xn.to(dtype), G.to(dtype), Z.to(dtype)


def self_check_cases(primitive: str, dtype: torch.dtype, device, precision: str | None = None):
    """``(run, reference)`` pairs: ``run(backend)`` and ``reference()`` each return a tuple of tensors.

    ``dtype`` is the operands' (the weight's for the chain and the epilogue), ``precision`` the one the
    primitive is asked for (default: the dtype's own). The torch reference runs the same call.
    """
    W, Xn, G, Z = _inputs(dtype, device)
    reference = TorchBackend()
    polar_c = polar_express_coefficients()
    precision = precision or EXACT_PRECISION[dtype]

    def against_reference(run):
        return run, lambda: run(reference)

    if primitive == "symmetric":
        return [against_reference(lambda b: (b.symmetric(Xn, Xn.mT, precision), b.symmetric(G, G, precision)))]
    if primitive == "product":
        a = polar_c[0][0]
        return [against_reference(lambda b: (
            b.product(G, Xn, precision), b.product(G, Xn, precision, Y=Xn, beta=a),
            b.product(G, Xn * 0.5, precision, Y=Xn), b.product(G, Xn, precision, alpha=-1.0, Y=Xn),
        ))]
    if primitive == "poly_step":
        return [against_reference(lambda b: (b.poly_step(G, *polar_c[0][1:], precision),))]
    if primitive == "sign_step":
        return [against_reference(lambda b: (b.sign_step(Z, NEWTON_SCHULZ_SIGN, precision),
                                             b.sign_step(Z, polar_c[0], precision)))]
    if primitive == "small_chain":
        cases = [(lambda b, p=p: (b.small_chain(wide(W), p, polar_c, precision).mT,),
                  lambda p=p: (spectral_power_svd(W, p),)) for p in (0, 2, 3)]
        if dtype == compute_dtype(dtype):  # the plan takes the sign of Gram-side matrices, in the compute dtype
            cases.append((lambda b: (b.small_chain(Z, 0, polar_c, precision, sign=True),), lambda: (msign_eigh(Z),)))
        return cases
    if primitive == "decay_epilogue_":
        D = torch.randn(wide(W).shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(
            device=device, dtype=compute_dtype(dtype))
        per_matrix = torch.tensor([0.5, -1.5], device=device).reshape(2, 1, 1)
        noise = torch.randint(-2**15, 2**15, wide(W).shape, dtype=torch.int16,
                              generator=torch.Generator().manual_seed(6)).to(device)
        scales = [(0.9, -0.1), (per_matrix, torch.tensor(-0.25, device=device)), (1.1, per_matrix)]

        def run(b):
            results = []
            for keep, step in scales:
                decayed = W.clone()
                b.decay_epilogue_(wide(decayed), D, keep, step)
                results.append(decayed)
            scaled = W.clone()
            b.decay_epilogue_(wide(scaled), None, per_matrix, 0.0)
            # Stochastic rounding: the same bits give the same result on every provider.
            rounded = W.clone()
            b.decay_epilogue_(wide(rounded), D, 0.9, -0.1, noise=noise)
            return (*results, scaled, rounded)

        return [against_reference(run)]
    raise ValueError(f"no self-check for primitive {primitive!r}")


def self_check_error(backend, primitive: str, dtype: torch.dtype, device, precision: str | None = None) -> float:
    """Largest relative error of ``backend``'s ``primitive`` (operands of ``dtype``, at ``precision``,
    by default the exact one for the dtype) against the reference on fixed inputs."""
    worst = 0.0
    for run, reference in self_check_cases(primitive, dtype, device, precision):
        try:
            got = run(backend)
        except Exception as error:  # a crashing kernel fails its check like a wrong one
            logger.debug("spectral_ops: %s self-check of %s raised %r", backend.name, primitive, error)
            return float("inf")
        for g, e in zip(got, reference()):
            error = relative_error(g, e)
            worst = max(worst, error if error == error else float("inf"))
    return worst


# ----- checking in a child process: a kernel that faults the device ends the child, not the caller


def all_checks() -> list[tuple[str, torch.dtype, str]]:
    """``(primitive, dtype, precision)`` of every check a GPU backend's kernels can be asked for."""
    return [(primitive, dtype, precision) for primitive in PRIMITIVES for dtype, precision in KERNEL_CHECKS]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def errors_in_child(backend, device, checks) -> tuple[dict[tuple, float], str | None]:
    """The self-check errors of ``backend`` (rebuilt in the child from its class, which must take no
    arguments) for ``checks`` (``(primitive, dtype, precision)``), computed in a child process:
    ``(errors, None)``, or ``({}, reason)`` if the child died or hung. The child gets this process's
    ``sys.path`` (as ``PYTHONPATH``), so this package and a backend defined anywhere importable here
    (a checkout, a test module) are importable there."""
    backend_class = type(backend)
    request = {"backend": f"{backend_class.__module__}:{backend_class.__qualname__}", "device": str(device),
               "checks": [[p, _dtype_name(d), precision] for p, d, precision in checks]}
    command = [sys.executable, "-m", "spectral_ops.selfcheck"]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    try:
        done = subprocess.run(command, input=json.dumps(request), capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, env=environment)
    except subprocess.TimeoutExpired:
        return {}, f"its self-check child process did not finish in {CHILD_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exit status {done.returncode}")
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        return {}, f"its self-check child process died ({how}: {last[0][:200]})"
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    return {(p, getattr(torch, d), precision): error for p, d, precision, error in answers}, None


def _child_main() -> None:
    """The child: read the request on stdin, print ``[primitive, dtype, precision, error]`` rows as JSON."""
    request = json.loads(sys.stdin.read())
    module, name = request["backend"].split(":")
    backend = getattr(importlib.import_module(module), name)()
    device = torch.device(request["device"])
    rows = [[p, d, precision, self_check_error(backend, p, getattr(torch, d), device, precision)]
            for p, d, precision in request["checks"]]
    print(json.dumps(rows))


if __name__ == "__main__":
    _child_main()
