"""bench/gpu_check.py on a CPU: the interpreter dry run of every case, and the GPU-free compile check."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

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
    for name in ("cli", "cases", "runner", "special_cases", "main", "schedule", "cuda_child", "build", "compile_only"):
        importlib.import_module(f"{spec.name}.{name}")
    yield package
    for name in [name for name in sys.modules if name.partition(".")[0] == spec.name]:
        del sys.modules[name]


def run(gpu_checks, argv) -> int:
    """What ``bench/gpu_check.py ARGV`` runs, in this process."""
    return gpu_checks.main.main(gpu_checks.cli.parse(argv))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every case, shared: under the interpreter it is the slow part of this module. It runs as
    on a GPU machine that has torch and triton but not this package, and no registry: from a plain copy of the
    repository. ``python -S`` with the site-packages folder on PYTHONPATH imports torch and triton but skips the
    ``.pth`` hook of this package's editable install. Its exit status, report and markdown, and the copy."""
    import shutil
    import sysconfig

    root, folder = SCRIPT.parents[1], tmp_path_factory.mktemp("dry_run")
    copy, out = folder / "checkout", folder / "results"
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, copy / name)
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    hidden = subprocess.run([sys.executable, "-S", "-c", "import spectral_ops"], cwd=folder, env=env,
                            capture_output=True, text=True)
    assert hidden.returncode != 0, "the installed package is still visible: the dry run would prove nothing"
    result = subprocess.run([sys.executable, "-S", "bench/gpu_check.py", "--dry-run", "--out", str(out)],
                            cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert (out / "gpu_check.json").exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return SimpleNamespace(exit_status=result.returncode, output=result.stdout[-3000:] + result.stderr[-3000:],
                           report=json.loads((out / "gpu_check.json").read_text()),
                           markdown=(out / "gpu_check.md").read_text())


def test_dry_run_checks_every_case_that_runs_on_a_cpu_and_writes_the_report(gpu_checks, dry_run):
    report, markdown = dry_run.report, dry_run.markdown
    assert dry_run.exit_status == 0, dry_run.output
    checks = [row for row in report["results"] if row["kind"] == "check"]
    passed = {(row["case"], row["backend"]) for row in checks if row["status"] == "ok"}
    assert passed == {(case.name, case.backend) for case in gpu_checks.cases.REGISTRY if case.tiny_shapes}
    assert all(row["error"] <= row["tolerance"] for row in checks if row["status"] == "ok")
    kernels = {"syrk", "poly_step", "update", "decay", "sign step", "small path S_2", "small path msign"}
    assert all(any(name in case for case, _ in passed) for name in kernels)
    assert {row["status"] for row in report["results"]} == {"ok", "skipped"}
    assert report["summary"]["ok"] + report["summary"]["skipped"] == len(report["results"])
    assert "| op decay_ p=2 | triton | float32 | 2x40x24 | ok |" in markdown


def test_dry_run_runs_the_headline_then_the_breadth_then_the_cuda_cases(gpu_checks, dry_run):
    rows = dry_run.report["results"]
    phases = [row["phase"] for row in rows]
    assert phases == sorted(phases, key=gpu_checks.runner.PHASES.index) and set(phases) == set(gpu_checks.runner.PHASES)
    headline = [row for row in rows if row["phase"] == "headline"]
    assert {"op decay_ p=2", "op polar", "syrk X X^T", "update a X + B X", "torch matmul (yardstick)",
            "small path S_2 (one program per matrix)"} <= {row["case"] for row in headline}
    assert any("vs torch.optim.Muon" in row["case"] for row in headline)
    # Each headline case is timed right after its check.
    for check, timing in zip(headline, headline[1:]):
        if check["kind"] == "check" and timing["kind"] == "timing":
            assert (check["case"], check["backend"], check["shape"]) == (timing["case"], timing["backend"],
                                                                         timing["shape"])
    assert all(row["backend"] == "cuda" for row in rows if row["phase"] == "cuda")
    assert {row["dtype"] for row in headline if row["backend"] == "triton"} == {"float32"}


def test_the_planned_gpu_run_ends_the_headline_within_240_s_of_the_budget(gpu_checks):
    """Computed from the plan (the tasks of a GPU run and each kind's estimate), timing nothing."""
    schedule = gpu_checks.schedule
    stages, headline_tasks = gpu_checks.main.planned_gpu_run(gpu_checks.cli.parse(["--dry-run"]))
    assert [stage.name.split()[0].rstrip(":") for stage in stages] == ["setup", "headline", "breadth", "cuda", "report"]
    headline = stages[1]
    assert headline.tasks == len(headline_tasks) > 0 and headline.end_s <= schedule.HEADLINE_DEADLINE_S
    assert headline_tasks[0].startswith("yardstick") and headline_tasks[-1].startswith("heads")
    assert gpu_checks.cli.parse([]).budget_s == schedule.TIMEOUT_S - schedule.STARTUP_S - schedule.REPORT_S
    text = schedule.format_plan(stages, schedule.DEFAULT_BUDGET_S, headline_tasks)
    assert f"| headline | {headline.tasks} |" in text and "timeout 540" in text


def test_the_headline_runs_in_the_issues_order(gpu_checks):
    """Gram, product, S_2 decay, Polar Express / Muon, the per-head stack: the GPU run's own task list."""
    args = gpu_checks.cli.parse([])
    tasks = gpu_checks.main.all_tasks(args, torch.device("cuda"), cuda_reason=None)
    groups = [name for name, _ in gpu_checks.runner.HEADLINE_GROUPS]
    order = [groups.index(gpu_checks.runner.headline_group(task)) for task in tasks if task.phase == "headline"]
    assert order == sorted(order) and set(order) == set(range(len(groups)))
    heads = [task for task in tasks if task.phase == "headline" and gpu_checks.runner.headline_group(task) == "heads"]
    assert all(task.shape[0] == 96 for task in heads if task.case != "torch matmul (yardstick)")


def test_skipped_is_never_ok_and_always_says_why(dry_run):
    report, markdown = dry_run.report, dry_run.markdown
    for row in report["results"]:
        assert (row["ok"] is True) == (row["status"] == "ok"), row
        if row["status"] == "skipped":
            assert row["ok"] is None and row["reason"], row
            assert f"| skipped: {row['reason']} |" in markdown


def test_cuda_graph_and_muon_cases_are_skipped_on_a_cpu(dry_run):
    rows = [row for row in dry_run.report["results"] if "CUDA graph" in row["case"] or "Muon" in row["case"]]
    assert len(rows) == 7
    assert all(row["status"] == "skipped" and row["ok"] is None and "CUDA" in row["reason"] for row in rows)


def test_cuda_kernels_are_skipped_without_the_extension_or_a_gpu(gpu_checks, dry_run):
    rows = [row for row in dry_run.report["results"] if row["backend"] == "cuda"]
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
    rows = {(row["kind"], row["case"]): row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == [("check", "fake slow"), ("check", "fake quick"),
                          ("timing", "fake slow"), ("timing", "fake quick")]
    slow = rows["check", "fake slow"]
    assert (slow["status"], slow["ok"]) == ("timed out", None) and "its limit" in slow["reason"]
    assert rows["check", "fake quick"]["status"] == "ok" and rows["timing", "fake quick"]["status"] == "ok"
    skipped = rows["timing", "fake slow"]
    assert (skipped["status"], skipped["reason"]) == ("skipped", "its check timed out")


def test_cases_past_the_time_budget_are_skipped(gpu_checks, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_checks.main, "REGISTRY", [_fake_case(gpu_checks, "fake quick", lambda d: d["x"])])
    out = tmp_path / "report.json"
    assert run(gpu_checks, ["--dry-run", "--only", "fake", "--budget-s", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(row["status"], row["ok"]) for row in rows] == [("skipped", None)] * 2
    assert rows[0]["reason"].startswith("time budget") and rows[1]["reason"] == "its check was skipped"


# A stand-in for `gpu_check.py --cuda-child START`: it writes one row per task from START on, and dies
# of SIGSEGV (as a sticky fault may end a process) at task 1, or hangs at task 3, each on its first try.
_FAKE_CHILD = """
import json, os, signal, sys, time
start, path, marks = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = []
for index in range(start, 5):
    if index == 1 and not os.path.exists(marks + "1"):
        open(marks + "1", "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    if index == 3 and not os.path.exists(marks + "3"):
        open(marks + "3", "w").close()
        time.sleep(60)
    rows.append({"case": f"case {index}", "status": "ok", "ok": True})
    with open(path + ".partial", "w") as f:
        json.dump(rows, f)
    os.replace(path + ".partial", path)
"""


def test_a_cuda_child_that_dies_or_hangs_costs_one_case_and_the_next_child_goes_on(gpu_checks, tmp_path):
    tasks = [gpu_checks.runner.Task("cuda", "check", f"case {index}", "cuda", "float32", (2, 2), None,
                                    timeout_s=0.5) for index in range(5)]

    def command(start, rows_path, seconds_left):
        return [sys.executable, "-c", _FAKE_CHILD, str(start), str(rows_path), str(tmp_path / "mark")]

    saved = []
    rows = gpu_checks.cuda_child.run_in_children(tasks, command, tmp_path, time.monotonic() + 120, saved.append,
                                                 hang_margin_s=1.0)
    assert [row["case"] for row in rows] == [f"case {index}" for index in range(5)]
    assert [row["status"] for row in rows] == ["ok", "failed", "ok", "timed out", "ok"]
    assert "SIGSEGV" in rows[1]["reason"] and "hung" in rows[3]["reason"]
    assert saved and len(saved[-1]) == 5


def test_a_bare_machine_names_the_missing_build_tool(gpu_checks, monkeypatch):
    build = gpu_checks.build
    monkeypatch.setenv("CUDACXX", sys.executable)  # an executable stands in for nvcc
    monkeypatch.setattr(build.shutil, "which", lambda name, *args, **kwargs: None if name == "cmake" else name)
    assert "no cmake" in build.find_tools()[1]
    monkeypatch.setattr(build.shutil, "which", lambda name, *args, **kwargs: name)
    monkeypatch.setitem(sys.modules, "pybind11", None)  # `import pybind11` raises ImportError
    assert "no pybind11" in build.find_tools()[1]


def test_a_driver_older_than_the_toolkit_is_one_line(gpu_checks):
    mismatch = gpu_checks.build.driver_mismatch
    line = mismatch(13000, 12040)
    assert "CUDA 13.0" in line and "CUDA 12.4" in line and "\n" not in line
    assert mismatch(13000, 13020) is None and mismatch(13020, 13000) is None  # minor-version compatibility
    assert mismatch(12080, 13000) is None and mismatch(None, 12040) is None


def test_recorded_outputs_are_zeros_and_a_failing_case_is_reported_not_raised(gpu_checks):
    compile_only = gpu_checks.compile_only
    allocators = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with compile_only.zero_filled_allocations():
        filled = [torch.empty(64), torch.empty_like(torch.ones(64)), torch.ones(1).new_empty(64)]
    assert all(bool((t == 0).all()) for t in filled)
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == allocators  # restored

    def overflows(d):
        raise OverflowError("spectral_power: the result does not fit in torch.bfloat16")

    case = _fake_case(gpu_checks, "fake overflow", overflows)
    launches, stopped = compile_only.record_launches([case], "sm90", tiny=True)
    assert launches == {} and [row["status"] for row in stopped] == ["stopped early"]
    assert stopped[0]["case"] == "fake overflow" and "OverflowError" in stopped[0]["reason"]


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
    report = json.loads(out.read_text())
    rows = report["compile_only"]
    assert report["cpu"]["cores"] >= 1 and report["timing"]["total_s"] > 0
    triton = [row for row in rows if row["source"] == "triton"]
    assert {row["kernel"] for row in triton} == {"symmetric_kernel", "small_kernel", "product_kernel"}
    # The stochastic rounding of the decay's write, for both 16-bit weights (the interpreter accepted a
    # return typed differently per branch, which the compiler refuses).
    rounded = {row["operands"] for row in triton if row["constexprs"].get("STOCHASTIC")}
    assert rounded == {"*bf16 *fp32 *i16", "*fp16 *fp32 *i16"}
    assert all(row["ok"] and row["shared"] > 0 and row["registers"] > 0 and row["stack"] >= 0 for row in triton)
    # Read from each variant's SASS: the bf16 Gram lowers to Hopper's warpgroup MMA on sm90.
    assert all({"HGMMA", "HMMA", "TMA", "LDGSTS"} <= set(row) for row in triton)
    assert any(row["HGMMA"] > 0 for row in triton if row["kernel"] == "symmetric_kernel" and "*bf16" in row["operands"])
    # The built extension's kernels, read from its sm_90 code; one skipped row where it was not built for sm_90.
    extension = [row for row in rows if row["source"] == "_C"]
    assert [row["status"] for row in extension] == ["skipped"] or all(
        row["status"] == "ok" and row["registers"] > 0 for row in extension)


def test_timing_rows_carry_the_models_rate_prediction_and_the_routers_choice(gpu_checks, monkeypatch):
    """On an H100 (the model's table; no GPU needed): the Triton Gram of a 4096 x 4096 X computes one
    triangle, n^2 k = 4096^3 FLOPs, cuBLAS the whole 2 n^2 k; no measured efficiency, no prediction
    for Triton; cuBLAS always has one."""
    from spectral_ops import gpu_model

    columns = gpu_checks.model_columns
    h100 = gpu_model.ARCHS["H100"]
    monkeypatch.setattr(columns, "arch_of", lambda device: h100)
    gram = next(case for case in gpu_checks.cases.REGISTRY if case.name == "syrk X X^T")
    row = columns.columns(gram, (4096, 4096), torch.bfloat16, torch.device("cpu"), "bf16", ms=1.0, baseline_ms=2.0)
    assert row["gflop"] == pytest.approx(4096**3 / 1e9) and row["baseline_gflop"] == pytest.approx(2 * 4096**3 / 1e9)
    assert row["tflops"] == pytest.approx(4096**3 / 1e-3 / 1e12)
    assert row["peak_pct"] == pytest.approx(100 * row["tflops"] * 1e12 / h100.peak("bf16"))
    assert row["predicted_ms"] is None and row["baseline_predicted_ms"] > 0
    assert row["router"] == "torch"  # a CPU tensor: nothing else can run it


def test_the_fastest_provider_of_each_call_is_marked_against_the_routers_choice(gpu_checks):
    def timing(backend, ms, baseline_ms, router):
        return {"kind": "timing", "status": "ok", "case": "op decay_ p=2", "dtype": "bfloat16", "shape": [8, 8],
                "backend": backend, "ms": ms, "baseline_ms": baseline_ms, "router": router}

    rows = [timing("triton", 2.0, 3.0, "torch"), timing("cuda", 1.0, 3.0, "torch")]
    gpu_checks.model_columns.mark_fastest(rows)
    assert [row["fastest"] for row in rows] == ["cuda", "cuda"]
    assert [row["router_fastest"] for row in rows] == [False, False]


def test_the_in_tree_build_records_itself_beside_its_module(gpu_checks, tmp_path, monkeypatch):
    """What `load_extension` reads: the record describes the in-tree build (its archs, or why it failed)."""
    from spectral_ops import _extension
    from spectral_ops.build_config import hash_sources, parse_cuda_arch_list

    (tmp_path / "spectral_ops").mkdir()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "gemm.cu").write_text("// the sources the module is built from\n")
    monkeypatch.setattr(gpu_checks.build, "ROOT", tmp_path)
    archs = parse_cuda_arch_list("90", source="test", ptx_for_newest=True)
    gpu_checks.build.write_build_record(archs, None, True, "")
    info = _extension.build_info(tmp_path / "spectral_ops")
    assert info["cuda_built"] and info["archs"] == ["sm_90", "compute_90"]
    assert info["sources_sha256"] == hash_sources(tmp_path / "csrc")  # what tests/test_cuda_sass.py compares
    gpu_checks.build.write_build_record(archs, None, False, "cmake --build exited 1")
    info = _extension.build_info(tmp_path / "spectral_ops")
    assert not info["cuda_built"] and info["reason"] == "cmake --build exited 1" and info["archs"] == []
