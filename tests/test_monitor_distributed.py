"""SpectralMonitor on parameters spread over processes (gloo ranks on CPU) against the same model in one
process: the reference Transformer under FSDP2 (uneven rows, attention heads cut by a shard), before and
after an FSDP2 training step; under tensor parallelism (heads whole per rank; O and down split by columns);
under FSDP2 over tensor parallelism (a 2 x 2 mesh: the row-and-column split weights are gathered, and only
they); stacks of experts, conv filters, matrices and an MQA attention split by their matrices, rows and
columns, empty shards included, on a 1-d mesh and under HSDP; ``exact=True`` (gathered); DDP's replicas.
Every rank gets the same values, bit for bit, and the collectives are those of
spectral_ops/monitor/sharded.py: where nothing is gathered, all_reduces only, one per iteration of a stack
and one for all the scalars, of vectors and scalars, not matrices.

Each world size is launched once (tests/process_results.py); every rank runs its scenarios, holding the
single-process model itself (the same seeds), and writes per scenario "ok" or the failure.

Tolerance. The spread iteration runs the same products from the same start vectors as one process, and
only the order of its sums differs: a row split adds the ranks' ``A_r^T (A_r v)``, a column split their
``A_r v_r`` (and ``||v_r||^2``), so each iteration's vector differs by a few fp32 roundings (2^-24 each).
The next iteration does not damp them in the directions it has not converged in, so they add up over the
iterations: a few ulps times the first call's 30, ``S_MAX = 2e-5`` relative (measured: at most 1.6e-7 on 2
and on 4 ranks). The Frobenius norm sums the ranks' squares in another order (in fp64): an fp32 rounding or
two of the norm, ``FROBENIUS = 1e-6`` (measured 1.5e-7), and the effective lr is ``lr`` over it. The stable
rank ``||W||_F^2 / s_max^2`` has twice each error (measured 6e-7), the QK bound, a product of two
``s_max``, twice that of one (measured 1.5e-7).
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from spectral_ops.monitor import SpectralMonitor
from spectral_ops.optim import SpectralAdamW
from spectral_ops.train.model import ModelConfig, Transformer, fully_shard_blocks, tensor_parallel_blocks

from process_results import run_ranks

S_MAX, FROBENIUS = 2e-5, 1e-6
TOLERANCE = {"s_max": S_MAX, "frobenius": FROBENIUS, "stable_rank": 2 * (S_MAX + FROBENIUS), "effective_lr": FROBENIUS,
             "qk_bound": 2 * S_MAX, "decay": 0}
# 3 heads of 10 rows: FSDP2's 15/15 split of q_proj and k_proj cuts the middle head in two.
FSDP_MODEL = ModelConfig(vocab_size=37, n_layers=1, d_model=30, n_heads=3, mlp_hidden=44, max_seq_len=8)
# Tensor parallelism splits the heads whole (4 heads over 2 ranks, or the 2 of a 2 x 2 mesh) and the MLP's 40
# hidden units evenly (torch's tensor parallelism needs even shards).
TP_MODEL = ModelConfig(vocab_size=37, n_layers=1, d_model=24, n_heads=4, mlp_hidden=40, max_seq_len=8)


# ----------------------------------------------------------------------------- the worker side


class _Collectives(TorchDispatchMode):
    """Every collective run under it (eager c10d ones, DTensor's functional ones): its op and the elements
    of its tensors."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("c10d.", "_c10d_functional.")) and "wait_tensor" not in name \
                and "_wrap_tensor" not in name:
            tensors = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])
                       if isinstance(a, torch.Tensor)]
            self.calls.append((name.split(".")[1], sum(t.numel() for t in tensors)))
        return func(*args, **(kwargs or {}))


def _compare(spread: SpectralMonitor, one: SpectralMonitor) -> _Collectives:
    """Both monitors' values now: the same names, within TOLERANCE, and the same bits on every rank. Returns
    the collectives the spread one ran."""
    with _Collectives() as collectives:
        got = spread.compute()
    expected = one.compute()
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    for key, value in expected.items():
        metric = key.split("/", 1)[0].rsplit(".", 1)[-1]
        assert got[key] == pytest.approx(value, rel=TOLERANCE[metric], abs=0), (key, got[key], value)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, got)
    assert all(values == got for values in everyone), "the ranks' values differ"
    return collectives


