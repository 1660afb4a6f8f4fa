"""How :class:`~spectral_ops.monitor.SpectralMonitor` reads a parameter spread over processes, and sums what
it computes of it over them (docs/monitoring.md, "Distributed").

A parameter's matrices are a grid ``(B, m, n)``: ``B`` matrices (a stack's, or one; the attention heads of a
``q_proj``/``k_proj`` weight, blocks of ``d_h`` rows of it) of ``m`` rows and ``n`` columns. Its
:class:`~spectral_ops.optim.distributed.Layout` (the optimizers' reading of a ``DTensor``'s placements) says
which entries this rank holds, and so how it is read (:func:`reader`):

* **Whole here** (:class:`Whole`): a plain tensor (one process; DDP's replicas, which compute the same bits
  each), a ``Replicate()`` ``DTensor``, or one whose process group is this rank alone. Nothing is reduced.
* **Rows split** (:class:`Rows`): FSDP2's ``Shard(0)``, tensor parallelism's ``ColwiseParallel`` (``Shard(0)``),
  FSDP2 over it on a 2-d mesh (rows over both mesh dims), a stack spread by its matrices (experts) or by its
  matrices' rows; uneven and empty shards included. Each rank iterates on the rows it holds: for a matrix
  whose rows lie on several ranks, ``x = A^T (A v) = sum_r A_r^T (A_r v)`` is one ``all_reduce`` per
  iteration of those matrices' vectors (power.py's ``reduce_columns``); a matrix held whole by one rank (an
  expert, an attention head under tensor parallelism) iterates there, with no collective.
* **Columns split** (:class:`Columns`): ``RowwiseParallel``'s ``Shard(1)``, a conv filter's input channels.
  The vector is split as the columns: ``A v = sum_r A_r v_r`` is one ``all_reduce`` per iteration (with each
  part's ``||v_r||^2``, which normalises ``v``), then each rank computes its part of ``A^T (A v)``.
* **Gathered** (a :class:`Whole` of ``full_tensor()``): rows and columns both split (FSDP2 over
  ``RowwiseParallel``, ``(Shard(0), Shard(1))`` on a 2-d mesh; a stack split by its matrices and by their
  columns): ``A v`` would need a sum over the columns' ranks and ``A^T u`` another over the rows' ranks, two
  collectives per iteration on two groups, for matrices that are a third of a Llama block. And every spread
  matrix with ``exact=True`` (an SVD needs the whole matrix).

The power iteration then runs the same products on the same start vectors as in one process
(:func:`~spectral_ops.monitor.power.initial_vectors` of the whole grid, this rank's part of them), so the
numbers differ from one process's only by the order of the sums. The per-matrix scalars that are sums over
ranks (``||A||_F^2 = sum_r ||A_r||_F^2``, and the ``s_max`` of a matrix that one rank iterated alone) go
through :class:`Totals`: one ``all_reduce`` per process group for all of a call's scalars. Every rank
therefore calls ``compute()`` (the collectives), and every rank gets the same values.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..matrix_views import as_matrices, batched
from ..optim.distributed import DTensor, layout_of, lend, let_go, local, whole
from .power import initial_vectors, power_iterations


def reader(param: torch.Tensor, matrix_view: str | None, rows: int | None = None, gather: bool = False):
    """How this rank reads ``param``'s matrices (module docstring): a :class:`Whole`, :class:`Rows` or
    :class:`Columns`. ``rows``: the matrices are blocks of that many rows of the view's (attention heads).
    ``gather``: whole matrices on every rank, however the parameter is spread (``exact=True``'s SVD)."""
    shape = tuple(param.shape)
    # The grid: the rows of a stack's matrices are those of its batch dims and its row dim, in order.
    row_dims = tuple(range(len(shape) - 1)) if batched(shape, matrix_view) else (0,)
    column_dims = tuple(range(row_dims[-1] + 1, len(shape)))
    m = rows or shape[row_dims[-1]]
    grid = (math.prod(shape[dim] for dim in row_dims) // m, m, math.prod(shape[dim] for dim in column_dims))
    layout = layout_of(param) if isinstance(param, DTensor) else None
    if layout is None or layout.replicated:
        return Whole(lambda: local(param), matrix_view, grid)
    spread = {dim for dim in range(len(shape)) if any(part[dim] != ((0, shape[dim]),) for part in layout.parts)}
    if gather or not (spread <= set(row_dims) or spread <= set(column_dims)):
        # exact=True's SVD, or rows and columns both split (module docstring): every rank gathers it whole.
        return Whole(lambda: whole(param), matrix_view, grid)
    if spread <= set(row_dims):
        return Rows(param, layout, matrix_view, grid, row_dims)
    return Columns(param, layout, matrix_view, grid, column_dims)


def _held(part, dims, shape) -> torch.Tensor:
    """The flat indices, over ``dims`` of a tensor of ``shape`` (row-major), of the entries a rank's ``part``
    (:attr:`Layout.parts`) holds, in the order it holds them (its runs are sorted: ascending)."""
    index = torch.zeros((), dtype=torch.long)
    for dim in dims:
        held = torch.cat([torch.arange(start, stop) for start, stop in part[dim]] or [torch.zeros(0, dtype=torch.long)])
        index = index[..., None] * shape[dim] + held
    return index.reshape(-1)


class Whole:
    """A parameter whose matrices this rank holds whole: ``read()`` gives them (the local tensor, or the
    gathered one)."""

    group = None

    def __init__(self, read, matrix_view, grid):
        self.read, self.matrix_view, self.grid = read, matrix_view, grid

    def matrices(self, dtype: torch.dtype) -> torch.Tensor:
        return as_matrices(self.read().detach(), self.matrix_view).reshape(self.grid).to(dtype)

    def start(self, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
        return initial_vectors(self.grid[0], self.grid[2], dtype, device, seed)

    def iterate(self, matrices, vectors, iterations):
        return power_iterations(matrices, vectors, iterations)

    def any_rank(self, flag: torch.Tensor) -> bool:
        """``flag`` (a 0-d bool) as every rank that shares this parameter's collectives decides it: here alone."""
        return bool(flag)

    def s_max(self, totals, estimates):
        return lambda: estimates

    def frobenius(self, totals, matrices):
        frobenius = torch.linalg.matrix_norm(matrices)
        return lambda: frobenius


class Rows:
    """A parameter whose matrices' rows are spread over the ranks of ``layout.group`` (module docstring).
    This rank holds rows of the matrices :attr:`touched` (ascending); its matrices are a ``(T, rows, n)`` stack
    of them, zero rows filling in where it holds more rows of one than of another (an attention head cut by a
    shard: a zero row changes neither ``A^T A`` nor ``||A||_F``)."""

    def __init__(self, param, layout, matrix_view, grid, row_dims):
        self.param, self.matrix_view, self.grid, self.group = param, matrix_view, grid, layout.group
        count, m, _ = grid
        # Which matrices each rank holds rows of (every rank works out every rank's: the same on all of them).
        touched = [torch.unique_consecutive(_held(part, row_dims, param.shape) // m) for part in layout.parts]
        holders = torch.zeros(count, dtype=torch.long)
        owner = torch.full((count,), layout.world_size)
        for rank in reversed(range(layout.world_size)):
            holders[touched[rank]] += 1
            owner[touched[rank]] = rank  # the lowest rank that holds rows of it: it reports the matrix's s_max
        split = holders > 1  # its rows lie on several ranks: their products are summed, every iteration
        device = local(param).device
        matrix_of = _held(layout.parts[layout.rank], row_dims, param.shape) // m
        mine, counts = torch.unique_consecutive(matrix_of, return_counts=True)
        self.split_count = int(split.sum())
        slots = split.cumsum(0) - 1  # each split matrix's place in the all_reduce of their vectors
        self.touched = mine.to(device)
        self.split_here = split[mine].nonzero().reshape(-1).to(device)  # positions in touched
        self.split_slots = slots[mine][split[mine]].to(device)
        self.reported = (owner[mine] == layout.rank).nonzero().reshape(-1).to(device)
        self.rows = int(counts.max()) if len(counts) else 0
        # Where this rank's rows go in its stack, where the matrices hold different counts of them.
        if len(counts) and not bool((counts == self.rows).all()):
            group = torch.repeat_interleave(torch.arange(len(mine)), counts)
            first = torch.cumsum(counts, 0) - counts
            self.places = (group.to(device), (torch.arange(len(matrix_of)) - first[group]).to(device))
        else:
            self.places = None

    def matrices(self, dtype: torch.dtype) -> torch.Tensor:
        n = self.grid[2]
        rows = as_matrices(local(self.param).detach(), self.matrix_view).reshape(-1, n).to(dtype)
        if self.places is None:
            return rows.reshape(len(self.touched), self.rows, n)
        stack = rows.new_zeros(len(self.touched), self.rows, n)
        stack[self.places] = rows
        return stack

    def start(self, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
        return initial_vectors(self.grid[0], self.grid[2], dtype, device, seed)[self.touched]

    def iterate(self, matrices, vectors, iterations):
        return power_iterations(matrices, vectors, iterations, self._sum if self.split_count else None)

    def any_rank(self, flag: torch.Tensor) -> bool:
        """``flag`` on any rank of the group, where the split matrices' ``all_reduce`` binds the ranks to
        iterate alike (each also iterates matrices it holds alone, whose flags differ); else this rank's."""
        if not self.split_count:
            return bool(flag)
        summed = lend(self.group, flag.reshape(1).to(torch.int32))  # a new tensor: lend takes no view
        dist.all_reduce(summed, group=self.group)
        let_go([summed])
        return bool(summed)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of the split matrices summed over the ranks: one ``all_reduce`` (every rank calls it, with
        zeros for the split matrices it holds no rows of)."""
        summed = lend(self.group, x.new_zeros(self.split_count, x.shape[-1]))
        summed.index_copy_(0, self.split_slots, x.index_select(0, self.split_here))
        dist.all_reduce(summed, group=self.group)
        let_go([summed])
        return x.index_copy_(0, self.split_here, summed.index_select(0, self.split_slots))

    def s_max(self, totals, estimates):
        # Every rank that holds rows of a split matrix has the same estimate; one of them adds it.
        reported = estimates.new_zeros(self.grid[0], dtype=torch.float64)
        reported[self.touched[self.reported]] = estimates[self.reported].to(torch.float64)
        total = totals.add(self.group, reported)
        return lambda: total().to(estimates.dtype)

    def frobenius(self, totals, matrices):
        squares = matrices.new_zeros(self.grid[0], dtype=torch.float64)
        squares.index_add_(0, self.touched, torch.linalg.matrix_norm(matrices).to(torch.float64) ** 2)
        total = totals.add(self.group, squares)
        return lambda: total().sqrt().to(matrices.dtype)


class Columns:
    """A parameter whose matrices' columns are spread over the ranks of ``layout.group`` (module docstring).
    Each rank keeps its part ``w_r`` of the vectors, not normalised: the next iteration's ``all_reduce`` sums
    ``||w_r||^2`` with ``A_r w_r``, and ``v = w / ||w||``. The estimates, from ``A v``, are the same on every
    rank."""

    def __init__(self, param, layout, matrix_view, grid, column_dims):
        self.param, self.matrix_view, self.grid, self.group = param, matrix_view, grid, layout.group
        self.columns = _held(layout.parts[layout.rank], column_dims, param.shape).to(local(param).device)

    def matrices(self, dtype: torch.dtype) -> torch.Tensor:
        count, m, _ = self.grid
        held = as_matrices(local(self.param).detach(), self.matrix_view)
        return held.reshape(count, m, len(self.columns)).to(dtype)

    def start(self, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
        return initial_vectors(self.grid[0], self.grid[2], dtype, device, seed)[:, self.columns]

    def iterate(self, matrices, vectors, iterations):
        """power.py's iteration with the vectors split as the columns: the same products, one ``all_reduce``
        of ``(B, m + 1)`` numbers each. A zero matrix gives 0 and keeps its vector."""
        m = matrices.shape[1]
        estimate = matrices.new_zeros(matrices.shape[0])
        for _ in range(iterations):
            summed = lend(self.group, torch.cat([torch.bmm(matrices, vectors.unsqueeze(-1)).squeeze(-1),
                                                 vectors.square().sum(-1, keepdim=True)], dim=-1))
            dist.all_reduce(summed, group=self.group)
            let_go([summed])
            norm = summed[:, m:].sqrt().clamp_min(torch.finfo(summed.dtype).tiny)
            image, vectors = summed[:, :m] / norm, vectors / norm  # A v and v, for v = w / ||w||
            estimate = image.square().sum(-1)
            x = torch.bmm(matrices.mT, image.unsqueeze(-1)).squeeze(-1)
            vectors = torch.where(estimate[:, None] > 0, x, vectors)
        return estimate.sqrt(), vectors

    def s_max(self, totals, estimates):
        return lambda: estimates

    def any_rank(self, flag: torch.Tensor) -> bool:
        """``flag``: the estimates, from the summed ``A v``, are the same bits on every rank, and so is it."""
        return bool(flag)

    def frobenius(self, totals, matrices):
        total = totals.add(self.group, torch.linalg.matrix_norm(matrices).to(torch.float64) ** 2)
        return lambda: total().sqrt().to(matrices.dtype)


class Totals:
    """The per-matrix sums over ranks of one ``compute()`` call, in fp64: :meth:`add` them all, then
    :meth:`reduce` them in one ``all_reduce`` per process group (every rank adds the same ones, in the same
    order), then read each through what :meth:`add` returned."""

    def __init__(self):
        self.parts = {}  # process group -> this rank's parts, in the order they were added
        self.sums = {}

    def add(self, group, part: torch.Tensor):
        parts = self.parts.setdefault(group, [])
        parts.append(part)
        index = len(parts) - 1
        return lambda: self.sums[group][index]

    def reduce(self) -> None:
        for group, parts in self.parts.items():
            summed = lend(group, torch.cat(parts))
            dist.all_reduce(summed, group=group)
            let_go([summed])
            self.sums[group] = summed.split([len(part) for part in parts])
