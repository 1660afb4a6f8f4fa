"""The Triton backend end to end: the public API forced to triton, against the FP64 SVD oracles.

The tests taking ``forced`` run twice, once per path: ``small`` (the default routing; these shapes
have a small side <= 128, so the one-program-per-matrix chain runs) and ``composed`` (the same backend
without its small chain, so the plan composes every symmetric, product, sign and decay kernel).
Tolerances are those of tests/test_ops.py for float32; float16 adds its own input/output rounding (2^-11).

The dispatch self-check of every primitive (both paths, both dtypes) runs with the interpreter's int32
overflow checks and the kernels' assertions (``spectral_ops.triton_kernels.interpreter``).
"""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import warnings

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch, reference, selfcheck
from spectral_ops.backends.base import PRIMITIVES
from spectral_ops.backends.triton_backend import TritonBackend, modules
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.plan import OPS
from spectral_ops.triton_kernels import interpreter

TOLERANCE = {torch.float32: 5e-5, torch.float16: 5e-3}
SHAPES = [(40, 24), (20, 36), (3, 33, 20), (2, 2, 17, 30)]  # tall, wide, batched, odd


class ComposedTriton(TritonBackend):
    """The Triton backend without its small chain."""

    def supports(self, primitive, *args, **kwargs):
        return primitive != "small_chain" and super().supports(primitive, *args, **kwargs)


BACKENDS = {"small": TritonBackend(), "composed": ComposedTriton()}


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Replaces conftest's per-test reset for this module: under the interpreter each first-use
    self-check costs about a second, so the results are kept while one backend is registered."""
    monkeypatch.delenv("SPECTRAL_OPS_BACKEND", raising=False)
    yield


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def path(request):
    """Module-scoped, so pytest runs all tests of one path together (one registration each)."""
    return request.param


@pytest.fixture
def forced(path):
    if dispatch.get_backend("triton") is not BACKENDS[path]:
        dispatch.register_backend(BACKENDS[path])
    with so.use_backend("triton"):
        yield path


def sample(shape, dtype=torch.float32, condition=30.0, seed=0):
    return matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), condition), dtype, seed=seed)


def ran_on_triton(op):
    return so.last_backend(op) == "triton"


@pytest.mark.parametrize("dtype", triton_env.DTYPES)
def test_the_dispatch_self_check_passes_for_every_primitive(forced, dtype):
    # First in the module, so the other tests of each path reuse the cached check results. Every
    # primitive with the interpreter's int32 overflow checks on (the module docstring).
    backend = BACKENDS[forced]
    for primitive in PRIMITIVES:
        if backend.supports(primitive, torch.device("cpu"), dtype, (2, 24, 40), steps=8):
            with interpreter.overflow_checks():
                error = selfcheck.self_check_error(backend, primitive, dtype, "cpu")
            assert error <= selfcheck.SELF_CHECK_TOLERANCE[dtype], primitive
    W = sample((20, 12), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed check warns before falling back
        for op in OPS:
            assert so.backend_for(op, W) == "triton", op


@pytest.mark.parametrize("dtype", triton_env.DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_spectral_power_against_the_svd(forced, shape, dtype):
    W = sample(shape, dtype)
    for p in range(5):
        result = so.spectral_power(W, p, method="gram", matrix_view="batch")
        assert ran_on_triton("spectral_power") or p == 1  # S_1(W) = W runs no primitive at all
        assert result.dtype == dtype and result.shape == W.shape
        assert relative_error(result, reference.spectral_power_svd(W, p)) < TOLERANCE[dtype], p


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gram_space_powers_against_the_svd(forced, shape):
    """The restarted Gram-space iteration is the plan's, over Triton's symmetric, poly_step and product
    kernels (fp32: in fp16 it is a few times less accurate than the rectangle, so nothing routes it
    there). Tolerance as tests/test_plan.py's for fp32 Gram space."""
    W = sample(shape)
    for p in (0, 2, 4):
        result = so.spectral_power(W, p, iteration="gram_space", precision="fp32", matrix_view="batch")
        assert ran_on_triton("spectral_power")
        assert relative_error(result, reference.spectral_power_svd(W, p)) < 2e-5, p


