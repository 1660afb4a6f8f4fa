"""The small-matrix path: a whole ``S_p`` or sign computation in one program per matrix.

Per-head weights (``[heads, 128, 768]`` and the like) have a small side ``r <= 128``. Run through the
tiled kernels, each of the ~30 launches of a Polar Express chain would cover one tile per matrix
and the step would be bound by launch latency. Here one program owns one matrix from start to
finish, with every ``r x r`` intermediate in a per-matrix fp32 workspace that stays in L2:

1. one pass over ``W`` (wide orientation, ``r x n``) builds the Gram ``X X^T`` and ``||X||_F^2``;
   ``Gn = G / ||X||^2`` goes to the workspace;
2. for even ``p``, the Polar Express chain: ``A = X X^T`` (step one: ``Gn`` scaled by the margin),
   ``B = b A + c A A``, then ``X <- a X + B X`` one ``R x BLOCK_K`` column chunk at a time. A chunk
   of the new ``X`` depends only on the same chunk of the old one, so the fp32 iterate is updated
   in place; the first step reads ``W`` itself, scaled by ``1 / (1.01 ||W||)``;
3. ``M = Gn^(p // 2)`` by repeated squaring;
4. the epilogue streams the chunks once more: ``out = ||W||^p M Z`` with ``Z = Q`` (even ``p``)
   or ``Z = W / ||W||`` (odd ``p``), again chunk by chunk, so ``out`` may be ``W``.

Every product is the tile loop of the tiled kernels (:func:`.common.accumulate_rows_product`) with
one ``R x R`` (or ``R x BLOCK_K``) accumulator: ``R`` is ``r`` rounded up to a power of two and the
padding reads zeros. Holding whole ``R x R`` operands in registers instead would need several
128 x 128 fp32 tiles at once, more than a multiprocessor's registers and shared memory. A
program reads back what its own threads wrote, so each workspace write is followed by a barrier.

The normalisation (``||X||_F``, ``1/1.01`` margin) is done in fp32 inside the program, as
:class:`~spectral_ops.plan.GramPlan` does it. The matrix sign of a symmetric
``r x r`` matrix (band projectors, ``msign``) is the same idea: :func:`small_sign`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..coefficients import NORMALIZATION_MARGIN
from .common import (
    Output,
    accumulate_rows_product,
    batched,
    check_precision,
    config,
    dot_precision,
    tile_indices,
    wide_offsets,
)

MAX_SIDE = 128
_TINY = torch.finfo(torch.float32).tiny
_coefficient_cache: dict[tuple, torch.Tensor] = {}


@triton.jit
def _load_square(S, rows, r, R: tl.constexpr):
    inside = (rows[:, None] < r) & (rows[None, :] < r)
    return tl.load(S + rows[:, None] * R + rows[None, :], mask=inside, other=0.0)


@triton.jit
def _store_square(S, value, rows, R: tl.constexpr):
    """Write an ``R x R`` workspace slot, then wait until every thread's part is visible."""
    tl.store(S + rows[:, None] * R + rows[None, :], value)
    tl.debug_barrier()


