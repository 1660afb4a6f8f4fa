"""One N-D rule for every entry point (spectral_ops.matrix_views, SPEC 1.8): a tensor of four or more
dimensions is read as the caller says, or refused; a 3-D tensor is a stack unsaid (torch.linalg's
convention); a 1 x 1 convolution is its (out, in) matrix.

Each reading is the op applied to the matrices it names, bit for bit (the same plan on the same values;
the 2-D ops are held to the FP64 SVD in test_ops.py and test_thresholds.py), and the issue's
reproductions are checked against the FP64 SVD of the (out, in * kh * kw) matrix.
"""

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.matrix_views import op_view, resolve_matrix_view, unambiguous_view

from op_calls import OPS, SAME_SHAPE

FILTER = (16, 8, 3, 3)  # (out, in, kh, kw)


def filter_weights(shape=FILTER, dtype=torch.float32, seed=0):
    """A tensor of ``shape`` whose flatten reading has condition 10."""
    rows, columns = shape[0], torch.Size(shape[1:]).numel()
    return matrix_with_spectrum((rows, columns), log_spaced_spectrum(min(rows, columns), 10.0), dtype,
                                seed=seed).reshape(shape)


def test_the_rule():
    # unambiguous_view's own cases: tests/test_optim_decay.py. An op adds the stack reading of 3-D.
    assert op_view((4, 6)) == "flatten"  # a matrix: either reading is itself
    assert op_view((4, 6, 1, 1)) == op_view((4, 6, 1, 1, 1)) == "flatten"
    assert unambiguous_view((4, 6, 3)) is None and op_view((4, 6, 3)) == op_view((4, 1, 1)) == "batch"
    assert unambiguous_view(FILTER) is op_view(FILTER) is None
    assert op_view((4, 6, 3, 1)) is None  # its batch matrices are 3 x 1, not 1 x 1
    assert resolve_matrix_view(FILTER, "flatten") == "flatten"
    with pytest.raises(ValueError, match="matrix_view must be one of"):
        resolve_matrix_view(FILTER, "kernels")


@pytest.mark.parametrize("op", OPS)
def test_every_op_refuses_an_unsaid_filter(op):
    W = filter_weights()
    original = W.clone()
    with pytest.raises(ValueError, match=r"\(16, 8, 3, 3\): say which matrices it holds with matrix_view="):
        OPS[op](W)
    assert torch.equal(W, original)


@pytest.mark.parametrize("op", OPS)
def test_every_op_reads_a_flattened_filter_as_its_matrix(op):
    W = filter_weights()
    result = OPS[op](W, matrix_view="flatten")
    matrix = OPS[op](W.reshape(16, 72))
    assert torch.equal(result, matrix.reshape(FILTER) if op in SAME_SHAPE else matrix)
    # A channels-last filter's matrix is no view of it: the op reads it through a contiguous copy.
    assert torch.equal(OPS[op](W.to(memory_format=torch.channels_last), matrix_view="flatten"), result)


@pytest.mark.parametrize("op", OPS)
def test_every_op_reads_a_stack_matrix_by_matrix(op):
    W = filter_weights((3, 24, 16))
    # A batched product may sum in another order than a single one (BLAS's batched kernels): each of the
    # ~30 products of an op's chain (inner sizes <= 24) may then differ by ~sqrt(24) fp32 roundoffs,
    # ~3e-5 in all; 1e-4 allows for that, and a wrong reading is off by O(1).
    stacked = OPS[op](W)  # 3-D: a stack unsaid
    assert torch.equal(OPS[op](W, matrix_view="batch"), stacked)
    for k in range(3):
        assert relative_error(stacked[k], OPS[op](W[k].contiguous())) < 1e-4
    four = filter_weights((2, 3, 24, 16))
    assert relative_error(OPS[op](four, matrix_view="batch")[1, 2], OPS[op](four[1, 2].contiguous())) < 1e-4


@pytest.mark.parametrize("op", OPS)
def test_a_one_by_one_convolution_is_its_matrix(op):
    W = filter_weights((16, 8, 1, 1))
    result = OPS[op](W)
    matrix = OPS[op](W.reshape(16, 8))
    assert torch.equal(result, matrix.reshape(W.shape) if op in SAME_SHAPE else matrix)


def test_the_issues_readings_against_the_svd():
    # Issue #43: the decay and the update of a conv filter were taken per 3 x 3 kernel position, 0.74 and
    # 0.46 off the (16, 72) matrix's. fp32 against the FP64 SVD: the decay's step within 5e-5 (as
    # test_decay.py's fp32 tolerance), the update within the real power's Gram-route accuracy in fp32
    # (docs/real-powers.md: below 1e-3 at this condition number).
    C = filter_weights(dtype=torch.float64).float()
    expected = reference.spectral_decay_svd(C.reshape(16, 72), 2, 0.02, 0.5).reshape(FILTER)
    decayed = so.spectral_decay_(C.clone(), 2, 0.02, 0.5, matrix_view="flatten")
    assert relative_error(decayed - C, expected - C) < 5e-5
    update = so.power_update(C, 0.25, matrix_view="flatten", precision="fp32")
    oracle = reference.power_update_svd(C.reshape(16, 72), 0.25, 1e-2).reshape(FILTER)
    assert relative_error(update, oracle) < 1e-3
    assert relative_error(so.power_update(C, 0.25, matrix_view="batch"), oracle) > 0.1
