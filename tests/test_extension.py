"""spectral_ops._C on a machine without a GPU: it imports, reports its build, and validates every
argument before it touches CUDA, so each validation error is testable here.

Without the module these tests skip, unless SPECTRAL_OPS_REQUIRE_CUDA=1 (as in CI, where nvcc
exists) turns the absence into a failure.
"""

import os

import pytest
import torch

from spectral_ops import _extension
from spectral_ops.build_config import ENV_REQUIRE_CUDA, env_flag

ext, unavailable_reason = _extension.load_extension()

# A plausible, well-aligned device address. No test lets a launch happen, so it is never dereferenced.
ADDRESS = 0x7F0000000000
NO_DEVICE = r"spectral_ops\._C: no CUDA device available \(cudaGetDeviceCount: "


@pytest.fixture
def C():
    if ext is None:
        if env_flag(os.environ, ENV_REQUIRE_CUDA):
            pytest.fail(f"{ENV_REQUIRE_CUDA}=1 but spectral_ops._C is unavailable: {unavailable_reason}")
        pytest.skip(f"spectral_ops._C is unavailable: {unavailable_reason}")
    return ext


@pytest.fixture
def no_gpu(C):
    count, _ = C.device_status()
    if count:
        pytest.skip("a CUDA device is visible; these tests cover machines without one")
    return C


def desc(shape, strides=None, dtype=0, device=0, address=ADDRESS):
    if strides is None:
        strides, step = [], 1
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
    return (address, list(shape), list(strides), dtype, device)


def call(C, w, d, *, keep=0.5, step=-0.25, noise=None):
    C.decay_epilogue_(w, d, keep, step, 0, None, None, noise)


def test_compiled_archs_match_the_build_record(C):
    info = _extension.build_info()
    assert info is not None and info["cuda_built"]
    assert C.compiled_archs() == info["archs"]
    assert all(a.startswith(("sm_", "compute_")) for a in info["archs"])


def test_runtime_version_matches_nvcc(C):
    major, minor, _ = _extension.build_info()["nvcc_version"].split(".")
    assert C.cuda_runtime_version() == int(major) * 1000 + int(minor) * 10


def test_device_status_without_gpu(no_gpu):
    count, message = no_gpu.device_status()
    assert count == 0
    assert message.startswith("no CUDA device available (cudaGetDeviceCount: ")


@pytest.mark.parametrize(
    "w, d",
    [
        (desc([3, 4]), desc([3, 4])),
        (desc([4, 3], strides=[1, 4]), desc([4, 3])),  # a transposed view
        (desc([2, 3, 4], strides=[24, 4, 1]), desc([2, 3, 4])),  # rows of a wider matrix
        (desc([2, 1, 4], strides=[4, 99, 1]), desc([2, 1, 4], strides=[4, 7, 1])),  # size-1 dims: any stride
        (desc([3, 4], dtype=1), desc([3, 4], dtype=0)),  # fp16 weights, fp32 update
        (desc([3, 4], dtype=2), desc([3, 4], dtype=2)),
        (desc([0, 4]), desc([0, 4])),
    ],
)
def test_valid_arguments_reach_the_device_check(no_gpu, w, d):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        call(no_gpu, w, d)


INT16 = 4  # the dtype code of a stochastic rounding's random bits


@pytest.mark.parametrize("dtype", [1, 2, 0])  # float16 and bfloat16 round with it; float32 ignores it
def test_stochastic_rounding_reaches_the_device_check(no_gpu, dtype):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        call(no_gpu, desc([2, 8], dtype=dtype), desc([2, 8]), noise=desc([2, 8], dtype=INT16))


@pytest.mark.parametrize(
    "w, noise, error, match",
    [
        (desc([2, 8], dtype=2), desc([2, 8], dtype=2), TypeError, "noise: dtype bfloat16 .* 16 random bits"),
        (desc([2, 8], dtype=2), desc([8, 2], dtype=INT16), ValueError, r"w has shape \[2, 8\] but noise has shape"),
        (desc([2, 8], dtype=2), desc([2, 8], strides=[1, 2], dtype=INT16), ValueError, "noise .*must be contiguous"),
        (desc([2, 8], dtype=INT16), desc([2, 8], dtype=INT16), TypeError, "w: dtype int16 is not supported"),
    ],
)
def test_stochastic_rounding_validation(C, w, noise, error, match):
    with pytest.raises(error, match=match):
        call(C, w, desc([2, 8], dtype=0 if w[3] == INT16 else w[3]), noise=noise)