def _model(config: ModelConfig, spread=None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    return model if spread is None else spread(model)


def _train_step(pairs) -> None:
    """One AdamW step of each ``(model, optimizer)`` on the same batch (every rank the same)."""
    tokens = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(1))
    for model, optimizer in pairs:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _perturb(pairs, seed: int) -> None:
    """Add the same seeded change to each ``(plain, spread)`` pair of weights: a DTensor takes its part of it
    (distribute_tensor with src_data_rank=None: no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for plain, spread in pairs:
            change = 0.01 * torch.randn(plain.shape, generator=generator)
            plain.add_(change)
            if isinstance(spread, DTensor):
                change = distribute_tensor(change, spread.device_mesh, spread.placements,
                                           src_data_rank=None).to_local()
                spread = spread.to_local()
            spread.add_(change)


def _monitors(spread, one, optimizer=torch.optim.AdamW, **options):
    """A monitor of each model, each with an ``optimizer`` of lr 1e-2 (the effective-lr proxy). Without rounds
    past the fixed iterations (``tolerance=0``) unless ``options`` say otherwise, so that the collectives can be
    counted; :func:`_scenario_rounds` runs the default rounds."""
    options.setdefault("tolerance", 0)
    optimizers = [optimizer(model.parameters(), lr=1e-2) for model in (spread, one)]
    return [SpectralMonitor(model, optimizer, per_head=True, **options)
            for model, optimizer in zip((spread, one), optimizers)], optimizers


def _only_all_reduces(collectives, iterations: int, monitor: SpectralMonitor) -> int:
    """Nothing gathered: all_reduces only, at most one per iteration of each stack (the parameters' and the
    heads') and one for the scalars; of vectors (a matrix's rows or columns, and a norm) per iteration, and
    two scalars per matrix. Returns the elements they moved."""
    assert {name for name, _ in collectives.calls} == {"allreduce_"}, collectives.calls
    stacks = monitor.stacks + [stack for q, k, _, _ in monitor.attention.values() for stack in (q, k)]
    assert len(collectives.calls) <= iterations * len(stacks) + 1, collectives.calls
    moved = sum(count for _, count in collectives.calls)
    bound = sum(count * (iterations * (max(m, n) + 1) + 2) for count, m, n in (s.reader.grid for s in stacks))
    assert moved <= bound, (moved, bound)
    return moved


def _scenario_fsdp2(mesh, rank, world):
    """FSDP2 on the reference model: at the first call (30 iterations), and after an FSDP2 training step
    (2 warm iterations), nothing gathered; the decay counts of a SpectralAdamW step as in one process."""
    spread, one = _model(FSDP_MODEL, lambda model: fully_shard_blocks(model, mesh)), _model(FSDP_MODEL)
    (monitor, reference), optimizers = _monitors(spread, one, functools.partial(
        SpectralAdamW, p=2, spectral_weight_decay=0.1))
    _only_all_reduces(_compare(monitor, reference), monitor.first_iterations, monitor)
    _train_step(zip((spread, one), optimizers))
    moved = _only_all_reduces(_compare(monitor, reference), monitor.iterations, monitor)
    weights = sum(param.numel() for param in one.parameters())
    assert moved < weights / 10, (moved, weights)  # FSDP2's step all-gathers every weight, twice


def _scenario_exact(mesh, rank, world):
    """exact=True takes each whole matrix's SVD: FSDP2's rows are gathered (the same bits as in one process)."""
    spread, one = _model(FSDP_MODEL, lambda model: fully_shard_blocks(model, mesh)), _model(FSDP_MODEL)
    (monitor, reference), _ = _monitors(spread, one, exact=True)
    collectives = _compare(monitor, reference)
    assert any(name == "all_gather_into_tensor" for name, _ in collectives.calls), collectives.calls


def _scenario_tensor_parallel(mesh, rank, world):
    """Tensor parallelism: Q, K, V, gate and up split by rows (each rank its heads whole), O and down by
    columns; the embedding, norms and head whole on every rank. Nothing gathered, before and after a change
    of every weight (the warm start of split vectors)."""
    spread, one = _model(TP_MODEL, lambda model: tensor_parallel_blocks(model, mesh)), _model(TP_MODEL)
    (monitor, reference), _ = _monitors(spread, one)
    _only_all_reduces(_compare(monitor, reference), monitor.first_iterations, monitor)
    _perturb(zip(one.parameters(), spread.parameters()), seed=2)
    _only_all_reduces(_compare(monitor, reference), monitor.iterations, monitor)


class _Bank(torch.nn.Module):
    """Stacks of experts, conv filters, matrices and an attention's heads, each weight of :attr:`SPLIT`
    placed by ``place(tensor, dim)`` (None: plain)."""

    # The dim each weight is split on: a stack by its matrices (5 over 4 ranks: one holds none), by their rows
    # and by their columns; a Conv1d filter (read flattened: 6 x 6) by its rows and by its input channels;
    # matrices by rows and by columns with empty shards (1 row, 1 column); a zero matrix by its columns. The
    # attention (3 query heads of 4 rows, one key head: MQA) has its query heads cut by its row split (12
    # rows: 6/6, 3/3/3/3) and its key head split by columns.
    SPLIT = {"experts": 0, "expert_rows": 1, "expert_columns": 2, "conv.weight": 0, "conv_inputs.weight": 1,
             "tall": 0, "row": 0, "wide": 1, "column": 1, "zero": 1, "attention.q_proj.weight": 0,
             "attention.k_proj.weight": 1}

    def __init__(self, place=None):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        for name, shape in (("experts", (5, 6, 4)), ("expert_rows", (5, 6, 4)), ("expert_columns", (5, 6, 4)),
                            ("tall", (5, 3)), ("row", (1, 7)), ("wide", (4, 7)), ("column", (3, 1))):
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=generator)))
        self.register_parameter("zero", torch.nn.Parameter(torch.zeros(4, 5)))
        self.conv, self.conv_inputs = torch.nn.Conv1d(2, 6, 3, bias=False), torch.nn.Conv1d(2, 6, 3, bias=False)
        self.attention = torch.nn.Module()
        self.attention.head_dim = 4
        self.attention.q_proj, self.attention.k_proj = torch.nn.Linear(5, 12, bias=False), torch.nn.Linear(5, 4,
                                                                                                           bias=False)
        with torch.no_grad():
            for name in ("conv.weight", "conv_inputs.weight", "attention.q_proj.weight", "attention.k_proj.weight"):
                self.get_parameter(name).copy_(torch.randn(self.get_parameter(name).shape, generator=generator))
        if place is not None:
            for name, dim in self.SPLIT.items():
                module_name, _, param_name = name.rpartition(".")
                module = self.get_submodule(module_name)
                setattr(module, param_name, torch.nn.Parameter(place(getattr(module, param_name).detach(), dim)))


def _scenario_stacks_and_filters(mesh, rank, world, placements=None, tolerance=0):
    """:class:`_Bank`'s weights each split on its dim (``placements(dim)``: on ``mesh``, ``[Shard(dim)]`` by
    default), before and after a change of every weight. Nothing gathered. With a ``tolerance``, the rounds
    until the estimates settle: a stack's ranks hold some matrices alone and share others, and decide alike."""
    from torch.distributed.tensor import Shard, distribute_tensor

    placements = placements or (lambda dim: [Shard(dim)])
    spread, one = _Bank(lambda value, dim: distribute_tensor(value, mesh, placements(dim))), _Bank()
    monitor, reference = [SpectralMonitor(model, per_head=True, tolerance=tolerance) for model in (spread, one)]
    for change in (None, 4):
        if change is not None:
            _perturb(zip(one.parameters(), spread.parameters()), seed=change)
        collectives = _compare(monitor, reference)
        if tolerance:
            assert {name for name, _ in collectives.calls} == {"allreduce_"}, collectives.calls
        else:
            _only_all_reduces(collectives, monitor.iterations if change else monitor.first_iterations, monitor)


