"""What every kernel family shares: launch configurations, the tile loop, scale arguments, batching.

Conventions used by all kernels in this package:

* operands are ``(batch, rows, cols)`` tensors with arbitrary strides; the batch offset is always
  computed in int64 (``batch * rows * cols`` overflows int32 for stacked large weights), offsets
  within one matrix only when that matrix spans 2^31 elements (``WIDE``): 64-bit addresses for
  every element of a tile cost registers that the tiles need;
* fp32, fp16 and bf16 operands are multiplied as they are stored and accumulated in fp32; when the
  two operands of a product differ in dtype both are upcast to fp32 first (``tl.dot`` needs one
  dtype), and ``input_precision`` then decides how fp32 operands use the tensor cores;
* a scale (``alpha``, ``beta``, ...) is either a Python number or a fp32 tensor with one value per
  matrix, so per-matrix norms and learning rates held on the device never cause a host sync and a
  step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Config:
    """One launch configuration. ``group``: tile rows a persistent program's neighbours walk
    together, column by column, so that column panels are reused from L2; ``programs_per_sm``: the
    persistent grid's programs per multiprocessor (what its registers and shared memory allow);
    ``descriptors``: load the operands' tiles through TMA tensor descriptors (sm90), where their
    strides allow it."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 1
    programs_per_sm: int = 1
    descriptors: bool = False


# Fixed per-architecture launch configurations. Nothing here is autotuned: the decay kernels write
# the weights in place, and autotuning trial runs would apply the decay several times. Keys are
# (family, operand width in bytes); the square kernels need block_m == block_n, and the small
# path's tile is the whole matrix, so only its column chunk (block_k) and warps are set. The
# interpreter entry only has to be cheap to interpret: its cost is per program and per loop step.
#
# Chosen by compiling every variant the backend launches for each target without a GPU
# (bench/gpu_check.py --compile-only; docs/backends.md has the tables): the tiled kernels' variants
# all fit shared memory and registers without spilling, odd sides (1000, 3000) included. sm90 follows
# Triton's persistent matmul recipe: TMA descriptors, BLOCK_K 64 for 2-byte operands, 128 x 256
# product tiles (the symmetric kernel's tiles are square). fp32 operands get 64 x 64 tiles because
# the default tf32x3 splits every operand into two tf32 halves, and 128 x 128 tiles then spill on
# both architectures; two such programs fit one multiprocessor (registers). The small path does
# spill in some shape classes (R = 128 on sm80, unaligned rows on sm90); the backend keeps it to
# those that do not (small.spill_free). Nothing here has been timed on a GPU.
CONFIGS: dict[str, dict[tuple[str, int], Config]] = {
    "sm90": {
        ("symmetric", 2): Config(128, 128, 64, 8, 3, group=8, descriptors=True),
        ("symmetric", 4): Config(64, 64, 32, 4, 3, group=8, programs_per_sm=2, descriptors=True),
        ("product", 2): Config(128, 256, 64, 8, 3, descriptors=True),
        ("product", 4): Config(64, 64, 32, 4, 3, programs_per_sm=2, descriptors=True),
        ("small", 2): Config(0, 0, 16, 8, 2),
        ("small", 4): Config(0, 0, 16, 8, 2),
    },
    "sm80": {
        ("symmetric", 2): Config(128, 128, 32, 8, 4, group=8),
        ("symmetric", 4): Config(64, 64, 16, 4, 2, group=8, programs_per_sm=2),
        ("product", 2): Config(128, 128, 32, 8, 4),
        ("product", 4): Config(64, 64, 16, 4, 2, programs_per_sm=2),
        ("small", 2): Config(0, 0, 16, 8, 2),
        ("small", 4): Config(0, 0, 16, 8, 2),
    },
    "interpreter": {
        ("symmetric", 2): Config(64, 64, 64, 1, 1),
        ("symmetric", 4): Config(64, 64, 64, 1, 1),
        ("product", 2): Config(64, 64, 64, 1, 1),
        ("product", 4): Config(64, 64, 64, 1, 1),
        ("small", 2): Config(0, 0, 64, 1, 1),
        ("small", 4): Config(0, 0, 64, 1, 1),
    },
}

INPUT_PRECISIONS = ("ieee", "tf32", "tf32x3")


