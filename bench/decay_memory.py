"""``python bench/decay_memory.py [--shapes 256x256 1024x256 ...] [--out-md FILE.md] [--out-json FILE.json]``

The workspace of one decay step against the size of the matrix it decays, on CPU: the peak of the
bytes allocated (net of frees) while ``spectral_ops.spectral_decay_`` runs, from torch.profiler's
allocation events (``profile_memory=True``) taken in time order, so a temporary freed before the
next one is allocated is not counted twice, as the profiler's per-op totals would count it. Every
decay runs the plan's iterations (``method="gram"``, the route a GPU takes): a CPU's ``"auto"`` may
factorise instead, whose workspace is LAPACK's.

What it sees is what goes through torch's CPU allocator. That includes the scratch oneDNN's bf16
kernels allocate inside a product on CPUs with native bf16 (AVX512_BF16, AMX), which MKL's fp32 GEMM
and the AVX2 kernels do not: each row gives the peak with it, the peak of the tensors alone (the same
on any CPU) and the largest scratch of one product (see :class:`Peak`).

Rows: spectral_decay_ for each shape, dtype and power; optionally a band decay (``Band(tau, "top")``,
p = 2) and one SpectralAdamW step (p = 1 and p = 2, measured on its second step, when the Adam
moments exist), next to torch.optim.AdamW's step as the baseline of the Adam half. "x W" is the
peak in units of the weight's own bytes; "x fp32 W" in units of a float32 copy of it (the plan's
compute dtype), the unit the temporaries of p >= 2 come in.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

import spectral_ops
from spectral_ops import Band
from spectral_ops.optim import SpectralAdamW
from spectral_ops.provenance import machine, machine_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
LR, COEFFICIENT = 0.01, 0.1  # lr * coefficient * s_max^(p-1) stays far below 1: no stability clamp fires


def parse_shape(text: str) -> tuple[int, tuple[int, int]]:
    """``"256x256"`` -> (1, (256, 256)); ``"4@256x256"`` -> a list of 4 such matrices."""
    count, _, shape = text.rpartition("@")
    m, n = (int(side) for side in shape.lower().split("x"))
    return int(count or 1), (m, n)


# The products whose own allocations, freed before they return, are the BLAS library's scratch.
PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


class Peak(NamedTuple):
    """The peak of one call's allocations, net of frees, over its start, in bytes.

    ``total`` counts every allocation. ``tensors`` leaves out the scratch a product allocates and
    frees inside itself (oneDNN's bf16 kernels reorder their operands into blocked buffers there; MKL's
    fp32 GEMM and the AVX2 kernels allocate none): what the caller's own tensors hold, the same on any
    CPU. ``scratch`` is the largest scratch of one product. A copy that torch makes inside a product
    (a ``contiguous`` operand) is a tensor of its own op, so ``tensors`` counts it.
    """

    total: int
    tensors: int
    scratch: int


def _profile(run):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    cpu = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CPU]
    memory = sorted(((e.start_ns(), e.nbytes()) for e in cpu if e.name() == "[memory]"), key=lambda event: event[0])
    ops = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in cpu if e.name() != "[memory]"]
    return memory, ops


def _innermost(time: int, ops):
    """The op that was running at ``time`` and started last, or None."""
    running = [op for op in ops if op[0] <= time < op[1]]
    return max(running, key=lambda op: op[0]) if running else None


def profiled_peak(run) -> Peak:
    """The :class:`Peak` of one profiled call of ``run``: allocation events taken in time order, so a
    temporary freed before the next one is allocated is not counted twice, as the profiler's per-op
    totals would count it. A product's scratch is an allocation made by the product itself (not by
    an op inside it) and freed by it, matched by size (the events carry no address)."""
    memory, ops = _profile(run)
    owner = [_innermost(time, ops) for time, _ in memory]
    scratch_events = set()
    unmatched = {}  # (product, size) -> indices of its own allocations of that size not yet freed
    for index, ((_, nbytes), op) in enumerate(zip(memory, owner)):
        if op is None or op[2] not in PRODUCTS:
            continue
        if nbytes > 0:
            unmatched.setdefault((op, nbytes), []).append(index)
        elif unmatched.get((op, -nbytes)):
            scratch_events.update((unmatched[(op, -nbytes)].pop(), index))
    running = total = held = tensors = scratch = 0
    live_scratch = defaultdict(int)  # product -> its scratch allocated and not yet freed
    for index, ((_, nbytes), op) in enumerate(zip(memory, owner)):
        running += nbytes
        total = max(total, running)
        if index in scratch_events:
            live_scratch[op] += nbytes
            scratch = max(scratch, live_scratch[op])
        else:
            held += nbytes
            tensors = max(tensors, held)
    return Peak(total, tensors, scratch)


def peak(run, repeats: int = 2) -> Peak:
    """The worst :class:`Peak` (each field) of ``repeats`` profiled calls after one unprofiled warm-up
    call (routing caches, lazy initialisation and first-call allocations are not the step's workspace)."""
    run()
    peaks = [profiled_peak(run) for _ in range(repeats)]
    return Peak(*(max(values) for values in zip(*peaks)))


def product_scratch(count: int, shape, dtype) -> int:
    """The largest scratch of a bare torch product of the decay's shapes and dtype, measured now: each
    product the plan forms (the Gram ``X X^T``, ``A X`` and ``b A + c A^2``, with and without an added
    term), with ``X`` contiguous or a transposed view, 2-D for one matrix, batched for a list. What
    the library underneath needs for those products on this machine, whatever the plan does."""
    m, n = shape
    r, N = min(m, n), max(m, n)
    batch = (count,) if count > 1 else ()
    mm, addmm = (torch.bmm, torch.baddbmm) if batch else (torch.mm, torch.addmm)
    A = torch.randn(*batch, r, r).to(dtype)
    worst = 0
    for X in (torch.randn(*batch, r, N).to(dtype), torch.randn(*batch, N, r).to(dtype).mT):
        products = (lambda: mm(X, X.mT), lambda: mm(A, X), lambda: addmm(X, A, X, beta=0.5, alpha=2.0),
                    lambda: addmm(A, A, A, beta=0.5, alpha=2.0))
        worst = max(worst, *(peak(product, repeats=1).scratch for product in products))
    return worst


def weights(count: int, shape, dtype, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Unit-scale entries over sqrt(n): singular values of order 1, as trained weights have.
    return [(torch.randn(shape, generator=generator) / math.sqrt(shape[1])).to(dtype) for _ in range(count)]


def decay_call(tensors, p: int, band=None):
    argument = tensors[0] if len(tensors) == 1 else tensors
    return lambda: spectral_ops.spectral_decay_(argument, p, LR, COEFFICIENT, band=band, method="gram")


def optimizer_step(tensors, p: int | None, rollback: bool = False):
    """One step of SpectralAdamW (or, for ``p=None``, torch.optim.AdamW's foreach step); ``rollback``: the
    step keeps its rollback record (a copy of the weights and both moments as it writes them; off by default)."""
    parameters = [torch.nn.Parameter(t) for t in tensors]
    if p is None:
        optimizer = torch.optim.AdamW(parameters, lr=LR, weight_decay=COEFFICIENT, foreach=True)
    else:
        optimizer = SpectralAdamW(parameters, lr=LR, weight_decay=0.0, p=p, spectral_weight_decay=COEFFICIENT,
                                  decay_method="gram", rollback=rollback)
    generator = torch.Generator().manual_seed(1)
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
    optimizer.step()  # the first step allocates the moments: the state, not the step's workspace
    return optimizer.step


def row(case: str, count: int, shape, dtype_name: str, p, peak: Peak) -> dict:
    numel = count * shape[0] * shape[1]
    matrix_bytes = numel * DTYPES[dtype_name].itemsize
    return {"case": case, "shape": f"{count}@{shape[0]}x{shape[1]}" if count > 1 else f"{shape[0]}x{shape[1]}",
            "dtype": dtype_name, "p": p, "matrix_bytes": matrix_bytes, "peak_bytes": peak.total,
            "tensor_bytes": peak.tensors, "product_scratch_bytes": peak.scratch,
            "x_matrix": peak.tensors / matrix_bytes, "x_fp32_matrix": peak.tensors / (4 * numel)}


def measure(shapes, dtype_names, powers, band: bool, optimizer: bool, repeats: int) -> list[dict]:
    rows = []
    for text in shapes:
        count, shape = parse_shape(text)
        for dtype_name in dtype_names:
            dtype = DTYPES[dtype_name]
            for p in powers:
                rows.append(row("spectral_decay_", count, shape, dtype_name, p,
                                peak(decay_call(weights(count, shape, dtype), p), repeats)))
            if band:
                # tau between the modes (singular values of a random matrix spread over about (0, 2)).
                rows.append(row("band top, tau 1", count, shape, dtype_name, 2,
                                peak(decay_call(weights(count, shape, dtype), 2, Band(tau=1.0, mode="top")), repeats)))
            if optimizer:
                for p in (None, 1, 2):
                    name = "torch AdamW step" if p is None else "SpectralAdamW step"
                    rows.append(row(name, count, shape, dtype_name, "-" if p is None else p,
                                    peak(optimizer_step(weights(count, shape, dtype), p), repeats)))
    return rows


def markdown(rows: list[dict], title: bool = True) -> str:
    lines = []
    if title:
        lines += ["# Workspace of one decay step (CPU)", "",
                  f"`python bench/decay_memory.py` on {machine_line()}. "
                  "Peak of the bytes allocated, net of frees, while one call runs, from torch.profiler's "
                  "allocation events in time order, after a warm-up call; lr 0.01, coefficient 0.1, "
                  "`precision=None` (bf16 weights: bf16 products, fp32 decay arithmetic). "
                  "Tensors: the peak without the scratch a product allocates and frees inside itself "
                  "(oneDNN's bf16 kernels on CPUs with native bf16; none on AVX2 CPUs or in fp32), the "
                  "same on any CPU; all: with it; scratch: the largest of one product. "
                  "x W: tensors in units of the weights' bytes; x fp32 W: in units of a float32 copy of them "
                  "(the compute dtype, the unit of the plan's temporaries). The optimizer rows are the "
                  "second step (the moments exist), the whole step: decay and Adam.", ""]
    lines += ["| case | shape | dtype | p | W bytes | peak: tensors | all | product scratch | x W | x fp32 W |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['shape']} | {r['dtype']} | {r['p']} | {r['matrix_bytes']:,} | "
                     f"{r['tensor_bytes']:,} | {r['peak_bytes']:,} | {r['product_scratch_bytes']:,} | "
                     f"{r['x_matrix']:.2f} | {r['x_fp32_matrix']:.2f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(description="The workspace of one decay step against the matrix size, on CPU: "
                                               "the peak net allocation from torch.profiler's allocation events.")
    main.add_argument("--shapes", nargs="+", default=["256x256", "1024x256", "256x1024", "4@256x256"],
                      help="MxN for one matrix, K@MxN for a list of K same-shape matrices "
                           "(default: 256x256 1024x256 256x1024 4@256x256)")
    main.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
                      help="weight dtypes (default: fp32 bf16)")
    main.add_argument("--powers", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                      help="spectral powers p (default: 0 1 2 3 4)")
    main.add_argument("--no-band", dest="band", action="store_false",
                      help="skip the band decay rows (Band(tau=1, mode='top'), p = 2)")
    main.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                      help="skip the optimizer rows (torch AdamW; SpectralAdamW with p = 1 and 2)")
    main.add_argument("--repeats", type=int, default=2,
                      help="profiled calls per row after one warm-up call; the worst is kept (default: 2)")
    main.add_argument("--out-md", type=Path, default=None,
                      help="write the markdown table here (default: print it only)")
    main.add_argument("--out-json", type=Path, default=None, help="write the rows as JSON here")
    return main


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    rows = measure(args.shapes, args.dtypes, args.powers, args.band, args.optimizer, args.repeats)
    print(markdown(rows, title=False), end="")
    if args.out_md:
        args.out_md.write_text(markdown(rows))
    if args.out_json:
        args.out_json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