def _scenario_rounds(mesh, rank, world):
    """FSDP2 with the default rounds until the estimates settle, before and after a training step: the same
    values as one process (which runs its own rounds), all_reduces only."""
    spread, one = _model(FSDP_MODEL, lambda model: fully_shard_blocks(model, mesh)), _model(FSDP_MODEL)
    (monitor, reference), optimizers = _monitors(spread, one, tolerance=1e-5)
    for step in range(2):
        if step:
            _train_step(zip((spread, one), optimizers))
        collectives = _compare(monitor, reference)
        assert {name for name, _ in collectives.calls} == {"allreduce_"}, collectives.calls


def _scenario_hsdp(mesh, rank, world):
    """HSDP: replicated over one dim of a 2 x 2 mesh, split over the other: each replica group sums over its
    own ranks."""
    from torch.distributed.tensor import Replicate, Shard

    _scenario_stacks_and_filters(_mesh_2d(world), rank, world, lambda dim: [Replicate(), Shard(dim)])


def _mesh_2d(world):
    """The ("dp", "tp") mesh of 2 x ``world / 2`` ranks, made once per process."""
    from torch.distributed.device_mesh import init_device_mesh

    if world not in _MESHES:
        _MESHES[world] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return _MESHES[world]


_MESHES = {}


