"""``--compile-only`` needs no GPU: it runs the Triton cases on CPU tensors with Triton's launcher
replaced by a recorder, compiles each distinct kernel specialisation it saw for the named targets
to a cubin (with Triton's bundled ``ptxas``, 12.8 in triton 3.7, which handles sm80 and sm90;
``TRITON_PTXAS_PATH`` names another), and reads each cubin's registers, stack frame, local and
shared memory with ``cuobjdump -res-usage`` (``bench/sass.py``); register spills show as a stack
frame. The same for every kernel of the built ``_C`` (its code for the target, as built: a target
it was not built for is reported as skipped). It exits 1 if a variant fails to compile or needs
more shared memory than the target has. ``--out DIR`` writes ``DIR/compile_only.md`` and ``.json``.
It relies on Triton's launcher internals (``JITFunction.run``, checked against triton 3.7).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import importlib.util
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

import torch

from .cases import REGISTRY, selected
from .checkout import bench_module, use_this_checkout
from .report import report_paths
from .tables import number, row_status, table

SASS = bench_module("sass")  # resource usage and SASS read with cuobjdump

# Shared memory a block may use (opt-in maximum), per target.
SHARED_MEMORY_LIMIT = {"sm80": 166912, "sm90": 232448}
STATIC_SHARED_LIMIT = 48 * 1024  # static __shared__ arrays; beyond it a kernel must use dynamic shared memory
# Without a GPU the cases run on CPU tensors (their launches are recorded, never run).
CPU = torch.device("cpu")

# Each worker holds torch and an LLVM context (~0.5 GB); a GPU machine has 16 or more cores.
MAX_COMPILE_WORKERS = 16


@contextlib.contextmanager
def zero_filled_allocations():
    """``torch.empty``, ``empty_like`` and ``Tensor.new_empty`` return zeros while launches are recorded.

    A recorded kernel writes nothing, so its output keeps what the allocation held: uninitialised
    memory may hold an infinity or a NaN, which a host-side check of the result (``checked_finite``)
    then reports as an overflow. Zeros are finite, and the same on every run."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).zero_()
    torch.empty_like = lambda *args, **kwargs: empty_like(*args, **kwargs).zero_()
    torch.Tensor.new_empty = lambda self, *args, **kwargs: new_empty(self, *args, **kwargs).zero_()
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty


def record_launches(cases, arch: str, device: torch.device = CPU, tiny: bool = False) -> tuple[dict, list[dict]]:
    """Every distinct kernel specialisation the selected cases launch with ``arch``'s configs, and one
    row per case whose recording stopped early.

    The cases run on ``device``'s tensors (the CPU without a GPU; on a GPU its host code is quicker
    there) at their full shapes (``tiny``: their interpreter shapes); each launch is bound and
    specialised exactly as Triton's launcher would for that target, then recorded instead of compiled
    and run (outputs are zeros: :func:`zero_filled_allocations`). A case whose host code raises on
    those zeros keeps the launches it made before; its row names the case and the error (no verdict on
    a kernel: ``ok`` is None).
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from spectral_ops.triton_kernels import common

    target = GPUTarget("cuda", int(arch[2:]), 32)
    backend = make_backend(target)
    launches = {}

    def record(kernel, *args, grid, warmup, **kwargs):
        kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        key = (kernel.fn.__name__, str(signature), str(sorted(constexprs.items())), str(attrs), str(options))
        launches.setdefault(key, (kernel, signature, constexprs, attrs, options))

    stopped = []
    real_run, real_arch = JITFunction.run, common.arch
    # CPU tensors take the target's configs; a GPU's own tensors take the configs a launch on it would.
    JITFunction.run, common.arch = record, (lambda device: arch) if device.type == "cpu" else real_arch
    try:
        for case in cases:
            for dtype in case.dtypes:
                for shape in case.tiny_shapes if tiny else case.shapes:
                    try:
                        with zero_filled_allocations():
                            case.fn(case.inputs(shape, dtype, device))
                    except Exception as error:
                        stopped.append({"source": "recording", "case": case.name, "arch": arch,
                                        "dtype": str(dtype).removeprefix("torch."), "shape": list(shape), "ok": None,
                                        "status": "stopped early",
                                        "reason": f"{type(error).__name__}: {error}"[:300]})
    finally:
        JITFunction.run, common.arch = real_run, real_arch
    return launches, stopped


def _resources(usage: dict) -> dict:
    """One kernel's ``cuobjdump -res-usage`` fields, as the report names them. Register spills and
    local arrays show as a stack frame (or local memory)."""
    return {"registers": usage["registers"], "stack": usage.get("stack", 0), "local": usage.get("local", 0),
            "static_shared": usage.get("shared", 0)}


def compile_jobs(launches: dict, arch: str) -> list[dict]:
    """One picklable description per recorded specialisation: a worker process finds the kernel by
    its module and name, and compiles it exactly as Triton's launcher would."""
    jobs = []
    for kernel, signature, constexprs, attrs, options in launches.values():
        flags = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()
                 if kernel.arg_names[path[0]].isupper()}
        pointers = sorted({kind for kind in signature.values() if kind.startswith("*")})
        jobs.append({"module": kernel.fn.__module__, "name": kernel.fn.__name__, "arch": arch,
                     "signature": signature, "constexprs": constexprs, "attrs": attrs, "options": options.__dict__,
                     "row": {"source": "triton", "kernel": kernel.fn.__name__, "arch": arch,
                             "operands": " ".join(pointers), "num_warps": options.num_warps,
                             "num_stages": options.num_stages, "constexprs": flags}})
    return jobs