def arch(device: torch.device) -> str:
    """The ``CONFIGS`` key for a device: CPU tensors only run under the interpreter."""
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


def config(family: str, device: torch.device, *dtypes: torch.dtype) -> Config:
    """The fixed configuration for ``family``; the widest operand decides the tile depth."""
    width = max(d.itemsize for d in dtypes)
    return CONFIGS[arch(device)][(family, width)]


def pointer_config(cfg: Config, family: str, *dtypes: torch.dtype) -> Config:
    """``cfg``, or where it reads through TMA descriptors, the configuration of the pointer path
    (sm80's, which compiles without spilling on sm90 too): for operands TMA cannot address, whose
    loads hold an address per element and cannot afford sm90's larger tiles."""
    if not cfg.descriptors:
        return cfg
    return CONFIGS["sm80"][(family, max(d.itemsize for d in dtypes))]


def check_precision(input_precision: str) -> str:
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision must be one of {INPUT_PRECISIONS}, got {input_precision!r}")
    return input_precision


def dot_precision(input_precision: str, *dtypes: torch.dtype) -> str:
    """The ``input_precision`` to hand ``tl.dot`` for operands of these dtypes.

    It only matters when the dot multiplies fp32 values (fp32 operands, or a mixed pair upcast to
    fp32). An fp16 or bf16 pair always runs on the tensor cores as it is; it gets Triton's default
    ``"tf32"`` rather than an fp32-only mode such as ``"tf32x3"``, whose rewrite expects fp32.
    """
    if len(set(dtypes)) == 1 and dtypes[0] != torch.float32:
        return "tf32"
    return input_precision


def wide_offsets(*tensors: torch.Tensor | None) -> bool:
    """Whether an offset inside one matrix of any operand can reach 2^31 (a tile past the edge included)."""
    return any(
        sum((size + 256) * abs(stride) for size, stride in zip(t.shape[-2:], t.stride()[-2:])) >= 2**31
        for t in tensors if t is not None
    )


def batched(t: torch.Tensor) -> torch.Tensor:
    """A ``(batch, rows, cols)`` view of ``(..., rows, cols)``, copying only when no view exists."""
    return t.reshape(-1, *t.shape[-2:])


def scale_arg(value, batch: int, device: torch.device):
    """``(kernel argument, per_matrix flag)`` for a scale: a float, or one fp32 value per matrix.

    A tensor is a 0-d value or a ``(batch,)`` vector (callers flatten ``(..., 1, 1)`` factors).
    """
    if not isinstance(value, torch.Tensor):
        return float(value), False
    value = value.to(device=device, dtype=torch.float32).reshape(-1)
    return torch.broadcast_to(value, (batch,)).contiguous(), True


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Conservative overlap test: any two views of one storage may overlap."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class Output:
    """Where a kernel writes ``out``: the tensor itself, or a workspace copied into it afterwards.

    A workspace is needed when ``out`` has no ``(batch, rows, cols)`` view, or when it may overlap
    an operand that other programs still read (``read_across``). Operands a program reads only at
    the tile it writes (``read_in_place``) may be ``out`` itself, as the identical view.
    """

    def __init__(self, out: torch.Tensor, read_across=(), read_in_place=()):
        self.out = out
        clash = any(t is not None and shares_memory(t, out) for t in read_across) or any(
            t is not None and shares_memory(t, out) and not same_view(t, out) for t in read_in_place
        )
        try:
            view = None if clash else out.view(-1, *out.shape[-2:])
        except RuntimeError:
            view = None
        self.direct = view is not None
        batch = math.prod(out.shape[:-2])
        self.target = view if self.direct else out.new_empty((batch, *out.shape[-2:]))

    def finish(self) -> torch.Tensor:
        if not self.direct:
            self.out.copy_(self.target.view(self.out.shape))
        return self.out


@triton.jit
def load_scale(arg, b, PER_MATRIX: tl.constexpr):
    if PER_MATRIX:
        return tl.load(arg + b)
    else:
        return arg


