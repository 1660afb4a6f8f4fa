"""Owner compute for parameters spread over processes (SPEC 10).

``S_p(W)`` and Muon's polar factor need the whole matrix, but FSDP2 (``fully_shard``) leaves each rank
a ``Shard(0)`` slice of it (a ``DTensor``), and DDP repeats the whole matrix on every rank. Each
matrix of a step is therefore given an *owner* rank. The step's groups submit their whole-matrix work
(:meth:`Exchange.submit`), and once every group is prepared it runs together (:meth:`Exchange.run`):
the owners are balanced over the whole step, largest matrices first, by the plan's FLOP model
(:func:`assign_owners`), and every job's collectives form one pipeline. The jobs are Muon's polar
factors (:mod:`spectral_ops.optim.muon`) and the decay's spectral directions (:func:`owner_decay`).

* A sharded matrix (``Shard(d)`` on any dim: FSDP2's rows, tensor parallelism's columns; on a 2-d mesh
  FSDP2 over tensor parallelism, whose owners are balanced over both mesh dims) is gathered
  on its owner with one ``all_to_all_single`` per round (every rank sends each owner its part of the
  matrices that owner holds, joined there: :meth:`Layout.join`), computed there with the
  single-device path, and each rank's part goes back with a second ``all_to_all_single``. A stack of
  matrices spread by its batch (experts) holds whole matrices: each rank computes its own.
* A replicated matrix (a ``Replicate()`` DTensor, or a plain parameter of an optimizer given
  ``process_group``, as under DDP) is already whole everywhere: its owner computes it, and one
  ``all_gather_single`` per round hands every rank the results of every owner.

A job's matrices of one shape and dtype travel together, in :data:`ROUNDS_PER_SHAPE` rounds: the
next round's collective (of this job or the next) is started, asynchronously, before this round is
computed, and an owner batches what it holds of a round into one call. Element-wise work (Adam's moments,
momentum, the ordinary decay) never leaves a rank: it runs on the local shard, and the optimizer state stays a DTensor
sharded like its parameter, so that ``torch.distributed.checkpoint`` saves and loads it.

Before anything is written, the ranks agree (:meth:`Exchange.agree`, one ``all_reduce``): a
parameter is skipped on every rank if one rank finds its gradient or update not finite, the clamp
factors the owners computed reach every rank, and an error raised on an owner (a stability error,
an overflow) is raised on every rank, so that no rank writes a step another refused.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from .. import plan
from ..decay import PendingWrite, prepare_decay, row_block
from ..matrix_views import as_matrices, batched, matrix_dims

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's over tensor parallelism
else:  # a torch built without torch.distributed: every parameter is a plain tensor
    DTensor = Replicate = Shard = _StridedShard = ()


def _all_gather_single(output, source, **options):
    """``dist.all_gather_single``: torch 2.13's name of ``all_gather_into_tensor``, whose old name
    warns at every call there."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, source, **options)


# Each set of same-shape matrices is exchanged in this many rounds (fewer when there are fewer
# matrices than ranks): one round's collective then runs while the previous round is computed, and
# each owner still batches half of what it holds of the set into one call.
ROUNDS_PER_SHAPE = 2
# The longest a step waits for Gloo to let go of a finished collective's buffers (see let_go): a worker
# thread descheduled on a loaded machine is back within milliseconds. Only memory depends on it: a buffer
# Gloo still holds after it stays pinned (see lend) until a later let_go finds it let go.
LET_GO_SECONDS = 0.1
# Buffers lent to Gloo collectives, by id (each is held here, so no other object takes its id): the buffer and
# its pin, until let_go finds that Gloo holds nothing of it.
_LENT: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_LENT_LOCK = threading.Lock()


def _through_gloo(group, device: torch.device) -> bool:
    """Whether ``group`` (None: the default group) takes ``device``'s tensors to Gloo: a group made for
    ``"gloo"``, or for no backend named (``init_process_group()`` on CPUs, whose ``get_backend`` is
    ``"undefined"``)."""
    try:
        backend = (group if group is not None else dist.group.WORLD)._get_backend(device)
    except RuntimeError:  # no backend for that device: the collective itself will say so
        return False
    return isinstance(backend, getattr(dist, "ProcessGroupGloo", ()))