def compile_variant(job: dict) -> dict:
    """One specialisation compiled for its arch by Triton (its bundled ``ptxas``, or the one
    ``TRITON_PTXAS_PATH`` names), its cubin read back with cuobjdump: what the GPU would load. The
    compiled kernel lands in Triton's cache, where a later launch of the same specialisation finds it."""
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(job["module"]), job["name"])
    arch = job["arch"]
    ptxas = knobs.nvidia.ptxas
    row = {**job["row"], "ptxas": SASS.tool_label(ptxas.path, ptxas.version)}
    started = time.monotonic()
    try:
        compiled = triton.compile(ASTSource(kernel, job["signature"], job["constexprs"], job["attrs"]),
                                  target=GPUTarget("cuda", int(arch[2:]), 32), options=job["options"])
    except Exception as error:
        # Triton's message is the source around the failure, then the cause: keep the cause.
        message = str(error)
        reason = message if len(message) <= 500 else "..." + message[-500:]
        return {**row, "ok": False, "status": "failed", "reason": f"{type(error).__name__}: {reason}"}
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        row.update(_resources(SASS.resource_usage(cubin)[compiled.metadata.name]))
        row.update(SASS.features(SASS.sass_instructions(cubin)[compiled.metadata.name]))
    row["compile_s"] = round(time.monotonic() - started, 2)
    # Triton asks for its shared memory at launch (dynamic); static arrays come on top.
    row["shared"] = compiled.metadata.shared + row["static_shared"]
    limit = SHARED_MEMORY_LIMIT.get(arch, SHARED_MEMORY_LIMIT["sm80"])  # a GPU's own arch: sm80's is the least
    row["ok"] = row["shared"] <= limit
    row["status"] = "ok" if row["ok"] else "failed"
    if not row["ok"]:
        row["reason"] = f"needs {row['shared']} B of shared memory, {arch} has {limit}"
    return row


def compile_pool(workers: int):
    """Worker processes that compile Triton variants (:func:`compile_variant`), started fresh
    (``spawn``): a fork of a process that has run torch's thread pools may hang. Each imports the
    package from this checkout first."""
    context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=use_this_checkout)


def compile_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_COMPILE_WORKERS))


def compile_all(jobs: list[dict], workers: int) -> list[dict]:
    """Every job's row, in the jobs' order: in this process for one worker, else in a pool."""
    if workers <= 1:
        return [compile_variant(job) for job in jobs]
    with compile_pool(workers) as pool:
        return list(pool.map(compile_variant, jobs))


