"""bench/gpu_check.py on a CPU: the interpreter dry run of every case, and the GPU-free compile check."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_dry_run_validates_every_case_and_writes_the_report(gpu_check, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(gpu_check.parse(["--dry-run", "--json", str(out)])) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    cases_run = {row["case"] for row in rows}
    assert cases_run == {case.name for case in gpu_check.REGISTRY if case.tiny_shapes}
    assert all(row["ok"] and row["error"] <= row["tolerance"] and row["ms"] > 0 for row in rows)
    kernels = {"syrk", "poly_step", "update", "decay", "sign step", "small path S_2", "small path msign"}
    assert all(any(name in case for case in cases_run) for name in kernels)
    assert "| case | backend | dtype |" in capsys.readouterr().out


def test_registry_cases_name_a_backend_and_full_size_shapes(gpu_check):
    for case in gpu_check.REGISTRY:
        assert case.backend and case.shapes, case.name
    assert len({case.name for case in gpu_check.REGISTRY}) == len(gpu_check.REGISTRY)


def test_compile_only_builds_sm90_kernels_without_a_gpu(tmp_path):
    """The compiled (not interpreted) frontend and lowering, which the interpreter never exercises."""
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--compile-only", "sm90", "--dry-run", "--only", "syrk X X^T,small path S_2",
         "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["compile_only"]
    assert {row["kernel"] for row in rows} == {"symmetric_kernel", "small_kernel"}
    assert all(row["ok"] and row["shared"] > 0 and row["registers"] for row in rows)


def test_dry_run_starts_from_a_bare_copy_of_the_checkout(tmp_path):
    """A GPU machine may have torch and triton but not this package, and no registry: the check must
    start from a plain copy of the repository. ``python -S`` with the site-packages folder on
    PYTHONPATH imports torch and triton but skips the ``.pth`` hook of this package's editable install."""
    import shutil
    import sysconfig

    root = SCRIPT.parents[1]
    copy = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, copy / name)
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    hidden = subprocess.run([sys.executable, "-S", "-c", "import spectral_ops"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert hidden.returncode != 0, "the installed package is still visible: the test would prove nothing"
    out = tmp_path / "results"
    result = subprocess.run([sys.executable, "-S", "bench/gpu_check.py", "--dry-run", "--only", "op decay_ p=2,syrk X X^T",
                             "--out", str(out)], cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert {row["case"] for row in report["results"]} >= {"op decay_ p=2", "syrk X X^T"}
    assert all(row["ok"] for row in report["results"])
    assert "| op decay_ p=2 |" in (out / "gpu_check.md").read_text()
