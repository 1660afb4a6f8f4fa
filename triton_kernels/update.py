"""The rectangular product with a fused epilogue: ``out = alpha * (M @ Z) + beta * Y + gamma * Z``.

``M`` is a small ``r x r`` factor (a polynomial in the Gram matrix, a projector), ``Z`` the wide
``r x n`` operand, ``Y`` an optional second ``r x n`` term (the weight itself in a decay step).
Each output tile is ``BLOCK_M x BLOCK_N``, computed from a row panel of ``M`` and a column panel of
``Z``. The launch is persistent (one program per slot the GPU runs at once, each walking the tiles
with a stride of the grid); the tiles are taken row tiles of one column panel first, so that
neighbouring programs share that panel of ``Z`` from L2 while ``M`` stays resident. On sm90 ``M``
and ``Z`` are read through TMA descriptors where their strides allow it.

The Polar Express update ``X <- a X + B X`` is this kernel with ``gamma = a``, ``alpha = 1``: the
accumulator starts as ``a X`` and the product is accumulated on top of it, in fp32, so adding
``a X`` costs no extra pass and no extra register tile. With ``alpha != 1`` (the decay epilogues) the
product is accumulated alone and scaled once at the end, instead of scaling every ``M`` tile inside
the loop, and the other terms are read only then. Without ``M`` the kernel is the fused elementwise
combination ``beta * Y + gamma * Z``.

The update cannot run in place: every program reads a whole column panel of ``Z``, which other
programs overwrite. The Polar Express chain alternates between two buffers; a decay written into
the weight goes through :mod:`.decay`.
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
    persistent_programs,
    pointer_config,
    scale_arg,
    stride_alignment,
    tile_indices,
    wide_offsets,
)


@triton.jit
def _epilogue_terms(Z, Y, b, rows, cols, inside, beta, gamma, s_zr, s_zc, s_yr, s_yc,
                    BETA_PER_MATRIX: tl.constexpr, GAMMA_PER_MATRIX: tl.constexpr,
                    HAS_Y: tl.constexpr, HAS_Z_TERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``gamma * Z + beta * Y`` on one tile, in fp32 (each term only if present)."""
    terms = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_Z_TERM:
        z = tl.load(Z + rows[:, None] * s_zr + cols[None, :] * s_zc, mask=inside, other=0.0)
        terms += load_scale(gamma, b, GAMMA_PER_MATRIX) * z.to(tl.float32)
    if HAS_Y:
        y = tl.load(Y + rows[:, None] * s_yr + cols[None, :] * s_yc, mask=inside, other=0.0)
        terms += load_scale(beta, b, BETA_PER_MATRIX) * y.to(tl.float32)
    return terms


