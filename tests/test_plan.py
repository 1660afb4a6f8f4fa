"""spectral_ops.plan: the one definition of precision=None, and the operand dtype each precision implies."""

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch, plan
from spectral_ops.linalg import compute_dtype, scaled_


@pytest.fixture
def float32_matmul_precision():
    """Set torch's float32 matmul precision for one test, and restore it afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype, expected", [
    (torch.float64, "fp64"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"),
])
def test_none_follows_the_weight_dtype_whatever_torch_says(float32_matmul_precision, dtype, expected):
    for setting in ("highest", "high", "medium"):
        float32_matmul_precision(setting)
        assert plan.resolve_precision(None, dtype) == expected


@pytest.mark.parametrize("setting, expected", [("highest", "fp32"), ("high", "tf32"), ("medium", "bf16")])
def test_none_follows_torch_float32_matmul_precision_for_float32(float32_matmul_precision, setting, expected):
    float32_matmul_precision(setting)
    assert plan.resolve_precision(None, torch.float32) == expected


def test_an_explicit_precision_wins():
    for precision in plan.PRECISIONS:
        assert plan.resolve_precision(precision, torch.float32) == precision


def test_medium_runs_a_float32_weight_in_bf16(float32_matmul_precision):
    W = torch.randn(24, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    float32_matmul_precision("medium")
    medium = so.spectral_power(W, 2, method="gram")
    float32_matmul_precision("highest")
    assert torch.equal(medium, so.spectral_power(W, 2, method="gram", precision="bf16"))
    assert not torch.equal(medium, so.spectral_power(W, 2, method="gram"))


def test_the_compute_dtype_is_fp64_only_for_fp64():
    assert compute_dtype(torch.bfloat16, "bf16") == torch.float32
    assert compute_dtype(torch.float32, "fp64") == torch.float64
    assert compute_dtype(torch.float64, "bf16") == torch.float64
    assert compute_dtype(torch.float16) == torch.float32


def test_an_unknown_precision_is_refused_before_anything_is_written():
    W = torch.randn(8, 6)
    before = W.clone()
    with pytest.raises(ValueError,
                       match=r"precision must be one of \[.bf16., .fp16., .fp32., .fp64., .tf32.\], got .int8."):
        so.spectral_decay_(W, 2, 0.1, 0.1, precision="int8")
    assert torch.equal(W, before)


# ----- Gram-space iteration (even p)

from spectral_ops import reference  # noqa: E402
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error  # noqa: E402

# The restarted Gram-space iteration against the FP64 SVD. In fp32 it keeps the rounding of each Gram
# it forms (the rectangle's iteration contracts its own away), so its error grows with kappa and with
# the small side r, not with the long side: at kappa 1e3, 2e-6 at r = 24, 5e-6 at r = 64, 1.5e-5 at
# r = 512 and r = 1024 (N from 2048 to 8192), against the rectangle's 1-2e-6. At these shapes (r <= 40)
# it is at most 4.5e-6 with MKL's AVX-512 kernels and 5.0e-6 with its AVX2 ones
# (MKL_ENABLE_INSTRUCTIONS=AVX2), so the package's fp32 bound of 2e-5 leaves 4x for other summation
# orders. In fp64 the error is the iteration's own and the rectangle's alike: modes below
# Polar Express's design bound (1e-3 ||W||_F) are not fully converged (1.2e-11 on the square 40x40 at
# p = 2, kappa = 1e3; up to 1e-8 at kappa = 1e6), so fp64 is held to the rectangle's error (1.5x, plus
# 1e-13 for the roundings where that error is tiny).
FP32_GRAM_SPACE_TOLERANCE = 2e-5
SHAPES = [(96, 24), (24, 96), (40, 40), (3, 64, 16), (17, 5)]
SHAPE_IDS = ["tall", "wide", "square", "batched", "odd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [2, 4, 6])
@pytest.mark.parametrize("kappa", [1e3, 1e6])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_gram_space_powers_match_the_svd(shape, kappa, p, dtype):
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), kappa), dtype, seed=p)
    expected = reference.spectral_power_svd(W.double(), p)
    error = relative_error(so.spectral_power(W, p, iteration="gram_space"), expected)
    if dtype == torch.float32:
        assert error < FP32_GRAM_SPACE_TOLERANCE
    else:
        assert error <= 1.5 * relative_error(so.spectral_power(W, p, method="gram", iteration="rectangle"),
                                             expected) + 1e-13


@pytest.mark.parametrize("kappa", [10.0, 1e3])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_the_gram_space_polar_factor_is_as_accurate_as_the_rectangles(shape, kappa):
    """p = 0 needs every mode, so the restarts matter most here: without them G^(-1/2) W lost 1.5e-3 at
    kappa = 1e3 (the rectangle: 6e-5). Now the two agree to fp32 rounding: within 1.5x of the
    rectangle's error (the design bound's 6e-5 at kappa = 1e3 on both) plus 2e-6 (a few fp32 roundings)."""
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), kappa), torch.float32, seed=1)
    expected = reference.spectral_power_svd(W.double(), 0)
    gram_space, rectangle = (relative_error(so.spectral_power(W, 0, iteration=iteration, precision="fp32"), expected)
                             for iteration in ("gram_space", "rectangle"))
    assert gram_space <= 1.5 * rectangle + 2e-6


def test_below_the_design_bound_neither_polar_factor_is_accurate():
    """The documented limit: at kappa = 1e6 half the modes are below Polar Express's design bound, and
    both iterations leave them partly lifted (errors 0.35-0.59). Gram space is then the worse (on
    40x40: 0.54 against 0.35), since s^2 < fp32's rounding of G drowns the smallest modes; neither is
    usable there, which is what method="svd" (in fp64: fp32 LAPACK is no better at 1e-6) is for."""
    W = matrix_with_spectrum((40, 40), log_spaced_spectrum(40, 1e6), torch.float32, seed=1)
    expected = reference.spectral_power_svd(W.double(), 0)
    errors = [relative_error(so.spectral_power(W, 0, iteration=iteration, precision="fp32"), expected)
              for iteration in ("gram_space", "rectangle")]
    assert min(errors) > 0.1
    assert relative_error(so.spectral_power(W, 0, method="svd", precision="fp64"), expected) < 1e-6


def test_gram_space_decay_matches_the_svd():
    W = matrix_with_spectrum((96, 24), log_spaced_spectrum(24, 1e3), torch.float32)
    expected = reference.spectral_decay_svd(W.double(), 2, 0.05, 0.2)
    so.spectral_decay_(W, 2, 0.05, 0.2, iteration="gram_space")
    assert relative_error(W, expected) < FP32_GRAM_SPACE_TOLERANCE


def test_restarts_split_the_steps_into_short_blocks_the_shortest_first():
    assert plan.restart_blocks(8) == [2, 3, 3]
    assert plan.restart_blocks(3) == [3]
    assert plan.restart_blocks(4) == [2, 2]
    assert plan.restart_blocks(10) == [2, 2, 3, 3]
    assert all(sum(plan.restart_blocks(n)) == n and max(plan.restart_blocks(n)) <= plan.GRAM_SPACE_BLOCK
               for n in range(1, 30))


def test_without_restarts_gram_space_loses_accuracy():
    """The restarts are what make Gram space accurate: with one block of 8 steps the same iteration is
    many times less accurate at kappa = 1e6 (measured 6.5e-5 against 3.4e-6 for S_2 on 256x64)."""
    W = matrix_with_spectrum((256, 64), log_spaced_spectrum(64, 1e6), torch.float32, seed=1)
    expected = reference.spectral_power_svd(W.double(), 2).mT
    coefficients = so.coefficients.polar_express_coefficients()

    def error(restart_every):
        gram_plan = plan.GramPlan(W, dispatch.kernels_for("spectral_power", W), "fp32", restart_every)
        return relative_error(scaled_(*gram_plan.scaled_power(2, coefficients, "gram_space")), expected)

    assert error(plan.GRAM_SPACE_BLOCK) < FP32_GRAM_SPACE_TOLERANCE < error(8)


# torch counts every product in full, for r = 64 on 4:1 (N = 4r): the Gram 2 r^2 N = 8 r^3; the blocks
# of 2, 3 and 3 steps, 5 + 9 + 9 r x r products (per step M^2, and Z Y, T Z but in a block's first
# step, Y T but in its last) = 46 r^3; two restarts, Z X and a Gram each, 32 r^3; then Z X (8 r^3) for
# p = 0, or M Z and (M Z) X (2 + 8 r^3) for p = 2. The rectangle: 152 r^3 and 144 r^3.
@pytest.mark.parametrize("p, gram_space_r3, rectangle_r3", [(2, 96, 152), (0, 94, 144)])
def test_gram_space_flops_as_torch_counts_them(p, gram_space_r3, rectangle_r3):
    # Imported here: it imports triton, which must not happen before the Triton tests set the
    # interpreter up (tests/triton_env.py), and pytest collects this module first.
    from torch.utils.flop_counter import FlopCounterMode

    r = 64
    W = torch.randn(4 * r, r)
    counts = {}
    for iteration in ("gram_space", "rectangle"):
        with FlopCounterMode(display=False) as counter:
            so.spectral_power(W, p, method="gram", iteration=iteration, precision="fp32")
        counts[iteration] = counter.get_total_flops() / r**3
    assert counts == {"gram_space": gram_space_r3, "rectangle": rectangle_r3}


def test_the_cost_counts_gram_space_with_symmetric_products_at_half():
    """plan.cost against the counts above, symmetric products at half: the Gram 4 r^3 (the restarts'
    Grams likewise), each M^2 1 r^3 (8 of them), the other 15 r x r products 2 r^3 each."""
    r = 64
    blocks = 8 + 30

    def half(p, iteration):
        return plan.cost("spectral_power", (r, 4 * r), p=p, iteration=iteration, symmetric_at_half=True)

    assert half(2, "gram_space") == (4 + blocks + 2 * (4 + 8) + 10) * r**3
    assert half(0, "gram_space") == (4 + blocks + 2 * (4 + 8) + 8) * r**3
    # The rectangle: the Gram 4, then 7 A (4 each), 8 A^2 (1), 8 B X (8), the final product 8: 112 r^3.
    assert half(2, "rectangle") == 112 * r**3
    assert half(0, "rectangle") == plan.cost("polar", (r, 4 * r), symmetric_at_half=True) == 104 * r**3


OP_COST_CASES = [
    ("polar", {}), ("msign", {}), ("band_projectors", {}), ("svt", {}), ("spectral_clip", {}),
    ("spectral_norm_bounds", {}),
    *[("spectral_power", {"p": p, "iteration": it}) for p in (0, 1, 2, 3, 4, 5) for it in ("rectangle", "gram_space")],
    *[("band_direction", {"p": 2, "band_mode": mode, "p_bot": 0}) for mode in ("top", "bot", "two_band")],
    *[("decay_", {"p": p, "iteration": it, "guard": guard})
      for p in (0, 1, 2, 3, 4) for it in ("rectangle", "gram_space") for guard in (False, True)],
    ("decay_", {"p": 2, "band_mode": "top"}),
    ("decay_", {"p": 1, "band_mode": "clip"}),
]


@pytest.mark.parametrize("op, options", OP_COST_CASES, ids=lambda case: str(case))
@pytest.mark.parametrize("shape", [(96, 24), (3, 64, 16), (24, 200), (32, 32)])
def test_the_cost_at_full_is_torchs_count_of_the_same_call(shape, op, options):
    """plan.cost runs the plan itself on meta tensors: at full cost it is what FlopCounterMode counts
    of the same call on the torch backend, op by op and iteration by iteration."""
    from torch.utils.flop_counter import FlopCounterMode

    if op == "msign":
        shape = (*shape[:-2], shape[-1], shape[-1])
    W = torch.randn(*shape)
    if op == "msign":
        W = W + W.mT
    polar_c, sign_c = so.coefficients.polar_express_coefficients(), so.coefficients.polar_express_coefficients()
    kernels = dispatch.kernels_for(op, W)
    band = plan.Band(0.5, options["band_mode"], options.get("p_bot", 1)) if "band_mode" in options else None
    p, iteration = options.get("p", 0), options.get("iteration", "rectangle")
    calls = {
        "polar": lambda: plan.polar(kernels, W, polar_c, "fp32"),
        "msign": lambda: plan.msign(kernels, W, sign_c, "fp32"),
        "band_projectors": lambda: plan.band_projectors(kernels, W, 0.5, sign_c, "fp32"),
        "svt": lambda: plan.svt(kernels, W, 0.5, polar_c, sign_c, "fp32"),
        "spectral_clip": lambda: plan.spectral_clip(kernels, W, 0.5, 1.0, polar_c, sign_c, "fp32"),
        "spectral_norm_bounds": lambda: plan.spectral_norm_bounds(kernels, W, plan.GUARD_SQUARINGS),
        "spectral_power": lambda: plan.spectral_power(kernels, W, p, polar_c, "fp32", iteration=iteration),
        "band_direction": lambda: plan.band_direction(kernels, W, p, band, polar_c, sign_c, "fp32"),
        "decay_": lambda: plan.decay_(kernels, W, plan.DecayRequest(
            p, 1e-3, 0.1, band=band, polar_coefficients=polar_c, sign_coefficients=sign_c, precision="fp32",
            iteration=iteration, stability="clamp" if options.get("guard") else "ignore",
            capturable=bool(options.get("guard")))),
    }
    with FlopCounterMode(display=False) as counter:
        calls[op]()
    assert plan.cost(op, shape, precision="fp32", **options) == counter.get_total_flops()


@pytest.mark.parametrize("p, shape, precision, expected", [
    (2, (2048, 512), "fp32", "gram_space"),
    (4, (512, 2048), "fp64", "gram_space"),
    (0, (2048, 512), "fp32", "gram_space"),  # restarted, as accurate as the rectangle
    (2, (512, 512), "fp32", "rectangle"),   # square: the rectangle's steps cost less
    (2, (1536, 512), "fp32", "rectangle"),  # 3:1: it would save only 23%
    (2, (2048, 512), "bf16", "rectangle"),  # 4-6x the rectangle's error in bf16
    (0, (2048, 512), "fp16", "rectangle"),
    (3, (2048, 512), "fp32", "rectangle"),  # odd: no iteration
])
def test_auto_takes_gram_space_where_it_is_cheaper_and_accurate(p, shape, precision, expected):
    assert plan.route(shape, torch.float32, "cuda", p, precision).iteration == expected


def test_auto_is_the_default_and_polar_stays_on_the_rectangle():
    """spectral_power and spectral_decay_ iterate as "auto" says (here Gram space: 4:1, fp32); polar, Muon's
    orthogonalisation, is torch.optim.Muon's iteration on the rectangle whatever the shape."""
    W = torch.randn(96, 24)
    assert torch.equal(so.spectral_power(W, 2, method="gram"),
                       so.spectral_power(W, 2, method="gram", iteration="gram_space"))
    assert torch.equal(so.polar(W), so.spectral_power(W, 0, method="gram", iteration="rectangle"))
    decayed, expected = W.clone(), W.clone()
    so.spectral_decay_(decayed, 2, 0.05, 0.2, method="gram")
    so.spectral_decay_(expected, 2, 0.05, 0.2, method="gram", iteration="gram_space")
    assert torch.equal(decayed, expected)
    with pytest.raises(ValueError, match="iteration must be one of"):
        so.spectral_decay_(torch.randn(8, 4), 2, 0.1, 0.1, iteration="gram")
    with pytest.raises(ValueError, match="iteration of method='gram'"):
        so.spectral_power(W, 2, method="svd", iteration="gram_space")