@pytest.mark.parametrize(
    "w, d, error, match",
    [
        (desc([3, 4]), desc([4, 3]), ValueError, r"shape mismatch: w has shape \[3, 4\] but d has shape \[4, 3\]"),
        (desc([3, 4]), desc([3, 4, 1]), ValueError, "shape mismatch"),
        (desc([3, 4], dtype=7), desc([3, 4]), TypeError, r"w: unknown dtype code 7 \(0=float32"),
        (desc([3, 4]), desc([3, 4], dtype=-1), TypeError, "d: unknown dtype code -1"),
        (
            desc([3, 4], dtype=2),
            desc([3, 4], dtype=1),
            TypeError,
            r"d: dtype float16 must be float32 or w's dtype \(bfloat16\)",
        ),
        (desc([3, 4]), desc([3, 4], dtype=3), TypeError, "d: dtype float64 must be float32"),
        (desc([3, 4], strides=[4]), desc([3, 4]), ValueError, "w: shape .* and strides .* differ in length"),
        (desc([3, -4], strides=[4, 1]), desc([3, 4]), ValueError, "w: negative size"),
        (desc([3, 4], strides=[-4, 1]), desc([3, 4]), ValueError, "negative strides are not supported"),
        (desc([3, 4], strides=[0, 1]), desc([3, 4]), ValueError, "w .*: elements overlap in memory"),
        (desc([3, 4], strides=[2, 1]), desc([3, 4]), ValueError, "elements overlap in memory"),
        (
            desc([3, 4]),
            desc([3, 4], strides=[1, 3]),
            ValueError,
            r"d \(float32, shape \[3, 4\], strides \[1, 3\]\): must be contiguous",
        ),
        (desc([2**40, 2**40]), desc([2**40, 2**40]), ValueError, "overflows int64"),
        (
            desc([4], address=ADDRESS + 2),
            desc([4]),
            ValueError,
            r"w: data pointer 0x7f0000000002 is not aligned .* \(4 bytes for float32\)",
        ),
        (
            desc([4], dtype=1),
            desc([4], dtype=1, address=ADDRESS + 1),
            ValueError,
            r"d: data pointer .* not aligned .*\(2 bytes for float16\)",
        ),
        (desc([4], address=0), desc([4]), ValueError, "w: null data pointer"),
        (desc([4], device=0), desc([4], device=1), ValueError, "device mismatch: w is on cuda:0 but d is on cuda:1"),
        (desc([4], device=-1), desc([4], device=-1), ValueError, r"w: not a CUDA tensor \(device index -1\)"),
        (
            desc([2] * 9, strides=[2**k for k in range(17, -1, -2)]),
            desc([2] * 9),
            ValueError,
            "at most 8 are supported",
        ),
    ],
)
def test_validation_comes_before_the_device(C, w, d, error, match):
    with pytest.raises(error, match=match):
        call(C, w, d)


def test_bad_python_argument_types_are_type_errors(C):
    with pytest.raises(TypeError):
        C.decay_epilogue_(desc([4]), desc([4]), "0.5", 1.0, False, 0, 0, 0)
    with pytest.raises(TypeError):
        C.decay_epilogue_(desc([4]), desc([4]), 0.5, 1.0, False, -1, 0, 0)  # seeds are uint64


# --- the Python wrapper -----------------------------------------------------------------------


def test_dtype_codes():
    assert [_extension.dtype_code(t) for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)] == [
        0,
        1,
        2,
        3,
    ]
    with pytest.raises(TypeError, match="not torch.int32"):
        _extension.dtype_code(torch.int32)


def test_tensor_descriptor_of_a_view():
    base = torch.zeros(6, 8, dtype=torch.bfloat16)
    view = base[1:, 2:].t()
    assert _extension.tensor_descriptor(view) == (view.data_ptr(), [6, 5], [1, 8], 2, -1)
    assert view.data_ptr() == base.data_ptr() + (8 + 2) * 2


def test_tensor_descriptor_rejects_sparse():
    with pytest.raises(TypeError, match="strided"):
        _extension.tensor_descriptor(torch.eye(3).to_sparse())


def test_wrapper_rejects_cpu_tensors(C):
    with pytest.raises(ValueError, match="w: not a CUDA tensor"):
        _extension.decay_epilogue_(torch.zeros(4), torch.zeros(4), 0.5, 1.0)


def test_wrapper_rejects_tensor_scalars(C):
    with pytest.raises(TypeError, match="keep must be a Python number"):
        _extension.decay_epilogue_(torch.zeros(4), torch.zeros(4), torch.tensor(0.5), 1.0)


def test_wrapper_refuses_to_bypass_autograd(C):
    w = torch.zeros(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        _extension.decay_epilogue_(w, torch.zeros(4), 0.5, 1.0)


def test_a_build_record_older_than_the_module_beside_it_is_ignored(tmp_path):
    """A CPU-only editable install leaves ``cuda_built: false``; a ``_C`` built later in the tree (by
    bench/gpu_check.py on a bare GPU machine) is another build, which that record does not describe."""
    import importlib.machinery
    import json

    record = tmp_path / _extension.BUILD_INFO_FILENAME
    record.write_text(json.dumps({"cuda_built": False, "reason": "no nvcc"}))
    assert _extension.build_info(tmp_path) == {"cuda_built": False, "reason": "no nvcc"}
    module = tmp_path / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    module.write_bytes(b"")
    recorded = record.stat().st_mtime_ns
    os.utime(module, ns=(recorded, recorded))  # unpacked together: the record still describes it
    assert _extension.build_info(tmp_path) is not None
    later = recorded + 60 * 10**9
    os.utime(module, ns=(later, later))  # built a minute after the record was written
    assert _extension.build_info(tmp_path) is None