def extension_resources(arch: str) -> list[dict]:
    """Every kernel of the built ``spectral_ops._C`` for ``arch``, read from its SASS with cuobjdump
    (no GPU, no rebuild: it says what that build holds). cuobjdump sees static shared memory only;
    the fused chain sizes its dynamic shared memory at launch, from the matrix size."""
    found = importlib.util.find_spec("spectral_ops._C")
    head = {"source": "_C", "kernel": "spectral_ops._C", "arch": arch}
    if found is None:
        return [{**head, "ok": None, "status": "skipped", "reason": "not built (python -m spectral_ops says why)"}]
    gpu = f"sm_{arch[2:]}"
    kernels = SASS.module_kernels(found.origin, gpu)  # cached: tests/test_cuda_sass.py reads the same
    if not kernels:
        return [{**head, "ok": None, "status": "skipped", "reason": f"the build holds no {gpu} code (python -m "
                 "spectral_ops lists what it holds): set SPECTRAL_OPS_CUDA_ARCHS and rebuild"}]
    rows = []
    for name in sorted(kernels):
        opcodes = [opcode for _, _, opcode, _ in kernels[name]["listing"]]
        row = {**head, "kernel": name, **_resources(kernels[name]["usage"]), **SASS.features(opcodes)}
        row["ok"] = row["static_shared"] <= STATIC_SHARED_LIMIT
        row["status"] = "ok" if row["ok"] else "failed"
        rows.append(row)
    return rows


