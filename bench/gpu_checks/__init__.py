"""The code of ``bench/gpu_check.py``, one module per responsibility; the script is its entry point.

    cli            the flags and their --help (standard library only)
    checkout       importing ``spectral_ops`` from a bare checkout; bench/'s other modules (standard library only)
    schedule       the stages' estimates against the budget, and the default budget (standard library only)
    build          building ``spectral_ops._C`` where it is not built; the driver/toolkit line
    cases          the case registry: the Triton kernels, the plan's ops, the CUDA extension's cases
    special_cases  the optimizer cases and the matmul yardstick
    model_columns  a timing row's cost-model columns: TFLOP/s, % of peak, predicted ms, the router's choice
    runner         checking and timing one case; the tasks in run order, under their limits and the budget
    cuda_child     the CUDA cases in child processes: a fault or a hang costs one case
    tables         result rows as markdown tables
    report         the report: gpu_check.json and gpu_check.md
    compile_only   --compile-only: registers, spills, shared memory and SASS per kernel, without a GPU;
                   the compile pool that warms Triton's cache on a GPU
    main           one run, from the parsed flags to the exit status

Importing ``cases`` (and every module that uses it) imports the Triton kernels, so the script sets
``TRITON_INTERPRET`` from the flags before it imports ``main``; another importer (the tests) sets it itself.
"""
