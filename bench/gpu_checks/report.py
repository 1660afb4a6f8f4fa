"""The report of a run: the machine, the time each phase took, the counts per status and one row per
task, as JSON and markdown.

Every row has a ``status`` -- ok, failed, skipped (with the reason) or timed out (with the limit) --
and ``ok``: true, false, or null for skipped and timed out, which are no verdict. The markdown table
(``--out DIR``: ``DIR/gpu_check.md``) and the JSON (``--json``, default ``bench/gpu_check.json``, or
``DIR/gpu_check.json``) hold one row per case, shape and dtype in each phase, the time each phase
took and the counts per status.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from .cases import TRITON
from .runner import PHASES
from .tables import number, row_status, table


def environment(device, cuda_reason) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "input_precision": TRITON.input_precision, "cuda_extension": cuda_reason or "loaded",
    }


def summarise(report: dict) -> None:
    """Per phase, the seconds its tasks took (the check phase's include every JIT compile and first-use
    warm-up); per status, how many rows have it."""
    rows = report["results"]
    report["phase_s"] = {"build": report["build_s"], **{
        phase: round(sum(r.get("wall_s", 0.0) for r in rows if r["phase"] == phase), 1) for phase in PHASES}}
    report["summary"] = {status: sum(r["status"] == status for r in rows)
                         for status in ("ok", "failed", "timed out", "skipped")}


_COMMON_COLUMNS = [("case", lambda r: r["case"]), ("backend", lambda r: r["backend"]), ("dtype", lambda r: r["dtype"]),
                   ("shape", lambda r: "x".join(map(str, r["shape"]))), ("status", row_status)]
_CHECK_COLUMNS = _COMMON_COLUMNS + [("rel. error", number("error", ".2e")), ("tol", number("tolerance", ".0e")),
                                    ("note", lambda r: r.get("note", "")), ("s", number("wall_s", ".1f"))]
_TIMING_COLUMNS = _COMMON_COLUMNS + [
    ("ms", number("ms", ".3f")), ("baseline", lambda r: r["baseline"]), ("baseline ms", number("baseline_ms", ".3f")),
    ("speedup", lambda r: f"{r['speedup']:.2f}x" if "speedup" in r else ""), ("runs", number("runs", "d")),
    ("rel. error", number("error", ".2e")), ("tol", number("tolerance", ".0e")),
    ("note", lambda r: r.get("note", "")), ("s", number("wall_s", ".1f"))]
_SECTIONS = {"check": ("1. Checks", _CHECK_COLUMNS), "headline": ("2. Headline timings", _TIMING_COLUMNS),
             "rest": ("3. Other timings", _TIMING_COLUMNS)}


def markdown(report: dict) -> str:
    env, phase_s = report["environment"], report["phase_s"]
    lines = [f"# gpu_check on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; CUDA extension: "
             f"{env['cuda_extension']}; budget {report['budget_s']:.0f} s.", "",
             f"Seconds: build {phase_s['build']:.0f}, checks {phase_s['check']:.0f} (every JIT compile and warm-up), "
             f"headline timings {phase_s['headline']:.0f}, other timings {phase_s['rest']:.0f}.", "",
             "Cases: " + ", ".join(f"{count} {status}" for status, count in report["summary"].items()) + "."]
    for phase, (title, columns) in _SECTIONS.items():
        rows = [row for row in report["results"] if row["phase"] == phase]
        lines += ["", f"## {title}", "", table(rows, columns) if rows else "(none)"]
    lines += ["", "## 4. Measured routing", "", "What dispatch measured and chose during this run (the cases "
              "routed \"auto\" use it).", "", report.get("routing", "(not yet)")]
    return "\n".join(lines) + "\n"


def report_paths(args, stem: str) -> tuple[Path, Path | None]:
    """``--out DIR``: ``DIR/<stem>.json`` and ``DIR/<stem>.md``; else ``--json`` and no markdown file."""
    if args.out is None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        return args.json, None
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out / f"{stem}.json", args.out / f"{stem}.md"
