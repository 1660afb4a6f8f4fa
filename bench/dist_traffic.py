"""``python bench/dist_traffic.py --out DIR [--presets paper8 paper12] [--world-sizes 2 4 8] [--meshes 2x2 2x4 4x2]``

The communication and load balance of the owner compute (SPEC 10, ``spectral_ops.optim.distributed``)
for the ``paper8`` and ``paper12`` presets, computed from the model's parameter shapes (built on the
meta device: nothing is allocated, nothing is run), next to FSDP2's and DDP's own traffic.

What the optimizer sends, per step (``spectral_ops/optim/distributed.py``):

* A matrix that needs a spectral direction (Muon's polar factor of its update; a decay with ``p != 1``
  and ``lambda_p != 0``, or a band) is one matrix of an :class:`~spectral_ops.optim.distributed.Exchange`
  ``map`` call (a job). The optimizer asks for one job per parameter group and purpose, in group order
  (a Muon group: its directions, then its decay), and ``Exchange.run`` assigns the owners of all the
  step's matrices at once, by the longest-processing-time rule over their FLOPs (``assign_owners``),
  then exchanges each job's matrices of one shape in ``ROUNDS_PER_SHAPE`` rounds: reproduced here with
  the package's own ``assign_owners``, ``decay_flops`` and ``direction_flops``.
* FSDP2 (``Shard(0)``): every rank sends the owner its rows of the matrix (``all_to_all_single``), and
  the owner sends every rank its rows of the result (a second one). The rows a rank holds of a matrix
  it owns do not cross the network and are not counted.
* DDP (replicated): each owner's results are all-gathered (``all_gather_single`` per round, every
  rank's part padded to the largest owner's share of the round; the padding is counted).
* One ``all_reduce`` of float64 flags per step (``Exchange.agree``): skips, clamp factors, errors.

Bytes sent per rank: a point-to-point exchange (all-to-all) counts what each rank sends (the ranks
differ: the mean and the busiest are reported); an all-gather or reduce-scatter of ``n`` elements per
rank counts ``(W - 1) n`` per rank, an all-reduce of ``n`` elements ``2 (W - 1) / W n`` (the ring
algorithms' per-rank volume, NCCL's "bus bandwidth" convention).

FSDP2's own traffic (``fully_shard`` on each block, then the root, FSDP2's default
``reshard_after_forward=True``): per micro-batch the parameters are all-gathered in the forward, the
blocks' again in the backward (the root's stay gathered), and the gradients are reduce-scattered;
each shard is padded to ``ceil(rows / W)`` rows, as FSDP2 pads it. DDP all-reduces the gradients once
per step (``no_sync`` while accumulating). The global batch is the preset's: each rank runs
``ceil(grad_accum / W)`` micro-batches of ``batch_size`` sequences.

2-d meshes (``--meshes DPxTP``, issue #32): torchtitan's tensor-parallel plan for the reference
Transformer (:data:`TENSOR_PARALLEL_DIMS`), then FSDP2 over dp. A matrix sharded over both dims has
its owner among all dp x tp ranks (one ``assign_owners`` as for a 1-d mesh of as many ranks); one not
TP-sharded (``Shard(0)`` over dp, replicated over tp) among its dp group's. Each rank's part is
:func:`~spectral_ops.optim.distributed.part_of`'s. FSDP2 gathers and reduce-scatters each rank's TP
shard over dp (padded), and TP all-reduces activations over tp. The alternative to owner compute, a
tensor-parallel iteration (:func:`tensor_parallel_iteration_sends`), is counted next to it: its Grams
are read off the plan's products (:class:`GramCounter`).
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from spectral_ops import plan
from spectral_ops.backends.counting import CountingKernels
from spectral_ops.optim import SpectralMuon
from spectral_ops.optim._decay import row_blocks_of
from spectral_ops.optim.distributed import (
    assign_owners,
    decay_flops,
    part_of,
    split_rounds,
)
from spectral_ops.optim.muon import direction_flops, orthogonalization_coefficients
from spectral_ops.plan import needs_direction
from spectral_ops.provenance import machine_line
from spectral_ops.train.config import preset
from spectral_ops.train.data import GPT2_VOCAB
from spectral_ops.train.model import Transformer
from spectral_ops.train.optimizers import build_optimizer

PRESETS = ("paper8", "paper12")
WORLD_SIZES = (2, 4, 8)
MESHES = ((2, 2), (2, 4), (4, 2))  # (dp, tp)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
ACTIVATION_DTYPE = "bf16"  # the training loop's autocast on GPUs
FLAG_BYTES = 8  # Exchange.agree reduces float64 flags
BALANCE_GOAL = 1.2  # issue #18: the largest owner's FLOPs at most 1.2x the mean on paper12 with 8 ranks
# Any nonzero lambda_p: the traffic and the FLOPs do not depend on its value, only on p != 1.
SPECTRAL_COEFFICIENT = 1e-4

# The optimizer settings the paper runs (SPEC 7.4, 7.5) as config overrides of each preset. paper8 is
# 7.4's sweep (Muon, p in {0, 1, 2, 4} on every matrix; p = 1, the preset, decays element-wise);
# paper12 is 7.5's HHH baseline (Muon, ordinary decay only) and its HHF + p = 2 V recipe.
SETTINGS = {
    "paper8": {
        "muon p=1 (preset)": {},
        "muon p=2": {"p": 2},
        "adamw p=2": {"optimizer": "adamw", "p": 2},
    },
    "paper12": {
        "muon HHH (preset)": {},
        "muon HHF + p=2 V": {"qkv_recipe": "HHF", "p_v": 2, "lambda_v": SPECTRAL_COEFFICIENT},
        "muon HHH p=2": {"p": 2, "spectral_weight_decay": SPECTRAL_COEFFICIENT},
        "adamw p=2": {"optimizer": "adamw", "qkv_recipe": "", "p": 2, "spectral_weight_decay": SPECTRAL_COEFFICIENT},
    },
}


# torchtitan's plan for the reference Transformer (no sequence parallelism): the dim tensor parallelism
# shards of each block's weights (ColwiseParallel: the output features; RowwiseParallel: the input
# features). The embedding, the norms and the head are not TP-sharded.
TENSOR_PARALLEL_DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1,
                        "down_proj": 1}
# Activation all-reduces over tp per block and micro-batch: RowwiseParallel's output in the forward and
# ColwiseParallel's input gradient in the backward, each of attention and of the MLP.
TENSOR_PARALLEL_ALL_REDUCES_PER_BLOCK = 4
# The device the plan routes for: the tensor-parallel iteration's Grams follow its choice of iteration.
TRAINING_DEVICE = "cuda"


@dataclass
class OwnerMap:
    """One ``Exchange.map`` call of a step (a job): a parameter group's Muon directions or its decay;
    the parameters, their matrix views' shapes, FLOP costs and owners (each an index in the
    parameter's owner group, see :func:`owner_groups`), and per parameter the rows ``(start, stop)``
    of each matrix the job computes with the Grams its iteration forms (:func:`gram_count`)."""

    role: str
    purpose: str  # "direction" or "decay"
    params: list
    shapes: list
    costs: list
    blocks: list
    owners: list = field(default_factory=list)


@dataclass
class Mesh:
    """FSDP2 over ``dp`` ranks and tensor parallelism over ``tp`` (a ("dp", "tp") mesh; ``tp = 1``: the
    1-d mesh of FSDP2 or DDP), with the dim TP shards of each parameter (``tp_dims``; absent: not
    TP-sharded)."""

    dp: int
    tp: int = 1
    tp_dims: dict = field(default_factory=dict)

    @property
    def sizes(self) -> tuple:
        return (self.dp, self.tp) if self.tp > 1 else (self.dp,)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def coordinates(self) -> list[tuple]:
        """Each rank's coordinate, in rank order (a flattened mesh's)."""
        return list(itertools.product(*map(range, self.sizes)))

    def placements(self, param) -> tuple:
        """The DTensor placements FSDP2 (over dp, after TP) gives ``param``: its rows of each rank's TP
        shard, which over a TP-sharded dim 0 is FSDP2's strided shard; replicated over tp where TP
        leaves it whole."""
        if self.tp == 1:
            return (Shard(0),)
        dim = self.tp_dims.get(param)
        if dim is None:
            return Shard(0), Replicate()
        return _StridedShard(0, split_factor=self.tp) if dim == 0 else Shard(0), Shard(dim)

    def tensor_parallel_part(self, param, tp_rank: int) -> tuple:
        """The runs per dim of ``param`` that TP rank ``tp_rank`` holds (its whole TP shard, before FSDP2)."""
        dim = self.tp_dims.get(param) if self.tp > 1 else None
        if dim is None:
            return tuple(((0, length),) for length in param.shape)
        return part_of(param.shape, (Shard(dim),), (self.tp,), (tp_rank,))


def tensor_parallel_dims(model) -> dict:
    """The dim TP shards of each parameter that :data:`TENSOR_PARALLEL_DIMS`'s plan shards."""
    modules = {param: name.split(".")[-2] for name, param in model.named_parameters() if param.ndim >= 2}
    return {param: TENSOR_PARALLEL_DIMS[module] for param, module in modules.items() if module in TENSOR_PARALLEL_DIMS}


