"""``python bench/emerging_clipping.py [--shapes 256x256 ...] [--cpuinfo FILE] [--out DIR]``

NVIDIA Emerging-Optimizers' spectral clipping functions against this package's counterparts on the same
float32 weights, on a CPU: each one's relative Frobenius error against the FP64 SVD of the weight, and
its time. The three pairs (docs/integrations.md, "NVIDIA Emerging-Optimizers"):

* hard cap ``s -> min(s, beta)``: its ``spectral_hardcap(W, beta)``, our ``spectral_clip(W, max=beta)``;
* clip ``s -> clamp(s, low, beta)``: its ``spectral_clip(W, low, beta)``, our ``spectral_clip(W, low, beta)``;
* clipped decay ``s -> s - c (s - beta)_+``: its ``spectral_clipped_weight_decay(W, beta, c)``, our
  ``spectral_decay(W, 1, c, 1.0, band=Band(beta, "clip"))``.

Ours runs twice: ``method="auto"`` (a CPU factorises: LAPACK's SVD) and ``method="gram"`` (the SVD-free
route a GPU takes). The weights have singular values log-spaced from 1 down to ``1/kappa`` (random
orthogonal factors); the bounds sit halfway (geometrically) between two neighbouring modes, a third and
two thirds of the way down the spectrum. All at fp32 with torch's default matmul precision ("highest").

Timing: one call of each implementation, then ``--repeats`` rounds in which every implementation runs
once, in the same order (interleaved: a slow spell of the shared machine hits every one alike); the
median of its rounds, and its ratio to Emerging-Optimizers' function for the same operation, timed in
the same rounds. Times at the first ``--kappas`` entry; errors at each.

Emerging-Optimizers needs Python >= 3.12: run this where it imports (the Debian chroot of
docs/testing.md). A chroot has no /proc, so pass the host's ``/proc/cpuinfo``, copied before entering
it, as ``--cpuinfo``: the results record the CPU model and its ISA flags from it. With the defaults it
took 13 minutes on one thread of a shared 2-core AMD EPYC under Debian's torch (a generic BLAS: its
products are slow; the 512x2048 calls take most of it); ``--shapes 256x256 --kappas 100`` takes seconds.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import statistics
import time
from pathlib import Path

import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.linalg import matrix_with_spectrum, relative_error
from spectral_ops.provenance import ISA_FLAGS, machine, machine_line

ROOT = Path(__file__).resolve().parent.parent
CLIPPED_DECAY_COEFFICIENT = 0.5  # c, its default
NOTES = """
Reading it:

* **Times** are those of the torch that runs Emerging-Optimizers (Debian's build in the chroot of
  docs/testing.md: a generic BLAS, CPU capability DEFAULT), whose matrix products are much slower than an
  MKL build's; LAPACK's SVD is not a product, so the ratios favour `auto` more than another build would.
  `gram` against theirs compares like with like: matrix products in fp32 on both sides.
* **Theirs at kappa 100** errs more as the matrix grows (3.2e-6 to 1.0e-4): its Polar Express steps
  resolve a mode's distance to a bound down to 1e-3 of the Frobenius norm of all of them, which grows as
  `sqrt(r)`, so at 256 and 512 modes the modes next to a bound are only partly resolved.
* **Theirs at kappa 1e4**: the smallest modes are below 1e-3 of `||W||_F`, outside its polar factor's
  design range, where its polar factor takes a mode `s` to `pi < 1`; its hard cap then moves a mode below
  `beta` by about `beta pi (1 - pi) / 2` (up to `beta / 8`) instead of leaving it
  (`tests/test_integrations_emerging_optimizers.py` checks its result against that prediction, mode by mode).
* **Ours, the clip at kappa 1e4, 1024x256 and 512x2048**: the smallest modes (1e-4) are at or below fp32's
  zero-mode cutoff `max(m, n) eps s_max` (1.2e-4, 2.4e-4), which ours keeps at 0 by design (docs/api.md,
  "Thresholded ops": below it an fp32 mode has no singular vectors), where the FP64 SVD lifts them to `low`.
  Against the FP64 SVD with that convention, 1024x256 errs 5.9e-4: the lift's own conditioning, which
  multiplies any fp32 method's error on a mode `s` by `low / s` (up to 17 here).