def _scenario_ddp(mesh, rank, world):
    """DDP's replicas: each rank computes alone (no collective), the same bits as one process."""
    replica = torch.nn.parallel.DistributedDataParallel(_model(FSDP_MODEL))
    (monitor, reference), _ = _monitors(replica.module, _model(FSDP_MODEL))
    collectives = _compare(monitor, reference)
    assert not collectives.calls, collectives.calls
    assert monitor.compute() == reference.compute()


def _scenario_2d(mesh, rank, world):
    """FSDP2 over tensor parallelism on a 2 x 2 mesh (torchtitan's order: parallelize_module on "tp", then
    fully_shard on "dp"): the column-wise weights' rows lie over both mesh dims (all_reduces over all four
    ranks); the row-wise ones, (Shard(0), Shard(1)), are gathered, and only they."""
    mesh_2d = _mesh_2d(world)
    spread = _model(TP_MODEL, lambda model: fully_shard_blocks(tensor_parallel_blocks(model, mesh_2d["tp"]),
                                                               mesh_2d["dp"]))
    one = _model(TP_MODEL)
    (monitor, reference), _ = _monitors(spread, one)
    collectives = _compare(monitor, reference)
    assert {name for name, _ in collectives.calls} == {"allreduce_", "all_gather_into_tensor"}, collectives.calls
    gathered = sum(count for name, count in collectives.calls if name == "all_gather_into_tensor")
    rowwise = sum(layer.attention.o_proj.weight.numel() + layer.mlp.down_proj.weight.numel() for layer in one.layers)
    assert 0 < gathered <= rowwise, (gathered, rowwise)


def _scenarios(world: int) -> dict:
    """Every 1-d scenario on 2 ranks; on 4, those that 4 add (a stack's rank without a matrix, 2/2/1/0 rows,
    heads cut in three places; the 2-d meshes): a launch costs seconds of every rank's imports."""
    if world == 4:
        return {"stacks and filters": _scenario_stacks_and_filters, "hsdp": _scenario_hsdp,
                "fsdp2 over tensor parallel": _scenario_2d}
    # The rounds on the bank: on 2 ranks too, some matrices are held by one rank alone, others cut between both.
    return {"fsdp2": _scenario_fsdp2, "exact": _scenario_exact, "tensor parallel": _scenario_tensor_parallel,
            "stacks and filters": _scenario_stacks_and_filters, "ddp": _scenario_ddp, "rounds": _scenario_rounds,
            "stacks and filters, rounds": functools.partial(_scenario_stacks_and_filters, tolerance=1e-5)}


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, scenario in _scenarios(world).items():
        try:
            scenario(mesh, rank, world)
            results[name] = "ok"
        except Exception:  # reported per scenario by the test
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


# ----------------------------------------------------------------------------- the test side


@pytest.mark.parametrize("world", [2, 4])
def test_spread_parameters_match_one_process(world):
    outcomes = run_ranks(_worker, world)
    failures = [f"{name}, rank {rank}:\n{outcome}" for rank, results in enumerate(outcomes)
                for name, outcome in results.items() if outcome != "ok"]
    assert not failures, "\n".join(failures)
