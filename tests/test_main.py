"""``python -m spectral_ops`` and the demo, run as a user would run them."""

import subprocess
import sys

import torch

import spectral_ops
from spectral_ops.__main__ import report


def test_report_lists_versions_archs_and_every_backend_with_a_reason():
    text = report()
    assert f"spectral-ops {spectral_ops.__version__}" in text
    assert f"| torch | {torch.__version__} |" in text
    for row in ("| triton |", "| CUDA runtime |", "| compiled architectures |", "| GPU |"):
        assert row in text
    backend_table = text.split("| backend |", 1)[1]
    backend_rows = [line for line in backend_table.splitlines()
                    if line.startswith(("| cuda |", "| triton |", "| torch |"))]
    assert len(backend_rows) == 3
    assert "| torch | available |" in backend_rows
    for row in backend_rows:
        status = row.split("|")[2].strip()
        assert status == "available" or (status.startswith("unavailable: ") and len(status) > len("unavailable: ") + 10)


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "spectral_ops"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("spectral-ops ")


def test_the_report_says_what_unmeasured_calls_run_on(monkeypatch):
    from spectral_ops import gpu_model
    from spectral_ops.__main__ import model_report

    assert "torch (cuBLAS); no GPU check has measured" in model_report("NVIDIA H200")
    assert "no entry for the GPU 'none visible to torch'" in model_report("none visible to torch")
    monkeypatch.setitem(gpu_model.MEASURED_EFFICIENCY, ("H200", "triton"), 0.7)
    assert model_report("NVIDIA H200").endswith("fastest of torch and triton (measured on an H200)")