def held(runs: tuple) -> list[int]:
    """Entries per dim of a part given as sorted runs per dim (:func:`part_of`)."""
    return [sum(stop - start for start, stop in dim_runs) for dim_runs in runs]


def part_sizes(param, mesh: Mesh) -> list[int]:
    """Elements of ``param`` each rank holds (rank order), as DTensor places them (:func:`part_of`)."""
    placements = mesh.placements(param)
    return [math.prod(held(part_of(param.shape, placements, mesh.sizes, coordinate)))
            for coordinate in mesh.coordinates()]


def owner_groups(param, mesh: Mesh) -> list[list[int]]:
    """The ranks (rank order) of each group that computes ``param``'s matrices together: those over
    the mesh dims that shard it, one group per coordinate of the dims that replicate it (each replica
    group computes the same, from the same values)."""
    placements = mesh.placements(param)
    groups = {}
    for rank, coordinate in enumerate(mesh.coordinates()):
        replica = tuple(index for index, placement in zip(coordinate, placements) if isinstance(placement, Replicate))
        groups.setdefault(replica, []).append(rank)
    return list(groups.values())


class GramCounter(CountingKernels):
    """Counts, besides the FLOPs, the products of a plan on :data:`PROBE_SHAPE` that have its long side
    inside: the Grams of the iterate, which a matrix sharded along that side forms from each rank's
    columns by an all-reduce. Every other product of the plan has the short side inside and runs on
    each rank's columns with no collective."""

    def __init__(self):
        super().__init__()
        self.grams = 0

    def _count(self, L, R, share=1.0):
        self.grams += L.shape[-1] == max(PROBE_SHAPE)
        return super()._count(L, R, share)