"""


def parse_shape(text: str) -> tuple[int, int]:
    m, n = (int(side) for side in text.lower().split("x"))
    return m, n


def host_machine(cpuinfo: Path) -> dict:
    """:func:`spectral_ops.provenance.machine`, with the CPU model and ISA flags read from ``cpuinfo`` (the
    host's ``/proc/cpuinfo``: inside a chroot there is none)."""
    facts = machine()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return facts
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    facts["cpu"] = model.group(1).strip() if model else facts["cpu"]
    facts["isa_flags"] = [flag for flag in ISA_FLAGS if flag in present]
    return facts


def bounds(spectrum: torch.Tensor) -> tuple[float, float]:
    """``(low, beta)``: halfway between two neighbouring modes, two thirds and a third down the spectrum."""
    def between(index):
        return (spectrum[index] * spectrum[index + 1]).sqrt().item()
    r = len(spectrum)
    return between(2 * r // 3), between(r // 3)


def operations(W: torch.Tensor, low: float, beta: float):
    """``{operation: (exact FP64 result, {implementation: call})}``."""
    from emerging_optimizers.orthogonalized_optimizers import spectral_clip, spectral_hardcap
    from emerging_optimizers.orthogonalized_optimizers.spectral_clipping_utils import spectral_clipped_weight_decay

    c = CLIPPED_DECAY_COEFFICIENT
    band = so.Band(beta, mode="clip")
    return {
        "hard cap": (reference.spectral_clip_svd(W, high=beta), {
            "emerging-optimizers": lambda: spectral_hardcap(W, beta),
            "spectral-ops auto": lambda: so.spectral_clip(W, max=beta),
            "spectral-ops gram": lambda: so.spectral_clip(W, max=beta, method="gram")}),
        "clip": (reference.spectral_clip_svd(W, low, beta), {
            "emerging-optimizers": lambda: spectral_clip(W, low, beta),
            "spectral-ops auto": lambda: so.spectral_clip(W, low, beta),
            "spectral-ops gram": lambda: so.spectral_clip(W, low, beta, method="gram")}),
        "clipped decay": (reference._per_mode(W.double(), lambda s: s - c * (s - beta).clamp_min(0)), {
            "emerging-optimizers": lambda: spectral_clipped_weight_decay(W, beta, c),
            "spectral-ops auto": lambda: so.spectral_decay(W, 1, c, 1.0, band=band),
            "spectral-ops gram": lambda: so.spectral_decay(W, 1, c, 1.0, band=band, method="gram")}),
    }


def timed(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call, over interleaved rounds (one warm-up call each first)."""
    for call in calls.values():
        call()
    seconds = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in seconds.items()}


def measure(shape, kappas, repeats) -> list[dict]:
    rows = []
    for index, kappa in enumerate(kappas):
        spectrum = torch.logspace(0, -torch.log10(torch.tensor(float(kappa))).item(), min(shape), dtype=torch.float64)
        W = matrix_with_spectrum(shape, spectrum, torch.float32, seed=0)
        low, beta = bounds(spectrum)
        for operation, (exact, calls) in operations(W, low, beta).items():
            seconds = timed(calls, repeats) if index == 0 else {}
            baseline = seconds.get("emerging-optimizers")
            for name, call in calls.items():
                rows.append({"shape": list(shape), "kappa": kappa, "operation": operation, "implementation": name,
                             "low": low if operation == "clip" else None, "beta": beta,
                             "error": relative_error(call(), exact),
                             "seconds": seconds.get(name), "ratio": seconds[name] / baseline if seconds else None})
            print(rows[-3:], flush=True)
    return rows


def markdown(rows: list[dict], facts: dict, args) -> str:
    kappas = list(dict.fromkeys(row["kappa"] for row in rows))
    lines = [
        "# Emerging-Optimizers' spectral clipping against spectral-ops (fp32, CPU)",
        "",
        f"Machine: {machine_line(facts)}. Made by `python bench/emerging_clipping.py` "
        f"(--repeats {args.repeats}, --threads {args.threads}), emerging-optimizers {args.version}.",
        "",
        "Relative Frobenius error against the FP64 SVD of the same float32 weight (singular values log-spaced "
        "from 1 to 1/kappa, bounds halfway between two modes), and the median time of interleaved rounds with "
        "its ratio to Emerging-Optimizers' function in the same rounds (at kappa "
        f"{kappas[0]:g}). Ours: `auto` factorises on a CPU (LAPACK's SVD); `gram` is the SVD-free route a GPU "
        "takes. Hard cap `s -> min(s, beta)`, clip `s -> clamp(s, low, beta)`, clipped decay "
        f"`s -> s - {CLIPPED_DECAY_COEFFICIENT} (s - beta)_+`.",
        "",
        "| shape | operation | implementation | " + " | ".join(f"error, kappa {k:g}" for k in kappas)
        + " | time (ms) | time / theirs |",
        "|---|---|---|" + "---|" * len(kappas) + "---|---|",
    ]
    keyed = {(tuple(r["shape"]), r["operation"], r["implementation"], r["kappa"]): r for r in rows}
    for shape, operation, name in dict.fromkeys((tuple(r["shape"]), r["operation"], r["implementation"])
                                                 for r in rows):
        first = keyed[shape, operation, name, kappas[0]]
        errors = " | ".join(f"{keyed[shape, operation, name, k]['error']:.1e}" for k in kappas)
        lines.append(f"| {shape[0]}x{shape[1]} | {operation} | {name} | {errors} | {first['seconds'] * 1e3:.1f} | "
                     f"{first['ratio']:.2f} |")
    return "\n".join(lines) + "\n" + NOTES


def main(argv=None):
    parser = argparse.ArgumentParser(description="Emerging-Optimizers' spectral clipping next to spectral-ops': "
                                     "error against the FP64 SVD and time, fp32, on a CPU (see the module docstring)")
    parser.add_argument("--shapes", nargs="+", default=["256x256", "1024x256", "512x2048"],
                        help="weights to clip, rows x columns (default: 256x256 1024x256 512x2048)")
    parser.add_argument("--kappas", nargs="+", type=float, default=[100.0, 1e4],
                        help="condition numbers of the weights' spectra; times at the first (default: 100 1e4)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (default: 5)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: 1, for a machine whose cores are shared)")
    parser.add_argument("--cpuinfo", type=Path, default=Path("/proc/cpuinfo"),
                        help="the host's /proc/cpuinfo (copy it before entering a chroot, which has none); "
                             "the results record its CPU model and ISA flags (default: /proc/cpuinfo)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "emerging-optimizers",
                        help="folder for emerging-optimizers.md and .json (default: docs/results/emerging-optimizers)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.version = importlib.metadata.version("emerging-optimizers")
    facts = host_machine(args.cpuinfo)
    rows = [row for shape in args.shapes for row in measure(parse_shape(shape), args.kappas, args.repeats)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "emerging-optimizers.md").write_text(markdown(rows, facts, args))
    (args.out / "emerging-optimizers.json").write_text(json.dumps(
        {"machine": facts, "emerging_optimizers": args.version, "repeats": args.repeats, "threads": args.threads,
         "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}/emerging-optimizers.md and .json")


if __name__ == "__main__":
    main()