def test_a_cpu_factorises_only_where_torch_would_run_the_products():
    """The CPU rules of plan.route (docs/backends.md): eigh for S_p with an even p >= 2, and an odd p on the
    Gram route (X G^k: products alone) while they cost no more than eigh's three (the Gram and two by the
    rectangle: at 2:1 up to p = 9); the SVD for a thresholded form at any power; the Gram route on a GPU
    and where another provider would run the products (a forced backend asks for its kernels); an
    explicit method is kept."""
    def method(device="cpu", p=2, **options):
        return plan.route((128, 64), torch.float32, device, p, "fp32", **options).method

    assert method() == method(p=4) == "eigh" and method(band=True) == "svd" and method(p=0, band=True) == "svd"
    assert [method(p=p) for p in (1, 3, 5, 7, 9, 11)] == ["gram"] * 5 + ["eigh"]
    assert method("cuda") == method("cuda", band=True) == "gram"
    assert method(provider="triton") == method(band=True, provider="triton") == "gram"
    assert method(method="eigh", band=True) == "eigh"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("side", [64, 128, 256])
def test_cpu_auto_polar_factor_is_the_svds_at_every_side(side, dtype):
    """CPU ``method="auto"`` for ``p = 0`` took Polar Express at sides 128 and 256 (up to 1.55x faster than
    LAPACK there), which resolves only the modes above its design bound (1e-3 of ||W||_F): at kappa 1e3 it
    erred 1.3e-3 (128) and 9.2e-3 (256). The SVD's backward error (eps s_max) moves the polar factor by
    about kappa eps (measured 8e-6 to 1.1e-5 in fp32)."""
    from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error

    W = matrix_with_spectrum((side, side), log_spaced_spectrum(side, 1e3), dtype, seed=0)
    assert plan.route(W.shape, dtype, "cpu", 0, plan.resolve_precision(None, dtype)).method == "svd"
    assert relative_error(so.spectral_power(W, 0), so.reference.polar_svd(W)) < 1e3 * torch.finfo(dtype).eps