@triton.jit
def tile_indices(start, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """``start + [0, BLOCK)``, in int64 when in-matrix offsets need it."""
    indices = start + tl.arange(0, BLOCK)
    if WIDE:
        indices = indices.to(tl.int64)
    return indices


@triton.jit
def lower_tile(t, n_tiles, GROUP: tl.constexpr):
    """The ``t``-th tile ``(i, j)``, ``j <= i``, of the lower triangle of ``n_tiles`` x ``n_tiles`` tiles.

    The triangle is cut into bands of ``GROUP`` tile rows, taken top to bottom; each band is
    walked column by column, so neighbouring programs share a column panel and ``GROUP`` row
    panels instead of one row panel and every column panel (L2 reuse). A band holds as many tiles
    as its rows have in a row-major walk, so the band is found from that walk's row, whose float
    square root is off by at most one (the two corrections fix it).
    """
    row = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    row = tl.where(row * (row + 1) // 2 > t, row - 1, row)
    row = tl.where((row + 1) * (row + 2) // 2 <= t, row + 1, row)
    start = row // GROUP * GROUP
    height = tl.minimum(n_tiles - start, GROUP)
    u = t - start * (start + 1) // 2
    # Left of the band's diagonal block, every column has `height` tiles; in it, column c has height - c.
    v = u - start * height
    c = 0
    for k in tl.static_range(1, GROUP):
        c += ((k < height) & (k * height - k * (k - 1) // 2 <= v)).to(tl.int32)
    in_block = v >= 0
    i = tl.where(in_block, start + c + v - (c * height - c * (c - 1) // 2), start + u % height)
    j = tl.where(in_block, start + c, u // height)
    return i, j


@triton.jit
def known_multiple(stride, ALIGN: tl.constexpr):
    """``stride`` as the compiler can see it: a multiple of ``ALIGN`` elements, as the host checked
    (:func:`stride_alignment`). Triton only knows multiples of 16; rows of 1000 or 3000 elements
    start 16 bytes apart too, and their tiles then load in 16-byte vectors instead of one element
    at a time (which costs a 64-bit address per element and, in 128-wide tiles, every register).
    A unit stride is left alone: Triton made it a constant already (and ``isinstance`` sees a
    constant unwrapped, as a Python ``int``; ``1 // ALIGN * ALIGN`` would be 0).
    """
    multiple = stride
    if not isinstance(stride, int):
        multiple = stride // ALIGN * ALIGN
    return multiple


@triton.jit
def known_multiples(s0, s1, s2, ALIGN: tl.constexpr):
    """One operand's batch, row and column strides through :func:`known_multiple`."""
    return known_multiple(s0, ALIGN), known_multiple(s1, ALIGN), known_multiple(s2, ALIGN)


def stride_alignment(*tensors: torch.Tensor | None) -> int:
    """The largest power of two up to 16 that divides every stride (other than 1) of ``tensors``.

    1 under the interpreter, which passes a unit stride as a plain value: it has no use for hints.
    """
    if triton.knobs.runtime.interpret:
        return 1
    align = 16
    for t in tensors:
        if t is None:
            continue
        for stride in t.stride():
            while stride != 1 and stride % align:
                align //= 2
    return align


@triton.jit
def _rows_step(acc, L, R, rows_l, rows_r, k0, mask_l, mask_r, inner, s_l_row, s_l_inner, s_r_row, s_r_inner,
               BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
               MASK_K: tl.constexpr):
    k = tile_indices(k0, BLOCK_K, WIDE)
    if MASK_K:
        in_k = k < inner
        left_mask = mask_l & in_k[None, :]
        right_mask = in_k[:, None] & mask_r
    else:
        left_mask = mask_l
        right_mask = mask_r
    left = tl.load(L + rows_l[:, None] * s_l_row + k[None, :] * s_l_inner, mask=left_mask, other=0.0)
    right = tl.load(R + k[:, None] * s_r_inner + rows_r[None, :] * s_r_row, mask=right_mask, other=0.0)
    if UPCAST:
        left = left.to(tl.float32)
        right = right.to(tl.float32)
    return tl.dot(left, right, acc, input_precision=INPUT_PRECISION)


@triton.jit
def accumulate_rows_product(acc, L, R, rows_l, rows_r, n_l, n_r, inner,
                            s_l_row, s_l_inner, s_r_row, s_r_inner,
                            BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                            WIDE: tl.constexpr, SPLIT_RAGGED_STEP: tl.constexpr = False):
    """``acc += L[rows_l, :] @ R[rows_r, :]^T``, walking the shared inner dimension in BLOCK_K steps.

    Both operands are read along their rows, so ``X X^T``, ``A A`` for symmetric ``A`` and
    ``M Z`` (pass ``Z``'s strides swapped: the rows of ``Z^T``) are all this loop. Out-of-range
    rows and the ragged last step read zeros, which add nothing. With ``SPLIT_RAGGED_STEP`` the
    whole steps mask rows only (a mask constant along ``k`` leaves the loads vectorised) and the
    ragged step is a second copy of the step after the loop: the tiled kernels' choice. The small
    path, which runs this loop a dozen times in one program, keeps one masked loop (half the code).
    """
    mask_l = rows_l[:, None] < n_l
    mask_r = rows_r[None, :] < n_r
    whole = inner // BLOCK_K * BLOCK_K if SPLIT_RAGGED_STEP else 0
    for k0 in range(0, whole, BLOCK_K):
        acc = _rows_step(acc, L, R, rows_l, rows_r, k0, mask_l, mask_r, inner, s_l_row, s_l_inner, s_r_row,
                         s_r_inner, BLOCK_K, UPCAST, INPUT_PRECISION, WIDE, False)
    for k0 in range(whole, inner, BLOCK_K):
        acc = _rows_step(acc, L, R, rows_l, rows_r, k0, mask_l, mask_r, inner, s_l_row, s_l_inner, s_r_row,
                         s_r_inner, BLOCK_K, UPCAST, INPUT_PRECISION, WIDE, True)
    return acc


# ----- TMA tensor descriptors (sm90) -----

def describe(t: torch.Tensor, block_rows: int, block_cols: int):
    """A TMA descriptor for ``(batch, rows, cols)`` ``t`` that loads ``1 x block_rows x block_cols``
    boxes (out-of-range elements read as zeros), or None where TMA cannot address ``t``: it needs
    unit-stride rows, 16-byte aligned strides and a 16-byte aligned start. (Pass ``t.mT`` for an
    operand stored by columns.)"""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, rows, cols = t.shape
    batch_stride = t.stride(0) if batch > 1 else rows * t.stride(1)  # never stepped over: any aligned value
    strides = (batch_stride, t.stride(1))
    if t.stride(2) != 1 or t.data_ptr() % 16 or any(s * t.itemsize % 16 or s <= 0 for s in strides) or 0 in t.shape:
        return None
    return TensorDescriptor(t, [batch, rows, cols], [*strides, 1], [1, block_rows, block_cols])


@triton.jit
def accumulate_described(acc, L, R, b, row_l, col_r, inner,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         LEFT_TRANSPOSED: tl.constexpr, RIGHT_BY_ROWS: tl.constexpr,
                         UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc += left @ right`` through TMA descriptors (Triton's sm90 matmul recipe), over the inner
    dimension. ``L`` describes the left operand as stored: ``(batch, rows, inner)``, or its
    transpose ``(batch, inner, rows)`` with ``LEFT_TRANSPOSED`` (a tall weight's ``W^T W``). ``R``
    describes the right operand as ``(batch, cols, inner)`` with ``RIGHT_BY_ROWS`` (the Gram's
    second operand), else as ``(batch, inner, cols)`` (the product's ``Z``). TMA zero-fills
    whatever lies past an edge, so no step is masked, whatever the sides."""
    for k0 in range(0, inner, BLOCK_K):
        if LEFT_TRANSPOSED:
            left = L.load([b, k0, row_l]).reshape(BLOCK_K, BLOCK_M).T
        else:
            left = L.load([b, row_l, k0]).reshape(BLOCK_M, BLOCK_K)
        if RIGHT_BY_ROWS:
            right = R.load([b, col_r, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            right = R.load([b, k0, col_r]).reshape(BLOCK_K, BLOCK_N)
        if UPCAST:
            left = left.to(tl.float32)
            right = right.to(tl.float32)
        acc = tl.dot(left, right, acc, input_precision=INPUT_PRECISION)
    return acc


def persistent_programs(device: torch.device, tiles: int, cfg: Config) -> int:
    """The persistent grid: as many programs as run at once (``programs_per_sm`` per multiprocessor),
    never more than there are tiles. The interpreter gets 3, so its tests walk several tiles per program."""
    if device.type != "cuda":
        return max(1, min(tiles, 3))
    return max(1, min(tiles, cfg.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count))