@triton.jit
def _slot_product(acc, L, M, rows, r, R: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc + L @ M`` for two ``R x R`` workspace slots: ``M``'s columns are the right operand's rows.

    The products are formed as written, not as ``L M^T``: the slots are symmetric only up to
    round-off, and an iteration fed ``M^T`` for ``M`` lets that asymmetry grow step by step.
    """
    return accumulate_rows_product(acc, L, M, rows, rows, r, r, r, R, 1, 1, R, BLOCK_K, False, INPUT_PRECISION,
                                   False)


@triton.jit
def _square_product(L, M, rows, r, R: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    return _slot_product(tl.zeros((R, R), dtype=tl.float32), L, M, rows, r, R, BLOCK_K, INPUT_PRECISION)


@triton.jit
def _poly_step(A, B, b, c, rows, r, R: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Slot ``B <- b A + c A A`` for the symmetric slot ``A``."""
    square = _square_product(A, A, rows, r, R, BLOCK_K, INPUT_PRECISION)
    _store_square(B, c * square + b * _load_square(A, rows, r, R), rows, R)


@triton.jit
def _columns_update(SRC, s_sr, s_sc, DST, s_dr, B, a, rows, r, n, R: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, WIDE: tl.constexpr):
    """``DST <- a SRC + B SRC`` one column chunk at a time (``DST`` may be ``SRC``)."""
    for k0 in range(0, n, BLOCK_K):
        cols = tile_indices(k0, BLOCK_K, WIDE)
        inside = (rows[:, None] < r) & (cols[None, :] < n)
        acc = a * tl.load(SRC + rows[:, None] * s_sr + cols[None, :] * s_sc, mask=inside, other=0.0).to(tl.float32)
        acc = accumulate_rows_product(acc, B, SRC, rows, cols, r, n, r, R, 1, s_sc, s_sr, BLOCK_K, UPCAST,
                                      INPUT_PRECISION, WIDE)
        # In place: other threads read this chunk of SRC as dot operands. Triton's current lowering
        # happens to finish those reads before any store; the barrier makes that a guarantee.
        tl.debug_barrier()
        tl.store(DST + rows[:, None] * s_dr + cols[None, :], acc, mask=inside)
    tl.debug_barrier()


@triton.jit
def small_kernel(
    W, OUT, X, WS, COEF,
    r, n, n_steps,
    s_wb, s_wr, s_wc, s_ob, s_or, s_oc, s_xb, s_xr,
    P: tl.constexpr, EVEN: tl.constexpr, P_HALF: tl.constexpr, LOW: tl.constexpr, NBITS: tl.constexpr,
    SHRINK: tl.constexpr, TINY: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    RAW_PRECISION: tl.constexpr, INPUT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tile_indices(0, R, WIDE)
    w = W + b * s_wb
    x_ws = X + b * s_xb
    # Five R x R slots: the Gram, a and b (the chain's A and B, later the squares), c and d (the power).
    gram = WS + b * (5 * R * R)
    slot_a = gram + R * R
    slot_b = gram + 2 * R * R
    slot_c = gram + 3 * R * R
    slot_d = gram + 4 * R * R

    # 1. Gram and Frobenius norm in one pass over W, both accumulated in fp32.
    G = tl.zeros((R, R), dtype=tl.float32)
    squares = tl.zeros((R,), dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        k = tile_indices(k0, BLOCK_K, WIDE)
        tile = tl.load(w + rows[:, None] * s_wr + k[None, :] * s_wc, mask=(rows[:, None] < r) & (k < n)[None, :],
                       other=0.0)
        G = tl.dot(tile, tl.trans(tile), G, input_precision=RAW_PRECISION)
        t32 = tile.to(tl.float32)
        squares += tl.sum(t32 * t32, axis=1)
    norm = tl.sqrt(tl.sum(squares, axis=0))
    inv = 1.0 / (norm + TINY)
    _store_square(gram, G / (norm * norm + TINY), rows, R)

    # 2. Polar Express for even p; the first step's A is Gn (scaled), its X is W itself.
    if EVEN:
        # Folded into one factor, a * inv / 1.01 would overflow for a zero matrix (inv = 1 / tiny).
        s0 = tl.where(norm > 0, inv * SHRINK, 0.0)
        square = _square_product(gram, gram, rows, r, R, BLOCK_K, INPUT_PRECISION)
        A = _load_square(gram, rows, r, R) * (SHRINK * SHRINK)
        B0 = tl.load(COEF + 1) * A + tl.load(COEF + 2) * (SHRINK * SHRINK * SHRINK * SHRINK) * square
        _store_square(slot_b, B0 * s0, rows, R)
        _columns_update(w, s_wr, s_wc, x_ws, s_xr, slot_b, tl.load(COEF) * s0, rows, r, n, R, BLOCK_K, UPCAST,
                        INPUT_PRECISION, WIDE)
        for step in range(1, n_steps):
            A = tl.zeros((R, R), dtype=tl.float32)
            A = accumulate_rows_product(A, x_ws, x_ws, rows, rows, r, r, n, s_xr, 1, s_xr, 1, BLOCK_K, False,
                                        INPUT_PRECISION, WIDE)
            _store_square(slot_a, A, rows, R)
            _poly_step(slot_a, slot_b, tl.load(COEF + 3 * step + 1), tl.load(COEF + 3 * step + 2), rows, r, R,
                       BLOCK_K, INPUT_PRECISION)
            _columns_update(x_ws, s_xr, 1, x_ws, s_xr, slot_b, tl.load(COEF + 3 * step), rows, r, n, R, BLOCK_K,
                            False, INPUT_PRECISION, WIDE)

    # 3. M = Gn^(p//2) into slot c: squares alternate between slots a and b, and each selected one
    #    is multiplied in through slot d, so no product ever overwrites one of its own operands.
    if P_HALF > 0:
        square_slot = gram
        for bit in tl.static_range(NBITS):
            if bit > 0:
                next_slot = slot_a if bit % 2 == 1 else slot_b
                _store_square(next_slot, _square_product(square_slot, square_slot, rows, r, R, BLOCK_K,
                                                         INPUT_PRECISION), rows, R)
                square_slot = next_slot
            if (P_HALF >> bit) & 1:
                if bit == LOW:
                    _store_square(slot_c, _load_square(square_slot, rows, r, R), rows, R)
                else:
                    _store_square(slot_d, _square_product(slot_c, square_slot, rows, r, R, BLOCK_K, INPUT_PRECISION),
                                  rows, R)
                    _store_square(slot_c, _load_square(slot_d, rows, r, R), rows, R)

    # 4. out = ||W||^p M Z, with Z = Q (even p) or W / ||W|| (odd p).
    factor = tl.full((), 1.0, tl.float32)
    for _ in tl.static_range(P):
        factor = factor * norm
    if not EVEN:
        factor = factor * inv
    for k0 in range(0, n, BLOCK_K):
        cols = tile_indices(k0, BLOCK_K, WIDE)
        inside = (rows[:, None] < r) & (cols[None, :] < n)
        direction = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        if P_HALF > 0:
            if EVEN:
                direction = accumulate_rows_product(direction, slot_c, x_ws, rows, cols, r, n, r, R, 1, 1, s_xr,
                                                    BLOCK_K, False, INPUT_PRECISION, WIDE)
            else:
                direction = accumulate_rows_product(direction, slot_c, w, rows, cols, r, n, r, R, 1, s_wc, s_wr,
                                                    BLOCK_K, UPCAST, INPUT_PRECISION, WIDE)
        else:
            direction = tl.load(x_ws + rows[:, None] * s_xr + cols[None, :], mask=inside, other=0.0)
        acc = factor * direction
        # OUT may be W, whose chunk other threads read as dot operands (odd p): stores wait for them.
        tl.debug_barrier()
        tl.store(OUT + b * s_ob + rows[:, None] * s_or + cols[None, :] * s_oc, acc.to(OUT.dtype.element_ty),
                 mask=inside)


def _coefficient_tensor(coefficients, device) -> torch.Tensor:
    key = (tuple(map(tuple, coefficients)), str(device))
    if key not in _coefficient_cache:
        _coefficient_cache[key] = torch.tensor(coefficients, dtype=torch.float32, device=device).reshape(-1)
    return _coefficient_cache[key]


def _padded(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def spill_free(arch: str, shape) -> bool:
    """Whether the one-program chain for ``(..., r, n)`` (either orientation) is in a shape class that
    compiles for ``arch`` without spilling registers (compile-only with Triton's ptxas; docs/backends.md).

    All of a matrix's products share one program, so the padded side ``R`` sets the register
    load. On sm80 every variant with ``R = 128`` spills (up to 344 bytes of stack); on sm90 those
    whose rows are not 16-element aligned do (100 x 300: unaligned loads cost an address register
    per element). Kept: sides that are multiples of 16, with ``R <= 64`` on sm80. The interpreter
    has no registers to spill.
    """
    r, n = sorted(shape[-2:])
    if r > MAX_SIDE:
        return False
    if arch == "interpreter":
        return True
    return r % 16 == 0 and n % 16 == 0 and (arch == "sm90" or _padded(r) <= 64)


def small_spectral(X: torch.Tensor, p: int, coefficients, *, out: torch.Tensor | None = None,
                   input_precision: str = "ieee", cfg=None) -> torch.Tensor:
    """``out = S_p(X)`` for wide ``(..., r, n)`` ``X`` with ``r <= 128``, one program per matrix.

    ``p = 0`` gives the polar factor by the Polar Express ``coefficients``. ``out`` may be ``X``
    itself; it defaults to a new tensor of ``X``'s dtype.
    """
    check_precision(input_precision)
    r, n = X.shape[-2:]
    if r > MAX_SIDE or r > n:
        raise ValueError(f"the small path takes wide (..., r, n) matrices with r <= {MAX_SIDE}, got {tuple(X.shape)}")
    if p == 1:
        raise ValueError("p = 1 needs no kernel: S_1(X) = X")
    Xb = batched(X)
    batch = Xb.shape[0]
    out = torch.empty_like(X) if out is None else out
    # Chunks are independent, so out may be X itself (same view); any other overlap is unsafe.
    target = Output(out, read_in_place=(X,))
    Ob = target.target
    R = _padded(r)
    cfg = cfg or config("small", X.device, X.dtype)
    even = p % 2 == 0
    iterate = torch.empty((batch, r, n) if even else (1, 1, 1), dtype=torch.float32, device=X.device)
    workspace = torch.empty((batch, 5, R, R), dtype=torch.float32, device=X.device)
    half = p // 2
    small_kernel[(batch,)](
        Xb, Ob, iterate, workspace, _coefficient_tensor(coefficients, X.device),
        r, n, len(coefficients), *Xb.stride(), *Ob.stride(), iterate.stride(0), iterate.stride(1),
        P=p, EVEN=even, P_HALF=half, LOW=(half & -half).bit_length() - 1 if half else 0, NBITS=half.bit_length(),
        SHRINK=1.0 / NORMALIZATION_MARGIN, TINY=_TINY, R=R, BLOCK_K=cfg.block_k, UPCAST=X.dtype != torch.float32,
        RAW_PRECISION=dot_precision(input_precision, X.dtype), INPUT_PRECISION=input_precision,
        WIDE=wide_offsets(Xb, Ob, iterate), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return target.finish()


@triton.jit
def small_sign_kernel(A, OUT, WS, COEF, r, n_steps, s_ab, s_ar, s_ac, s_ob, s_or, s_oc,
                      TINY: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, R)
    inside = (rows[:, None] < r) & (rows[None, :] < r)
    z_slot = WS + b * (3 * R * R)
    square_slot = z_slot + R * R
    poly_slot = z_slot + 2 * R * R
    Z = tl.load(A + b * s_ab + rows[:, None] * s_ar + rows[None, :] * s_ac, mask=inside, other=0.0).to(tl.float32)
    _store_square(z_slot, Z / (tl.sqrt(tl.sum(tl.sum(Z * Z, axis=1), axis=0)) + TINY), rows, R)
    for step in range(n_steps):
        # Z' = a Z + (b Z^2 + c Z^4) Z: the square, the polynomial, then the update, all symmetric.
        _store_square(square_slot, _square_product(z_slot, z_slot, rows, r, R, BLOCK_K, INPUT_PRECISION), rows, R)
        _poly_step(square_slot, poly_slot, tl.load(COEF + 3 * step + 1), tl.load(COEF + 3 * step + 2), rows, r, R,
                   BLOCK_K, INPUT_PRECISION)
        Z = tl.load(COEF + 3 * step) * _load_square(z_slot, rows, r, R)
        Z = _slot_product(Z, poly_slot, z_slot, rows, r, R, BLOCK_K, INPUT_PRECISION)
        tl.debug_barrier()  # in place, as in _columns_update: every read of z_slot before the store
        _store_square(z_slot, Z, rows, R)
    tl.store(OUT + b * s_ob + rows[:, None] * s_or + rows[None, :] * s_oc, Z.to(OUT.dtype.element_ty), mask=inside)


def small_sign(A: torch.Tensor, coefficients, *, out: torch.Tensor | None = None, input_precision: str = "ieee",
               cfg=None) -> torch.Tensor:
    """``msign(A)`` for symmetric ``(..., r, r)`` ``A``, ``r <= 128``: ``Z = A / ||A||_F``, then every step
    ``Z <- a Z + (b Z^2 + c Z^4) Z``, in one program per matrix. ``out`` (default: ``A``'s dtype) may be ``A``.
    """
    check_precision(input_precision)
    r = A.shape[-1]
    if r > MAX_SIDE or A.shape[-2] != r:
        raise ValueError(
            f"the small sign path takes square (..., r, r) matrices with r <= {MAX_SIDE}, got {tuple(A.shape)}")
    Ab = batched(A)
    out = torch.empty_like(A) if out is None else out
    target = Output(out, read_in_place=(A,))
    Ob = target.target
    R = _padded(r)
    cfg = cfg or config("small", A.device, A.dtype)
    workspace = torch.empty((Ab.shape[0], 3, R, R), dtype=torch.float32, device=A.device)
    small_sign_kernel[(Ab.shape[0],)](
        Ab, Ob, workspace, _coefficient_tensor(coefficients, A.device), r, len(coefficients),
        *Ab.stride(), *Ob.stride(),
        TINY=_TINY, R=R, BLOCK_K=cfg.block_k, INPUT_PRECISION=input_precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return target.finish()
