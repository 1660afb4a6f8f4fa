"""Symmetric products: the Gram matrix ``X X^T`` (SYRK), and ``L R^T`` whenever it is symmetric.

``X X^T`` is symmetric, so only the tiles on and below the diagonal are computed: with ``T`` row
tiles there are ``T (T + 1) / 2`` tiles per matrix, laid out as a triangle (no program is spent on
a tile above the diagonal). The launch is persistent, as in Triton's sm90 matmul recipe: one
program per slot the GPU runs at once, each walking the tiles of every matrix with a stride of the
grid, the triangle in bands of ``group`` tile rows (:func:`.common.lower_tile`). On sm90 the
operands are read through TMA descriptors where their strides allow it; elsewhere (and on sm80)
through pointers, rows masked and only the last, ragged step of the inner dimension masked in ``k``.

Each tile is stored twice, at ``(i, j)`` and transposed at ``(j, i)``; on a diagonal tile the lower
half is stored and then mirrored, so the output is exactly symmetric bit for bit, whatever order
the hardware sums in.

The same kernel computes ``L R^T`` for two different operands when the product is known to be
symmetric: ``A A`` for symmetric ``A`` (``A = A^T``), and the product of two commuting symmetric
matrices (polynomials in one Gram matrix, or ``B Z`` in the sign iteration). The epilogue
``alpha * L R^T + beta * C`` covers the Gram's normalisation and the polynomial steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    Output,
    accumulate_described,
    accumulate_rows_product,
    batched,
    check_precision,
    config,
    describe,
    dot_precision,
    known_multiples,
    load_scale,
    lower_tile,
    persistent_programs,
    pointer_config,
    scale_arg,
    stride_alignment,
    tile_indices,
    wide_offsets,
)


@triton.jit
def symmetric_kernel(
    L, R, C, OUT, alpha, beta,
    n, inner, n_tiles, batch,
    s_lb, s_lr, s_lk, s_rb, s_rr, s_rk, s_cb, s_cr, s_cc, s_ob, s_or, s_oc,
    ALPHA_PER_MATRIX: tl.constexpr, BETA_PER_MATRIX: tl.constexpr, HAS_C: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, WIDE: tl.constexpr, ALIGN: tl.constexpr, DESCRIBED: tl.constexpr,
    LEFT_TRANSPOSED: tl.constexpr, RIGHT_BY_ROWS: tl.constexpr,
):
    """Persistent: each program walks the lower tiles of every matrix with a stride of the grid.
    ``L`` and ``R`` are TMA descriptors when ``DESCRIBED`` (oriented as
    :func:`.common.accumulate_described` says), else pointers (strides ``s_l*``, ``s_r*``)."""
    tiles = n_tiles * (n_tiles + 1) // 2
    s_lb, s_lr, s_lk = known_multiples(s_lb, s_lr, s_lk, ALIGN)
    s_rb, s_rr, s_rk = known_multiples(s_rb, s_rr, s_rk, ALIGN)
    s_cb, s_cr, s_cc = known_multiples(s_cb, s_cr, s_cc, ALIGN)
    s_ob, s_or, s_oc = known_multiples(s_ob, s_or, s_oc, ALIGN)
    for tile in range(tl.program_id(0), batch * tiles, tl.num_programs(0)):
        b32 = tile // tiles
        b = b32.to(tl.int64)
        i, j = lower_tile(tile % tiles, n_tiles, GROUP)
        rows = tile_indices(i * BLOCK, BLOCK, WIDE)
        cols = tile_indices(j * BLOCK, BLOCK, WIDE)

        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        if DESCRIBED:
            acc = accumulate_described(acc, L, R, b32, i * BLOCK, j * BLOCK, inner, BLOCK, BLOCK, BLOCK_K,
                                       LEFT_TRANSPOSED, RIGHT_BY_ROWS, UPCAST, INPUT_PRECISION)
        else:
            acc = accumulate_rows_product(acc, L + b * s_lb, R + b * s_rb, rows, cols, n, n, inner,
                                          s_lr, s_lk, s_rr, s_rk, BLOCK_K, UPCAST, INPUT_PRECISION, WIDE,
                                          SPLIT_RAGGED_STEP=True)
        acc = acc * load_scale(alpha, b, ALPHA_PER_MATRIX)
        inside = (rows[:, None] < n) & (cols[None, :] < n)
        if HAS_C:
            c = tl.load(C + b * s_cb + rows[:, None] * s_cr + cols[None, :] * s_cc, mask=inside, other=0.0)
            acc += load_scale(beta, b, BETA_PER_MATRIX) * c.to(tl.float32)

        value = acc.to(OUT.dtype.element_ty)
        out = OUT + b * s_ob
        tl.store(out + rows[:, None] * s_or + cols[None, :] * s_oc, value,
                 mask=inside & (rows[:, None] >= cols[None, :]))
        # The mirror, stored as the transposed tile: rows of the output, so the stores stay contiguous.
        tl.store(out + cols[:, None] * s_or + rows[None, :] * s_oc, tl.trans(value),
                 mask=tl.trans(inside & (rows[:, None] > cols[None, :])))


def symmetric_product(L: torch.Tensor, R: torch.Tensor, *, alpha=1.0, beta=0.0, C: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, input_precision: str = "ieee", cfg=None) -> torch.Tensor:
    """``out = alpha * L R^T + beta * C`` for ``(..., n, k)`` operands whose product is symmetric.

    Only the lower tiles are computed, so the caller vouches for the symmetry (``L = R``, or
    ``L R^T = R L^T``). ``C`` may be ``out`` itself (each program reads ``C`` only where it
    writes); ``out`` must not overlap ``L`` or ``R``, or it is written through a workspace.
    ``alpha``/``beta`` are numbers or one value per matrix. The output defaults to fp32.
    """
    check_precision(input_precision)
    n, inner = L.shape[-2:]
    if R.shape[-2:] != (n, inner):
        raise ValueError(f"L and R must have the same (n, k) shape, got {tuple(L.shape)} and {tuple(R.shape)}")
    Lb, Rb = batched(L), batched(R)
    batch = Lb.shape[0]
    if out is None:
        out = torch.empty(*L.shape[:-1], n, dtype=torch.float32, device=L.device)
    target = Output(out, read_across=(L, R), read_in_place=(C,))
    Ob = target.target
    Cb = batched(C) if C is not None else Ob
    cfg = cfg or config("symmetric", L.device, L.dtype, R.dtype)
    alpha_arg, alpha_per = scale_arg(alpha, batch, L.device)
    beta_arg, beta_per = scale_arg(beta, batch, L.device)
    wide = wide_offsets(Lb, Rb, Cb, Ob)
    # Both descriptors or neither; each over the operand as stored (by rows, or by columns: X^T X).
    # 64-bit offsets stay on pointers.
    left_transposed, right_by_rows = Lb.stride(2) != 1, Rb.stride(2) == 1
    descriptors = [None]
    if cfg.descriptors and not wide:
        descriptors = [describe(Lb.mT, cfg.block_k, cfg.block_m) if left_transposed else
                       describe(Lb, cfg.block_m, cfg.block_k),
                       describe(Rb, cfg.block_m, cfg.block_k) if right_by_rows else
                       describe(Rb.mT, cfg.block_k, cfg.block_m)]
    described = None not in descriptors
    operands = descriptors if described else [Lb, Rb]
    if not described:
        cfg = pointer_config(cfg, "symmetric", L.dtype, R.dtype)
    n_tiles = triton.cdiv(n, cfg.block_m)
    grid = (persistent_programs(L.device, batch * n_tiles * (n_tiles + 1) // 2, cfg),)
    symmetric_kernel[grid](
        *operands, Cb, Ob, alpha_arg, beta_arg, n, inner, n_tiles, batch,
        *Lb.stride(), *Rb.stride(), *Cb.stride(), *Ob.stride(),
        ALPHA_PER_MATRIX=alpha_per, BETA_PER_MATRIX=beta_per, HAS_C=C is not None,
        BLOCK=cfg.block_m, BLOCK_K=cfg.block_k, GROUP=cfg.group, UPCAST=L.dtype != R.dtype,
        INPUT_PRECISION=dot_precision(input_precision, L.dtype, R.dtype), WIDE=wide,
        ALIGN=stride_alignment(Lb, Rb, Cb, Ob), DESCRIBED=described, LEFT_TRANSPOSED=left_transposed,
        RIGHT_BY_ROWS=right_by_rows,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return target.finish()


def syrk(X: torch.Tensor, *, trans: bool = False, alpha=1.0, beta=0.0, C: torch.Tensor | None = None,
         out: torch.Tensor | None = None, input_precision: str = "ieee", cfg=None) -> torch.Tensor:
    """``alpha * X X^T + beta * C``, or ``alpha * X^T X + beta * C`` with ``trans=True``.

    ``trans`` reads ``X`` through its transposed strides: a tall weight's small Gram ``W^T W`` costs
    no transpose copy, only a different load pattern.
    """
    operand = X.mT if trans else X
    return symmetric_product(operand, operand, alpha=alpha, beta=beta, C=C, out=out,
                             input_precision=input_precision, cfg=cfg)
