"""bench/gpu_check.py on a CPU: the interpreter dry run of every case, and the GPU-free compile check."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
PACKAGE = SCRIPT.with_name("gpu_checks")  # the script's code


@pytest.fixture(scope="module")
def gpu_checks():
    """The package ``bench/gpu_checks`` (bench/ is not on ``sys.path`` here), its modules imported."""
    spec = importlib.util.spec_from_file_location(PACKAGE.name, PACKAGE / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package  # its modules, and dataclasses, look it up there
    spec.loader.exec_module(package)
    for name in ("cli", "cases", "runner", "special_cases", "main"):
        importlib.import_module(f"{spec.name}.{name}")
    yield package
    for name in [name for name in sys.modules if name.partition(".")[0] == spec.name]:
        del sys.modules[name]


def run(gpu_checks, argv) -> int:
    """What ``bench/gpu_check.py ARGV`` runs, in this process."""
    return gpu_checks.main.main(gpu_checks.cli.parse(argv))


@pytest.fixture(scope="module")
def dry_run(gpu_checks, tmp_path_factory):
    """One dry run of every case, shared: under the interpreter it is the slow part of this module."""
    out = tmp_path_factory.mktemp("dry_run")
    exit_status = run(gpu_checks, ["--dry-run", "--out", str(out)])
    return exit_status, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_dry_run_checks_every_case_that_runs_on_a_cpu_and_writes_the_report(gpu_checks, dry_run):
    exit_status, report, markdown = dry_run
    assert exit_status == 0
    checks = [row for row in report["results"] if row["phase"] == "check"]
    passed = {(row["case"], row["backend"]) for row in checks if row["status"] == "ok"}
    assert passed == {(case.name, case.backend) for case in gpu_checks.cases.REGISTRY if case.tiny_shapes}
    assert all(row["error"] <= row["tolerance"] for row in checks if row["status"] == "ok")
    kernels = {"syrk", "poly_step", "update", "decay", "sign step", "small path S_2", "small path msign"}
    assert all(any(name in case for case, _ in passed) for name in kernels)
    assert {row["status"] for row in report["results"]} == {"ok", "skipped"}
    assert report["summary"]["ok"] + report["summary"]["skipped"] == len(report["results"])
    assert "| op decay_ p=2 | triton | float32 | 2x40x24 | ok |" in markdown


def test_dry_run_runs_the_checks_then_the_headline_timings_then_the_rest(gpu_checks, dry_run):
    rows = dry_run[1]["results"]
    phases = [row["phase"] for row in rows]
    assert phases == sorted(phases, key=gpu_checks.runner.PHASES.index) and set(phases) == set(gpu_checks.runner.PHASES)
    headline = {row["case"] for row in rows if row["phase"] == "headline"}
    assert {"op decay_ p=2", "syrk X X^T", "torch matmul (yardstick)", "SpectralAdamW step in a CUDA graph"} <= headline
    assert any("vs torch.optim.Muon" in case for case in headline)
    assert rows[[row["phase"] for row in rows].index("headline") - 1]["phase"] == "check"
    # CUDA cases are checked before the Triton ones, whose first launches compile.
    backends = [row["backend"] for row in rows if row["phase"] == "check"]
    assert backends.index("triton") > len(backends) - 1 - backends[::-1].index("cuda")
    assert {row["dtype"] for row in rows if row["phase"] == "headline" and row["backend"] == "triton"} == {"float32"}


def test_skipped_is_never_ok_and_always_says_why(dry_run):
    _, report, markdown = dry_run
    for row in report["results"]:
        assert (row["ok"] is True) == (row["status"] == "ok"), row
        if row["status"] == "skipped":
            assert row["ok"] is None and row["reason"], row
            assert f"| skipped: {row['reason']} |" in markdown


def test_cuda_graph_and_muon_cases_are_skipped_on_a_cpu(dry_run):
    rows = [row for row in dry_run[1]["results"] if "CUDA graph" in row["case"] or "Muon" in row["case"]]
    assert len(rows) == 7
    assert all(row["status"] == "skipped" and row["ok"] is None and "CUDA" in row["reason"] for row in rows)


def test_cuda_kernels_are_skipped_without_the_extension_or_a_gpu(gpu_checks, dry_run):
    rows = [row for row in dry_run[1]["results"] if row["backend"] == "cuda"]
    assert {row["case"] for row in rows} == {case.name for case in gpu_checks.cases.REGISTRY if case.backend == "cuda"}
    assert all(row["status"] == "skipped" and row["reason"] for row in rows)


def _fake_case(gpu_checks, name, fn):
    return gpu_checks.cases.Case(name, "fake", fn=fn, reference=lambda d: d["x"],
                                 inputs=lambda shape, dtype, device: {"x": torch.ones(shape)}, shapes=[(2, 2)],
                                 tiny_shapes=[(2, 2)], dtypes=(torch.float32,), tolerance={torch.float32: 0.0},
                                 timeout_s=0.5)


def test_a_case_past_its_time_limit_is_reported_as_timed_out_and_the_run_goes_on(gpu_checks, tmp_path, monkeypatch):
    def hangs(d):
        time.sleep(60)  # never ends in time: the limit interrupts it, or the case would pass
        return d["x"]

    monkeypatch.setattr(gpu_checks.main, "REGISTRY", [_fake_case(gpu_checks, "fake slow", hangs),
                                                      _fake_case(gpu_checks, "fake quick", lambda d: d["x"])])
    out = tmp_path / "report.json"
    assert run(gpu_checks, ["--dry-run", "--only", "fake", "--json", str(out)]) == 0
    rows = {(row["phase"], row["case"]): row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == [("check", "fake slow"), ("check", "fake quick"),
                          ("rest", "fake slow"), ("rest", "fake quick")]
    slow = rows["check", "fake slow"]
    assert (slow["status"], slow["ok"]) == ("timed out", None) and "its limit" in slow["reason"]
    assert rows["check", "fake quick"]["status"] == "ok" and rows["rest", "fake quick"]["status"] == "ok"
    skipped = rows["rest", "fake slow"]
    assert (skipped["status"], skipped["reason"]) == ("skipped", "its check timed out")


def test_cases_past_the_time_budget_are_skipped(gpu_checks, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_checks.main, "REGISTRY", [_fake_case(gpu_checks, "fake quick", lambda d: d["x"])])
    out = tmp_path / "report.json"
    assert run(gpu_checks, ["--dry-run", "--only", "fake", "--budget-s", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(row["status"], row["ok"]) for row in rows] == [("skipped", None)] * 2
    assert rows[0]["reason"].startswith("time budget") and rows[1]["reason"] == "its check was skipped"


def test_muon_case_compares_with_torch_muon_on_a_cpu(gpu_checks):
    """The case's code, on CPU at a tiny size: the GPU run is no place to find a typo."""
    cpu = torch.device("cpu")
    compared = gpu_checks.special_cases.muon_against_torch(1, 32, 48, "torch NS5", cpu, dry_run=True)
    assert compared["ok"] and compared["error"] <= compared["tolerance"] and compared["ms"] > 0
    heads = gpu_checks.special_cases.muon_against_torch(2, 16, 48, "Polar Express", cpu, dry_run=True)
    assert heads["ok"] and "error" not in heads and heads["note"]