PROBE_SHAPE = (2, 3)  # wide, so that a product's inner dim says which side it contracts


def gram_count(purpose: str, shape, group: dict, options) -> int:
    """The Grams (all-reduces of a tensor-parallel iteration) of one matrix's direction (Muon's polar
    factor: on the rectangle, as torch.optim.Muon iterates) or decay (the plan's iteration for a
    ``shape`` matrix on a GPU: Gram space restarts from fewer Grams), read off the plan's products."""
    if purpose == "direction":
        return polar_grams(orthogonalization_coefficients(group))
    precision = plan.resolve_precision(options.precision, torch.float32)
    iteration = plan.route(tuple(shape), torch.float32, TRAINING_DEVICE, options.p, precision, method="gram",
                           iteration=options.iteration, steps=len(options.polar_coefficients)).iteration
    return decay_grams(options, precision, iteration)


# Cached: the plan runs once per iteration, not once per head of every matrix.
@functools.lru_cache(maxsize=None)
def polar_grams(coefficients: tuple) -> int:
    counter = GramCounter()
    plan.polar(counter, torch.empty(PROBE_SHAPE, device="meta"), coefficients, "fp32")
    return counter.grams


@functools.lru_cache(maxsize=None)
def decay_grams(options, precision: str, iteration: str) -> int:
    counter = GramCounter()
    plan.decay_(counter, torch.empty(PROBE_SHAPE, device="meta"), plan.DecayRequest(
        options.p, 1.0, 1.0, band=options.band, polar_coefficients=options.polar_coefficients,
        sign_coefficients=options.sign_coefficients, precision=precision, iteration=iteration,
        stability=options.stability, capturable=True, method="gram"))
    return counter.grams


def meta_optimizer(preset_name: str, overrides: dict):
    """The training loop's model and optimizer for a preset (``build_optimizer`` on a ``Transformer``
    built on the meta device), with the token shards' vocabulary (the protocols refuse the byte corpus)."""
    config = preset(preset_name, **overrides)
    with torch.device("meta"):
        model = Transformer(config.model_config(GPT2_VOCAB))
    return config, model, build_optimizer(model, config)


