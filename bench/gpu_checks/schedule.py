"""The run's plan against its budget: the stages in order, each one's estimated seconds, and the budget
that follows from them. Standard library only (``cli`` reads the default budget before torch is imported).

    setup     start-up, then building ``_C`` while a process pool compiles the Triton variants
    headline  the headline cases, each checked then timed
    breadth   every other check, then every other timing
    cuda      the CUDA extension's cases, in a child process
    report    the last rewrite of the report

The estimates are per task kind, fixed guesses until a GPU run measures them (its report puts each
stage's seconds next to them). The README runs ``timeout 540``: the budget is what is left of it after
Python's start-up and the final report, and the headline must end by :data:`HEADLINE_DEADLINE_S` by the
estimate (``tests/test_triton_gpu_check.py`` asserts it from the plan, timing nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

TIMEOUT_S = 540.0  # the README's `timeout 540`
STARTUP_S = 15.0  # importing torch and triton, registering the cases
REPORT_S = 15.0  # the final report and Python's exit
DEFAULT_BUDGET_S = TIMEOUT_S - STARTUP_S - REPORT_S
HEADLINE_DEADLINE_S = 240.0  # from the process's start: a run cut short still has every headline answer

# Guesses for one H100/H200 with its host, until a GPU run measures them.
BUILD_S = 90.0  # nvcc on csrc/'s five .cu files for one arch, -O3
RECORD_S = 10.0  # running the Triton cases' host code on the GPU with the launcher replaced
COMPILE_S_PER_VARIANT = 3.0  # one Triton specialisation on one core (about 1 s on a fast host, 2-4 s here)
POOL_START_S = 8.0  # a spawned worker imports torch and triton
GPU_HOST_CORES = 16  # the GPU machines this project is lent: the compile pool's workers there
TRITON_VARIANTS = 130  # sm90 specialisations the cases launch (docs/results/compile-only/, rounded up)
ESTIMATE_S = {"check": 0.5, "timing": 0.8, "optimizer": 8.0, "compiled step": 40.0}
CUDA_CHILD_START_S = 15.0  # a child imports torch and the registry, then loads _C
CUDA_TASK_S = 0.4  # a CUDA case: inputs, the kernel, its reference (small shapes, compiled ahead)


@dataclass
class Stage:
    name: str
    estimate_s: float
    start_s: float
    tasks: int

    @property
    def end_s(self) -> float:
        return self.start_s + self.estimate_s


def task_estimate(task) -> float:
    return ESTIMATE_S[task.estimate_kind]


def setup_estimate(build_needed: bool, workers: int, variants: int = TRITON_VARIANTS) -> float:
    """The build and the compile pool run side by side; the recording comes first."""
    pool = POOL_START_S + variants * COMPILE_S_PER_VARIANT / max(workers, 1)
    return STARTUP_S + RECORD_S + max(BUILD_S if build_needed else 0.0, pool)


def plan_stages(tasks, build_needed: bool, workers: int) -> list[Stage]:
    """The stages of a GPU run of ``tasks`` (in run order), with their estimated start and length."""
    stages = [Stage("setup: start-up, then build _C beside the compile pool", setup_estimate(build_needed, workers),
                    0.0, 0)]
    for phase in ("headline", "breadth"):
        chosen = [task for task in tasks if task.phase == phase]
        stages.append(Stage(phase, sum(map(task_estimate, chosen)), stages[-1].end_s, len(chosen)))
    cuda = [task for task in tasks if task.phase == "cuda"]
    stages.append(Stage("cuda (child process)", CUDA_CHILD_START_S + CUDA_TASK_S * len(cuda) if cuda else 0.0,
                        stages[-1].end_s, len(cuda)))
    stages.append(Stage("report", REPORT_S, stages[-1].end_s, 0))
    return stages


def format_plan(stages: list[Stage], budget_s: float, headline: list[str] = ()) -> str:
    """The planned order against the budget: per stage its estimate, start and end, and what a budget
    cut would leave out; then the headline's tasks in order (``headline``: one label each)."""
    lines = [f"Planned GPU run (estimates; `timeout {TIMEOUT_S:.0f}`, budget {budget_s:.0f} s after "
             f"{STARTUP_S:.0f} s start-up, headline by {HEADLINE_DEADLINE_S:.0f} s):", "",
             "| stage | tasks | estimate s | starts s | ends s | within |", "|---|---|---|---|---|---|"]
    for stage in stages:
        deadline = HEADLINE_DEADLINE_S if stage.name == "headline" else TIMEOUT_S
        within = "yes" if stage.end_s <= deadline else f"**no** (past {deadline:.0f} s: cut by the budget)"
        lines.append(f"| {stage.name} | {stage.tasks} | {stage.estimate_s:.0f} | {stage.start_s:.0f} | "
                     f"{stage.end_s:.0f} | {within} |")
    if headline:
        lines += ["", "Headline order:"] + [f"{index:3d}. {label}" for index, label in enumerate(headline, 1)]
    return "\n".join(lines)