@triton.jit
def _round_stochastic(v, noise, DTYPE: tl.constexpr):
    """fp32 ``v`` to bf16/fp16 ``DTYPE``, up or down with the probabilities that make it unbiased, each
    element deciding with its 16 ``noise`` bits: the rule of
    :func:`spectral_ops.backends.torch_backend.round_stochastic`, bit for bit."""
    uniform = noise.to(tl.int32) & 0xFFFF
    # One return: Triton types every return of a function alike, even in a branch it prunes.
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        truncated = ((bits + uniform) & -0x10000).to(tl.float32, bitcast=True).to(tl.bfloat16)
        rounded = tl.where(finite, truncated, v.to(tl.bfloat16))
    else:
        toward_zero = v.to(tl.float16, fp_downcast_rounding="rtz")
        low = toward_zero.to(tl.float32)
        away = (toward_zero.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
        up = uniform.to(tl.float32) * (1.0 / 65536.0) * tl.abs(away.to(tl.float32) - low) < tl.abs(v - low)
        rounded = tl.where(tl.abs(v) <= 65504.0, tl.where(up, away, toward_zero), v.to(tl.float16))
    return rounded


@triton.jit
def _product_tile(acc, M, Z, M_DESC, Z_DESC, b32, row0, col0, rows, cols, r, n, s_mr, s_mc, s_zr, s_zc,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, WIDE: tl.constexpr, DESCRIBED: tl.constexpr):
    """``acc + M Z`` on one tile: through the TMA descriptors, or through pointers, where ``Z``'s
    columns are the rows of ``Z^T`` (its strides passed swapped to the row-times-row tile loop)."""
    if DESCRIBED:
        acc = accumulate_described(acc, M_DESC, Z_DESC, b32, row0, col0, r, BLOCK_M, BLOCK_N, BLOCK_K, False, False,
                                   UPCAST, INPUT_PRECISION)
    else:
        acc = accumulate_rows_product(acc, M, Z, rows, cols, r, n, r, s_mr, s_mc, s_zc, s_zr, BLOCK_K, UPCAST,
                                      INPUT_PRECISION, WIDE, SPLIT_RAGGED_STEP=True)
    return acc


@triton.jit
def product_kernel(
    M, Z, Y, OUT, NOISE, M_DESC, Z_DESC, alpha, beta, gamma,
    r, n, n_row_tiles, n_col_tiles, batch,
    s_mb, s_mr, s_mc, s_zb, s_zr, s_zc, s_yb, s_yr, s_yc, s_ob, s_or, s_oc,
    ALPHA_PER_MATRIX: tl.constexpr, BETA_PER_MATRIX: tl.constexpr, GAMMA_PER_MATRIX: tl.constexpr,
    HAS_M: tl.constexpr, HAS_Y: tl.constexpr, HAS_Z_TERM: tl.constexpr, INIT_WITH_TERMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, WIDE: tl.constexpr, STOCHASTIC: tl.constexpr,
    ALIGN: tl.constexpr, DESCRIBED: tl.constexpr,
):
    """Persistent: each program walks the tiles of every matrix with a stride of the grid.
    ``M_DESC``/``Z_DESC`` are ``M``'s and ``Z``'s TMA descriptors when ``DESCRIBED`` (unused otherwise)."""
    tiles = n_row_tiles * n_col_tiles
    s_mb, s_mr, s_mc = known_multiples(s_mb, s_mr, s_mc, ALIGN)
    s_zb, s_zr, s_zc = known_multiples(s_zb, s_zr, s_zc, ALIGN)
    s_yb, s_yr, s_yc = known_multiples(s_yb, s_yr, s_yc, ALIGN)
    s_ob, s_or, s_oc = known_multiples(s_ob, s_or, s_oc, ALIGN)
    for tile in range(tl.program_id(0), batch * tiles, tl.num_programs(0)):
        b32 = tile // tiles
        b = b32.to(tl.int64)
        t = tile % tiles
        row0 = (t % n_row_tiles) * BLOCK_M
        col0 = (t // n_row_tiles) * BLOCK_N
        rows = tile_indices(row0, BLOCK_M, WIDE)
        cols = tile_indices(col0, BLOCK_N, WIDE)
        inside = (rows[:, None] < r) & (cols[None, :] < n)
        m = M + b * s_mb
        z = Z + b * s_zb
        y = Y + b * s_yb

        if INIT_WITH_TERMS:
            acc = _epilogue_terms(z, y, b, rows, cols, inside, beta, gamma, s_zr, s_zc, s_yr, s_yc,
                                  BETA_PER_MATRIX, GAMMA_PER_MATRIX, HAS_Y, HAS_Z_TERM, BLOCK_M, BLOCK_N)
            if HAS_M:
                acc = _product_tile(acc, m, z, M_DESC, Z_DESC, b32, row0, col0, rows, cols, r, n,
                                    s_mr, s_mc, s_zr, s_zc, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, INPUT_PRECISION, WIDE,
                                    DESCRIBED)
        else:
            acc = _product_tile(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), m, z, M_DESC, Z_DESC, b32,
                                row0, col0, rows, cols, r, n, s_mr, s_mc, s_zr, s_zc,
                                BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, INPUT_PRECISION, WIDE, DESCRIBED)
            acc = acc * load_scale(alpha, b, ALPHA_PER_MATRIX) + _epilogue_terms(
                z, y, b, rows, cols, inside, beta, gamma, s_zr, s_zc, s_yr, s_yc,
                BETA_PER_MATRIX, GAMMA_PER_MATRIX, HAS_Y, HAS_Z_TERM, BLOCK_M, BLOCK_N)

        if STOCHASTIC:
            noise = tl.load(NOISE + b * r * n + rows[:, None] * n + cols[None, :], mask=inside, other=0)
            value = _round_stochastic(acc, noise, OUT.dtype.element_ty)
        else:
            value = acc.to(OUT.dtype.element_ty)
        tl.store(OUT + b * s_ob + rows[:, None] * s_or + cols[None, :] * s_oc, value, mask=inside)


def _is_one(value) -> bool:
    return not isinstance(value, torch.Tensor) and float(value) == 1.0


def _is_zero(value) -> bool:
    return not isinstance(value, torch.Tensor) and float(value) == 0.0


def product(M: torch.Tensor | None, Z: torch.Tensor, *, alpha=1.0, gamma=0.0, Y: torch.Tensor | None = None,
            beta=0.0, out: torch.Tensor | None = None, input_precision: str = "ieee", noise=None,
            cfg=None) -> torch.Tensor:
    """``out = alpha * (M @ Z) + beta * Y + gamma * Z`` for ``(..., r, r)`` ``M`` and ``(..., r, n)`` ``Z``, ``Y``.

    ``M=None`` drops the product. Scales are numbers or one value per matrix. ``Y`` (and ``Z``
    when there is no product) may be ``out`` itself, as the identical view: they are read only at
    the tile being written. If ``out`` overlaps anything else, the result goes through a workspace.
    The output defaults to a new fp32 tensor. ``noise`` (int16, ``out``'s shape): a bf16/fp16 ``out``
    is rounded stochastically with these bits (see :func:`_round_stochastic`).
    """
    check_precision(input_precision)
    stochastic = noise is not None and out is not None and out.dtype in (torch.bfloat16, torch.float16)
    if stochastic and (noise.shape != out.shape or noise.dtype != torch.int16):
        raise ValueError(f"noise must be int16 of out's shape {tuple(out.shape)}, "
                         f"got {noise.dtype} {tuple(noise.shape)}")
    r, n = Z.shape[-2:]
    if M is not None and M.shape[-2:] != (r, r):
        raise ValueError(f"M must be (..., {r}, {r}) for Z of shape {tuple(Z.shape)}, got {tuple(M.shape)}")
    if Y is not None and Y.shape[-2:] != (r, n):
        raise ValueError(f"Y must have Z's shape {tuple(Z.shape)}, got {tuple(Y.shape)}")
    Zb = batched(Z)
    batch = Zb.shape[0]
    if out is None:
        out = torch.empty(Z.shape, dtype=torch.float32, device=Z.device)
    if M is None:
        target = Output(out, read_in_place=(Y, Z))
    else:
        target = Output(out, read_across=(M, Z), read_in_place=(Y,))
    Ob = target.target
    Mb = batched(M) if M is not None else Ob
    Yb = batched(Y) if Y is not None else Ob
    dtypes = (Z.dtype, *([M.dtype] if M is not None else []))
    cfg = cfg or config("product", Z.device, *dtypes)
    wide = wide_offsets(Mb, Zb, Yb, Ob) or (stochastic and noise.numel() >= 2**31)
    descriptors = [None]
    if M is not None and cfg.descriptors and not wide:
        descriptors = [describe(Mb, cfg.block_m, cfg.block_k), describe(Zb, cfg.block_k, cfg.block_n)]
    described = None not in descriptors
    if not described:
        cfg = pointer_config(cfg, "product", *dtypes)
    n_row_tiles, n_col_tiles = triton.cdiv(r, cfg.block_m), triton.cdiv(n, cfg.block_n)
    (alpha_arg, alpha_per), (beta_arg, beta_per), (gamma_arg, gamma_per) = (
        scale_arg(v, batch, Z.device) for v in (alpha, beta, gamma))
    product_kernel[(persistent_programs(Z.device, batch * n_row_tiles * n_col_tiles, cfg),)](
        Mb, Zb, Yb, Ob, noise.contiguous() if stochastic else Ob, *(descriptors if described else (Mb, Zb)),
        alpha_arg, beta_arg, gamma_arg, r, n, n_row_tiles, n_col_tiles, batch,
        *Mb.stride(), *Zb.stride(), *Yb.stride(), *Ob.stride(),
        ALPHA_PER_MATRIX=alpha_per, BETA_PER_MATRIX=beta_per, GAMMA_PER_MATRIX=gamma_per,
        HAS_M=M is not None, HAS_Y=Y is not None, HAS_Z_TERM=not _is_zero(gamma),
        INIT_WITH_TERMS=M is None or _is_one(alpha),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        UPCAST=M is not None and M.dtype != Z.dtype,
        INPUT_PRECISION=dot_precision(input_precision, *dtypes),
        WIDE=wide, STOCHASTIC=stochastic, ALIGN=stride_alignment(Mb, Zb, Yb, Ob),
        DESCRIBED=described, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return target.finish()


def polar_update(X: torch.Tensor, B: torch.Tensor, a, *, out: torch.Tensor | None = None,
                 input_precision: str = "ieee", cfg=None) -> torch.Tensor:
    """One Polar Express update ``a X + B X`` (``B = b A + c A^2``) into a buffer other than ``X``."""
    return product(B, X, gamma=a, out=out, input_precision=input_precision, cfg=cfg)
