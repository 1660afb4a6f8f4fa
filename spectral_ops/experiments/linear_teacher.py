"""SPEC 7.2 / SPEC 2: the exactly whitened linear teacher, trained vs analytic, for p in {0, 1, 2, 4}."""

from __future__ import annotations

import numpy as np
import torch

from ..analysis import (
    covariance_identity_error,
    linear_teacher_problem,
    teacher_objective,
    teacher_singular_values,
    train_linear_teacher,
)
from ..metrics import matrix_metrics, singular_values
from ..reporting import markdown_table, plt, write_outputs
from .report import command_line

POWERS = (0, 1, 2, 4)
STEPS, QUICK_STEPS, LR = 2000, 300, 0.1


def analytic_solution(problem, p: int):
    """``(W*, s*)``: the optimum shares the teacher's singular vectors; ``s*`` from the teacher solver."""
    U, a, Vh = torch.linalg.svd(problem.A)
    s = teacher_singular_values(a, problem.lam, p)
    return (U * s) @ Vh, s


def run(out_dir, quick: bool = False) -> str:
    steps = QUICK_STEPS if quick else STEPS
    problem = linear_teacher_problem()
    teacher = matrix_metrics(problem.A)
    results, rows = {}, []
    for p in POWERS:
        optimum, s_analytic = analytic_solution(problem, p)
        trained = train_linear_teacher(problem, p, steps=steps, lr=LR)
        s_trained = singular_values(trained.W)
        metrics = matrix_metrics(trained.W)
        # Singular values of Y_W / sqrt(N) must equal those of W when the inputs are white.
        output_singular_values = singular_values(problem.X @ trained.W.mT / problem.samples**0.5)
        results[p] = {
            "analytic_singular_values": s_analytic.tolist(),
            "trained_singular_values": s_trained.tolist(),
            "max_singular_value_error": float((s_trained - s_analytic).abs().max()),
            "relative_solution_error": float(torch.linalg.matrix_norm(trained.W - optimum)
                                             / torch.linalg.matrix_norm(optimum)),
            "covariance_identity_error": covariance_identity_error(problem, trained.W),
            "output_singular_value_error": float((output_singular_values - s_trained).abs().max()),
            "effective_rank": float(metrics["effective_rank"]),
            "output_energy_rank": float(metrics["output_energy_rank"]),
            "stable_rank": float(metrics["stable_rank"]),
            "objective_gap": [value - teacher_objective(problem, optimum, p) for value in trained.objective],
        }
        r = results[p]
        rows.append([p, ", ".join(f"{v:.4g}" for v in r["analytic_singular_values"]), r["max_singular_value_error"],
                     r["relative_solution_error"], r["covariance_identity_error"], r["effective_rank"],
                     r["output_energy_rank"], r["stable_rank"]])
    rows.append(["teacher A", ", ".join(f"{v:.4g}" for v in problem.singular_values.tolist()), "", "", "",
                 float(teacher["effective_rank"]), float(teacher["output_energy_rank"]), float(teacher["stable_rank"])])

    headers = ["p", "analytic s*", "max abs err trained s", "‖W−W*‖/‖W*‖", "cov. identity err", "eRank",
               "output-energy eRank", "stable rank"]
    table = markdown_table(headers, rows)
    markdown = f"""# Linear teacher (SPEC 2, 7.2)

`{command_line("linear-teacher", out_dir, quick)}`

d = {problem.A.shape[1]}, N = {problem.samples} inputs in +/- pairs whitened exactly by a reduced QR
(X^T X / N = I), teacher singular values {tuple(problem.singular_values.tolist())} with random singular
vectors, lambda = {problem.lam}. Gradient descent from W = 0, {steps} steps of lr {LR} on
||Y - X W^T||^2 / (2N) + lambda/(p+1) sum s^(p+1), the penalty gradient from `spectral_power`; p = 0
takes the proximal step `svt(W - lr grad, lr lambda)`. The analytic optimum keeps the teacher's
singular vectors and solves s + lambda s^p = a (p = 0: s = (a - lambda)_+).

{table}

`‖W−W*‖/‖W*‖` compares whole matrices (vectors included); the covariance identity error is
‖Y_W^T Y_W / N − W W^T‖_F / ‖W W^T‖_F for the student's outputs Y_W = X W^T. Ranks are of the trained
W; eRank = exp H(s / Σs), output-energy eRank = exp H(s² / Σs²).
"""
    figure, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    modes = np.arange(1, problem.singular_values.numel() + 1)
    ax = axes[0, 0]
    ax.semilogy(modes, problem.singular_values.numpy(), "k--", label="teacher a")
    for i, p in enumerate(POWERS):
        r = results[p]
        analytic = np.array(r["analytic_singular_values"])
        shown = analytic > 0  # p = 0 zeroes the modes below lambda
        ax.semilogy(modes[shown], analytic[shown], "-", color=f"C{i}", label=f"p={p} analytic")
        trained = np.array(r["trained_singular_values"])
        ax.semilogy(modes[shown], trained[shown], "o", color=f"C{i}", mfc="none")
    ax.set(xlabel="mode i", ylabel="singular value", title="analytic (lines) vs trained (circles)")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for i, p in enumerate(POWERS):
        s = np.array(results[p]["trained_singular_values"])
        shown = np.array(results[p]["analytic_singular_values"]) > 0  # not the round-off of p = 0's zeros
        ax.semilogy(modes[shown], (s / s[0])[shown], "o-", color=f"C{i}", label=f"p={p}")
    a = problem.singular_values.numpy()
    ax.semilogy(modes, a / a[0], "k--", label="teacher")
    ax.set(xlabel="mode i", ylabel="s_i / s_1", title="normalised spectra")
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    for i, p in enumerate(POWERS):
        gap = np.maximum(np.array(results[p]["objective_gap"]), 1e-17)
        ax.semilogy(gap, color=f"C{i}", label=f"p={p}")
    ax.set(xlabel="step", ylabel="objective - optimum", title="convergence of gradient descent")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    width = 0.38
    x = np.arange(len(POWERS))
    ax.bar(x - width / 2, [results[p]["effective_rank"] for p in POWERS], width, label="eRank exp H(s/Σs)")
    ax.bar(x + width / 2, [results[p]["output_energy_rank"] for p in POWERS], width, label="output-energy eRank")
    ax.axhline(float(teacher["effective_rank"]), color="C0", ls=":", label="teacher eRank")
    ax.axhline(float(teacher["output_energy_rank"]), color="C1", ls=":", label="teacher output-energy eRank")
    ax.set_xticks(x, [f"p={p}" for p in POWERS])
    ax.set(ylabel="effective rank", title="effective ranks of the trained W")
    ax.legend(fontsize=8)
    figure.tight_layout()
    stride = max(1, steps // 100)
    for r in results.values():
        r["objective_gap"] = r["objective_gap"][::stride]
    data = {"protocol": {"d": problem.A.shape[1], "samples": problem.samples, "lambda": problem.lam,
                         "teacher_singular_values": problem.singular_values.tolist(), "steps": steps, "lr": LR,
                         "objective_gap_recorded_every": stride},
            "teacher": {key: float(value) for key, value in teacher.items()},
            "results": {str(p): r for p, r in results.items()}}
    write_outputs(out_dir, "linear-teacher", markdown, data, figure)
    return markdown