def owner_maps(optimizer) -> list[OwnerMap]:
    """The step's ``map`` calls, in the optimizer's order, without owners (see :func:`assign_step`)."""
    maps = []
    for group in optimizer.param_groups:
        matrices = [param for param in group["params"] if param.ndim >= 2]
        if not matrices:
            continue
        shapes = [(param.shape[0], math.prod(param.shape[1:])) for param in matrices]
        role = group.get("role", "matrix")  # param_groups_by_module's tag, when the groups come from it
        options = optimizer.decay_options(group)
        # A Muon group's decay takes the update's matrices (each head of a head-wise block).
        spans = [decay_blocks(optimizer, group, param) for param in matrices]
        purposes = ["direction"] if isinstance(optimizer, SpectralMuon) and group["algorithm"] == "muon" else []
        if needs_direction(options.p, group[optimizer.spectral_key], options.band):
            purposes.append("decay")
        for purpose in purposes:
            blocks = [[(start, stop, gram_count(purpose, (stop - start, cols), group, options)) for start, stop in rows]
                      for rows, (_, cols) in zip(spans, shapes)]
            if purpose == "direction":
                costs = [direction_flops(shape, group) for shape in shapes]
            else:
                costs = [sum(decay_flops((stop - start, cols), options) for start, stop in rows)
                         for rows, (_, cols) in zip(spans, shapes)]
            maps.append(OwnerMap(role, purpose, matrices, shapes, costs, blocks))
    return maps


def decay_blocks(optimizer, group: dict, param) -> list[tuple[int, int]]:
    """The rows ``(start, stop)`` of each matrix the decay sees in ``param`` (a Muon group's fused
    projection: each block; else the whole matrix view)."""
    blocks = SpectralMuon._decay_blocks(group) if isinstance(optimizer, SpectralMuon) else None
    return [span or (0, param.shape[0]) for span in row_blocks_of(param, blocks)]


def assign_step(maps: list[OwnerMap], mesh: Mesh) -> list[float]:
    """Owners as ``Exchange.run`` assigns them: one ``assign_owners`` over the costs of every job's
    matrices, in job order, per kind of owner group (on a 1-d mesh, or where every matrix is sharded
    over the whole mesh, one); fills each map's ``owners``, returns each rank's load."""
    entries = [(owner_map, index) for owner_map in maps for index in range(len(owner_map.costs))]
    for owner_map in maps:
        owner_map.owners = [None] * len(owner_map.costs)
    kinds = {}
    for owner_map, index in entries:
        kinds.setdefault(owner_group_kind(owner_map.params[index], mesh), []).append((owner_map, index))
    loads = [0.0] * mesh.world_size
    for members in kinds.values():
        groups = owner_groups(members[0][0].params[members[0][1]], mesh)
        owners, group_loads = assign_owners([owner_map.costs[index] for owner_map, index in members], len(groups[0]))
        for (owner_map, index), owner in zip(members, owners):
            owner_map.owners[index] = owner
        for group in groups:
            for position, rank in enumerate(group):
                loads[rank] += group_loads[position]
    return loads


def owner_group_kind(param, mesh: Mesh) -> tuple:
    """The mesh dims that shard ``param``: the matrices of one kind share their owner groups."""
    placements = mesh.placements(param)
    return tuple(index for index, placement in enumerate(placements) if not isinstance(placement, Replicate))


def imbalance(loads) -> float:
    """The largest owner's FLOPs over the mean (1: perfectly balanced; 1 when there is no work)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def sharded_sends(maps: list[OwnerMap], mesh: Mesh) -> list[int]:
    """Elements each rank sends under FSDP2 (and TP): its part of every matrix to that matrix's owner
    in its owner group, and as the owner, every other rank's part of the result."""
    sent = [0] * mesh.world_size
    for owner_map in maps:
        for param, owner in zip(owner_map.params, owner_map.owners):
            parts = part_sizes(param, mesh)
            for group in owner_groups(param, mesh):
                for rank in group:
                    if rank != group[owner]:
                        sent[rank] += parts[rank]  # the gather
                        sent[group[owner]] += parts[rank]  # the return
    return sent


def rounds_of(owner_map: OwnerMap, mesh: Mesh) -> list[list[int]]:
    """The matrices (indices) of each collective round of a job: its same-shape matrices of one kind
    of owner group, split as ``Exchange.run`` splits them over the group's ranks."""
    by_shape = {}
    for index, (shape, param) in enumerate(zip(owner_map.shapes, owner_map.params)):
        by_shape.setdefault((shape, owner_group_kind(param, mesh)), []).append(index)
    return [members for shape_members in by_shape.values()
            for members in split_rounds(shape_members, len(owner_groups(owner_map.params[shape_members[0]], mesh)[0]))]