def test_cuda_graph_case_compares_the_replay_with_eager_steps(gpu_checks):
    """On CPU the step stands in for its replay: the comparison must then find no difference, and must
    find one when the replay does nothing."""
    cpu = torch.device("cpu")
    same = gpu_checks.special_cases.graph_against_eager((24, 40), cpu, dry_run=True, capture=lambda step: step)
    assert same["ok"] and same["error"] == 0 and same["max_abs_diff"] == 0
    frozen = gpu_checks.special_cases.graph_against_eager((24, 40), cpu, dry_run=True,
                                                          capture=lambda step: lambda: None)
    assert not frozen["ok"] and frozen["error"] > 0.5


def test_registry_cases_name_a_backend_and_full_size_shapes(gpu_checks):
    for case in gpu_checks.cases.REGISTRY:
        assert case.backend and case.shapes, case.name
        assert set(case.headline) <= set(case.shapes), case.name
    assert len({(case.name, case.backend) for case in gpu_checks.cases.REGISTRY}) == len(gpu_checks.cases.REGISTRY)
    assert gpu_checks.cases.CUDA_HEADLINE <= {case.name for case in gpu_checks.cases.REGISTRY if case.headline}


def test_compile_only_builds_sm90_kernels_without_a_gpu(tmp_path):
    """The compiled (not interpreted) frontend and lowering, which the interpreter never exercises."""
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--compile-only", "sm90", "--dry-run", "--only",
         "syrk X X^T,small path S_2,stochastic rounding", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["compile_only"]
    triton = [row for row in rows if row["source"] == "triton"]
    assert {row["kernel"] for row in triton} == {"symmetric_kernel", "small_kernel", "product_kernel"}
    # The stochastic rounding of the decay's write, for both 16-bit weights (the interpreter accepted a
    # return typed differently per branch, which the compiler refuses).
    rounded = {row["operands"] for row in triton if row["constexprs"].get("STOCHASTIC")}
    assert rounded == {"*bf16 *fp32 *i16", "*fp16 *fp32 *i16"}
    assert all(row["ok"] and row["shared"] > 0 and row["registers"] > 0 and row["stack"] >= 0 for row in triton)
    # The built extension's kernels, read from its sm_90 code; one skipped row where it was not built for sm_90.
    extension = [row for row in rows if row["source"] == "_C"]
    assert [row["status"] for row in extension] == ["skipped"] or all(
        row["status"] == "ok" and row["registers"] > 0 for row in extension)


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
    rows = json.loads((out / "gpu_check.json").read_text())["results"]
    ran = {(row["case"], row["backend"]) for row in rows if row["status"] == "ok"}
    assert ran >= {("op decay_ p=2", "triton"), ("op decay_ p=2", "auto"), ("syrk X X^T", "triton")}
    assert all(row["status"] == "skipped" for row in rows if row["backend"] == "cuda")
    assert "| op decay_ p=2 | triton |" in (out / "gpu_check.md").read_text()
