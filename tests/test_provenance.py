"""The machine a result names: its CPU, the instruction sets its kernels depend on, torch and the BLAS."""

import json

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
