"""What the monitor hosts' tests share: models whose matrices have a spectral gap, the scalars a run wrote,
read back with tensorboard's own ``EventAccumulator``, and their check against an FP64 SVD of the weights
at each log step.

The tolerance of ``s_max`` (and of what is made from it) follows from the power iteration's theory
(spectral_ops/monitor/power.py), step by step along the run, with the FP64 spectra of the logged weights:
* the estimate ``sqrt(v^T A^T A v)`` of the vector ``v`` entering the last iteration, at angle ``theta`` to
  the top right singular vector, is at least ``s_1 cos(theta)``: its relative error is at most
  ``sin^2(theta)``, and never negative (a lower bound);
* an iteration multiplies ``tan(theta)`` by ``rho^2`` at most, ``rho = s_2 / s_1``;
* the first call starts from a random vector: ``tan(theta) <= 1e3`` assumed (a random unit vector in at
  most 64 dimensions at least 0.06 degrees off orthogonal to a given one; 30 iterations at the ``rho`` of
  these models turn any such start into fp32's rounding);
* each later call starts from the last vector, and the top vector itself moved between the two log steps
  by an angle whose sine is at most ``||dW||_2 / (s_1 - s_2 - ||dW||_2)`` (Wedin's theorem, with Weyl's
  bound on the other matrix's ``s_2``).
Both sides get ``ROUNDING`` more: the fp32 products of the iteration (``n eps_32`` of ``s^2`` at ``n <= 64``)
and the event file's fp32 storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectral_ops.qk_cap import attention_pairs
from spectral_ops.train.model import ModelConfig, Transformer

# The fp32 products and the event file's fp32 value, relative (module docstring).
ROUNDING = 1e-5
# The gapped matrices' ratio s_{i+1} / s_i: the iteration converges in a few steps, as it does on trained
# weights, whose top singular values stand apart (a random init's top pair can be 2% apart).
RATIO = 0.3
FIRST_TANGENT = 1e3  # the first call's start vector (module docstring)
VOCAB, SEQUENCE = 64, 16  # the reference model's and its batches'


def read_scalars(log_dir) -> dict[str, dict[int, float]]:
    """Every scalar under ``log_dir`` as ``{tag: {step: value}}``, read by tensorboard's EventAccumulator from
    the one folder holding event files (the Trainer writes into a subfolder of its logging dir)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = {path.parent for path in Path(log_dir).rglob("events.out.tfevents.*")}
    assert len(folders) == 1, f"expected the event files of one run under {log_dir}, found {sorted(folders)}"
    accumulator = EventAccumulator(str(folders.pop()), size_guidance={"scalars": 0}).Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def _gapped(rows: int, cols: int, generator, top_direction=None) -> torch.Tensor:
    """A ``rows x cols`` matrix with singular values ``RATIO^i`` (``s_1 = 1``); ``top_direction``: its top
    right singular vector."""
    rank = min(rows, cols)
    u = torch.linalg.qr(torch.randn(rows, rank, generator=generator, dtype=torch.float64))[0]
    v = torch.randn(cols, rank, generator=generator, dtype=torch.float64)
    if top_direction is not None:
        v[:, 0] = top_direction
    v = torch.linalg.qr(v)[0]
    return (u * RATIO ** torch.arange(rank, dtype=torch.float64)) @ v.T


