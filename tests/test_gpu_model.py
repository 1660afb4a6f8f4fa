"""The GPU cost model's arithmetic, on CPU: the work read off the plan, the roofline, calibration."""

import json
from pathlib import Path

import pytest
import torch

from spectral_ops import gpu_model, plan
from spectral_ops.gpu_model import ARCHS, Work

H200 = ARCHS["H200"]


def test_the_gpu_names_torch_reports_find_their_model():
    assert gpu_model.arch_for("NVIDIA H200").name == "H200"
    assert gpu_model.arch_for("NVIDIA H100 80GB HBM3").name == "H100"
    assert gpu_model.arch_for("NVIDIA A100-SXM4-80GB").name == "A100"
    assert gpu_model.arch_for("NVIDIA GeForce RTX 4090") is None


def test_a_symmetric_product_costs_the_kernels_half_and_cublas_all_of_it():
    n, k = 512, 2048
    for provider, share in (("torch", 1.0), ("triton", 0.5), ("cuda", 0.5)):
        work = gpu_model.primitive_work("symmetric", (3, n, k), torch.bfloat16, "bf16", provider)
        assert work.flops == share * 2 * n * k * n * 3
        # Each operand read once and the result written once, 2 bytes per element.
        assert work.bytes == 2 * (n * k + k * n + n * n) * 3 and work.launches == 1


def test_the_epilogue_moves_bytes_and_does_no_matrix_flops():
    work = gpu_model.primitive_work("decay_epilogue_", (64, 256), torch.float32, "fp32", "torch")
    assert work == Work(0.0, 4 * 64 * 256 * 3, 1)  # W read and written, D read


def test_a_fused_chain_does_its_compositions_products_in_one_launch():
    """The model counts a small chain by running the plan's composition of one (which dispatch is handed)
    on meta tensors: the FLOPs are the composed polar factor's, as the cost model counts that op."""
    for provider in ("torch", "triton"):
        fused = gpu_model.primitive_work("small_chain", (4, 64, 256), torch.bfloat16, "bf16", provider,
                                         compose=plan.composed_chain, steps=5)
        composed = gpu_model.composed_chain_work(plan.composed_chain, (4, 64, 256), torch.bfloat16, "bf16",
                                                 provider, steps=5)
        halves = gpu_model.halves_symmetric_products(provider)
        assert fused.flops == composed.flops == plan.cost("polar", (4, 64, 256), precision="bf16", steps=5,
                                                          symmetric_at_half=halves)
        assert fused.launches == 1 < composed.launches
    with pytest.raises(ValueError, match="compose="):
        gpu_model.primitive_work("small_chain", (64, 256), torch.float32, "fp32", "torch")


def test_the_prediction_is_the_roofline_over_the_efficiency_plus_launches():
    compute_bound = Work(flops=1e12, bytes=1e6, launches=3)
    expected_s = 1e12 / H200.peak("bf16") / gpu_model.ASSUMED_CUBLAS_EFFICIENCY + 3 * gpu_model.LAUNCH_S
    assert gpu_model.predict_ms(H200, "torch", compute_bound, "bf16") == pytest.approx(1e3 * expected_s)
    memory_bound = Work(flops=1e6, bytes=1e10, launches=0)
    expected_s = 1e10 / H200.bandwidth / gpu_model.ASSUMED_CUBLAS_EFFICIENCY
    assert gpu_model.predict_ms(H200, "torch", memory_bound, "bf16") == pytest.approx(1e3 * expected_s)


def test_fp32_is_fp32_fma_on_cublas_and_three_tf32_passes_on_the_kernels():
    assert gpu_model.provider_peak(H200, "torch", "fp32") == H200.peak("fp32")
    assert gpu_model.provider_peak(H200, "triton", "fp32") == pytest.approx(H200.peak("tf32") / 3)
    assert gpu_model.provider_peak(H200, "triton", "tf32") == H200.peak("tf32")


def test_an_unmeasured_kernel_gets_no_prediction_and_a_measured_one_does(monkeypatch):
    work = Work(1e12, 1e9, 1)
    assert gpu_model.predict_ms(H200, "triton", work, "bf16") is None
    assert gpu_model.predict_ms(H200, "cuda", work, "bf16") is None
    monkeypatch.setitem(gpu_model.MEASURED_EFFICIENCY, ("H200", "triton"), 0.5)
    assert gpu_model.predict_ms(H200, "triton", work, "bf16") > gpu_model.predict_ms(H200, "torch", work, "bf16")
    assert gpu_model.predict_ms(ARCHS["H100"], "triton", work, "bf16") is None  # measured on another GPU


def test_achieved_rate_and_share_of_the_peak():
    tflops, percent = gpu_model.achieved(H200, Work(flops=H200.peak("bf16") / 2), 1e3, "bf16")
    assert tflops == pytest.approx(H200.peak("bf16") / 2e12) and percent == pytest.approx(50.0)


def test_calibration_recovers_the_efficiency_a_gpu_check_measured(tmp_path):
    rows = []
    for provider, fraction in (("triton", 0.7), ("torch", 0.8)):
        for n in (1024, 2048, 4096):
            work = gpu_model.primitive_work("symmetric", (n, n), torch.bfloat16, "bf16", provider)
            roofline_s = max(work.flops / H200.peak("bf16"), work.bytes / H200.bandwidth)
            ms = 1e3 * (roofline_s / fraction + work.launches * gpu_model.LAUNCH_S)
            rows.append({"status": "ok", "backend": provider, "precision": "bf16", "ms": ms,
                         "work": {"flops": work.flops, "bytes": work.bytes, "launches": work.launches}})
    rows.append({"status": "failed", "backend": "cuda", "precision": "bf16", "ms": 1.0,
                 "work": {"flops": 1.0, "bytes": 1.0, "launches": 1}})
    report = tmp_path / "gpu_check.json"
    report.write_text(json.dumps({"environment": {"gpu": "NVIDIA H200"}, "results": rows}))
    assert gpu_model.calibrate(report) == {("H200", "triton"): 0.7, ("H200", "torch"): 0.8}
    report.write_text(json.dumps({"environment": {"gpu": "Some GPU"}, "results": rows}))
    with pytest.raises(ValueError, match="not in gpu_model.ARCHS"):
        gpu_model.calibrate(report)


def test_every_measured_efficiency_comes_from_a_committed_gpu_check():
    """Filled from GPU-check results only, never from papers: each entry is what one of the committed
    reports calibrates to."""
    reports = sorted(Path(__file__).parents[1].glob("docs/results/gpu/*/gpu_check.json"))
    calibrated = {}
    for report in reports:
        try:
            calibrated.update(gpu_model.calibrate(report))
        except (ValueError, KeyError):
            continue  # a report from a GPU the model does not know, or from before the work was recorded
    for key, value in gpu_model.MEASURED_EFFICIENCY.items():
        assert calibrated.get(key) == value, key
