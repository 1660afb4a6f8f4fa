"""The report of a run: the driver/toolkit line first, the machine, the setup (build and compile pool),
the time each stage took, the counts per status and one row per task, as JSON and markdown.

Every row has a ``status`` -- ok, failed, skipped (with the reason) or timed out (with the limit) --
and ``ok``: true, false, or null for skipped and timed out, which are no verdict. The markdown table
(``--out DIR``: ``DIR/gpu_check.md``) and the JSON (``--json``, default ``bench/gpu_check.json``, or
``DIR/gpu_check.json``) hold one row per check or timing of a case, shape and dtype, by stage:
headline, breadth, CUDA cases. A timing row shows both sides' ms, TFLOP/s and % of the GPU's peak,
the model's predicted ms, the provider the router would choose and whether it measured fastest.
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
    """Per stage, the seconds it took (setup: the build and the compile pool side by side); per status,
    how many rows have it."""
    rows = report["results"]
    report["phase_s"] = {"setup": report["build_s"], **{
        phase: round(sum(r.get("wall_s", 0.0) for r in rows if r["phase"] == phase), 1) for phase in PHASES}}
    report["summary"] = {status: sum(r["status"] == status for r in rows)
                         for status in ("ok", "failed", "timed out", "skipped")}


def _yes_no(value) -> str:
    return "" if value is None else ("yes" if value else "**no**")


_COMMON_COLUMNS = [("case", lambda r: r["case"]), ("backend", lambda r: r["backend"]), ("dtype", lambda r: r["dtype"]),
                   ("shape", lambda r: "x".join(map(str, r["shape"]))), ("status", row_status)]
_CHECK_COLUMNS = _COMMON_COLUMNS + [("rel. error", number("error", ".2e")), ("tol", number("tolerance", ".0e")),
                                    ("note", lambda r: r.get("note", "")), ("s", number("wall_s", ".1f"))]
_TIMING_COLUMNS = _COMMON_COLUMNS + [
    ("precision", lambda r: r.get("precision", "")), ("ms", number("ms", ".3f")),
    ("TFLOP/s", number("tflops", ".1f")), ("% peak", number("peak_pct", ".0f")),
    ("predicted ms", number("predicted_ms", ".3f")), ("baseline", lambda r: r["baseline"]),
    ("baseline ms", number("baseline_ms", ".3f")), ("baseline TFLOP/s", number("baseline_tflops", ".1f")),
    ("baseline % peak", number("baseline_peak_pct", ".0f")),
    ("baseline predicted ms", number("baseline_predicted_ms", ".3f")),
    ("speedup", lambda r: f"{r['speedup']:.2f}x" if "speedup" in r else ""),
    ("router", lambda r: r.get("router") or ""),
    ("fastest", lambda r: r.get("fastest", "")), ("router's is fastest", lambda r: _yes_no(r.get("router_fastest"))),
    ("runs", number("runs", "d")), ("rel. error", number("error", ".2e")),
    ("note", lambda r: "; ".join(filter(None, [r.get("note"), r.get("model_error") and f"model: {r['model_error']}"]))),
    ("s", number("wall_s", ".1f"))]
_SECTIONS = {"headline": "1. Headline: each case checked, then timed", "breadth": "2. Breadth",
             "cuda": "3. The CUDA extension's cases (in a child process)"}


def markdown(report: dict) -> str:
    env, phase_s, setup = report["environment"], report["phase_s"], report.get("setup", {})
    triton = setup.get("triton", {})
    lines = [f"# gpu_check on {env['device']}", "", f"**{report.get('toolchain', '')}**", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; CUDA extension: "
             f"{env['cuda_extension']}; budget {report['budget_s']:.0f} s.", "",
             f"Setup: {setup.get('build', '')}; Triton variants compiled ahead: "
             + (f"{triton['variants']} for {triton['arch']} in {triton['compile_s']:.0f} s ({triton['workers']} "
                f"processes), {len(triton['failed'])} failed, {triton['with_stack']} with a stack frame"
                if "variants" in triton else triton.get("error", "none")) + ".", "",
             f"Seconds: setup {phase_s['setup']:.0f}, headline {phase_s['headline']:.0f}, breadth "
             f"{phase_s['breadth']:.0f}, CUDA cases {phase_s['cuda']:.0f}.", "",
             "Cases: " + ", ".join(f"{count} {status}" for status, count in report["summary"].items()) + ".", "",
             "Timings are at equal precision on both sides (bf16 against bf16 cuBLAS, tf32 against cuBLAS with "
             "TF32 allowed, fp32 against fp32 cuBLAS). TFLOP/s and % peak: the cost model's FLOPs for each side's "
             "provider (spectral_ops.gpu_model); predicted: its time, blank where it has no measured efficiency; "
             "router: the provider dispatch would choose for that call now; fastest: among the providers timed "
             "for that call."]
    for phase, title in _SECTIONS.items():
        lines += ["", f"## {title}"]
        for kind, columns in (("check", _CHECK_COLUMNS), ("timing", _TIMING_COLUMNS)):
            rows = [row for row in report["results"] if row["phase"] == phase and row.get("kind") == kind]
            if rows:
                lines += ["", table(rows, columns)]
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
