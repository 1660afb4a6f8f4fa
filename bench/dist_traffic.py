"""``python bench/dist_traffic.py --out DIR [--presets paper8 paper12] [--world-sizes 2 4 8]``

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
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spectral_ops.optim import SpectralMuon
from spectral_ops.optim._decay import row_blocks_of
from spectral_ops.plan import needs_direction
from spectral_ops.optim.distributed import (
    assign_owners,
    decay_flops,
    shard_row_counts,
    split_rounds,
)
from spectral_ops.optim.muon import direction_flops
from spectral_ops.provenance import machine_line
from spectral_ops.train.config import preset
from spectral_ops.train.data import GPT2_VOCAB
from spectral_ops.train.model import Transformer
from spectral_ops.train.optimizers import build_optimizer

PRESETS = ("paper8", "paper12")
WORLD_SIZES = (2, 4, 8)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
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


@dataclass
class OwnerMap:
    """One ``Exchange.map`` call of a step (a job): a parameter group's Muon directions or its decay;
    the matrices' shapes (the parameters' matrix views), FLOP costs and owners."""

    role: str
    purpose: str  # "direction" or "decay"
    shapes: list
    costs: list
    owners: list = field(default_factory=list)


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
        if isinstance(optimizer, SpectralMuon) and group["algorithm"] == "muon":
            maps.append(OwnerMap(role, "direction", shapes, [direction_flops(shape, group) for shape in shapes]))
        options = optimizer.decay_options(group)
        if needs_direction(options.p, group[optimizer.spectral_key], options.band):
            costs = [sum(decay_flops((stop - start, cols), options)
                         for start, stop in decay_blocks(optimizer, group, param))
                     for param, (_, cols) in zip(matrices, shapes)]
            maps.append(OwnerMap(role, "decay", shapes, costs))
    return maps


def decay_blocks(optimizer, group: dict, param) -> list[tuple[int, int]]:
    """The rows ``(start, stop)`` of each matrix the decay sees in ``param`` (a Muon group's fused
    projection: each block; else the whole matrix view)."""
    blocks = SpectralMuon._decay_blocks(group) if isinstance(optimizer, SpectralMuon) else None
    return [span or (0, param.shape[0]) for span in row_blocks_of(param, blocks)]


def assign_step(maps: list[OwnerMap], world_size: int) -> list[float]:
    """Owners as ``Exchange.run`` assigns them: one ``assign_owners`` over the costs of every job's
    matrices, in job order; fills each map's ``owners``, returns the ranks' loads."""
    owners, loads = assign_owners([cost for owner_map in maps for cost in owner_map.costs], world_size)
    start = 0
    for owner_map in maps:
        owner_map.owners = owners[start:start + len(owner_map.costs)]
        start += len(owner_map.costs)
    return loads


def imbalance(loads) -> float:
    """The largest owner's FLOPs over the mean (1: perfectly balanced; 1 when there is no work)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def sharded_sends(maps: list[OwnerMap], world_size: int) -> list[int]:
    """Elements each rank sends under FSDP2: its rows of every matrix to that matrix's owner, and as
    the owner, every other rank's rows of the result."""
    sent = [0] * world_size
    for owner_map in maps:
        for (rows, cols), owner in zip(owner_map.shapes, owner_map.owners):
            counts = shard_row_counts(rows, world_size)
            for rank in range(world_size):
                if rank != owner:
                    sent[rank] += counts[rank] * cols  # the gather
                    sent[owner] += counts[rank] * cols  # the return
    return sent


def rounds_of(owner_map: OwnerMap, world_size: int) -> list[list[int]]:
    """The matrices (indices) of each collective round of a job: its same-shape matrices split as
    ``Exchange.run`` splits them."""
    by_shape = {}
    for index, shape in enumerate(owner_map.shapes):
        by_shape.setdefault(shape, []).append(index)
    return [members for shape_members in by_shape.values() for members in split_rounds(shape_members, world_size)]


def replicated_sends(maps: list[OwnerMap], world_size: int) -> tuple[int, int, int]:
    """``(elements each rank sends, of which padding, rounds)`` under DDP: each round all-gathers every
    owner's results, each rank's part padded to the largest owner's share of the round."""
    sent = padding = count = 0
    for owner_map in maps:
        for members in rounds_of(owner_map, world_size):
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


def fsdp_sends(model, world_size: int) -> tuple[int, int]:
    """``(forward all-gather, backward all-gather)`` elements each rank sends per micro-batch (the
    reduce-scatter sends as many as the forward all-gather): ``(W - 1)`` padded shards of each
    parameter; the blocks' are gathered again in the backward, the root's are not."""
    forward = backward = 0
    for name, param in model.named_parameters():
        rows = param.shape[0]
        shard = -(-rows // world_size) * (param.numel() // rows)
        forward += (world_size - 1) * shard
        if name.startswith("layers."):
            backward += (world_size - 1) * shard
    return forward, backward


def traffic_row(preset_name: str, setting: str, world_size: int, dtype: str = "fp32") -> dict:
    """Bytes sent per rank per step and the load balance of one preset, setting and world size."""
    config, model, optimizer = meta_optimizer(preset_name, SETTINGS[preset_name][setting])
    element = ELEMENT_BYTES[dtype]
    maps = owner_maps(optimizer)
    loads = assign_step(maps, world_size)
    sharded = sharded_sends(maps, world_size)
    replicated, padding, rounds = replicated_sends(maps, world_size)
    flags = 2 * (world_size - 1) / world_size * flag_count(optimizer) * FLAG_BYTES
    forward, backward = fsdp_sends(model, world_size)
    micro_batches = -(-config.grad_accum // world_size)
    parameters = sum(param.numel() for param in model.parameters())
    return {
        "preset": preset_name, "setting": setting, "world_size": world_size, "dtype": dtype,
        "parameters": parameters,
        "owner_matrices": sum(len(m.shapes) for m in maps),
        "owner_maps": len(maps),
        "fsdp_owner_bytes_mean": sum(sharded) / world_size * element + flags,
        "fsdp_owner_bytes_max": max(sharded) * element + flags,
        "fsdp_owner_collectives": 2 * sum(len(rounds_of(m, world_size)) for m in maps) + 1,
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


def traffic_rows(presets=PRESETS, world_sizes=WORLD_SIZES, dtype: str = "fp32") -> list[dict]:
    return [traffic_row(name, setting, world, dtype) for name in presets for setting in SETTINGS[name]
            for world in world_sizes]


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def markdown(rows: list[dict]) -> str:
    dtype = rows[0]["dtype"] if rows else "fp32"
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
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "dist-traffic.md").write_text(markdown(rows))
    (out / "dist-traffic.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(out / "dist-traffic.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
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
                      help="numbers of ranks (default: 2 4 8)")
    main.add_argument("--dtype", choices=sorted(ELEMENT_BYTES), default="fp32",
                      help="parameter dtype of every exchanged element (default: fp32, the loop's master weights)")
    return main


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    if any(world < 2 for world in args.world_sizes):
        raise SystemExit("--world-sizes: at least 2 ranks (one rank computes alone and sends nothing)")
    rows = traffic_rows(args.presets, args.world_sizes, args.dtype)
    write(rows, args.out)
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