@torch.no_grad()
def with_spectral_gaps(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` with every matrix gapped (:data:`RATIO`), each attention head's query and key rows too, the
    heads of one projection sharing their top right singular vector (so the whole projection, with ``s_1``
    the square root of its head count, is gapped as well)."""
    generator = torch.Generator().manual_seed(seed)
    heads_of = {}
    for q, k, heads, kv_heads in attention_pairs(model).values():
        heads_of[id(q)], heads_of[id(k)] = heads, kv_heads
    for param in model.parameters():
        if param.ndim != 2:
            continue
        heads = heads_of.get(id(param), 1)
        rows = param.shape[0] // heads
        top = torch.randn(param.shape[1], generator=generator, dtype=torch.float64)
        param.copy_(torch.cat([_gapped(rows, param.shape[1], generator, top) for _ in range(heads)]))
    return model


def reference_model() -> Transformer:
    """The reference Transformer, 4 heads of 8, gapped: the same weights at every call."""
    with torch.random.fork_rng():  # the global generator as it was, for the tests after
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, max_seq_len=SEQUENCE))
    return with_spectral_gaps(model)


def token_batches(steps: int, batch_size: int = 4) -> torch.utils.data.DataLoader:
    """``steps`` batches of ``(inputs, targets)``: random tokens and the same shifted by one."""
    tokens = torch.randint(0, VOCAB, (steps * batch_size, SEQUENCE + 1), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                                       batch_size=batch_size)


def _power_bounds(stacks: list[torch.Tensor], first_iterations: int, iterations: int) -> list[tuple]:
    """For one parameter's matrices ``(B, m, n)`` (FP64) at each log step in order: ``(s_1, bound)`` per
    matrix, ``bound`` the largest relative error of the monitor's ``s_max`` there (module docstring)."""
    results, tangent_out, previous = [], None, None
    for call, stack in enumerate(stacks):
        s = torch.linalg.svdvals(stack)
        rho = s[:, 1] / s[:, 0]
        if call == 0:
            tangent_in, count = torch.full_like(rho, FIRST_TANGENT), first_iterations
        else:
            moved = torch.linalg.matrix_norm(stack - previous, ord=2)
            gap = s[:, 0] - s[:, 1] - moved
            assert (gap > 0).all() and (moved / gap < 0.5).all(), "the weights moved too far for the bound"
            angle = torch.atan(tangent_out) + torch.asin(moved / gap)
            assert (angle < 1).all(), "the warm start is too far from the top vector for the bound"
            tangent_in, count = torch.tan(angle), iterations
        tangent_last = rho ** (2 * (count - 1)) * tangent_in
        tangent_out = rho ** (2 * count) * tangent_in
        results.append((s[:, 0], tangent_last**2 / (1 + tangent_last**2)))
        previous = stack
    return results


def assert_matches_fp64(scalars: dict, weights_at: dict[int, dict[str, torch.Tensor]], model: torch.nn.Module,
                        lr: float, first_iterations: int, iterations: int, tag_prefix: str = "") -> None:
    """The run's ``spectral.*`` scalars at each step of ``weights_at`` (``{step: state dict}``, every log step
    from the first) against the FP64 SVD of those weights: ``s_max`` within the power iteration's bound
    (below) and ``ROUNDING`` (above), ``stable_rank`` and ``qk_bound`` accordingly, the Frobenius norm and the
    effective-lr proxy ``lr / ||W||_F`` to ``ROUNDING``; every matrix and attention module at every step."""
    steps = sorted(weights_at)
    matrices = [name for name, param in model.named_parameters() if param.ndim == 2]
    pairs = {path: (next(n for n, p in model.named_parameters() if p is q),
                    next(n for n, p in model.named_parameters() if p is k), heads, kv_heads)
             for path, (q, k, heads, kv_heads) in attention_pairs(model).items()}
    weights = {step: {name: tensor.to(torch.float64) for name, tensor in state.items()}
               for step, state in weights_at.items()}

    def value(metric, name, step):
        tag = f"{tag_prefix}spectral.{metric}/{name}"
        assert step in scalars.get(tag, {}), f"{tag} was not logged at step {step}"
        return scalars[tag][step]

    for name in matrices:
        bounds = _power_bounds([weights[step][name][None] for step in steps], first_iterations, iterations)
        module = name.removesuffix(".weight")
        for step, (s_1, bound) in zip(steps, bounds):
            s_1, bound = s_1.item(), bound.item()
            frobenius = torch.linalg.matrix_norm(weights[step][name]).item()
            estimate = value("s_max", module, step)
            assert s_1 * (1 - bound - ROUNDING) <= estimate <= s_1 * (1 + ROUNDING), (module, step, estimate, s_1)
            assert value("frobenius", module, step) == pytest.approx(frobenius, rel=ROUNDING)
            stable_rank = frobenius**2 / s_1**2
            assert stable_rank * (1 - 3 * ROUNDING) <= value("stable_rank", module, step) \
                <= stable_rank / (1 - bound - ROUNDING) ** 2, (module, step)
            assert value("effective_lr", module, step) == pytest.approx(lr / frobenius, rel=ROUNDING)
    for path, (q_name, k_name, heads, kv_heads) in pairs.items():
        def heads_at(step, name, count):
            return weights[step][name].view(count, -1, weights[step][name].shape[-1])

        q_bounds = _power_bounds([heads_at(step, q_name, heads) for step in steps], first_iterations, iterations)
        k_bounds = _power_bounds([heads_at(step, k_name, kv_heads) for step in steps], first_iterations, iterations)
        for step, (s_q, bound_q), (s_k, bound_k) in zip(steps, q_bounds, k_bounds):
            exact = (s_q * s_k.repeat_interleave(heads // kv_heads)).max().item()
            low = (1 - bound_q.max().item() - ROUNDING) * (1 - bound_k.max().item() - ROUNDING)
            assert exact * low <= value("qk_bound", path, step) <= exact * (1 + ROUNDING) ** 2, (path, step)


def decay_counts(scalars: dict, step: int, tag_prefix: str = "", label: str = "optimizer") -> dict[str, float]:
    """The ``spectral.decay/{label}.*`` scalars at ``step``."""
    head = f"{tag_prefix}spectral.decay/{label}."
    return {tag.removeprefix(head): points[step] for tag, points in scalars.items()
            if tag.startswith(head) and step in points}


def spectral_tags(scalars: dict, tag_prefix: str = "") -> set[str]:
    return {tag for tag in scalars if tag.startswith(f"{tag_prefix}spectral.")}