def source_description() -> str:
    """The command and the checkout's commit (``+ changes`` when its tracked files differ from it)."""
    import subprocess

    from .checkout import ROOT

    def git(*command) -> str:
        result = subprocess.run(["git", "-C", str(ROOT), *command], capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = " + changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"`python3 bench/gpu_check.py {' '.join(sys.argv[1:])}` at commit {commit}{changed}"


def cpu_description() -> dict:
    """This machine's CPU: its model, cores and instruction-set flags (the recording runs the cases'
    host code on it; the compiled code does not depend on it)."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return {"model": fields.get("model name", platform.processor() or platform.machine()),
            "cores": len(os.sched_getaffinity(0)), "flags": fields.get("flags", "").split()}


# The flags that decide how fast torch's CPU kernels run the recording's host code (bf16 is emulated without them).
_NOTABLE_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
_RESOURCE_COLUMNS = [("registers", number("registers", "d")), ("stack B", number("stack", "d")),
                     ("local B", number("local", "d"))]
_SASS_COLUMNS = [(name, number(name, "d")) for name in ("HGMMA", "HMMA", "TMA", "LDGSTS")]
_TRITON_COLUMNS = [("kernel", lambda r: r["kernel"]), ("arch", lambda r: r["arch"]),
                   ("operands", lambda r: r["operands"]), ("warps", lambda r: r["num_warps"]),
                   ("stages", lambda r: r["num_stages"]), *_RESOURCE_COLUMNS,
                   ("shared KiB", lambda r: f"{r['shared'] / 1024:.1f}" if "shared" in r else ""), *_SASS_COLUMNS,
                   ("status", row_status), ("constexprs", lambda r: r["constexprs"])]
_EXTENSION_COLUMNS = [("kernel", lambda r: r["kernel"]), ("arch", lambda r: r["arch"]), *_RESOURCE_COLUMNS,
                      ("static shared KiB", lambda r: f"{r['static_shared'] / 1024:.1f}" if "static_shared" in r
                       else ""), *_SASS_COLUMNS, ("status", row_status)]
_RECORDING_COLUMNS = [("case", lambda r: r["case"]), ("arch", lambda r: r["arch"]), ("dtype", lambda r: r["dtype"]),
                      ("shape", lambda r: "x".join(map(str, r["shape"]))), ("status", row_status)]


def warm_triton_cache(cases, device, workers: int) -> dict:
    """On a GPU, before the checks: record the Triton variants the cases launch on this GPU (no kernel
    runs) and compile them in a pool of ``workers`` processes into Triton's cache, where each first
    launch then finds its kernel. Returns the summary the report shows."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm{major}{minor}"
    started = time.monotonic()
    launches, stopped = record_launches(cases, arch, device)
    recorded = time.monotonic()
    rows = compile_all(compile_jobs(launches, arch), workers)
    return {"arch": arch, "variants": len(rows), "failed": [row.get("reason") for row in rows if row["ok"] is False],
            "with_stack": sum(bool(row.get("stack")) for row in rows), "recordings_stopped": len(stopped),
            "record_s": round(recorded - started, 1), "compile_s": round(time.monotonic() - recorded, 1),
            "workers": workers}


def compile_only(args) -> int:
    import triton.runtime.interpreter
    from triton import knobs

    from spectral_ops.triton_kernels import syrk as any_kernel_module

    if isinstance(any_kernel_module.symmetric_kernel, triton.runtime.interpreter.InterpretedFunction):
        print("--compile-only needs compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    archs = [a.strip() for a in args.compile_only.split(",") if a.strip()]
    unknown = [arch for arch in archs if arch not in SHARED_MEMORY_LIMIT]
    if unknown:
        print(f"unknown target(s) {unknown}; known: {', '.join(SHARED_MEMORY_LIMIT)}", file=sys.stderr)
        return 2
    source = source_description()  # before the run: the code that ran, whatever a checkout does meanwhile
    started = time.monotonic()
    jobs, stopped = [], []
    cases = [case for case in REGISTRY if case.backend == "triton" and selected(case.name, args.only)]
    for arch in archs:
        launches, stopped_here = record_launches(cases, arch, tiny=args.dry_run)
        jobs += compile_jobs(launches, arch)
        stopped += stopped_here
    recorded = time.monotonic()
    workers = args.workers or compile_workers()
    print(f"recorded {len(jobs)} Triton variants in {recorded - started:.0f} s; compiling them in {workers} "
          f"process(es) ...", flush=True)
    rows = compile_all(jobs, workers)
    compiled = time.monotonic()
    rows += [row for arch in archs for row in extension_resources(arch)]
    timing = {"record_s": round(recorded - started, 1), "compile_s": round(compiled - recorded, 1),
              "extension_s": round(time.monotonic() - compiled, 1), "total_s": round(time.monotonic() - started, 1),
              "workers": workers}
    cpu = cpu_description()
    notable = [flag for flag in _NOTABLE_CPU_FLAGS if flag in cpu["flags"]]
    failed = [row for row in rows if row["ok"] is False]
    text = "\n".join([
        f"# Kernel resources for {', '.join(archs)} ({SASS.tool_label(SASS.find_cuobjdump())}; "
        f"{SASS.tool_label(knobs.nvidia.ptxas.path, knobs.nvidia.ptxas.version)})", "",
        f"Written by {source}.", "",
        f"No GPU: CPU {cpu['model']}, {cpu['cores']} cores (flags: "
        f"{', '.join(notable) or 'none of ' + '/'.join(_NOTABLE_CPU_FLAGS)}); "
        f"torch {torch.__version__}, triton {triton.__version__}. Seconds: recording {timing['record_s']:.0f}, "
        f"compiling {timing['compile_s']:.0f} ({workers} processes), _C {timing['extension_s']:.0f}, "
        f"total {timing['total_s']:.0f}.", "",
        f"{len(jobs)} Triton variants, {len(failed)} failed; {len(stopped)} case recordings stopped early. "
        "HGMMA: Hopper warpgroup MMA (wgmma); HMMA: warp MMA (mma.sync); TMA: tensor-memory-accelerator "
        "copies (UTMALDG, UTMASTG, UBLKCP, ...); LDGSTS: cp.async. Counts are static SASS instructions.", "",
        "## Triton kernels (one row per specialisation the cases launch)", "",
        table([r for r in rows if r["source"] == "triton"], _TRITON_COLUMNS), "",
        "## spectral_ops._C (static shared memory only; dynamic is set at launch)", "",
        table([r for r in rows if r["source"] == "_C"], _EXTENSION_COLUMNS), "",
        "## Case recordings that stopped early (their launches before the error are compiled above)", "",
        table(stopped, _RECORDING_COLUMNS) if stopped else "(none)", ""])
    print(text)
    json_path, markdown_path = report_paths(args, "compile_only")
    report = {"cpu": cpu, "torch": torch.__version__, "triton": triton.__version__,
              "ptxas": knobs.nvidia.ptxas.version, "timing": timing, "compile_only": rows, "stopped": stopped}
    json_path.write_text(json.dumps(report, indent=1, default=str))
    if markdown_path is not None:
        markdown_path.write_text(text)
    print(f"wrote {json_path}" + (f" and {markdown_path}" if markdown_path is not None else ""))
    # A recording that stopped early is no verdict on a kernel: only a compile or shared-memory failure fails.
    return 1 if failed else 0
