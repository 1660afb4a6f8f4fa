"""Fixed small inputs on which a backend's primitives must agree with the reference (see dispatch).

Each primitive is exercised in every form the plan calls it with (transposed views of a tall weight,
batches, odd sizes, the ``Y is Z`` update, per-matrix scales, a weight written in place), so that a
backend that passes can run any op. The reference is the torch backend, except for the fused small
chain, which torch does not have: it is compared with the FP64 SVD and eigendecomposition.
"""

from __future__ import annotations

import torch

from .backends.torch_backend import TorchBackend
from .coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from .linalg import compute_dtype, matrix_with_spectrum, normalized_wide, wide
from .reference import msign_eigh, spectral_power_svd

# Singular values sit in two clusters around TAU, so the sign iterations converge well inside the
# default number of steps and the checks compare converged outputs.
TAU = 0.75


def _inputs(dtype: torch.dtype, device):
    """A batched, tall, odd-sized weight (two clusters of singular values) and what the plan derives from it."""
    r = 24
    spectrum = torch.cat([torch.linspace(0.5, 0.65, r // 2), torch.linspace(0.85, 1.0, r - r // 2)])
    W = matrix_with_spectrum((2, 40, r), spectrum, dtype, device, seed=1234)
    _, scale, Xn = normalized_wide(W)
    G = Xn @ Xn.mT
    shifted = G - (TAU / scale) ** 2 * torch.eye(r, dtype=Xn.dtype, device=device)
    return W, Xn, G, shifted / torch.linalg.matrix_norm(shifted)[..., None, None]


def self_check_cases(primitive: str, dtype: torch.dtype, device):
    """``(run, reference)`` pairs: ``run(backend)`` and ``reference()`` each return a tuple of tensors."""
    W, Xn, G, Z = _inputs(dtype, device)
    reference = TorchBackend()
    polar_c = polar_express_coefficients()

    def against_reference(run):
        return run, lambda: run(reference)

    if primitive == "symmetric":
        return [against_reference(lambda b: (b.symmetric(Xn, Xn.mT), b.symmetric(G, G)))]
    if primitive == "product":
        a = polar_c[0][0]
        return [against_reference(lambda b: (
            b.product(G, Xn), b.product(G, Xn, Y=Xn, alpha=a), b.product(G, Xn * 0.5, Y=Xn),
            b.product(G, Xn, beta=-1.0, Y=Xn),
        ))]
    if primitive == "poly_step":
        return [against_reference(lambda b: (b.poly_step(G, *polar_c[0][1:]),))]
    if primitive == "sign_step":
        return [against_reference(lambda b: (b.sign_step(Z, NEWTON_SCHULZ_SIGN), b.sign_step(Z, polar_c[0])))]
    if primitive == "small_chain":
        cases = [(lambda b, p=p: (b.small_chain(wide(W), p, polar_c).mT,), lambda p=p: (spectral_power_svd(W, p),))
                 for p in (0, 2, 3)]
        if dtype == compute_dtype(dtype):  # the plan takes the sign of Gram-side matrices, in the compute dtype
            cases.append((lambda b: (b.small_chain(Z, 0, polar_c, sign=True),), lambda: (msign_eigh(Z),)))
        return cases
    if primitive == "decay_epilogue_":
        D = torch.randn(wide(W).shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(
            device=device, dtype=compute_dtype(dtype))
        per_matrix = torch.tensor([0.5, -1.5], device=device).reshape(2, 1, 1)
        scales = [(0.9, -0.1), (per_matrix, torch.tensor(-0.25, device=device)), (1.1, per_matrix)]

        def run(b):
            results = []
            for keep, step in scales:
                decayed = W.clone()
                b.decay_epilogue_(wide(decayed), D, keep, step)
                results.append(decayed)
            scaled = W.clone()
            b.decay_epilogue_(wide(scaled), None, per_matrix, 0.0)
            return (*results, scaled)

        return [against_reference(run)]
    raise ValueError(f"no self-check for primitive {primitive!r}")
