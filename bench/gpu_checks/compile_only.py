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

import importlib.util
import json
import sys
from pathlib import Path

import torch

from .cases import REGISTRY, selected
from .checkout import bench_module
from .report import report_paths
from .tables import number, row_status, table

SASS = bench_module("sass")  # resource usage and SASS read with cuobjdump

# Shared memory a block may use (opt-in maximum), per target.
SHARED_MEMORY_LIMIT = {"sm80": 166912, "sm90": 232448}
STATIC_SHARED_LIMIT = 48 * 1024  # static __shared__ arrays; beyond it a kernel must use dynamic shared memory


def record_launches(args, arch: str) -> dict:
    """Every distinct kernel specialisation the selected cases launch with ``arch``'s configs.

    The cases run on CPU tensors; each launch is bound and specialised exactly as Triton's
    launcher would for that target, then recorded instead of compiled and run (outputs stay
    uninitialised, which no host-side decision depends on).
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

    real_run, real_arch = JITFunction.run, common.arch
    JITFunction.run, common.arch = record, (lambda device: arch)
    try:
        for case in (case for case in REGISTRY if case.backend == "triton" and selected(case.name, args.only)):
            for dtype in case.dtypes:
                for shape in case.tiny_shapes if args.dry_run else case.shapes:
                    case.fn(case.inputs(shape, dtype, torch.device("cpu")))
    finally:
        JITFunction.run, common.arch = real_run, real_arch
    return launches


def _resources(usage: dict) -> dict:
    """One kernel's ``cuobjdump -res-usage`` fields, as the report names them. Register spills and
    local arrays show as a stack frame (or local memory)."""
    return {"registers": usage["registers"], "stack": usage.get("stack", 0), "local": usage.get("local", 0),
            "static_shared": usage.get("shared", 0)}


def compile_launches(launches: dict, arch: str) -> list[dict]:
    """Each recorded specialisation compiled for ``arch`` by Triton (its bundled ``ptxas``, or the one
    ``TRITON_PTXAS_PATH`` names), its cubin read back with cuobjdump: what the GPU would load."""
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", int(arch[2:]), 32)
    ptxas = knobs.nvidia.ptxas
    rows = []
    for kernel, signature, constexprs, attrs, options in launches.values():
        flags = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()
                 if kernel.arg_names[path[0]].isupper()}
        pointers = sorted({kind for kind in signature.values() if kind.startswith("*")})
        row = {"source": "triton", "kernel": kernel.fn.__name__, "arch": arch, "operands": " ".join(pointers),
               "num_warps": options.num_warps, "num_stages": options.num_stages, "constexprs": flags,
               "ptxas": f"{ptxas.version} ({ptxas.path})"}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        except Exception as error:
            # Triton's message is the source around the failure, then the cause: keep the cause.
            message = str(error)
            reason = message if len(message) <= 500 else "..." + message[-500:]
            rows.append({**row, "ok": False, "status": "failed", "reason": f"{type(error).__name__}: {reason}"})
            continue
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            row.update(_resources(SASS.resource_usage(cubin)[compiled.metadata.name]))
        # Triton asks for its shared memory at launch (dynamic); static arrays come on top.
        row["shared"] = compiled.metadata.shared + row["static_shared"]
        row["ok"] = row["shared"] <= SHARED_MEMORY_LIMIT[arch]
        row["status"] = "ok" if row["ok"] else "failed"
        if not row["ok"]:
            row["reason"] = f"needs {row['shared']} B of shared memory, {arch} has {SHARED_MEMORY_LIMIT[arch]}"
        rows.append(row)
    return rows


def extension_resources(arch: str) -> list[dict]:
    """Every kernel of the built ``spectral_ops._C`` for ``arch``, read from its SASS with cuobjdump
    (no GPU, no rebuild: it says what that build holds). cuobjdump sees static shared memory only;
    the fused chain sizes its dynamic shared memory at launch, from the matrix size."""
    found = importlib.util.find_spec("spectral_ops._C")
    head = {"source": "_C", "kernel": "spectral_ops._C", "arch": arch}
    if found is None:
        return [{**head, "ok": None, "status": "skipped", "reason": "not built (python -m spectral_ops says why)"}]
    gpu = f"sm_{arch[2:]}"
    usage = SASS.resource_usage(found.origin, arch=gpu)
    if not usage:
        return [{**head, "ok": None, "status": "skipped", "reason": f"the build holds no {gpu} code (python -m "
                 "spectral_ops lists what it holds): set SPECTRAL_OPS_CUDA_ARCHS and rebuild"}]
    names = SASS.demangle(usage)
    rows = []
    for name in sorted(usage, key=names.get):
        row = {**head, "kernel": names[name], **_resources(usage[name])}
        row["ok"] = row["static_shared"] <= STATIC_SHARED_LIMIT
        row["status"] = "ok" if row["ok"] else "failed"
        rows.append(row)
    return rows


_RESOURCE_COLUMNS = [("registers", number("registers", "d")), ("stack B", number("stack", "d")),
                     ("local B", number("local", "d"))]
_TRITON_COLUMNS = [("kernel", lambda r: r["kernel"]), ("arch", lambda r: r["arch"]),
                   ("operands", lambda r: r["operands"]), ("warps", lambda r: r["num_warps"]),
                   ("stages", lambda r: r["num_stages"]), *_RESOURCE_COLUMNS,
                   ("shared KiB", lambda r: f"{r['shared'] / 1024:.1f}" if "shared" in r else ""),
                   ("status", row_status), ("constexprs", lambda r: r["constexprs"])]
_EXTENSION_COLUMNS = [("kernel", lambda r: r["kernel"]), ("arch", lambda r: r["arch"]), *_RESOURCE_COLUMNS,
                      ("static shared KiB", lambda r: f"{r['static_shared'] / 1024:.1f}" if "static_shared" in r
                       else ""), ("status", row_status)]


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
    rows = []
    for arch in archs:
        rows += compile_launches(record_launches(args, arch), arch)
        rows += extension_resources(arch)
    text = "\n".join([
        f"# Kernel resources for {', '.join(archs)} (cuobjdump {SASS.find_cuobjdump()}; Triton's ptxas "
        f"{knobs.nvidia.ptxas.version})", "",
        "## Triton kernels (one row per specialisation the cases launch)", "",
        table([r for r in rows if r["source"] == "triton"], _TRITON_COLUMNS), "",
        "## spectral_ops._C (static shared memory only; dynamic is set at launch)", "",
        table([r for r in rows if r["source"] == "_C"], _EXTENSION_COLUMNS), ""])
    print(text)
    json_path, markdown_path = report_paths(args, "compile_only")
    json_path.write_text(json.dumps({"compile_only": rows}, indent=1, default=str))
    if markdown_path is not None:
        markdown_path.write_text(text)
    print(f"wrote {json_path}" + (f" and {markdown_path}" if markdown_path is not None else ""))
    return 1 if any(r["ok"] is False for r in rows) else 0
