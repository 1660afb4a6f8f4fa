"""The torch provider hands transposed operands to BLAS as they are (issue [portable]).

Its products copy nothing but what a BLAS epilogue needs: ``addmm``/``baddbmm`` accumulate into their
output, so the added term ``Y`` is copied there first, as in torch.optim.Muon's own ``addmm``. Counted
as the bytes ``aten::copy_`` writes under torch.profiler, which do not depend on the machine.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from spectral_ops.backends.torch_backend import TorchBackend

# torch.profiler's names of the dtypes a copy can write.
ITEMSIZES = {"double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2}


def copied_bytes(run) -> int:
    """Bytes written by ``aten::copy_`` (``contiguous()``, ``clone()``, casts, an epilogue's copy of its
    added term) while ``run`` runs, profiled after one unprofiled call (lazy initialisation and
    first-call work are not what a call copies). Copies of one number per matrix (0-d or
    ``(..., 1, 1)``: Python numbers made tensors, norms, exponents) move no data and are left out."""
    run()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return sum(math.prod(event.input_shapes[0]) * ITEMSIZES[event.input_dtypes[0]]
               for event in prof.events() if event.name == "aten::copy_" and math.prod(event.input_shapes[0][-2:]) > 1)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


R, N = 48, 80


def wide_operands(dtype):
    """``X`` (``R x N``) in each layout the plan hands the provider, by name: row-major; the wide view
    of a tall weight (column-major); a batch of one each way (the tall one from an elementwise op on
    the view, whose batch stride is then not ``R N``, which oneDNN wants of a column-major batch); a
    batch of three each way."""
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return {
        "row-major": draw(R, N),
        "tall weight's view": draw(N, R).mT,
        "batch of one": draw(1, R, N),
        "batch of one, tall": draw(1, N, R).mT * 0.5,
        "batch of three": draw(3, R, N),
        "batch of three, tall": draw(3, N, R).mT,
    }


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(wide_operands(torch.float32)))
def test_products_copy_no_operand(dtype, layout):
    """The Gram ``X X^T``, ``A A`` and a product without an added term copy nothing."""
    backend, X = TorchBackend(), wide_operands(dtype)[layout]
    A = backend.symmetric(X, X.mT)
    assert copied_bytes(lambda: backend.symmetric(X, X.mT)) == 0
    assert copied_bytes(lambda: backend.symmetric(A, A)) == 0
    assert copied_bytes(lambda: backend.product(A, X)) == 0
    assert copied_bytes(lambda: backend.product(A, X, alpha=0.5)) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(wide_operands(torch.float32)))
def test_epilogues_copy_only_their_added_term(dtype, layout):
    """``b A + c A^2`` copies ``A`` once, ``a X + P X`` copies ``X`` once, as torch.optim.Muon's ``addmm``
    calls do, whatever the layout of ``X``."""
    backend, X = TorchBackend(), wide_operands(dtype)[layout]
    A = backend.symmetric(X, X.mT)
    assert copied_bytes(lambda: backend.poly_step(A, -4.775, 2.0315)) == nbytes(A)
    assert copied_bytes(lambda: backend.product(A, X, Y=X, beta=3.4445)) == nbytes(X)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_and_keeps_the_edges(dtype):
    from spectral_ops.backends.torch_backend import round_stochastic

    # Values across the range, subnormals included, each drawn 20,000 times: every draw is one of the
    # two neighbours, and their mean is the value within 5 sigma (sigma <= gap / (2 sqrt(N))).
    tiny = torch.finfo(dtype).smallest_normal
    values = torch.tensor([1 + 1 / 3, -(1 + 1 / 3), 3e-3, -7.1, 0.3 * tiny, 1e4 + 0.37]).double()
    draws = 20_000
    noise = torch.randint(-2**15, 2**15, (draws, len(values)), dtype=torch.int16,
                          generator=torch.Generator().manual_seed(0))
    rounded = round_stochastic(values.float().expand(draws, -1).contiguous(), dtype, noise).double()
    low = values.float().to(dtype).double()
    gap = (low - values).abs() + (rounded - values).abs().amax(0)
    assert ((rounded - values).abs() <= gap).all()
    assert ((rounded.mean(0) - values.float().double()).abs() <= 5 * gap / (2 * draws**0.5)).all()
    # Exact values, zeros, Inf and NaN pass unchanged. Beyond fp16's largest value round to nearest
    # decides (fp32 to bf16 keeps the exponent range: only values within a unit of the top can overflow).
    edges = torch.tensor([0.0, -0.0, 1.0, float("inf"), -float("inf"), float("nan")])
    same = round_stochastic(edges, dtype, torch.full((6,), -1, dtype=torch.int16))
    assert torch.equal(same[:5], edges[:5].to(dtype)) and same[5].isnan()
    if dtype == torch.float16:
        huge = torch.tensor([7e4, -1e6])
        assert torch.equal(round_stochastic(huge, dtype, torch.zeros(2, dtype=torch.int16)), huge.to(dtype))