def replicated_sends(maps: list[OwnerMap], world_size: int) -> tuple[int, int, int]:
    """``(elements each rank sends, of which padding, rounds)`` under DDP: each round all-gathers every
    owner's results, each rank's part padded to the largest owner's share of the round."""
    sent = padding = count = 0
    for owner_map in maps:
        for members in rounds_of(owner_map, Mesh(world_size)):
            rows, cols = owner_map.shapes[members[0]]
            held = [sum(owner_map.owners[i] == rank for i in members) for rank in range(world_size)]
            part = max(held) * rows * cols
            sent += (world_size - 1) * part
            padding += (world_size - 1) * (part - len(members) * rows * cols / world_size)
            count += 1
    return sent, padding, count


def flag_count(optimizer) -> int:
    """Float64 values ``Exchange.agree`` all-reduces: one error flag, one per parameter, one clamp
    factor per spread matrix (a fused projection's blocks each) when the group clamps."""
    flags = 1
    for group in optimizer.param_groups:
        flags += len(group["params"])
        options = optimizer.decay_options(group)
        if needs_direction(options.p, group[optimizer.spectral_key], options.band) and options.stability == "clamp":
            flags += sum(len(decay_blocks(optimizer, group, param)) for param in group["params"] if param.ndim >= 2)
    return flags


