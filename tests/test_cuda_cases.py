"""bench/cuda_cases.py, the GPU cases for bench/gpu_check.py, is well formed and covers every CUDA op.

The cases run on a GPU only; here their structure is checked (tests/test_cuda_emulation.py runs the
kernels themselves on the CPU)."""

import importlib.util
from pathlib import Path

import torch

from spectral_ops.plan import OPS

_spec = importlib.util.spec_from_file_location("cuda_cases",
                                               Path(__file__).resolve().parents[1] / "bench" / "cuda_cases.py")
cuda_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_cases)
# The ops whose chain-sized cases run (band forms need a spectral gap the small test spectra lack).
CHAIN_OPS = ("polar", "spectral_power", "decay_")

KEYS = {"name", "op", "dtype", "shape", "make_inputs", "run", "reference", "tolerance", "baseline", "op_options",
        "precision"}
EXTENSION_OPS = {"gemm", "syrk", "poly_step", "sign_step", "small_chain", "decay_epilogue_"}


def check(cases):
    names = [case["name"] for case in cases]
    assert len(names) == len(set(names))
    for case in cases:
        assert set(case) == KEYS
        assert isinstance(case["dtype"], torch.dtype) and isinstance(case["shape"], tuple)
        assert all(callable(case[k]) for k in ("make_inputs", "run", "reference", "baseline"))
        assert 0 < case["tolerance"] < 0.1


def test_correctness_cases_cover_every_op_path_and_dtype():
    cases = cuda_cases.cases()
    check(cases)
    backend_ops = {f"backend.{op}[chain]" for op in CHAIN_OPS} | {f"backend.{op}[composed]" for op in OPS}
    assert {case["op"] for case in cases} == EXTENSION_OPS | backend_ops
    for op in EXTENSION_OPS | backend_ops:
        dtypes = {case["dtype"] for case in cases if case["op"] == op}
        expected = {torch.float32} if op in ("poly_step", "sign_step") else set(cuda_cases.DTYPES.values())
        assert dtypes == expected, op


def test_shapes_include_batched_odd_tall_and_wide():
    shapes = [case["shape"] for case in cuda_cases.cases()]
    assert any(len(s) > 2 for s in shapes)
    assert any(s[-1] % 2 or s[-2] % 2 for s in shapes)
    assert any(s[-2] > s[-1] for s in shapes) and any(s[-2] < s[-1] for s in shapes)


def test_timing_cases_time_every_op_against_torch():
    cases = cuda_cases.timing_cases()
    check(cases)
    timed = {case["op"].split("[")[0] for case in cases}
    assert EXTENSION_OPS - {"small_chain"} <= timed  # the chain is timed through backend.*[chain]
    assert {case["op"] for case in cases} >= {"backend.polar[chain]", "backend.polar[composed]",
                                              "backend.msign[composed]"}


def test_timing_baselines_run_at_the_cases_precision():
    """A bf16 Gram timed against an fp32 GEMM (``X.float() @ X.float().mT``) would report a meaningless
    speed-up: each baseline's result has the dtype of the case's operands (on CPU, at a small size)."""
    for case in cuda_cases.timing_cases():
        if case["op"] != "syrk":
            continue
        X = torch.ones(8, 16, dtype=case["dtype"])
        assert case["baseline"](X).dtype == case["dtype"], case["name"]
        assert case["reference"](X).dtype == torch.float32  # checked against the exact Gram
    # fp32 (3xTF32) and one TF32 pass are both timed, each against cuBLAS at its precision.
    assert {(case["op"], case["precision"]) for case in cuda_cases.timing_cases() if case["dtype"] == torch.float32
            and case["op"] in ("gemm", "syrk")} == {("gemm", None), ("gemm", "tf32"), ("syrk", None), ("syrk", "tf32")}