def test_cpu_auto_never_takes_the_iteration_for_a_polar_factor():
    for side in (64, 128, 256, 512, 1024, 4096):
        for shape in ((side, side), (4 * side, side)):
            for dtype in (torch.float32, torch.float64):
                assert plan.route(shape, dtype, "cpu", 0, plan.resolve_precision(None, dtype)).method == "svd"


def test_a_negative_or_floored_power_is_routed_as_a_real_one():
    """A floored power (every negative one is) is a real power: its iteration is its polar factor's, never
    G^k's (route() costed G^(p/2) for p = -2, and repeated squaring never ended for k < 0), no chain, and on
    a CPU the SVD (eigh would amplify the floor's weights on its small modes)."""
    from test_extremes import returns_within

    polar = plan.route((2048, 512), torch.float32, "cuda", 0, "fp32")
    with returns_within():
        for p in (-2, -30, -0.5, 2, 0.5):
            chosen = plan.route((2048, 512), torch.float32, "cuda", p, "fp32", floored=True)
            assert chosen.iteration == polar.iteration and not chosen.chain
            assert plan.route((128, 64), torch.float32, "cpu", p, "fp32", floored=True).method == "svd"
        assert plan.cost("spectral_power", (64, 32), p=-2, eps=1e-2) == plan.cost("spectral_power", (64, 32), p=-2.0,
                                                                                  eps=1e-2) > 0
        with pytest.raises(ValueError, match="needs a floor"):
            plan.cost("spectral_power", (64, 32), p=-2)
        with pytest.raises(ValueError, match="integer k >= 0"):
            plan.repeated_squaring(-1, None, None)