def fsdp_sends(model, mesh: Mesh) -> tuple[int, int]:
    """``(forward all-gather, backward all-gather)`` elements each rank sends per micro-batch over dp
    (the reduce-scatter sends as many as the forward all-gather): ``(dp - 1)`` padded shards of each
    parameter's TP shard (the largest, TP rank 0's); the blocks' are gathered again in the backward,
    the root's are not."""
    forward = backward = 0
    for name, param in model.named_parameters():
        rows, *cols = held(mesh.tensor_parallel_part(param, 0))
        shard = -(-rows // mesh.dp) * math.prod(cols)
        forward += (mesh.dp - 1) * shard
        if name.startswith("layers."):
            backward += (mesh.dp - 1) * shard
    return forward, backward


def tensor_parallel_iteration_sends(maps: list[OwnerMap], mesh: Mesh) -> list[float]:
    """Elements each rank sends under the distributed alternative to owner compute: FSDP2's rows are
    all-gathered over dp (each rank's part padded to its dp group's largest, as FSDP2 pads), so that
    every rank holds its TP shard of each matrix; then each matrix the job computes runs its iteration
    where it lies: on one TP rank alone, or split over ``k`` TP ranks, which all-reduce each Gram over
    the dim they split (the other side squared: the columns where TP splits rows, the rows where it
    splits columns) and ``||X||_F`` (one element) in ``2 (k - 1) / k`` per rank. Each rank keeps its rows
    of the result: nothing returns."""
    sent = [0.0] * mesh.world_size
    coordinates = mesh.coordinates()
    for owner_map in maps:
        for param, shape, blocks in zip(owner_map.params, owner_map.shapes, owner_map.blocks):
            parts = part_sizes(param, mesh)
            for rank, coordinate in enumerate(coordinates):
                dp_group = [parts[other] for other, place in enumerate(coordinates) if place[1:] == coordinate[1:]]
                sent[rank] += (mesh.dp - 1) * max(dp_group)
            dim = mesh.tp_dims.get(param) if mesh.tp > 1 else None
            if dim is None:
                continue
            tp_parts = [mesh.tensor_parallel_part(param, tp_rank) for tp_rank in range(mesh.tp)]
            for start, stop, grams in blocks:
                holders = [tp_rank for tp_rank, runs in enumerate(tp_parts)
                           if any(max(first, start) < min(end, stop) for first, end in runs[0]) and held(runs)[1]]
                if len(holders) < 2:
                    continue
                side = shape[1] if dim == 0 else stop - start
                volume = 2 * (len(holders) - 1) / len(holders) * (grams * side * side + 1)
                for rank, coordinate in enumerate(coordinates):
                    if coordinate[1] in holders:
                        sent[rank] += volume
    return sent


def tensor_parallel_sends(config, mesh: Mesh) -> float:
    """Activation elements each rank sends per micro-batch in TP's all-reduces over tp."""
    elements = config.batch_size * config.seq_len * config.d_model
    return config.n_layers * TENSOR_PARALLEL_ALL_REDUCES_PER_BLOCK * 2 * (mesh.tp - 1) / mesh.tp * elements


def traffic_row(preset_name: str, setting: str, world_size: int, dtype: str = "fp32") -> dict:
    """Bytes sent per rank per step and the load balance of one preset, setting and world size."""
    config, model, optimizer = meta_optimizer(preset_name, SETTINGS[preset_name][setting])
    element = ELEMENT_BYTES[dtype]
    mesh = Mesh(world_size)
    maps = owner_maps(optimizer)
    loads = assign_step(maps, mesh)
    sharded = sharded_sends(maps, mesh)
    replicated, padding, rounds = replicated_sends(maps, world_size)
    flags = 2 * (world_size - 1) / world_size * flag_count(optimizer) * FLAG_BYTES
    forward, backward = fsdp_sends(model, mesh)
    micro_batches = -(-config.grad_accum // world_size)
    parameters = sum(param.numel() for param in model.parameters())
    return {
        "preset": preset_name, "setting": setting, "world_size": world_size, "dtype": dtype,
        "parameters": parameters,
        "owner_matrices": sum(len(m.shapes) for m in maps),
        "owner_maps": len(maps),
        "fsdp_owner_bytes_mean": sum(sharded) / world_size * element + flags,
        "fsdp_owner_bytes_max": max(sharded) * element + flags,
        "fsdp_owner_collectives": 2 * sum(len(rounds_of(m, mesh)) for m in maps) + 1,
        "ddp_owner_bytes": replicated * element + flags,
        "ddp_owner_padding_bytes": padding * element,
        "ddp_owner_collectives": rounds + 1,
        "flag_bytes": flags,
        "micro_batches": micro_batches,
        "fsdp_all_gather_bytes": micro_batches * (forward + backward) * element,
        "fsdp_reduce_scatter_bytes": micro_batches * forward * element,
        "ddp_all_reduce_bytes": 2 * (world_size - 1) / world_size * parameters * element,
        "balance": imbalance(loads),
        "max_owner_gflop": max(loads) / 1e9,
        "mean_owner_gflop": sum(loads) / world_size / 1e9,
    }


def mesh_traffic_row(preset_name: str, setting: str, dp: int, tp: int, dtype: str = "fp32",
                     activation_dtype: str = ACTIVATION_DTYPE) -> dict:
    """Bytes sent per rank per step and the load balance of one preset and setting on a dp x tp mesh:
    owner compute over each matrix's owner group, the distributed alternative
    (:func:`tensor_parallel_iteration_sends`), FSDP2's collectives over dp and TP's over tp."""
    config, model, optimizer = meta_optimizer(preset_name, SETTINGS[preset_name][setting])
    element = ELEMENT_BYTES[dtype]
    mesh = Mesh(dp, tp, tensor_parallel_dims(model))
    maps = owner_maps(optimizer)
    loads = assign_step(maps, mesh)
    sharded = sharded_sends(maps, mesh)
    distributed = tensor_parallel_iteration_sends(maps, mesh)
    world_size = mesh.world_size
    flags = 2 * (world_size - 1) / world_size * flag_count(optimizer) * FLAG_BYTES
    forward, backward = fsdp_sends(model, mesh)
    micro_batches = -(-config.grad_accum // dp)
    return {
        "preset": preset_name, "setting": setting, "mesh": f"{dp}x{tp}", "dp": dp, "tp": tp,
        "world_size": world_size, "dtype": dtype, "activation_dtype": activation_dtype,
        "parameters": sum(param.numel() for param in model.parameters()),
        "owner_matrices": sum(len(m.shapes) for m in maps),
        "owner_maps": len(maps),
        "owner_bytes_mean": sum(sharded) / world_size * element + flags,
        "owner_bytes_max": max(sharded) * element + flags,
        "owner_collectives": 2 * sum(len(rounds_of(m, mesh)) for m in maps) + 1,
        "distributed_bytes_mean": sum(distributed) / world_size * element + flags,
        "distributed_bytes_max": max(distributed) * element + flags,
        "flag_bytes": flags,
        "micro_batches": micro_batches,
        "fsdp_all_gather_bytes": micro_batches * (forward + backward) * element,
        "fsdp_reduce_scatter_bytes": micro_batches * forward * element,
        "tp_all_reduce_bytes": micro_batches * tensor_parallel_sends(config, mesh) * ELEMENT_BYTES[activation_dtype],
        "balance": imbalance(loads),
        "max_owner_gflop": max(loads) / 1e9,
        "mean_owner_gflop": sum(loads) / world_size / 1e9,
    }


def traffic_rows(presets=PRESETS, world_sizes=WORLD_SIZES, meshes=MESHES, dtype: str = "fp32",
                 activation_dtype: str = ACTIVATION_DTYPE) -> list[dict]:
    return ([traffic_row(name, setting, world, dtype) for name in presets for setting in SETTINGS[name]
             for world in world_sizes]
            + [mesh_traffic_row(name, setting, dp, tp, dtype, activation_dtype) for name in presets
               for setting in SETTINGS[name] for dp, tp in meshes])


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def markdown(rows: list[dict]) -> str:
    mesh_rows = [row for row in rows if "tp" in row]
    rows = [row for row in rows if "tp" not in row]
    dtype = (rows or mesh_rows)[0]["dtype"]
    lines = [
        "# Owner compute: communication and load balance per step (computed)",
        "",
        "`python bench/dist_traffic.py --out docs/results/dist-traffic` (SPEC 10, issue #18). Bytes sent per rank per "
        f"optimizer step, in MiB, {dtype} parameters (the training loop's master weights; in bf16 every byte count "
        "halves, the ratios stay). Owner compute: what `spectral_ops.optim.distributed` sends (FSDP2: rows to the "
        "owner and back by all-to-all, mean over ranks / busiest rank; DDP: each owner's results all-gathered, "
        "padding included), plus one all-reduce of float64 flags. FSDP2: parameter all-gathers (forward, and the "
        "blocks again in the backward) and gradient reduce-scatter, once per micro-batch (the preset's global batch, "
        "ceil(grad_accum / W) micro-batches per rank); DDP: "
        "one gradient all-reduce. Ring volumes: (W-1)/W of the gathered bytes per all-gather or reduce-scatter, "
        "2(W-1)/W per all-reduce. Balance: the largest owner's FLOPs over the mean (plan FLOP model), as the "
        "optimizer assigns owners: one assignment over all the step's matrices, largest first.",
        "",
        f"Computed, not measured (the same on any machine), with {machine_line()}.",
        "",
        "| preset | setting | W | matrices | FSDP owner mean / max | micro-batches | FSDP all-gather "
        "| FSDP reduce-scatter | owner / FSDP grad | DDP owner (padding) | DDP all-reduce | balance |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = row["fsdp_owner_bytes_mean"] / row["fsdp_reduce_scatter_bytes"]
        lines.append(
            f"| {row['preset']} | {row['setting']} | {row['world_size']} | {row['owner_matrices']} "
            f"| {mib(row['fsdp_owner_bytes_mean'])} / {mib(row['fsdp_owner_bytes_max'])} | {row['micro_batches']} "
            f"| {mib(row['fsdp_all_gather_bytes'])} | {mib(row['fsdp_reduce_scatter_bytes'])} | {ratio:.2f} "
            f"| {mib(row['ddp_owner_bytes'])} ({mib(row['ddp_owner_padding_bytes'])}) "
            f"| {mib(row['ddp_all_reduce_bytes'])} "
            f"| {row['balance']:.3f} |")
    goal = [row for row in rows if row["preset"] == "paper12" and row["world_size"] == 8]
    if goal:
        worst = max(goal, key=lambda row: row["balance"])
        verdict = "met" if worst["balance"] <= BALANCE_GOAL else "not met"
        lines += ["", f"Balance goal (largest owner <= {BALANCE_GOAL}x the mean, paper12, 8 ranks): {verdict}; worst "
                      f"{worst['balance']:.3f} ({worst['setting']})."]
    if mesh_rows:
        lines += [""] + mesh_markdown(mesh_rows)
    return "\n".join(lines) + "\n"


def mesh_markdown(rows: list[dict]) -> list[str]:
    """The 2-d meshes' table and what it decides: owner compute or the tensor-parallel iteration."""
    lines = [
        "## FSDP2 x tensor parallelism (dp x tp meshes)",
        "",
        "torchtitan's plan for the reference Transformer: q, k, v, gate and up ColwiseParallel, o and down "
        "RowwiseParallel (no sequence parallelism; embedding, norms and head not TP-sharded), then FSDP2 over dp "
        "(over a ColwiseParallel weight a strided shard). Owner compute: each matrix gathered to an owner over all "
        "dp x tp ranks (owners balanced over them, the parts as DTensor places them) and its parts sent back, mean "
        "over ranks / busiest rank, plus the flags' all-reduce over the mesh. Distributed: the alternative, a "
        "tensor-parallel iteration: FSDP2's rows all-gathered over dp, then each matrix the job computes (each head "
        "of a head-wise block) iterated where it lies, a matrix split over k TP ranks all-reducing each Gram of "
        "its plan (the side TP does not split, squared; Muon: one per Polar Express step; the decay: those of the "
        "plan's iteration on a GPU, Gram space restarting from fewer) and ||X||_F, plus the same flags. FSDP2: its "
        "all-gathers and reduce-scatter over dp of each rank's TP shard (padded), ceil(grad_accum / dp) "
        f"micro-batches. TP: {TENSOR_PARALLEL_ALL_REDUCES_PER_BLOCK} activation all-reduces per block and "
        f"micro-batch over tp (batch x seq_len x d_model, {rows[0]['activation_dtype']}). MiB per rank per step.",
        "",
        "| preset | setting | dp x tp | owner mean / max | distributed mean / max | distributed / owner "
        "| FSDP all-gather | FSDP reduce-scatter | TP all-reduce | owner / FSDP grad | balance |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['preset']} | {row['setting']} | {row['mesh']} "
            f"| {mib(row['owner_bytes_mean'])} / {mib(row['owner_bytes_max'])} "
            f"| {mib(row['distributed_bytes_mean'])} / {mib(row['distributed_bytes_max'])} "
            f"| {row['distributed_bytes_mean'] / row['owner_bytes_mean']:.1f} "
            f"| {mib(row['fsdp_all_gather_bytes'])} | {mib(row['fsdp_reduce_scatter_bytes'])} "
            f"| {mib(row['tp_all_reduce_bytes'])} | {row['owner_bytes_mean'] / row['fsdp_reduce_scatter_bytes']:.2f} "
            f"| {row['balance']:.3f} |")
    ratios = [row["distributed_bytes_mean"] / row["owner_bytes_mean"] for row in rows]
    busiest = [row["distributed_bytes_max"] / row["owner_bytes_max"] for row in rows]
    decision = "owner compute" if min(ratios + busiest) > 1 else "neither everywhere: see the rows"
    lines += ["", f"Decision: {decision}. The tensor-parallel iteration sends {min(ratios):.1f}-{max(ratios):.1f}x "
                  f"owner compute's bytes per rank on average ({min(busiest):.1f}-{max(busiest):.1f}x on the busiest "
                  "rank): owner compute moves each element of a matrix about twice (to the owner, back), the "
                  "iteration a Gram per step, which for these shapes is as large as the matrix or larger."]
    return lines


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "dist-traffic.md").write_text(markdown(rows))
    (out / "dist-traffic.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(out / "dist-traffic.csv", "w", newline="") as handle:
        # The 1-d and the 2-d rows share most columns; a row leaves the others empty.
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(description="Bytes per rank per step and owner load balance of the distributed "
                                               "optimizers for the paper presets, from the model shapes (no GPU, "
                                               "nothing allocated)")
    main.add_argument("--out", type=Path, required=True,
                      help="folder for dist-traffic.md, dist-traffic.json and dist-traffic.csv")
    main.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS), help="presets to compute")
    main.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES),
                      help="numbers of ranks of the 1-d meshes, FSDP2 and DDP (default: 2 4 8)")
    main.add_argument("--meshes", type=mesh_shape, nargs="*", default=list(MESHES),
                      help="2-d meshes as DPxTP, FSDP2 over DP ranks of tensor parallelism over TP (default: "
                           f"{' '.join(f'{dp}x{tp}' for dp, tp in MESHES)}; none: the 1-d meshes only)")
    main.add_argument("--dtype", choices=sorted(ELEMENT_BYTES), default="fp32",
                      help="parameter dtype of every exchanged element (default: fp32, the loop's master weights)")
    main.add_argument("--activation-dtype", choices=sorted(ELEMENT_BYTES), default=ACTIVATION_DTYPE,
                      help=f"dtype of TP's activation all-reduces (default: {ACTIVATION_DTYPE}, the loop's autocast "
                           "on GPUs)")
    return main


def mesh_shape(text: str) -> tuple[int, int]:
    """``DPxTP`` as ``(dp, tp)``, each at least 2 (one of them 1 is a 1-d mesh: see --world-sizes)."""
    sizes = text.lower().split("x")
    if len(sizes) != 2 or not all(size.isdigit() and int(size) >= 2 for size in sizes):
        raise argparse.ArgumentTypeError(f"a mesh is DPxTP with DP, TP >= 2 (e.g. 2x4), got {text!r}")
    return int(sizes[0]), int(sizes[1])


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    if any(world < 2 for world in args.world_sizes):
        raise SystemExit("--world-sizes: at least 2 ranks (one rank computes alone and sends nothing)")
    rows = traffic_rows(args.presets, args.world_sizes, args.meshes, args.dtype, args.activation_dtype)
    write(rows, args.out)
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
