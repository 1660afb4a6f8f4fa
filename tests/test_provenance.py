"""The machine a result names: its CPU, the instruction sets its kernels depend on, torch and the BLAS."""

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

import torch

from spectral_ops.provenance import ISA_FLAGS, machine, machine_line


def test_the_machine_names_the_cpu_its_isa_flags_and_the_libraries():
    facts = machine()
    json.dumps(facts)  # it goes into results files as it is
    assert facts["cpu"] and facts["torch"] == str(torch.__version__) and facts["blas"]
    assert set(facts["isa_flags"]) <= set(ISA_FLAGS)
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return
    assert facts["isa_flags"] == [flag for flag in ISA_FLAGS if flag in flags]


def test_the_line_carries_every_fact_a_cpu_number_depends_on(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    facts = machine()
    line = machine_line(facts)
    for fact in (facts["cpu"], facts["torch"], facts["blas"], f"{facts['threads']} threads", "ONEDNN_MAX_CPU_ISA=AVX2",
                 "MKL_ENABLE_INSTRUCTIONS=AVX2", *facts["isa_flags"]):
        assert fact in line


# An absolute path on the machine that wrote a report: a home, a checkout, a venv or a temporary folder.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:home|root|work|tmp|var|opt|usr|mnt|srv)/[\w./-]+|site-packages")
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_no_committed_report_names_a_path_of_the_machine_that_wrote_it():
    """A report names the tools and their versions that made it (provenance, bench/sass.py's tool_label),
    never where the writer kept them: a reader's machine has other paths, and a path leaks a user's folders."""
    offenders = {}
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in (".md", ".json", ".csv", ".txt") and path.is_file():
            found = sorted(set(MACHINE_PATH.findall(path.read_text(errors="replace"))))
            if found:
                offenders[str(path.relative_to(RESULTS))] = found[:3]
    assert not offenders


def test_a_tool_is_named_by_its_release_and_origin_not_its_path(tmp_path):
    spec = importlib.util.spec_from_file_location("sass", RESULTS.parents[1] / "bench" / "sass.py")
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    tool = tmp_path / "cuda" / "bin" / "cuobjdump"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    tool.chmod(0o755)
    assert sass.tool_label(tool) == "cuobjdump 12.8 (CUDA toolkit)"
    bundled = tmp_path / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    triton = importlib.metadata.version("triton")
    assert sass.tool_label(bundled, "12.8") == f"ptxas 12.8 (bundled with triton {triton})"
    assert not MACHINE_PATH.search(sass.tool_label(tool)) and str(tmp_path) not in sass.tool_label(bundled, "12.8")
