"""The build's decisions (spectral_ops/build_config.py) and the no-CUDA install path."""

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_CONFIG = ROOT / "spectral_ops" / "build_config.py"


def _load_by_path():
    # The way setup.py loads it: by path, without importing the package.
    spec = importlib.util.spec_from_file_location("_spectral_ops_build_config_under_test", BUILD_CONFIG)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bc = _load_by_path()


def cmake(env):
    return bc.cmake_arch_string(bc.parse_cuda_archs(env))


# --- architecture lists ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("80;90", "80-real;90"),
        ("80,90", "80-real;90"),
        ("sm_80 sm_90", "80-real;90"),
        ("90;80;90", "80-real;90"),  # sorted, duplicates merged
        ("8.0;9.0", "80-real;90"),
        ("90a", "90a"),
        ("sm_80;sm_90a", "80-real;90a"),
        ("80;100;120", "80-real;100-real;120"),
        ("80; 90;", "80-real;90"),
        # Once an entry says what it wants, the list is literal: no PTX is added.
        ("80;90-real", "80-real;90-real"),
        ("80+PTX;90", "80;90-real"),
        ("80;compute_90", "80-real;90-virtual"),
        ("80-real;90-virtual", "80-real;90-virtual"),
        ("sm_90+PTX", "90"),
    ],
)
def test_spectral_ops_cuda_archs(value, expected):
    assert cmake({"SPECTRAL_OPS_CUDA_ARCHS": value}) == expected


@pytest.mark.parametrize(
    "value, expected",
    [
        ("8.0;9.0+PTX", "80-real;90"),
        ("8.0 9.0", "80-real;90-real"),  # PyTorch's meaning: PTX only where +PTX says so
        ("9.0+PTX;8.0", "80-real;90"),
        ("8.6+PTX", "86"),
        ("9.0a", "90a-real"),
    ],
)
def test_torch_cuda_arch_list(value, expected):
    assert cmake({"TORCH_CUDA_ARCH_LIST": value}) == expected


def test_default_is_sm80_sm90_and_ptx_for_the_newest():
    assert cmake({}) == "80-real;90"
    assert bc.arch_names(bc.parse_cuda_archs({})) == ["sm_80", "sm_90", "compute_90"]
    assert bc.cuda_archs_source({}) == "default"


def test_precedence():
    env = {"SPECTRAL_OPS_CUDA_ARCHS": "90", "TORCH_CUDA_ARCH_LIST": "8.0"}
    assert cmake(env) == "90"
    assert bc.cuda_archs_source(env) == "SPECTRAL_OPS_CUDA_ARCHS"
    # An empty variable counts as unset (CI templates often export empty values).
    env = {"SPECTRAL_OPS_CUDA_ARCHS": " ", "TORCH_CUDA_ARCH_LIST": "8.0"}
    assert cmake(env) == "80-real"
    assert bc.cuda_archs_source(env) == "TORCH_CUDA_ARCH_LIST"


@pytest.mark.parametrize(
    "value",
    ["Ampere", "sm80", "8", "8.10", "80x", "90b", "80+PTX-real", "sm_90-virtual", "compute_90-real", "70", ";", "all"],
)
def test_garbage_arch_lists_raise(value):
    with pytest.raises(bc.BuildConfigError, match="SPECTRAL_OPS_CUDA_ARCHS"):
        bc.parse_cuda_archs({"SPECTRAL_OPS_CUDA_ARCHS": value})


def test_garbage_in_torch_list_names_that_variable():
    with pytest.raises(bc.BuildConfigError, match=r"TORCH_CUDA_ARCH_LIST: cannot read 'Hopper'"):
        bc.parse_cuda_archs({"TORCH_CUDA_ARCH_LIST": "8.0;Hopper"})


def test_arch_names_match_what_compiled_archs_reports():
    archs = bc.parse_cuda_archs({"SPECTRAL_OPS_CUDA_ARCHS": "80-real;90a;100-virtual"})
    assert bc.arch_names(archs) == ["sm_80", "sm_90a", "compute_100"]
    assert bc.arch_names(bc.parse_cuda_archs({"SPECTRAL_OPS_CUDA_ARCHS": "90a"})) == ["sm_90a", "compute_90a"]


def test_cmakelists_default_matches_build_config():
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r'set\(CMAKE_CUDA_ARCHITECTURES "([^"]+)"\)', text)
    assert match, "CMakeLists.txt no longer sets a default CMAKE_CUDA_ARCHITECTURES"
    assert match.group(1) == bc.cmake_arch_string(list(bc.DEFAULT_CUDA_ARCHS))


# --- whether to build CUDA ------------------------------------------------------------------


def test_no_cuda_env_skips_even_with_nvcc():
    assert bc.cuda_build_decision({"SPECTRAL_OPS_NO_CUDA": "1"}, "/usr/bin/nvcc") == (False, "SPECTRAL_OPS_NO_CUDA=1")


def test_missing_nvcc_skips_with_reason():
    build, reason = bc.cuda_build_decision({}, None)
    assert not build
    assert reason.startswith("no nvcc found")


