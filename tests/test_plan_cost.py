"""spectral_ops.plan's costs, held (issue #45): every decay costs its direction's FLOPs plus the guard's allowance.

The direction is ``spectral_power(W, p, method="gram")``, counted by torch's FlopCounterMode. The guard's
allowance is 0 where ``||W||_F`` (free) settles it in an eager step; elsewhere up to
:data:`~spectral_ops.plan.GUARD_SQUARINGS` squarings of the plan's own ``r x r`` Gram, ``2 r^3`` each per
matrix, never a second Gram. The CPU's ``"auto"`` decay once took ``eigh`` for ``p = 3`` (the Gram and two
products by the rectangle: 24 r^3 at 4:1 against the Gram route's 16 r^3, 6 against 4 on a square).
"""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch, plan
from spectral_ops.linalg import matrix_with_spectrum

SHAPES = {"square": (32, 32), "tall": (96, 24), "wide": (24, 96), "stacked": (3, 48, 16)}
POWERS = [0, 2, 3, 4, 2.5]


def _flops(call) -> int:
    from torch.utils.flop_counter import FlopCounterMode  # imports triton: not at collection time

    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def directions():
    """Each shape's weights (singular values over [1/2, 1]: s_max = 1, ||W||_F >= sqrt(r) / 2) and the
    FLOPs of each power's direction on the Gram route."""
    cases = {}
    for name, shape in SHAPES.items():
        r = min(shape[-2:])
        W = matrix_with_spectrum(shape, torch.linspace(1.0, 0.5, r, dtype=torch.float64), torch.float32, seed=3)
        cases[name] = W, {p: _flops(lambda p=p: so.spectral_power(W, p, method="gram")) for p in POWERS}
    return cases


@pytest.mark.parametrize("mode", ["raise", "clamp", "capturable"])
@pytest.mark.parametrize("p", POWERS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_decay_costs_its_direction_and_the_guards_allowance(directions, shape, p, mode):
    """lr = 1e-6: ||W||_F settles the guard; lr = 0.5 / p: p kappa = 1/2 at s_max but at least
    0.5 (sqrt(r) / 2)^(p - 1) >= 1 by ||W||_F (r >= 16), so the guard forms its bound (and passes)."""
    W, direction = directions[shape]
    *batch, m, n = W.shape
    r, matrices = min(m, n), max(1, torch.Size(batch).numel())
    capturable = mode == "capturable"
    for lr, settled in ((1e-6, True), (0.5 / max(p, 1), p < 2)):
        decayed = W.clone()
        flops = _flops(lambda: so.spectral_decay_(decayed, p, lr, 1.0, capturable=capturable,
                                                  stability="clamp" if capturable else mode))
        allowance = 0 if p < 2 or (settled and not capturable) else plan.GUARD_SQUARINGS * 2 * r**3 * matrices
        assert flops <= direction[p] + allowance, (flops / r**3 / matrices, direction[p] / r**3 / matrices)


@pytest.mark.parametrize("shape", [(2048, 512), (512, 512), (512, 2048)])
def test_an_odd_power_decays_on_the_gram_route_at_its_directions_cost(shape):
    """At the issue's shapes, on meta tensors: a CPU's "auto" takes the Gram route for p = 3, and that
    decay costs its direction, 16 r^3 at 4:1 and 4 r^3 on a square (eigh's three products: 24 and 6)."""
    r, side = min(shape), max(shape)
    assert plan.route(shape, torch.float32, "cpu", 3, "fp32").method == "gram"
    direction = plan.cost("spectral_power", shape, p=3)
    assert plan.cost("decay_", shape, p=3) == direction == 2 * (2 * r * r * side)
    assert direction < plan.EIGH_PRODUCTS * 2 * r * r * side


@pytest.mark.parametrize("op, p", [("spectral_power", -0.5), ("spectral_power", 2.5), ("power_update", 0.25)])
@pytest.mark.parametrize("shape", [(48, 16), (2, 16, 40)])
def test_a_floors_matrix_vector_products_are_counted(op, p, shape):
    """A floor's scale comes from the spectral norm estimate (GramPlan.spectral_norm_estimate), whose
    matrix-vector products run outside the primitives: plan.cost counts them, so it is still what
    FlopCounterMode counts of the same call; and a caller's FlopCounterMode around the model counts none of
    the model's own (meta) products."""
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    polar_c = so.coefficients.polar_express_coefficients()
    kernels = dispatch.kernels_for(op, W)
    calls = {
        "spectral_power": lambda: plan.spectral_power(kernels, W, p, polar_c, "fp32", eps=1e-2),
        "power_update": lambda: plan.power_update(kernels, W, p, polar_c, "fp32", 1e-2),
    }
    plan.costs._counted.cache_clear()
    assert _flops(lambda: plan.cost(op, shape, p=p, eps=1e-2)) == 0
    assert plan.cost(op, shape, p=p, eps=1e-2) == _flops(calls[op])