def test_auto_takes_a_backends_fused_chain_first(monkeypatch):
    """Where a backend fuses the rectangle's whole iteration into one kernel per matrix (small
    matrices), launches bound the time and Gram space would save nothing: "auto" takes the chain even
    where the FLOP model prefers Gram space; an explicit "gram_space" does not."""
    W = torch.randn(96, 24)
    # Routed before the plan is patched: the route weighs the cost, read off the (unpatched) plan.
    chosen = plan.route(W.shape, W.dtype, "cpu", 2, "fp32")
    explicit = plan.route(W.shape, W.dtype, "cpu", 2, "fp32", iteration="gram_space")
    assert chosen.iteration == "gram_space" and chosen.chain and not explicit.chain
    chained = (torch.zeros(24, 96), torch.zeros(()))
    monkeypatch.setattr(plan.gram, "chained_power", lambda *args: chained)
    gram_plan, coefficients = plan.GramPlan(W, None, "fp32"), so.coefficients.polar_express_coefficients()
    assert gram_plan.scaled_direction(2, coefficients, chosen) is chained
    monkeypatch.setattr(plan.GramPlan, "scaled_power", lambda self, p, coefficients, iteration, eps=None: iteration)
    assert gram_plan.scaled_direction(2, coefficients, explicit) == "gram_space"