def lend(group, buffer: torch.Tensor) -> torch.Tensor:
    """``buffer``, ready to be handed to a collective of ``group``: call it before the collective, on a tensor of
    its own (not a view, no views of it yet). Under Gloo it is pinned until :func:`let_go` finds Gloo done with it.

    Since torch 2.10 a tensor's C++ side holds a reference to its Python object while more than one C++
    reference to it lives, and whichever thread takes that count from 2 to 1 drops it, taking the GIL. A Gloo
    worker thread keeps a collective's tensors a moment after ``wait()`` returns (a third of a 2-process loop's
    all_reduces, measured), and where Python holds the buffer alone, the worker's release is that step from 2
    to 1: it takes the GIL after the step that waited has moved on, even after a use count read there showed
    it released (1 in 100 to 750 all_reduces, measured under load). When the program has ended by then (its
    last step, then the end of the script), the thread asks for the GIL once the interpreter is finalizing,
    is ended there, and the process aborts ("terminate called without an active exception", exit code -6;
    torchrun then stops the other ranks). A pin, a view of ``buffer`` (one more C++ reference) made before
    the collective, keeps every release of Gloo's above 2: its threads never touch Python for the buffer.
    The pin goes only once Gloo holds nothing of it, so a buffer still held at the exit keeps its pin.

    A tensor made under ``torch.inference_mode`` has no views that pin it: a copy made outside that mode is lent
    in its place. Under another backend (NCCL releases its works from a watchdog thread that a use count does
    not follow), ``buffer`` itself, unpinned."""
    if not _through_gloo(group, buffer.device):
        return buffer
    if buffer.is_inference():
        with torch.inference_mode(False):
            buffer = buffer.clone()
    if buffer._base is not None or buffer._use_count() != 1:
        raise ValueError("lend takes a tensor of its own, which nothing else references yet (a view's pin would "
                         "hold its base, not the view): lend the tensor the collective is given, as it is made")
    with _LENT_LOCK:
        _LENT[id(buffer)] = buffer, buffer.view_as(buffer)
    return buffer


def _held(buffer: torch.Tensor) -> bool:
    """Whether something beyond a lent buffer itself and its pin (see :func:`lend`) holds it: Gloo, or a view
    of it made since."""
    return buffer._use_count() > 2


def let_go(buffers) -> None:
    """Unpin what Gloo's threads have let go of: ``buffers`` (those :func:`lend` pinned: the others are left
    alone) of finished collectives, whose ``Work`` handles are dropped, waited for up to
    :data:`LET_GO_SECONDS`, and any earlier loan Gloo no longer holds (a view made since reads as held, so
    pass ``buffers`` before viewing them).

    Nothing depends on the wait but memory: a buffer Gloo still holds keeps its pin until a later call finds
    it let go, the exit included, so that Gloo's threads never need Python for it."""
    lent = [buffer for buffer in buffers if id(buffer) in _LENT]
    deadline = time.monotonic() + LET_GO_SECONDS
    while any(_held(buffer) for buffer in lent) and time.monotonic() < deadline:
        time.sleep(0)  # yields the core to the worker
    with _LENT_LOCK:
        for key in [key for key, (buffer, _) in _LENT.items() if not _held(buffer)]:
            del _LENT[key]