@pytest.mark.parametrize("dtype", triton_env.DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_spectral_decay_against_the_svd(forced, shape, dtype):
    W = sample(shape, dtype, seed=1)
    for p, p0_mode in [(0, "explicit"), (0, "prox"), (2, "explicit"), (3, "explicit")]:
        decayed = W.clone()
        assert so.spectral_decay_(decayed, p, 0.1, 0.2, ordinary_weight_decay=0.05, p0_mode=p0_mode) is decayed
        assert ran_on_triton("decay_")
        expected = reference.spectral_decay_svd(W, p, 0.1, 0.2, 0.05, p0_mode=p0_mode)
        assert relative_error(decayed, expected) < TOLERANCE[dtype], (p, p0_mode)


def band_test_matrix():
    # Singular values 0.2..1 with a gap around tau = 0.5, so 8 sign steps resolve the bands.
    spectrum = torch.cat([torch.linspace(1.0, 0.7, 8), torch.linspace(0.35, 0.2, 8)])
    return matrix_with_spectrum((2, 30, 16), spectrum, torch.float32, seed=2)


@pytest.mark.parametrize("mode", ["top", "bot", "top_only", "bot_only", "two_band"])
def test_band_decay_and_direction_against_the_svd(forced, mode):
    # two_band takes S_1 below tau here: its p_bot = 0 lifts every non-zero mode, whose zero cutoff's sign
    # runs in float64, which a forced Triton refuses (the test below).
    p_bot = 1 if mode == "two_band" else 0
    W = band_test_matrix()
    D = so.band_direction(W, 0.5, 2, mode, p_bot=p_bot, lambda_top=0.5, lambda_bot=2.0)
    assert ran_on_triton("band_direction")
    expected = reference.band_direction_svd(W, 0.5, 2, mode, p_bot=p_bot, lambda_top=0.5, lambda_bot=2.0)
    assert relative_error(D, expected) < 5e-5
    decayed = W.clone()
    so.spectral_decay_(decayed, 2, 0.1, 0.3, band=so.Band(0.5, mode, p_bot=p_bot, spectral_weight_decay_bot=0.2))
    direction = reference.band_direction_svd(W, 0.5, 2, mode, p_bot=p_bot, lambda_top=0.3, lambda_bot=0.2)
    scale = 1.0 if mode == "two_band" else 0.3
    assert relative_error(decayed, W.double() - 0.1 * scale * direction) < 5e-6


def test_a_lift_to_the_zero_cutoff_is_refused_by_a_forced_triton_before_any_write(forced):
    """A lift of every non-zero mode (p = 0 below tau) resolves fp32's zero cutoff with a float64 sign
    iteration on the r x r Gram (plan.thresholds), which no GPU kernel runs: unforced it runs on torch;
    a forced backend that cannot run it says so, and writes nothing."""
    W = band_test_matrix()
    with pytest.raises(so.BackendUnavailableError, match="no sign_step for torch.float64"):
        so.band_direction(W, 0.5, 2, "two_band", p_bot=0)
    decayed = W.clone()
    with pytest.raises(so.BackendUnavailableError, match="no sign_step for torch.float64"):
        so.spectral_decay_(decayed, 2, 0.1, 0.3, band=so.Band(0.5, "two_band", p_bot=0))
    assert torch.equal(decayed, W)


def test_polar_msign_projectors_and_svt_against_the_oracles(forced):
    spectrum = torch.cat([torch.linspace(1.0, 0.7, 10), torch.linspace(0.35, 0.2, 10)])
    W = matrix_with_spectrum((2, 20, 44), spectrum, torch.float32, seed=3)
    assert relative_error(so.polar(W), reference.polar_svd(W)) < 5e-5
    P_top, P_bot = so.band_projectors(W, 0.5)
    expected_top, expected_bot = reference.band_projectors_svd(W, 0.5)
    assert relative_error(P_top, expected_top) < 5e-5 and relative_error(P_bot, expected_bot) < 5e-5
    assert relative_error(so.svt(W, 0.5), reference.svt_svd(W, 0.5)) < 5e-5
    A = W @ W.mT - 0.25 * torch.eye(20)
    assert relative_error(so.msign(A, method="polar_express"), reference.msign_eigh(A)) < 5e-5
    assert all(so.last_backend(op) == "triton" for op in ("polar", "band_projectors", "svt", "msign"))


def test_lists_views_and_per_matrix_clamped_scales(forced):
    heads = [sample((12, 40), seed=i) for i in range(3)]
    expected = [h.clone() for h in heads]
    with so.use_backend("torch"):
        so.spectral_decay_(expected, 2, 0.5, 4.0, stability="clamp")  # clamps each matrix differently
    so.spectral_decay_(heads, 2, 0.5, 4.0, stability="clamp")
    assert ran_on_triton("decay_")
    for head, reference_head in zip(heads, expected):
        assert relative_error(head, reference_head) < 5e-6
    base = sample((30, 50), seed=4)
    view = base.mT  # a transposed, non-contiguous weight is decayed in place
    decayed = reference.spectral_decay_svd(view, 3, 0.1, 0.1)
    so.spectral_decay_(view, 3, 0.1, 0.1)
    assert relative_error(base.mT, decayed) < 5e-5


@pytest.mark.parametrize("dtype", triton_env.DTYPES)
def test_p1_decay_is_bitwise_the_ordinary_multiply(forced, dtype):
    W = sample((2, 20, 36), dtype, seed=5)
    expected = W.clone().mul_(1 - 1e-3 * 0.1)
    so.spectral_decay_(W, 1, 1e-3, 0.1)
    assert ran_on_triton("decay_") and torch.equal(W, expected)


def test_the_environment_variable_forces_triton_too(monkeypatch):
    monkeypatch.setenv("SPECTRAL_OPS_BACKEND", "triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        so.polar(sample((24, 16)))
    assert so.last_backend("polar") == "triton"


def test_unsupported_dtypes_are_refused_with_the_reason_before_any_write():
    dispatch.reset()
    with so.use_backend("triton"):
        with pytest.raises(so.BackendUnavailableError, match="forced for polar, but .* no symmetric for torch.float64"):
            so.polar(sample((20, 12)).double())
        # The interpreter has no bfloat16 arithmetic: a bfloat16 weight's default bf16 operands are
        # refused; at fp32 precision the iteration runs, and only the write into the weight needs
        # bfloat16, which is refused before anything is written.
        W = sample((20, 12)).bfloat16()
        with pytest.raises(so.BackendUnavailableError, match="no symmetric for torch.bfloat16"):
            so.spectral_power(W, 2, method="gram")
        result = so.spectral_power(W, 2, method="gram", precision="fp32")
        assert relative_error(result, reference.spectral_power_svd(W, 2)) < 1e-2
        assert so.last_backend("spectral_power") == "triton"
        before = W.clone()
        with pytest.raises(so.BackendUnavailableError, match="no decay_epilogue_ for torch.bfloat16"):
            so.spectral_decay_(W, 2, 0.1, 0.1, precision="fp32")
        assert torch.equal(W, before)


def test_unforced_cpu_calls_stay_on_torch_under_the_interpreter():
    dispatch.reset()
    assert so.backend_for("polar", sample((20, 12))) == "torch"
    assert "only when the triton backend is forced" in dict(so.backend_status(torch.device("cpu")))["triton"]


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_a_wrong_small_chain_is_refused_before_it_runs_and_the_plan_composes(monkeypatch):
    dispatch.reset()
    real = modules.small.small_spectral
    monkeypatch.setattr(modules.small, "small_spectral", lambda *args, **kwargs: real(*args, **kwargs).mul_(1.5))
    W = sample((2, 30, 16))
    with so.use_backend("triton"), pytest.warns(RuntimeWarning, match="triton backend's small_chain disagrees"):
        result = so.spectral_power(W, 2, method="gram")
    assert so.last_backend("spectral_power") == "triton"
    assert relative_error(result, reference.spectral_power_svd(W, 2)) < TOLERANCE[torch.float32]
    dispatch.reset()


def test_int64_in_matrix_offsets_are_chosen_by_extent_and_give_identical_results(monkeypatch):
    from spectral_ops.triton_kernels.common import wide_offsets

    assert not wide_offsets(torch.empty_strided((4096, 16384), (16384, 1), device="meta"))
    assert wide_offsets(torch.empty_strided((2, 3), (2**31, 1), device="meta"))
    W = sample((2, 40, 24), seed=6)

    def powers():
        results = []
        for backend in BACKENDS.values():
            dispatch.register_backend(backend)
            with so.use_backend("triton"):
                results.append(so.spectral_power(W, 2, method="gram"))
        return results

    expected = powers()
    for module in (modules.syrk, modules.update, modules.small):
        monkeypatch.setattr(module, "wide_offsets", lambda *tensors: True)
    for got, want in zip(powers(), expected):
        assert torch.equal(got, want)


# ----- the kernels as torch.library custom ops -------------------------------------------------------


def custom_op_samples():
    """``(op, args)`` for every Triton custom op, on small CPU inputs the interpreter runs."""
    X, W = sample((2, 12, 20)), sample((2, 20, 12), seed=1)
    G = X @ X.mT
    flat = [v for triple in so.polar_express_coefficients() for v in triple]
    scales = torch.tensor([0.9, 1.1])
    ops = torch.ops.spectral_ops
    return [
        (ops.triton_symmetric, (X, X.mT, "ieee")),
        (ops.triton_product, (G, X, X, 1.0, 2.0, "ieee")),
        (ops.triton_product, (G, X, None, -0.5, 0.0, "ieee")),
        (ops.triton_poly_step, (G, 0.5, -0.25, "ieee")),
        (ops.triton_sign_step, (G / torch.linalg.matrix_norm(G)[..., None, None], 3.0, -3.2, 1.2, "ieee")),
        (ops.triton_small_chain, (X, 2, flat, False, "ieee")),
        (ops.triton_decay_epilogue, (W.mT, torch.randn(2, 12, 20), 1.0, scales, -0.1, None, "ieee", None)),
        (ops.triton_decay_epilogue, (W.mT.half(), torch.randn(2, 12, 20), 1.0, scales, -0.1, None, "ieee",
                                     torch.randint(-2**15, 2**15, (2, 12, 20), dtype=torch.int16))),
    ]


@pytest.mark.parametrize("index", range(7))
def test_every_triton_custom_op_passes_opcheck(index):
    # Schema, declared mutations, the fake (meta) implementation and its agreement with the real one.
    op, args = custom_op_samples()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_a_custom_op_compiles_without_a_graph_break_and_writes_through_torch():
    X, W = sample((2, 12, 20)), sample((2, 20, 12), seed=1)

    def decay_step(W, X):
        G = torch.ops.spectral_ops.triton_symmetric(X, X.mT, "ieee")
        D = torch.ops.spectral_ops.triton_product(G, X, None, 1.0, 0.0, "ieee")
        torch.ops.spectral_ops.triton_decay_epilogue(W.mT, D, 0.9, None, -0.1, None, "ieee", None)
        return W

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    expected = W.mT.mul(0.9).sub(0.1 * (X @ X.mT @ X)).mT
    compiled = torch.compile(decay_step, backend="aot_eager", fullgraph=True)
    version = W._version
    assert compiled(W, X) is W
    assert not torch._dynamo.utils.counters["graph_break"]
    assert relative_error(W, expected) < 1e-6
    assert W._version > version  # the mutation was declared, so torch bumped the version counter itself


@pytest.mark.parametrize("name", ["adamw", "muon-heads"])
def test_a_capturable_step_on_the_triton_backend_reads_nothing_back(name):
    # The Triton primitives take their scales as device tensors (number_and_per_matrix): nothing in
    # the backend reads a value back either (the detector: tests/test_optim_capturable.py).
    from test_optim_capturable import FAMILY, OPTIONS, gradients, host_reads_forbidden

    from optim_models import tiny_model

    with so.use_backend("triton"):
        model = tiny_model()
        # The interpreter runs fp32 and fp16 (Muon's default orthogonalisation is bf16).
        precision = {"precision": "fp32"} if name.startswith("muon") else {}
        optimizer = FAMILY[name](model, lr=torch.tensor(1e-2), **OPTIONS["band"], **precision)
        gradients(model, 0)
        optimizer.step()
        gradients(model, 1)
        with host_reads_forbidden():
            optimizer.step()
    assert so.last_backend("decay_") == "triton"
