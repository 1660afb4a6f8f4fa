"""bench/teardown_stress.py without launching anything: how a process's ending is classified, and the
report it writes (the launches themselves take minutes: docs/testing.md)."""

import importlib.util
import json
import signal
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("teardown_stress",
                                               Path(__file__).parents[1] / "bench" / "teardown_stress.py")
teardown_stress = importlib.util.module_from_spec(_spec)
sys.modules["teardown_stress"] = teardown_stress
_spec.loader.exec_module(teardown_stress)


def test_an_ending_is_judged_by_the_done_marker_then_the_exit_code():
    done = f"step 3\n{teardown_stress.DONE}\n"
    assert teardown_stress.outcome(done, 0) == "clean"
    assert teardown_stress.outcome(done, -signal.SIGABRT) == "aborted after done"
    assert teardown_stress.outcome(done, 1) == "failed after done"
    assert teardown_stress.outcome(done, -signal.SIGSEGV) == "failed after done"
    # Without the marker the run failed, whatever the exit code says (a crash, or a raise caught late).
    assert teardown_stress.outcome("step 3\n", 0) == "failed before done"
    assert teardown_stress.outcome("", -signal.SIGABRT) == "failed before done"


def test_the_report_has_a_row_per_variant_and_names_the_machine(tmp_path):
    counts = {("fsdp", "spectral-muon", "none"): {"clean": 31, "aborted after done": 1, "failed after done": 0,
                                                  "failed before done": 0}}
    settings = dict(runs=32, load=2, optimizers=["spectral-muon"], teardowns=["none"], parallels=["fsdp"],
                    steps=3, world_size=2, concurrent=1, as_worker=False, output=str(tmp_path / "t"))
    teardown_stress.write_report(str(tmp_path / "t"), counts, settings)
    markdown = (tmp_path / "t.md").read_text()
    assert "| fsdp | spectral-muon | none | 31/32 | 1/32 | 0/32 | 0/32 |" in markdown
    assert "--optimizers spectral-muon" in markdown and "threads" in markdown
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["counts"] == [{"parallel": "fsdp", "optimizer": "spectral-muon", "teardown": "none",
                               **counts[("fsdp", "spectral-muon", "none")]}]
    assert "isa_flags" in data["machine"] and data["settings"]["runs"] == 32 and "output" not in data["settings"]