class Layout:
    """How one parameter of ``shape`` is spread over the ranks of ``group``: rank ``k`` holds the entries
    ``parts[k]`` (per dim, sorted ``(start, stop)`` runs, the part being their product: see
    :func:`part_of`), or all of them everywhere (``parts`` None: replicated)."""

    def __init__(self, group, shape, parts=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.shape = tuple(shape)
        self.parts = None if parts is None else tuple(parts)

    @property
    def replicated(self) -> bool:
        return self.parts is None

    def part_shape(self, rank: int) -> tuple:
        """The shape of what ``rank`` holds."""
        if self.replicated:
            return self.shape
        return tuple(sum(stop - start for start, stop in runs) for runs in self.parts[rank])

    def _blocks(self, rank: int):
        """``(whole, held)`` index tuples, one per block of ``rank``'s part: the block's place in the
        whole and in the part (one block unless a strided shard left several runs on a dim)."""
        per_dim = []
        for runs in self.parts[rank]:
            offsets = [0]
            for start, stop in runs:
                offsets.append(offsets[-1] + stop - start)
            per_dim.append([(slice(start, stop), slice(offset, offset + stop - start))
                            for (start, stop), offset in zip(runs, offsets)])
        for block in itertools.product(*per_dim):
            yield tuple(whole for whole, _ in block), tuple(held for _, held in block)

    def take(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of a whole tensor of the parameter's shape (a view where it is one block)."""
        blocks = list(self._blocks(rank))
        if len(blocks) == 1:
            return whole[blocks[0][0]]
        part = whole.new_empty(self.part_shape(rank))
        for in_whole, held in blocks:
            part[held] = whole[in_whole]
        return part

    def join(self, parts) -> torch.Tensor:
        """The whole tensor from every rank's part (``parts[k]``: rank ``k``'s)."""
        whole = parts[0].new_empty(self.shape)
        for rank, part in enumerate(parts):
            for in_whole, held in self._blocks(rank):
                whole[in_whole] = part[held]
        return whole

    def _sharded(self, dim: int) -> bool:
        return not self.replicated and any(runs != ((0, self.shape[dim]),) for runs in
                                           (part[dim] for part in self.parts))

    def local_rows(self, matrix_view):
        """The rows of the matrices ``matrix_view`` reads from the parameter that this rank holds, as
        runs, or None where it holds all of them (a stack spread by its batch, a matrix by its columns)."""
        row_dim = len(self.shape) - 2 if batched(self.shape, matrix_view) else 0
        return self.parts[self.rank][row_dim] if self._sharded(row_dim) else None

    def holds_whole_matrices(self, matrix_view) -> bool:
        """A stack spread by its batch dims only (expert parallelism): each rank holds whole matrices."""
        return (not self.replicated and batched(self.shape, matrix_view)
                and not any(self._sharded(dim) for dim in (len(self.shape) - 2, len(self.shape) - 1)))

    def local_matrices(self) -> torch.Tensor:
        """Where the matrices this rank holds of a stack that :meth:`holds_whole_matrices` sit in the
        whole stack: their numbers, in the order it holds them."""
        numbers = torch.zeros((), dtype=torch.long)
        for length, runs in zip(self.shape[:-2], self.parts[self.rank][:-2]):
            held = torch.tensor([entry for start, stop in runs for entry in range(start, stop)], dtype=torch.long)
            numbers = numbers[..., None] * length + held
        return numbers.reshape(-1)


def _chunk_span(length: int, chunks: int, index: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of chunk ``index`` of ``length`` entries in ``torch.chunk``'s split."""
    size = -(-length // chunks)
    return min(index * size, length), min((index + 1) * size, length)


def _take(ranges: tuple, start: int, stop: int) -> tuple:
    """Positions ``[start, stop)`` of the entries ``ranges`` lists (sorted ``(first, end)`` runs)."""
    taken, offset = [], 0
    for first, end in ranges:
        low, high = max(start - offset, 0), min(stop - offset, end - first)
        if low < high:
            taken.append((first + low, first + high))
        offset += end - first
    return tuple(taken)


def part_of(shape, placements, mesh_sizes, coordinate) -> tuple:
    """The entries of a ``shape`` DTensor placed ``placements`` on a mesh of ``mesh_sizes`` that the rank
    at ``coordinate`` holds: per dim, sorted ``(start, stop)`` runs, the part being their product.

    DTensor's left-to-right order: each mesh dim's placement splits what the dims before it left. A
    ``Shard(d)`` takes its chunk (``torch.chunk``'s split) of the entries; a ``_StridedShard(d, sf)``
    (FSDP2 over a tensor-parallel ``Shard(d)``: ``sf`` is the later dims' count of shards) splits them
    into ``sf`` chunks, then takes its chunk of each, so that the later ``Shard(d)`` then takes one of
    them whole. A ``Replicate`` leaves them."""
    held = [((0, length),) for length in shape]
    for placement, size, index in zip(placements, mesh_sizes, coordinate):
        dim = getattr(placement, "dim", None)  # Shard and _StridedShard (not a Shard subclass in torch 2.13)
        if dim is None:
            continue
        runs = held[dim]
        length = sum(end - first for first, end in runs)
        split = int(getattr(placement, "split_factor", 1))
        pieces = []
        for piece in range(split):
            first, end = _chunk_span(length, split, piece)
            start, stop = _chunk_span(end - first, size, index)
            for run in _take(runs, first + start, first + stop):
                if pieces and pieces[-1][1] == run[0]:  # adjacent runs merge: one run per contiguous span
                    run = (pieces.pop()[0], run[1])
                pieces.append(run)
        held[dim] = tuple(pieces)
    return tuple(held)


def layout_of(param: torch.Tensor, process_group=None) -> Layout | None:
    """The parameter's :class:`Layout`, or None for a parameter this process computes alone: a plain
    tensor when ``process_group`` is None, or one no other rank holds a part of.

    A DTensor's group is that of the mesh dims it is sharded over (FSDP2's, tensor parallelism's, or
    both, flattened: one owner per matrix over all of them); over a dim it is replicated on (HSDP's
    replicas), each replica group computes the same, from the same gradients."""
    if isinstance(param, DTensor):
        mesh, placements = param.device_mesh, tuple(param.placements)
        unknown = [placement for placement in placements
                   if not isinstance(placement, (Replicate, Shard, _StridedShard))]
        if unknown:
            raise ValueError(
                f"a {tuple(param.shape)} DTensor placed {placements}: spectral_ops optimizers take parameters "
                f"sharded (Shard, FSDP2's strided shards) or replicated over each mesh dim, not {unknown}; "
                "redistribute it to one of those")
        sharded = [dim for dim, placement in enumerate(placements) if not isinstance(placement, Replicate)]
        group = _group_over(mesh, sharded or [0])
        if dist.get_world_size(group) == 1:
            return None
        if not sharded:
            return Layout(group, param.shape)
        grid = mesh.mesh
        coordinates = [tuple((grid == dist.get_global_rank(group, rank)).nonzero()[0].tolist())
                       for rank in range(dist.get_world_size(group))]
        layout = Layout(group, param.shape, [part_of(param.shape, placements, grid.shape, coordinate)
                                             for coordinate in coordinates])
        if layout.part_shape(layout.rank) != tuple(param.to_local().shape):
            raise ValueError(
                f"a {tuple(param.shape)} DTensor placed {placements} holds a {tuple(param.to_local().shape)} part on "
                f"rank {layout.rank}, not the {layout.part_shape(layout.rank)} of the placements' split "
                "(torch.chunk's, as DTensor's Shard takes it)")
        return layout
    if process_group is None or dist.get_world_size(process_group) == 1:
        return None
    return Layout(process_group, param.shape)


# (world, ranks) -> the process group of those ranks: one per set of mesh dims a parameter is sharded over.
_FLATTENED_GROUPS = {}


def _group_over(mesh, dims):
    """The process group of this rank's sub-mesh over mesh dims ``dims`` (a dim's own group for one).
    Several dims get a group of their own, made once by the ranks in it, when the optimizer is built."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    coordinate = mesh.get_coordinate()
    ranks = tuple(sorted(mesh.mesh[tuple(slice(None) if dim in dims else coordinate[dim]
                                         for dim in range(mesh.ndim))].flatten().tolist()))
    key = (dist.group.WORLD, ranks)
    if key not in _FLATTENED_GROUPS:
        _FLATTENED_GROUPS[key] = dist.new_group(list(ranks), backend=dist.get_backend(mesh.get_group(dims[0])),
                                                use_local_synchronization=True)
    return _FLATTENED_GROUPS[key]


def local_slice(start: int, stop: int, runs) -> slice:
    """Entries ``[start, stop)`` of a dim as a slice of the entries a rank holds of it, listed by
    ``runs`` (sorted ``(first, end)`` runs; an empty slice where it holds none of them)."""
    def held_before(index):
        return sum(min(max(index, first), end) - first for first, end in runs)
    return slice(held_before(start), held_before(stop))


def local_block(matrices: torch.Tensor, start: int, stop: int, rows) -> torch.Tensor:
    """This rank's part of rows ``[start, stop)`` of each matrix, from its part ``matrices`` of a
    parameter (see :func:`spectral_ops.matrix_views.as_matrices`): of the rows it holds (``rows``, runs:
    :meth:`Layout.local_rows`), those in the block; else (``rows`` None: it holds every row, as of a
    stack spread by its batch or a matrix by its columns) those rows of every matrix it holds."""
    return matrices[..., start:stop, :] if rows is None else matrices[..., local_slice(start, stop, rows), :]


def local(tensor):
    """A DTensor's shard on this rank (its storage: writing it writes the DTensor), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor as one tensor on every rank (a collective: every rank calls it), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def state_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Optimizer state computed on ``param``'s shard, held like the parameter (a DTensor with its
    placements, as torch's optimizers keep the state of a DTensor parameter)."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def assign_owners(costs, world_size: int, loads=None) -> tuple[list[int], list[float]]:
    """``(owners, loads)``: each job to the least loaded rank (the lowest on a tie), most costly jobs
    first (the longest-processing-time rule: the largest load is at most 4/3 of the optimum), starting
    from ``loads`` (per rank; zeros by default). Every rank computes the same assignment."""
    loads = [0.0] * world_size if loads is None else list(loads)
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owner = min(range(world_size), key=loads.__getitem__)
        owners[index] = owner
        loads[owner] += costs[index]
    return owners, loads


def split_rounds(members: list, world_size: int) -> list[list]:
    """A job's same-shape matrices in :data:`ROUNDS_PER_SHAPE` rounds of consecutive ones (one round
    when there are fewer than twice as many matrices as ranks)."""
    count = min(ROUNDS_PER_SHAPE, max(1, len(members) // world_size))
    size = -(-len(members) // count)
    return [members[start:start + size] for start in range(0, len(members), size)]


def counted(coefficients) -> int | None:
    """The number of steps of given coefficients; None (designed for a threshold) stays None."""
    return None if coefficients is None else len(coefficients)


def decay_flops(shape, options, dtype: torch.dtype = torch.float32) -> float:
    """The plan's FLOPs of one matrix's decay (:func:`spectral_ops.plan.cost`, symmetric products at
    half), at the precision ``options`` resolve to for ``dtype``; a band's steps designed for its
    threshold at the capturable design (for tau >= s_max / 1000: the weights' norm is not read here)."""
    band = options.band
    flops = plan.cost("decay_", tuple(shape), p=options.p, precision=plan.resolve_precision(options.precision, dtype),
                      iteration=options.iteration, steps=counted(options.polar_coefficients),
                      sign_steps=counted(options.sign_coefficients), band_mode=band.mode if band else None,
                      p_bot=band.p_bot if band else 1, symmetric_at_half=True)
    return flops + shape[0] * shape[1]  # the element-wise update, so that no matrix is free


def polar_blocks_flops(shape, count: int, steps: int) -> float:
    """The plan's FLOPs of ``count`` polar factors of ``shape`` blocks (Muon's heads)."""
    return count * plan.cost("polar", tuple(shape), steps=steps, symmetric_at_half=True)


class Job:
    """Whole-matrix work submitted to an :class:`Exchange` (:meth:`Exchange.submit`); ``results``: one
    per source, on this rank's rows, by position, once the exchange has run (None before)."""

    def __init__(self, fn, sources, layouts, costs, here):
        self.fn, self.sources, self.layouts, self.costs, self.here = fn, sources, layouts, costs, here
        self.results = None


class Exchange:
    """One step's owner compute: the whole-matrix jobs the step's groups submit (:meth:`submit`), run
    together once every group is prepared (:meth:`run`: owners balanced over the whole step, one
    pipeline of rounds), then what the ranks agree on before anything is written (:meth:`agree`). The
    work that takes a job's results in is a generator that reads top to bottom (dion's style),
    ``results = yield exchange.submit(...)``: started by :meth:`wait`, resumed by :meth:`run`."""

    def __init__(self):
        self.jobs = []
        self.waiting = []  # (generator, the job it waits for)
        self.error = None
        self.clamp_slots_of = defaultdict(list)  # group -> [(PendingWrite, entries, float64 factors, eager)]

    def submit(self, fn, sources, layouts, costs, here=None) -> Job:
        """Ask for ``fn`` of whole matrices: ``fn(positions, matrices)`` takes the whole matrices
        (positions into ``sources``, this rank's matrices: shards or whole) and returns one result of
        the same shape and dtype each, and runs on each matrix's owner; ``costs`` are the matrices'
        FLOPs. ``here[i]``: ``sources[i]`` is already made of whole matrices (a stack spread by its batch,
        as expert parallelism spreads experts), so ``fn`` runs on it where it lives, with no collective.
        The returned :class:`Job` holds the results once :meth:`run` has run."""
        job = Job(fn, sources, layouts, costs, here or [False] * len(sources))
        self.jobs.append(job)
        return job

    def wait(self, work) -> None:
        """Run ``work``, a generator, up to its ``yield`` of the job it submitted; :meth:`run` sends it the
        job's results, and it ends."""
        self.waiting.append((work, next(work)))

    def clamp_slots(self, group, write, entries, batch_shapes, eager: bool, device) -> torch.Tensor:
        """The clamp factors of the matrices ``write.tensors[i]`` stands for, ``i`` in ``entries``
        (of ``group``), one after another, each entry's of shape ``batch_shapes[i]`` (``()``: one
        matrix): the matrices' owners set them and :meth:`agree` hands them to every rank, as
        ``write.clamp_factors[i]``."""
        factors = torch.ones(sum(math.prod(shape) for shape in batch_shapes), dtype=torch.float64, device=device)
        self.clamp_slots_of[group].append((write, list(zip(entries, batch_shapes)), factors, eager))
        return factors

    def run(self) -> None:
        """Every job of the step: owners per process group over all the step's matrices, then the
        rounds of every job in one pipeline (every rank issues the same collectives in the same order)."""
        jobs, self.jobs = self.jobs, []
        matrices = defaultdict(list)  # group -> [(job number, position)]
        for number, job in enumerate(jobs):
            for position, layout in enumerate(job.layouts):
                if not job.here[position]:
                    matrices[layout.group].append((number, position))
        owners = {}
        for members in matrices.values():
            world_size = jobs[members[0][0]].layouts[members[0][1]].world_size
            assigned, _ = assign_owners([jobs[number].costs[position] for number, position in members], world_size)
            owners.update(zip(members, assigned))
        rounds = []
        for number, job in enumerate(jobs):
            results = [None] * len(job.sources)
            self._run_here(job.fn, [i for i in range(len(job.sources)) if job.here[i]], job.sources, results)
            by_kind = defaultdict(list)
            for position, (source, layout) in enumerate(zip(job.sources, job.layouts)):
                if job.here[position]:
                    continue
                by_kind[(layout.group, layout.shape, layout.parts, source.dtype)].append(position)
            for members in by_kind.values():
                for positions in split_rounds(members, job.layouts[members[0]].world_size):
                    rounds.append(_Round(self, job.fn, positions, [owners[number, i] for i in positions], job.sources,
                                         job.layouts, results))
            job.results = results
        _pipeline(rounds)
        waiting, self.waiting = self.waiting, []
        for work, job in waiting:
            try:
                work.send(job.results)
            except StopIteration:  # it took the results in and ended
                continue
            raise RuntimeError("work waiting on an exchange yields once, for the job it submitted")

    def _run_here(self, fn, positions, sources, results) -> None:
        """``fn`` on the whole matrices this rank holds (:meth:`submit`'s ``here``); a failure is raised on
        every rank by :meth:`agree`, as an owner's is. A rank that holds none of a stack's matrices has
        nothing to compute."""
        for i in positions:
            if not sources[i].numel():
                results[i] = sources[i]
        positions = [i for i in positions if sources[i].numel()]
        if not positions:
            return
        if self.error is None:
            try:
                for i, result in zip(positions, fn(positions, [sources[i] for i in positions])):
                    results[i] = result.to(sources[i].dtype).reshape(sources[i].shape)
                return
            except Exception as error:  # any failure: raised on every rank by Exchange.agree, not here
                self.error = error
        for i in positions:
            results[i] = torch.zeros_like(sources[i])

    def agree(self, checked) -> list:
        """Every rank's decision for each ``(layout, keep)`` of ``checked`` (``keep``: a Python bool or
        a 0-d bool tensor): kept only if kept on every rank of its group. Raises, on every rank, the
        error an owner met; fills in the clamp factors. One ``all_reduce`` per process group."""
        decisions = [keep for _, keep in checked]
        by_group = defaultdict(list)
        for index, (layout, _) in enumerate(checked):
            by_group[layout.group].append(index)
        # In the order the step met them: every rank must reduce its groups in the same order.
        for group in list(by_group) + [group for group in self.clamp_slots_of if group not in by_group]:
            indices, slots = by_group.get(group, []), self.clamp_slots_of.get(group, [])
            on_host = [i for i in indices if not isinstance(checked[i][1], torch.Tensor)]
            on_device = [i for i in indices if isinstance(checked[i][1], torch.Tensor)]
            eager = bool(on_host) or any(eager for *_, eager in slots)
            device = next((factors.device for _, _, factors, _ in slots), None) or next(
                (checked[i][1].device for i in on_device), None) or _collective_device(group)
            # Host values in one copy: the error flag (1: none here), then the host decisions; then the
            # device decisions and the owners' clamp factors. MIN: 0 wins, the smallest factor wins.
            parts = [torch.tensor([float(self.error is None)] + [float(checked[i][1]) for i in on_host],
                                  dtype=torch.float64, device=device)]
            if on_device:
                parts.append(torch.stack([checked[i][1] for i in on_device]).to(torch.float64))
            parts += [factors for _, _, factors, _ in slots]
            reduced = lend(group, torch.cat(parts))
            dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=group)
            if not eager and self.error is not None:
                raise self.error  # capturable: no host read of the others' state; they wait on this rank
            values = reduced.tolist() if eager else None
            if values is not None and values[0] < 1:
                self._raise_agreed_error(group)
            for position, index in enumerate(on_host, start=1):
                decisions[index] = values[position] >= 1
            for position, index in enumerate(on_device, start=1 + len(on_host)):
                decisions[index] = reduced[position] > 0
            offset = 1 + len(indices)
            for write, entries, factors, eager_factors in slots:
                factors.copy_(reduced[offset:offset + len(factors)])
                start = 0
                for index, shape in entries:
                    count = math.prod(shape)
                    # Eager: only the clamped ones, as one process records them; capturable: all.
                    if not eager_factors or min(values[offset + start:offset + start + count]) < 1:
                        write.clamp_factors[index] = factors[start:start + count].view(shape)
                    start += count
                offset += len(factors)
            let_go([reduced])
        return decisions

    def _raise_agreed_error(self, group):
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, self.error, group=group)
        if self.error is not None:
            raise self.error
        rank, error = next((rank, error) for rank, error in enumerate(errors) if error is not None)
        if not isinstance(error, BaseException):  # it did not survive pickling
            error = RuntimeError(str(error))
        error.add_note(f"raised on rank {rank}, which computed that matrix; nothing was written on any rank")
        raise error


def owner_decay(exchange: Exchange, write: PendingWrite, sources, layouts, entries, owners, options,
                arguments: dict, *, matrix_view: str, eager: bool) -> None:
    """Add to ``write`` the decay of spread parameters, to commit on this rank: ``sources[k]`` is this
    rank's part of the ``k``-th parameter (``layouts[k].parts``; ``owners[k]``: its owner in ``write``),
    holding the matrices ``matrix_view`` says (:func:`spectral_ops.matrix_views.as_matrices`); each
    ``(k, rows)`` of ``entries`` is a block the decay takes as matrices of their own (``rows``:
    ``(start, stop)`` of each matrix's rows, None: all of them). Each whole parameter is decayed on its
    owner when ``exchange`` runs, with ``prepare_decay(..., options, **arguments)``, except a stack
    spread by its batch, whose matrices are decayed where they live; this rank keeps its part of each
    entry, a target of ``write`` (maybe empty), whose value the exchange fills in. ``eager``: the clamp
    factors are read on the host (see :meth:`Exchange.clamp_slots`)."""
    rows_held = [layout.local_rows(matrix_view) for layout in layouts]
    shapes = [layout.shape for layout in layouts]
    stacked = [batched(shape, matrix_view) for shape in shapes]
    # A stack sharded by its batch holds whole matrices: decayed where they live (expert parallelism),
    # its clamp factors and reports at its matrices' places in the whole stack.
    here = [layout.holds_whole_matrices(matrix_view) for layout in layouts]
    numbers = [layout.local_matrices() if held else torch.arange(math.prod(shape[:-2]) if stack else 1)
               for layout, held, shape, stack in zip(layouts, here, shapes, stacked)]
    entry_rows = [rows if rows is not None else (0, matrix_dims(shapes[k], matrix_view)[0]) for k, rows in entries]

    def part(k, matrices, start, stop):
        return local_block(matrices, start, stop, rows_held[k])

    base = len(write.tensors)  # the targets' indices in write: base + their entry's
    write.include(PendingWrite([part(k, as_matrices(sources[k], matrix_view), *rows)
                                for (k, _), rows in zip(entries, entry_rows)]),
                  [owners[k] for k, _ in entries], [rows for _, rows in entries])

    def view_of(tensor, k, rows):  # a target's view of a tensor laid out as its source
        return part(k, as_matrices(tensor, matrix_view), *rows)

    # A cautious decay reads the update through them (see PendingWrite.views).
    write.views.update((base + index, functools.partial(view_of, k=k, rows=rows))
                       for index, ((k, _), rows) in enumerate(zip(entries, entry_rows)))
    # One clamp factor per matrix: a stack's entry has one per matrix of the whole stack.
    batch_shapes = [shapes[k][:-2] if stacked[k] else () for k, _ in entries]
    counts = [math.prod(shape) for shape in batch_shapes]
    slot_of = {}  # entry index -> (its group's clamp factors, where its own start)
    if options.stability == "clamp":
        by_group = defaultdict(list)
        for index, (k, _) in enumerate(entries):
            by_group[layouts[k].group].append(index)
        for group, members in by_group.items():
            factors = exchange.clamp_slots(group, write, [base + i for i in members],
                                           [batch_shapes[i] for i in members], eager, sources[0].device)
            starts = [0]
            for index in members:
                starts.append(starts[-1] + counts[index])
            slot_of.update((index, (factors, start)) for start, index in zip(starts, members))
    entries_of = defaultdict(list)
    for index, (k, _) in enumerate(entries):
        entries_of[k].append(index)

    def decay_whole(positions, wholes):
        indices = [index for k in positions for index in entries_of[k]]
        whole = prepare_decay([row_block(as_matrices(tensor, matrix_view), entry_rows[index])
                               for k, tensor in zip(positions, wholes) for index in entries_of[k]],
                              options, **arguments)
        values = whole.new_values()
        # Each matrix's number in its whole stack (a stack decayed where it lives holds some of them).
        number_of = {index: numbers[k] for k in positions for index in entries_of[k]}
        for position, factor in whole.clamp_factors.items():
            factors, start = slot_of[indices[position]]
            factors[start + number_of[indices[position]].to(factors.device)] = factor.reshape(-1)
        write.clamped.extend((base + indices[position], int(number_of[indices[position]][matrix]), *report)
                             for position, matrix, *report in whole.clamped)
        value_of = dict(zip(indices, values))
        blocks = [[value_of[index] for index in entries_of[k]] for k in positions]
        return [block[0] if len(block) == 1 else torch.cat(block, dim=-2) for block in blocks]

    costs = [0.0] * len(sources)
    for (k, _), (start, stop), count in zip(entries, entry_rows, counts):
        costs[k] += count * decay_flops((stop - start, matrix_dims(shapes[k], matrix_view)[1]), options,
                                        sources[k].dtype)

    def decayed_on_owners():
        results = yield exchange.submit(decay_whole, sources, layouts, costs, here)
        for index, ((k, _), rows) in enumerate(zip(entries, entry_rows)):
            write.decayed[base + index] = part(k, as_matrices(results[k], matrix_view), *rows)

    exchange.wait(decayed_on_owners())


def _collective_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Round:
    """One collective's worth of same-shape matrices: gathered on their owners, computed there, and
    returned (each rank its part, or the whole to every rank)."""

    def __init__(self, exchange, fn, positions, owners, sources, layouts, results):
        self.exchange, self.fn, self.positions, self.results = exchange, fn, positions, results
        self.sources = [sources[i] for i in positions]
        self.owner = owners
        self.layout = layouts[positions[0]]
        self.shape = self.layout.shape
        self.dtype, self.device = self.sources[0].dtype, self.sources[0].device
        world, rank = self.layout.world_size, self.layout.rank
        self.held = [[k for k, owner in enumerate(self.owner) if owner == r] for r in range(world)]
        self.mine = self.held[rank]

    def _part_size(self, rank: int) -> int:
        return math.prod(self.layout.part_shape(rank))

    def start_gather(self) -> None:
        """Send each owner this rank's part of the matrices it holds (a sharded round)."""
        self.work = None
        if self.layout.replicated:
            return
        world, rank = self.layout.world_size, self.layout.rank
        send = [self.sources[k].reshape(-1) for owner in range(world) for k in self.held[owner]]
        send_sizes = [len(self.held[owner]) * self._part_size(rank) for owner in range(world)]
        receive_sizes = [len(self.mine) * self._part_size(source) for source in range(world)]
        group = self.layout.group
        self.send = lend(group, torch.cat(send) if send else self.sources[0].new_empty(0))
        self.received = lend(group, self.sources[0].new_empty(sum(receive_sizes)))
        self.receive_sizes = receive_sizes
        self.work = dist.all_to_all_single(self.received, self.send, receive_sizes, send_sizes, group=group,
                                           async_op=True)

    def matrices(self) -> list[torch.Tensor]:
        """The whole matrices this rank owns, once they have arrived: the parts, joined."""
        if self.layout.replicated:
            return [self.sources[k] for k in self.mine]
        self.work.wait()
        self.work = None
        pieces = self.received.split(self.receive_sizes)
        parts = [piece.view(len(self.mine), *self.layout.part_shape(source)) for source, piece in enumerate(pieces)]
        return [self.layout.join([part[index] for part in parts]) for index in range(len(self.mine))]

    def compute(self, matrices) -> list[torch.Tensor]:
        """``fn`` on what this rank owns. After a failure nothing more is computed (the step raises at
        the agreement), but this rank still sends its share, since the other ranks wait for it."""
        if self.mine and self.exchange.error is None:
            try:
                results = self.fn([self.positions[k] for k in self.mine], matrices)
                return [result.to(self.dtype).reshape(self.shape) for result in results]
            except Exception as error:  # any failure: raised on every rank by Exchange.agree, not here
                self.exchange.error = error
        return [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in self.mine]

    def start_return(self, results) -> None:
        """Send the results back: each rank its part (sharded), or every result to every rank."""
        world, rank, group = self.layout.world_size, self.layout.rank, self.layout.group
        if self.layout.replicated:
            most = max(len(held) for held in self.held) * math.prod(self.shape)
            send = lend(group, torch.zeros(most, dtype=self.dtype, device=self.device))
            if results:
                flat = torch.cat([result.reshape(-1) for result in results])
                send[:flat.numel()] = flat
            self.send_back = send
            self.returned = lend(group, send.new_empty(world * most))
            self.return_sizes = [most] * world
            self.return_work = _all_gather_single(self.returned, send, group=group, async_op=True)
            return
        send = [self.layout.take(result, target).reshape(-1) for target in range(world) for result in results]
        send_sizes = [len(self.mine) * self._part_size(target) for target in range(world)]
        self.return_sizes = [len(self.held[owner]) * self._part_size(rank) for owner in range(world)]
        self.send_back = lend(group, torch.cat(send) if send else self.sources[0].new_empty(0))
        self.returned = lend(group, self.sources[0].new_empty(sum(self.return_sizes)))
        self.return_work = dist.all_to_all_single(self.returned, self.send_back, self.return_sizes, send_sizes,
                                                  group=group, async_op=True)

    def finish(self) -> None:
        """Each matrix's result on this rank's part, into the job's results (by position)."""
        self.return_work.wait()
        self.return_work = None
        # Before the results view the returned buffer (a view reads as Gloo's hold; see let_go).
        lent = [self.send_back, self.returned] + ([] if self.layout.replicated else [self.send, self.received])
        let_go(lent)
        local_shape = self.layout.part_shape(self.layout.rank)
        size = math.prod(local_shape)
        for owner, piece in enumerate(self.returned.split(self.return_sizes)):
            for slot, k in enumerate(self.held[owner]):
                self.results[self.positions[k]] = piece[slot * size:(slot + 1) * size].view(local_shape)


def _pipeline(rounds: list[_Round]) -> None:
    """Gather round ``i + 1`` while round ``i`` is computed; return every round's results."""
    if not rounds:
        return
    rounds[0].start_gather()
    for index, current in enumerate(rounds):
        if index + 1 < len(rounds):
            rounds[index + 1].start_gather()
        current.start_return(current.compute(current.matrices()))
    for current in rounds:
        current.finish()