def test_the_polar_factor_starts_from_the_margin_without_a_pass_over_the_matrix():
    """The normalisation margin ``1 / 1.01`` is folded into the first step's coefficients: the iterates
    of ``X / 1.01``, to fp64 rounding, from products alone (the margin once cost a pass over ``X`` and one
    over its Gram, 2 of a Muon step's ~20 element-wise passes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from spectral_ops.backends.torch_backend import TorchBackend
    from spectral_ops.coefficients import NORMALIZATION_MARGIN

    generator = torch.Generator().manual_seed(0)
    W = torch.randn(6, 10, generator=generator, dtype=torch.float64)
    coefficients = so.polar_express_coefficients(steps=4)
    gram_plan = plan.GramPlan(W, TorchBackend(), "fp64")

    class Ops(TorchDispatchMode):
        names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(arg, torch.Tensor) and arg.numel() > 1 for arg in args):  # not a log scale
                self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        polar = gram_plan.polar(coefficients)
    assert ops.names <= {"mm", "addmm", "t", "transpose"}, ops.names
    expected = plan.polar_iterations(TorchBackend(), gram_plan.Xn / NORMALIZATION_MARGIN, coefficients, "fp64")
    torch.testing.assert_close(polar, expected, rtol=0, atol=64 * torch.finfo(torch.float64).eps)


def test_the_route_is_computed_once_per_op_call(monkeypatch):
    """route() runs once per op call, and the op passes it down (it ran in routed and again in
    GramPlan.scaled_direction). The cost model's own calls, on the wide meta shape, are not the op's."""
    shapes = []
    original = plan.routing.route

    def counted(shape, *args, **options):
        shapes.append(tuple(shape))
        return original(shape, *args, **options)

    monkeypatch.setattr(plan.routing, "route", counted)
    W = torch.randn(96, 24)
    calls = [lambda: so.spectral_power(W, 2, method="gram"), lambda: so.spectral_power(W, 0, method="gram"),
             lambda: so.spectral_power(W, 3), lambda: so.polar(W), lambda: so.power_update(W, 0.5),
             lambda: so.spectral_decay_(W.clone(), 2, 0.01, 0.1, method="gram"),
             lambda: so.band_direction(W, 0.5, 2, method="gram")]
    for call in calls:
        shapes.clear()
        call()
        assert shapes.count((96, 24)) == 1


def test_the_band_modes_table_gives_the_guard_its_terms_and_each_route_its_sides():
    """One table (plan.BAND_SIDES) says what each band mode puts above and below tau: the guard's terms
    (a power below tau is capped at it; a two-band's bottom carries its own coefficient), which forms
    hold the polar factor, and the validation's list of modes all follow from it."""
    assert so.ops.BAND_MODES == plan.BAND_MODES == ("top", "bot", "top_only", "bot_only", "two_band", "clip")
    terms = {mode: plan.stability_terms(3, 0.5, plan.Band(1.0, mode, p_bot=4, spectral_weight_decay_bot=0.2))
             for mode in plan.BAND_MODES}
    assert terms == {"top": [(3, 0.5, False)], "bot": [(3, 0.5, True)], "top_only": [(3, 0.5, False)],
                     "bot_only": [(3, 0.5, True)], "two_band": [(3, 0.5, False), (4, 0.2, True)], "clip": []}
    assert [mode for mode in plan.BAND_MODES if plan.weighs_its_bands(plan.Band(1.0, mode))] == ["two_band"]