def test_bad_cudacxx_is_the_reason():
    build, reason = bc.cuda_build_decision({"CUDACXX": "/nowhere/nvcc"}, None)
    assert not build and reason == "CUDACXX=/nowhere/nvcc is not an executable"


def test_require_cuda_without_nvcc_raises():
    with pytest.raises(bc.BuildConfigError, match="SPECTRAL_OPS_REQUIRE_CUDA=1 but no nvcc found"):
        bc.cuda_build_decision({"SPECTRAL_OPS_REQUIRE_CUDA": "1"}, None)


def test_require_and_no_cuda_contradict():
    with pytest.raises(bc.BuildConfigError, match="contradict"):
        bc.cuda_build_decision({"SPECTRAL_OPS_REQUIRE_CUDA": "1", "SPECTRAL_OPS_NO_CUDA": "1"}, "/usr/bin/nvcc")


def test_builds_with_nvcc():
    assert bc.cuda_build_decision({"SPECTRAL_OPS_REQUIRE_CUDA": "1"}, "/x/nvcc") == (True, "nvcc found at /x/nvcc")
    assert bc.cuda_build_decision({"SPECTRAL_OPS_NO_CUDA": "0"}, "/x/nvcc")[0]


@pytest.mark.parametrize(
    "value, expected", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)]
)
def test_env_flag(value, expected):
    assert bc.env_flag({"X": value}, "X") is expected


def test_env_flag_rejects_garbage():
    with pytest.raises(bc.BuildConfigError, match="X='maybe' is not a boolean"):
        bc.env_flag({"X": "maybe"}, "X")


def _fake_nvcc(folder: Path) -> str:
    folder.mkdir(parents=True)
    nvcc = folder / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return str(nvcc)


def test_find_nvcc_order(tmp_path):
    on_path = _fake_nvcc(tmp_path / "path")
    in_home = _fake_nvcc(tmp_path / "home" / "bin")
    chosen = _fake_nvcc(tmp_path / "cxx")
    none = ()
    assert (
        bc.find_nvcc({"PATH": str(tmp_path / "path"), "CUDA_HOME": str(tmp_path / "home"), "CUDACXX": chosen}, none)
        == chosen
    )
    assert bc.find_nvcc({"PATH": str(tmp_path / "path"), "CUDA_HOME": str(tmp_path / "home")}, none) == on_path
    assert bc.find_nvcc({"PATH": str(tmp_path / "empty"), "CUDA_HOME": str(tmp_path / "home")}, none) == in_home
    assert bc.find_nvcc({"PATH": str(tmp_path / "empty")}, (str(tmp_path / "home"),)) == in_home
    assert bc.find_nvcc({"PATH": str(tmp_path / "empty")}, none) is None


def test_parse_nvcc_version():
    text = "Cuda compilation tools, release 13.0, V13.0.88\nBuild cuda_13.0.r13.0/compiler.36424714_0\n"
    assert bc.parse_nvcc_version(text) == "13.0.88"
    assert bc.parse_nvcc_version("garbage") is None


def test_build_config_needs_only_the_standard_library():
    # -S -I: no site-packages and no user paths, so a third-party import would fail here.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('bc', {str(BUILD_CONFIG)!r}); "
        "m = importlib.util.module_from_spec(spec); sys.modules['bc'] = m; spec.loader.exec_module(m); "
        "print(m.cmake_arch_string(m.parse_cuda_archs({})))"
    )
    out = subprocess.run([sys.executable, "-S", "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "80-real;90"


def test_nothing_imports_triton_kernels_as_a_top_level_package():
    # Installed, it is spectral_ops.triton_kernels; `import triton_kernels` would find another distribution.
    pattern = re.compile(r"^\s*(from|import)\s+triton_kernels\b", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("spectral_ops", "triton_kernels", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if pattern.search(path.read_text())
    ]
    assert offenders == []


# --- the no-CUDA install path -----------------------------------------------------------------

# What the build reads; copying only these also checks that the build needs nothing else.
BUILD_INPUTS = ["pyproject.toml", "setup.py", "CMakeLists.txt", "README.md", "spectral_ops", "triton_kernels", "csrc"]


def test_no_cuda_wheel(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "_C*.so", "_build_info.json", "*.egg-info")
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, source / name)
    wheels = tmp_path / "wheels"
    env = {**os.environ, "SPECTRAL_OPS_NO_CUDA": "1"}
    env.pop("SPECTRAL_OPS_REQUIRE_CUDA", None)
    # --no-build-isolation: the test environment already has the build backend, and no network is needed.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(wheels),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    line = "spectral-ops: building without the CUDA extension: SPECTRAL_OPS_NO_CUDA=1"
    assert output.count(line) == 1, output[-4000:]

    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # nothing compiled, so a pure wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "spectral_ops/triton_kernels/__init__.py" in names
    assert "spectral_ops/build_config.py" in names
    assert not [n for n in names if n.startswith("triton_kernels/")]
    assert not [n for n in names if re.match(r"spectral_ops/_C\b", n)]
    info = json.loads(zipfile.ZipFile(wheel).read("spectral_ops/_build_info.json"))
    assert info["cuda_built"] is False
    assert info["reason"] == "SPECTRAL_OPS_NO_CUDA=1"
    assert info["archs"] == []
