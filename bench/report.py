"""``python bench/report.py RESULTS.json [--out FILE.md]``: pytest-benchmark JSON -> markdown tables.

Main table, one row per (op, implementation, shape, dtype): its precision, median time with its
p20-p80 range, TFLOP/s and (on a GPU) percent of the measured dense-matmul peak (FLOP model in
flops.py), and the speedup over the composed-torch route (``spectral_ops[torch]``) and over the FP32
SVD route (``svd32``) measured in the same run. Further tables: SpectralMuon against torch.optim.Muon
(interleaved ratios, and the bytes each step copies), and the CPU method-selection crossover, if
they were run. The header names the machine the benchmarks ran on (``machine_line``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from spectral_ops.provenance import ISA_FLAGS, machine_line

COMPOSED_TORCH = "spectral_ops[torch]"
SVD_ROUTE = "svd32"


def quantiles(entry) -> tuple[float, float, float]:
    """Median and p20/p80 of the timing rounds (raw data needs ``--benchmark-save-data``;
    without it, the quartiles stand in for p20/p80)."""
    stats = entry["stats"]
    data = stats.get("data")
    if data and len(data) >= 2:
        cuts = statistics.quantiles(data, n=10)
        return stats["median"], cuts[1], cuts[7]
    return stats["median"], stats["q1"], stats["q3"]


def seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def shape_text(shape) -> str:
    return "x".join(map(str, shape))


def main_table(entries) -> list[str]:
    rows = [e for e in entries if not e["extra_info"]["op"].startswith("select_")
            and e["extra_info"]["op"] not in AGAINST_TORCH]
    medians = {}
    for e in rows:
        info = e["extra_info"]
        medians[(info["op"], shape_text(info["shape"]), info["dtype"], info["implementation"])] = e["stats"]["median"]
    lines = ["| op | implementation | shape | dtype | precision | median (p20-p80) | TFLOP/s | % of peak | "
             "vs composed torch | vs SVD route |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(rows, key=lambda e: (e["extra_info"]["op"], e["extra_info"]["shape"], e["extra_info"]["dtype"],
                                         e["stats"]["median"])):
        info = e["extra_info"]
        median, low, high = quantiles(e)
        key = (info["op"], shape_text(info["shape"]), info["dtype"])
        rate = info["flops"] / median if info["flops"] else 0.0
        # A CPU's "peak" from one small GEMM is no ceiling (LAPACK and bf16 kernels beat it): GPU only.
        on_gpu = info.get("device") == "cuda" and info.get("peak_flops")
        percent = f"{100 * rate / info['peak_flops']:.1f}%" if on_gpu and rate else "-"

        def speedup(baseline):
            other = medians.get((*key, baseline))
            return f"{other / median:.2f}x" if other else "-"

        lines.append(f"| {info['op']} | {info['implementation']} | {key[1]} | {info['dtype']} | "
                     f"{info.get('precision', '-')} | "
                     f"{seconds(median)} ({seconds(low)}-{seconds(high)}) | {rate / 1e12:.3g} | {percent} | "
                     f"{speedup(COMPOSED_TORCH)} | {speedup(SVD_ROUTE)} |")
    return lines


def selection_table(entries) -> list[str]:
    """Per (p, shape, dtype): each method's median, the fastest, and how far ``auto`` is from it."""
    table = defaultdict(dict)
    for e in entries:
        info = e["extra_info"]
        if info["op"].startswith("select_"):
            shape_key = (info["op"][len("select_"):], tuple(info["shape"]), info["dtype"])
            table[shape_key][info["implementation"]] = e["stats"]["median"]
    if not table:
        return []
    lines = ["| op | shape | dtype | gram | svd | eigh | auto | fastest | auto / fastest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (selection, shape, dtype), times in sorted(table.items()):
        candidates = {m: t for m, t in times.items() if m != "auto"}
        best = min(candidates, key=candidates.get)
        cells = [seconds(times[m]) if m in times else "-" for m in ("gram", "svd", "eigh", "auto")]
        ratio = times["auto"] / candidates[best] if "auto" in times else float("nan")
        # "p2": spectral_power's; else a band form (test_band_method_selection).
        op = f"S_{selection[1:]}" if selection[0] == "p" and selection[1:].isdigit() else selection
        lines.append(f"| {op} | {shape_text(shape)} | {dtype} | {' | '.join(cells)} | {best} | {ratio:.2f} |")
    return lines


# Benchmarks that time one of ours against a torch optimizer in the same interleaved rounds:
# op -> (section title, what the implementation column holds, the torch side).
AGAINST_TORCH = {
    "muon_vs_torch": ("SpectralMuon against torch.optim.Muon (interleaved, same run)", "SpectralMuon",
                      "torch.optim.Muon step"),
    "optimizer_step_vs_adamw": ("Optimizer step against torch.optim.AdamW(foreach=True) (interleaved, same run)",
                                "optimizer", "AdamW step"),
    "schedule_vs_rectangle": ("Gram-space iteration against the rectangle (interleaved, same run)", "schedule",
                              "rectangle"),
    "decay_vs_spectral_power": ("spectral_decay_ against spectral_power (interleaved, same run)", "decay",
                                "spectral_power"),
    "stochastic_vs_nearest_rounding": ("spectral_decay_ of bf16 weights rounded stochastically against rounded to "
                                       "nearest (interleaved, same run)", "stochastic", "nearest"),
    "compiled_step_vs_eager": ("The default step under torch.compile against the same step eager (interleaved, "
                               "same run)", "compiled", "eager step"),
}


def mebibytes(count: int) -> str:
    return f"{count / 2**20:.3g} MiB"


def against_torch_tables(entries) -> list[str]:
    """Per such op, our step time over torch's, both timed in the same interleaved rounds; and where
    the benchmark counted them, the bytes each step copies (machine-independent)."""
    lines = []
    for op, (title, ours, theirs) in AGAINST_TORCH.items():
        rows = [e["extra_info"] for e in entries if e["extra_info"]["op"] == op]
        if not rows:
            continue
        copies = all("ours_copied_bytes" in info for info in rows)
        copy_header = " | copied per step (ours / torch)" if copies else ""
        lines += ["", f"### {title}", "", f"| case | {ours} | precision | our step | {theirs} | ratio{copy_header} |",
                  "|---|---|---|---|---|---|" + ("---|" if copies else "")]
        for info in sorted(rows, key=lambda info: (info["case"], info["implementation"])):
            case = info["case"]
            if "flops_r3" in info:  # FlopCounterMode's counts, as torch counts them
                case += f" ({info['flops_r3']:.0f} r^3 FLOPs against {info['rectangle_flops_r3']:.0f})"
            copied = (f" | {mebibytes(info['ours_copied_bytes'])} / {mebibytes(info['torch_copied_bytes'])}"
                      if copies else "")
            lines.append(f"| {case} | {info['implementation']} | {info['precision']} | "
                         f"{seconds(info['ours_median_s'])} | {seconds(info['torch_median_s'])} | {info['ratio']:.2f}x"
                         f"{copied} |")
    return lines


def machine_text(results: dict) -> str:
    """The machine the benchmarks ran on: :func:`~spectral_ops.provenance.machine_line` of the facts
    bench/conftest.py stored, or, in results saved before it did, the CPU's brand and ISA flags as
    pytest-benchmark recorded them (torch and the BLAS were not)."""
    machine = results.get("machine_info", {})
    if "spectral_ops" in machine:
        return machine_line(machine["spectral_ops"])
    cpu = machine.get("cpu", {})
    flags = ", ".join(flag for flag in ISA_FLAGS if flag in cpu.get("flags", ())) or "no AVX2"
    return (f"{cpu.get('brand_raw', machine.get('processor', 'unknown CPU'))} ({flags}), "
            f"{cpu.get('count', '?')} threads, torch and BLAS not recorded")


def render(results: dict) -> str:
    entries = results["benchmarks"]
    header = [f"Benchmarks on {machine_text(results)}, {results.get('datetime', '')}; "
              f"device: {entries[0]['extra_info']['device'] if entries else '?'}.", ""]
    selection = selection_table(entries)
    body = main_table(entries) if any(e["extra_info"]["op"] not in AGAINST_TORCH for e in entries) else []
    body += against_torch_tables(entries)
    if selection:
        body += ["", "### Method selection (`spectral_power` and the band forms, CPU)", ""] + selection
    return "\n".join(header + body) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path, help="write the markdown here too")
    args = parser.parse_args(argv)
    text = render(json.loads(args.results.read_text()))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
