"""The optimizers on parameters spread over processes (SPEC 10): FSDP2's Shard(0) DTensors, tensor
parallelism's Shard(1), experts spread by their batch, replicated DTensors and DDP's plain parameters,
HSDP, and FSDP2 over tensor parallelism on a 2 x world/2 mesh (the "2-d" scenarios), on CPU with gloo,
against the same optimizer in one process.

Each world size (2 and 4 processes) is started once, by a module fixture; every process runs all the
scenarios below and writes, per scenario, "ok" or the failure, which the tests then read. Every
process holds the single-process reference itself (the same seeds), so each one checks its own rows.

Tolerance: the owner computes each matrix with the single-device path on the same whole matrix (the
gathered rows are the exact bits), but batched with whatever else it owns rather than with every
matrix of that shape, which may change the blocking of the batched products: a few fp32 ulps of
values of order 1, hence ``rtol=1e-5, atol=1e-6`` (on this CPU the results come out bitwise equal).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spectral_ops.decay import SpectralStabilityError
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD
from spectral_ops.optim.distributed import Exchange, assign_owners, local_slice, part_of

from process_results import judge, run_ranks

# Uneven on purpose: 41 rows split 21/20 on 2 ranks and 11/11/11/8 on 4; (5, 3) leaves a rank of 4
# without a row; the (16, 41) and (41, 16) pair share a Gram size but not a shape; (5, 2, 3), a conv
# filter bank, is read as one 5 x 6 matrix (matrix_view="flatten"), empty on that rank too.
# STACKS: stacks of matrices (matrix_view="batch": MoE experts, banks), spread by their batch: 5
# experts split 3/2 and 2/2/1/0, and a 2 x 2 bank whose rows of dim 0 are pairs of matrices.
STACKS = [(5, 6, 4), (3, 4, 6), (5, 6, 4), (2, 2, 5, 3), (41,)]
SHAPES = [(41, 16), (16, 41), (41, 16), (8, 8), (48, 16), (5, 3), (5, 2, 3), (41,)]
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the worker side


def _tensors(seed: int, shapes=SHAPES, steps: int = 2, scale: float = 0.2):
    """Weights (singular values up to about ``12 scale``) and ``steps`` gradients, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    weights = [scale * torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]
    return weights, grads


def _spread(tensor, mesh, placement):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tensor.clone(), mesh, [placement])


def _whole(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _compare(make, mesh, *, seed=0, shapes=SHAPES, place=None, process_group=None, steps=2, scale=0.2):
    """``make(params, **options)`` on spread parameters against the same in one process: weights and
    state after ``steps`` steps. ``place(index, tensor)`` spreads a weight or gradient (by default
    ``Shard(0)`` on ``mesh``); ``process_group`` is the optimizer's, for plain (DDP) parameters.
    Returns both optimizers and both parameter lists."""
    from torch.distributed.tensor import Shard

    place = place or (lambda index, tensor: _spread(tensor, mesh, Shard(0)))
    weights, grads = _tensors(seed, shapes, steps, scale)
    reference = [torch.nn.Parameter(w.clone()) for w in weights]
    spread = [torch.nn.Parameter(place(i, w)) for i, w in enumerate(weights)]
    expected = make(reference)
    actual = make(spread, process_group=process_group)
    for step_grads in grads:
        for param, grad in zip(reference, step_grads):
            param.grad = grad.clone()
        for i, (param, grad) in enumerate(zip(spread, step_grads)):
            param.grad = place(i, grad)
        expected.step()
        actual.step()
    for a, b in zip(spread, reference):
        torch.testing.assert_close(_whole(a.detach()), b.detach(), **TOLERANCE)
    for a, b in zip(spread, reference):
        for key, value in expected.state[b].items():
            torch.testing.assert_close(_whole(actual.state[a][key]), value, **TOLERANCE)
            if hasattr(a, "placements") and value.shape == b.shape:  # element-wise state: sharded as its parameter
                assert actual.state[a][key].placements == a.placements, (key, actual.state[a][key].placements)
    return expected, actual, reference, spread


def _on_dim_1(mesh):
    """``Shard(1)`` for a tensor of two or more dims, ``Shard(0)`` for a vector."""
    from torch.distributed.tensor import Shard

    return lambda index, tensor: _spread(tensor, mesh, Shard(1 if tensor.ndim >= 2 else 0))


def _replicated(index, tensor):
    """A plain copy: under DDP every rank holds the whole parameter and the averaged gradient."""
    return tensor.clone()


def _scenario_two_groups(mesh, rank, world):
    """Sharded DTensors (the mesh's group) next to plain parameters replicated over another group: the
    two groups' collectives and agreements interleave in the same order on every rank."""
    from torch.distributed.tensor import Shard

    group = dist.new_group(list(range(world)))
    _compare(_muon, mesh, seed=19, process_group=group,
             place=lambda i, t: _spread(t, mesh, Shard(0)) if i % 2 else t.clone())


def _exchanges(run) -> int:
    """The owner-compute collectives (:mod:`spectral_ops.optim.distributed`'s gathers and returns) that
    ``run()`` starts; the agreement's all_reduce is not one."""
    from spectral_ops.optim import distributed

    counted = {"all_to_all_single": dist.all_to_all_single, "_all_gather_single": distributed._all_gather_single}
    calls = []

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return counted[name](*args, **kwargs)
        return call

    try:
        dist.all_to_all_single = counting("all_to_all_single")
        distributed._all_gather_single = counting("_all_gather_single")
        run()
    finally:
        dist.all_to_all_single = counted["all_to_all_single"]
        distributed._all_gather_single = counted["_all_gather_single"]
    return len(calls)


def _scenario_experts_stay_where_they_live(mesh, rank, world):
    """Expert parallelism: stacks sharded by their experts (Shard(0), matrix_view="batch") are decayed and
    Muon's updates computed where they live, with no owner collective, and match one process; one matrix
    spread by its rows still goes to its owner (the count sees it)."""
    experts = [(8, 6, 4), (4, 4, 6), (5, 6, 4)]  # 5 experts on 4 ranks: one rank holds none
    for make in (_adamw(2, "batch", stability="clamp"), _muon_stacks):
        assert _exchanges(lambda: _compare(make, mesh, seed=23, shapes=experts, scale=2.0)) == 0
    assert _exchanges(lambda: _compare(_adamw(2, "batch"), mesh, seed=24, shapes=[(12, 8)])) > 0


def _muon(params, p=2, **options):
    matrices = [param for param in params if param.ndim >= 2]
    fused = [param for param in matrices if param.shape[0] == 48]
    others = [param for param in matrices if param.shape[0] != 48]
    vectors = [param for param in params if param.ndim < 2]
    return SpectralMuon([{"params": fused, "heads": 2, "splits": (16, 16, 16), "recipe": "HHF"},
                         {"params": others},
                         {"params": vectors, "algorithm": "adamw", "weight_decay": 0.0}],
                        lr=2e-2, p=p, spectral_weight_decay=0.5, precision="fp32", matrix_view="flatten", **options)


def _muon_stacks(params, **options):
    """Muon on stacks: head-wise and fused blocks split every matrix of a stack, in its rows (dim -2)."""
    fused = [p for p in params if p.ndim >= 2 and p.shape[-2] == 48]
    others = [p for p in params if p.ndim >= 2 and p.shape[-2] != 48]
    vectors = [p for p in params if p.ndim < 2]
    return SpectralMuon([{"params": fused, "heads": 2, "splits": (16, 16, 16), "recipe": "HHF"},
                         {"params": others},
                         {"params": vectors, "algorithm": "adamw", "weight_decay": 0.0}],
                        lr=2e-2, p=2, spectral_weight_decay=0.5, precision="fp32", matrix_view="batch", **options)


def _adamw(p, matrix_view="flatten", **more):
    return lambda params, **o: SpectralAdamW(params, lr=1e-2, p=p, spectral_weight_decay=0.5, matrix_view=matrix_view,
                                             **more, **o)


def _band(mode):
    return lambda params, **o: SpectralDecay(params, p=2, spectral_weight_decay=0.3, lr=0.1, matrix_view="flatten",
                                             band={"tau": 1.0, "mode": mode, "spectral_weight_decay_bot": 0.2}, **o)


def _scenario_skip(mesh, rank, world, place=None):
    """A NaN in one rank's part of one gradient: every rank skips that parameter, as one process does."""
    from torch.distributed.tensor import Shard

    place = place or (lambda index, tensor: _spread(tensor, mesh, Shard(0)))
    weights, grads = _tensors(3, steps=1)
    grads[0][0][0, 0] = float("nan")  # entry (0, 0): on rank 0 only
    spread = [torch.nn.Parameter(place(i, w)) for i, w in enumerate(weights)]
    optimizer = SpectralAdamW(spread, lr=1e-2, p=2, spectral_weight_decay=0.5, matrix_view="flatten")
    for i, (param, grad) in enumerate(zip(spread, grads[0])):
        param.grad = place(i, grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        optimizer.step()
    assert torch.equal(_whole(spread[0].detach()), weights[0]), "the skipped weight changed"
    state = optimizer.state[spread[0]]  # created before the step, as torch's Adam does, and left at its start
    assert int(state["step"]) == 0 and not _whole(state["exp_avg"]).any() and not _whole(state["exp_avg_sq"]).any()
    assert int(next(iter(optimizer.skipped.values()))) == 1
    assert not torch.equal(_whole(spread[1].detach()), weights[1]), "a finite parameter was not updated"


def _scenario_error(mesh, rank, world, place=None):
    """An owner's stability error is raised on every rank, and no rank writes anything."""
    from torch.distributed.tensor import Shard

    place = place or (lambda index, tensor: _spread(tensor, mesh, Shard(0)))
    weights, grads = _tensors(4, steps=1, scale=1.0)
    spread = [torch.nn.Parameter(place(i, w)) for i, w in enumerate(weights)]
    optimizer = SpectralAdamW(spread, lr=1.0, p=4, spectral_weight_decay=50.0, stability="raise", matrix_view="flatten")
    for i, (param, grad) in enumerate(zip(spread, grads[0])):
        param.grad = place(i, grad)
    try:
        optimizer.step()
    except SpectralStabilityError:
        pass
    else:
        raise AssertionError("no SpectralStabilityError on this rank")
    for param, weight in zip(spread, weights):
        assert torch.equal(_whole(param.detach()), weight), "a weight changed in a refused step"
    assert not any(optimizer.state.values()), "state was written in a refused step"


def _scenario_clamp(mesh, rank, world):
    """Clamp factors computed on the owners are counted on every rank, as in one process."""
    expected, actual, reference, spread = _compare(_adamw(4, stability="clamp"), mesh, seed=5, scale=1.0)
    counts = {name: int(record.count) for name, record in expected.clamped.items()}
    assert counts and any(counts.values()), "the scenario does not clamp"
    assert {name: int(record.count) for name, record in actual.clamped.items()} == counts


def _scenario_clamp_stacks(mesh, rank, world):
    """A stack's clamps, one per matrix, computed on its owner: the same counts on every rank as in one process."""
    expected, actual, _, _ = _compare(_adamw(4, "batch", stability="clamp"), mesh, seed=5, scale=1.0, shapes=STACKS)
    counts = {name: int(record.count) for name, record in expected.clamped.items()}
    assert any(count > 2 for count in counts.values()), f"no stack had more than one matrix clamped: {counts}"
    assert {name: int(record.count) for name, record in actual.clamped.items()} == counts


def _scenario_stochastic_rounding_keeps_replicas_equal(mesh, rank, world):
    """DDP with bf16 weights rounded stochastically, each rank's generator seeded apart: a replicated
    matrix is decayed and rounded once, on its owner, and every rank takes that result, so the replicas
    stay equal (with or without a spectral direction); a replicated vector, which each rank would round
    itself, is refused."""
    torch.manual_seed(100 + rank)
    weights, grads = _tensors(22, shapes=[(41, 16), (16, 41), (5, 2, 3)], steps=2)
    for p, spectral in ((1, 0.0), (2, 0.5)):
        params = [torch.nn.Parameter(w.bfloat16()) for w in weights]
        optimizer = SpectralAdamW(params, lr=1e-2, weight_decay=0.5, p=p, spectral_weight_decay=spectral,
                                  rounding="stochastic", matrix_view="flatten", process_group=dist.group.WORLD)
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.bfloat16()
            optimizer.step()
        for param in params:
            replicas = [torch.empty(param.shape) for _ in range(world)]
            dist.all_gather(replicas, param.detach().float())
            assert all(torch.equal(replica, replicas[0]) for replica in replicas), f"p={p}: the replicas differ"
    vector = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    try:
        SpectralAdamW([vector], weight_decay=0.1, rounding="stochastic", process_group=dist.group.WORLD)
    except ValueError as error:
        assert "drift apart" in str(error), str(error)
    else:
        raise AssertionError("a replicated vector rounded stochastically was accepted")


def _scenario_ddp_splits_the_work(mesh, rank, world):
    """DDP: the results equal one process's, and this rank decayed only its share of the matrices."""
    from spectral_ops.optim import _decay, distributed

    computed = []
    original = _decay.prepare_decay
    assert distributed.prepare_decay is original

    def counting(tensors, *args, **kwargs):
        computed.extend(t.shape for t in tensors)
        return original(tensors, *args, **kwargs)

    _decay.prepare_decay = distributed.prepare_decay = counting
    try:
        _compare(_adamw(2), mesh, seed=6, place=_replicated, process_group=dist.group.WORLD)
    finally:
        _decay.prepare_decay = distributed.prepare_decay = original
    # The one-process reference decays every matrix at each of the 2 steps (in _decay); the rest is this
    # rank's share (the owner decay, in distributed).
    total = 2 * sum(len(shape) >= 2 for shape in SHAPES)
    share = torch.tensor(len(computed) - total)
    assert 0 < share < total, f"rank {rank} decayed {share} of the {total} matrices"
    dist.all_reduce(share)
    assert share == total, f"the ranks decayed {share} matrices, not {total}"


def _two_layers(hidden: int, spread=None):
    """The modules' net, 16 -> ``hidden`` -> 8 (seeded: the same weights on every rank and in the
    reference); ``spread(net)`` shards it in place."""
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 8))
    if spread is not None:
        spread(net)
    return net


def _fsdp_over_tp_module(mesh):
    """``spread`` for :func:`_two_layers` as torchtitan sets a model up: the first layer column-wise and
    the second row-wise over ``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def spread(net):
        parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(net, mesh=mesh["dp"])
    return spread


def _train(pairs, steps: int, inputs=None) -> None:
    """``steps`` steps of each ``(net, optimizer)`` on a fixed batch (every rank the same)."""
    inputs = torch.randn(6, 16, generator=torch.Generator().manual_seed(8)) if inputs is None else inputs
    for _ in range(steps):
        for net, optimizer in pairs:
            net(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def _model_muon(params, **options):
    """SpectralMuon on a module's parameters: its matrices, and its vectors under AdamW."""
    return SpectralMuon([{"params": [p for p in params if p.ndim == 2]},
                         {"params": [p for p in params if p.ndim < 2], "algorithm": "adamw"}],
                        lr=1e-2, p=2, spectral_weight_decay=0.5, precision="fp32", **options)


def _compare_modules(build, optimizers, steps: int) -> None:
    """Each ``(name, make, tolerance)`` of ``optimizers`` on ``build(True)`` (a sharded module) against
    the same on ``build(False)`` in one process, after ``steps`` steps."""
    for name, make, tolerance in optimizers:
        reference, sharded = build(False), build(True)
        expected, actual = make(list(reference.parameters())), make(list(sharded.parameters()))
        _train([(reference, expected), (sharded, actual)], steps)
        for a, b in zip(sharded.parameters(), reference.parameters()):
            difference = (_whole(a.detach()) - b.detach()).abs().max().item()
            torch.testing.assert_close(_whole(a.detach()), b.detach(), **tolerance,
                                       msg=lambda text: f"{name}: {text} (max difference {difference:.3g})")


def _scenario_fsdp_model(mesh, rank, world):
    """fully_shard on a module, gradients from its backward (every rank the same batch, so FSDP's
    average is exact): SpectralAdamW, SpectralDecay attached to torch's AdamW, and SpectralMuon, as a
    user sets them up."""
    from torch.distributed.fsdp import fully_shard

    _compare_modules(lambda spread: _two_layers(41, (lambda net: fully_shard(net, mesh=mesh)) if spread else None),
                     [("SpectralAdamW", _adamw(2), TOLERANCE), ("AdamW, decay attached", _attached_adamw, TOLERANCE),
                      ("SpectralMuon", _model_muon, TOLERANCE)], steps=2)


def _scenario_checkpoint(mesh, rank, world, folder: Path):
    """torch.distributed.checkpoint saves the sharded state, and a fresh optimizer resumes from it
    (here, or at another world size: the folder the 2-process run wrote, loaded by the 4-process one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    def setup():
        net = _two_layers(41, lambda net: fully_shard(net, mesh=mesh))
        return net, SpectralAdamW(net.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)

    inputs = torch.randn(6, 16, generator=torch.Generator().manual_seed(10))

    def train(net, optimizer, steps, skipped=False):
        for _ in range(steps):
            net(inputs).square().mean().backward()
            if skipped:  # a non-finite gradient: the step only counts the skip
                from spectral_ops.optim.distributed import local

                local(next(net.parameters()).grad).fill_(float("nan"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                optimizer.step()
            optimizer.zero_grad()

    saved = folder / "saved"
    if world == 2:
        net, optimizer = setup()
        train(net, optimizer, 2)
        train(net, optimizer, 1, skipped=True)
        # get_optimizer_state_dict keeps torch's keys only: the skip counts go next to it.
        dcp.save({"model": net.state_dict(), "optimizer": get_optimizer_state_dict(net, optimizer),
                  "counts": optimizer.count_state()}, checkpoint_id=saved)
    net, optimizer = setup()
    train(net, optimizer, 2)  # the state to replace (and the weights, loaded below)
    state = {"model": net.state_dict(), "optimizer": get_optimizer_state_dict(net, optimizer),
             "counts": {"skipped": {0: torch.zeros((), dtype=torch.int32)}}}
    dcp.load(state, checkpoint_id=saved)
    net.load_state_dict(state["model"])
    set_optimizer_state_dict(net, optimizer, state["optimizer"])
    optimizer.load_count_state(state["counts"])
    train(net, optimizer, 1)

    reference = _two_layers(41)
    expected = SpectralAdamW(reference.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    train(reference, expected, 2)
    train(reference, expected, 1, skipped=True)
    train(reference, expected, 1)
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(_whole(a.detach()), b.detach(), **TOLERANCE)
    assert [int(count) for count in optimizer.skipped.values() if int(count)] == [1]


def _scenario_step_waits_for_gloo_to_let_go(mesh, rank, world):
    """A step frees its collectives' buffers within the step once Gloo's workers let go of them (see
    distributed.let_go): a worker letting go of the agreement's buffer late, played by a view of it
    dropped 50 ms after the all_reduce returned, is waited for."""
    import threading

    from spectral_ops.optim import distributed

    views, durations = [], []
    all_reduce, agree = dist.all_reduce, distributed.Exchange.agree

    def late_all_reduce(tensor, *args, **kwargs):
        all_reduce(tensor, *args, **kwargs)
        views.append(tensor.view_as(tensor))
        threading.Timer(0.05, views.clear).start()

    def timed_agree(self, checked):
        start = time.perf_counter()
        try:
            return agree(self, checked)
        finally:
            durations.append(time.perf_counter() - start)

    dist.all_reduce, distributed.Exchange.agree = late_all_reduce, timed_agree
    try:
        _compare(_adamw(2), mesh, seed=20, steps=1)
    finally:
        dist.all_reduce, distributed.Exchange.agree = all_reduce, agree
    assert durations and min(durations) >= 0.05, f"agreements returned after {durations} s, while Gloo held the buffer"


def _scenario_every_buffer_handed_to_gloo_is_lent(mesh, rank, world):
    """Every tensor a step hands to a Gloo collective is pinned when it is handed (distributed.lend): the
    rounds' gathers and returns, sharded (FSDP2, by all_to_all) and replicated (DDP, by all_gather), and the
    agreement's all_reduce, under SpectralAdamW p = 2 and SpectralMuon p = 0 (its AdamW group too). Unpinned,
    a Gloo worker's late release of a buffer takes the GIL after the step returned, which aborts a process
    whose program has ended meanwhile (tests/test_dist_exit.py)."""
    from spectral_ops.optim import distributed

    unpinned = []

    def lent_only(collective):
        def call(*args, **kwargs):
            unpinned.extend(tuple(tensor.shape) for tensor in args if isinstance(tensor, torch.Tensor)
                            and id(tensor) not in distributed._LENT)
            return collective(*args, **kwargs)
        return call

    originals = dist.all_to_all_single, dist.all_reduce, distributed._all_gather_single
    dist.all_to_all_single, dist.all_reduce, distributed._all_gather_single = map(lent_only, originals)
    try:
        _compare(_adamw(2), mesh, seed=40)
        _compare(lambda params, **options: _muon(params, p=0, **options), mesh, seed=41, place=_replicated,
                 process_group=dist.group.WORLD)
    finally:
        dist.all_to_all_single, dist.all_reduce, distributed._all_gather_single = originals
    assert not unpinned, f"tensors of these shapes were handed to Gloo unpinned: {unpinned}"


def _mesh_2d(world):
    """The ("dp", "tp") mesh of 2 x ``world / 2`` ranks, made once per process (every rank in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world not in _MESHES:
        _MESHES[world] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return _MESHES[world]


_MESHES = {}


def _fsdp_over_tp(mesh):
    """The placements FSDP2 over tensor parallelism gives (tests/... checks them on a real model): a
    ColwiseParallel weight (even positions, and vectors) ``(_StridedShard(0, tp), Shard(0))``, a
    RowwiseParallel one ``(Shard(0), Shard(1))``."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    column = [_StridedShard(0, split_factor=mesh.size(1)), Shard(0)]
    return lambda index, tensor: distribute_tensor(
        tensor.clone(), mesh, column if tensor.ndim < 2 or index % 2 == 0 else [Shard(0), Shard(1)], src_data_rank=None)


def _attached_adamw(params, **options):
    """torch's AdamW with a SpectralDecay attached, as a user adds the decay to an optimizer of theirs."""
    host = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    SpectralDecay([p for p in params if p.ndim >= 2], p=2, spectral_weight_decay=0.5, matrix_view="flatten",
                  **options).attach(host)
    return host


def _scenario_3d(mesh, rank, world):
    """A 3-d mesh, (2, 1, world/2) on 4 ranks, replicated over its first dim (HSDP's replicas) and
    sharded as FSDP2 over tensor parallelism on the other two: each replica group's owners (a group made
    of the two sharded dims) compute its matrices, and the result is one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh3 = init_device_mesh("cpu", (2, 1, world // 2), mesh_dim_names=("replica", "dp", "tp"))
    column = [Replicate(), _StridedShard(0, split_factor=world // 2), Shard(0)]
    row = [Replicate(), Shard(0), Shard(1)]
    _compare(_muon, mesh3, seed=37, place=lambda index, tensor: distribute_tensor(
        tensor.clone(), mesh3, column if tensor.ndim < 2 or index % 2 == 0 else row, src_data_rank=None))


def _scenario_2d_parts(mesh, rank, world):
    """Layout's parts (part_of) are the entries DTensor puts on each rank, for every placement FSDP2 and
    tensor parallelism give, even and uneven."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from spectral_ops.optim.distributed import layout_of

    mesh2 = _mesh_2d(world)
    for shape in [(42, 16), (41, 7), (5, 3), (10, 42), (3, 2, 5)]:
        numbers = torch.arange(math.prod(shape)).view(shape)
        for placements in [(_StridedShard(0, split_factor=mesh2.size(1)), Shard(0)), (Shard(0), Shard(1)),
                           (Shard(1), Shard(0)), (Replicate(), Shard(1)), (Shard(0), Replicate()),
                           (_StridedShard(0, split_factor=2), Replicate())]:
            spread = distribute_tensor(numbers, mesh2, placements, src_data_rank=None)
            layout = layout_of(spread)
            if layout is None:
                continue
            assert torch.equal(layout.take(numbers, layout.rank), spread.to_local()), (shape, placements)
            parts = [torch.empty(layout.part_shape(r), dtype=numbers.dtype) for r in range(layout.world_size)]
            for r, part in enumerate(parts):
                part.copy_(layout.take(numbers, r))
            assert torch.equal(layout.join(parts), numbers), (shape, placements)


def _scenario_strided_alone(mesh, rank, world):
    """A strided shard that no later dim splits further, ``(_StridedShard(0, 2), Replicate())``: each
    rank holds two runs of rows that are not adjacent (every layout above leaves one run per dim), for
    matrices under the decay and Muon, and for expert stacks, whose experts a rank holds are then not
    consecutive (decayed where they live, clamped per expert)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh2 = _mesh_2d(world)
    place = lambda index, tensor: distribute_tensor(  # noqa: E731
        tensor.clone(), mesh2, [_StridedShard(0, split_factor=2), Replicate()], src_data_rank=None)
    _compare(_adamw(2), mesh2, seed=38, place=place)
    _compare(_muon, mesh2, seed=39, place=place)
    experts = [(8, 6, 4), (6, 4, 6), (5, 6, 4)]
    assert _exchanges(lambda: _clamps_match(_compare(_adamw(4, "batch", stability="clamp"), mesh2, seed=5,
                                                     shapes=experts, scale=1.0, place=place), some=True)) == 0


def _scenario_2d_agreements(mesh, rank, world):
    """Over the whole 2-d mesh: a NaN in one rank's part of a gradient skips that parameter on every
    rank; an owner's stability error is raised on every rank, nothing written; clamps are counted
    everywhere as in one process (capturable: the decisions stay on the device)."""
    mesh2 = _mesh_2d(world)
    _scenario_skip(mesh2, rank, world, place=_fsdp_over_tp(mesh2))
    _scenario_error(mesh2, rank, world, place=_fsdp_over_tp(mesh2))
    _clamps_match(_compare(_adamw(4, capturable=True, stability="clamp"), mesh2, seed=5, scale=1.0,
                           place=_fsdp_over_tp(mesh2)), some=True)


def _scenario_2d_experts(mesh, rank, world):
    """Expert parallelism with FSDP2 over it: stacks spread by their experts over both mesh dims (strided:
    each rank holds experts that are not consecutive) are decayed, clamped and Muon-updated where they
    live, with no owner collective; a stack also sharded inside its matrices goes to its owners."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh2 = _mesh_2d(world)
    experts = [(8, 6, 4), (6, 4, 6), (5, 6, 4)]
    by_expert = lambda i, t: distribute_tensor(  # noqa: E731
        t.clone(), mesh2, [_StridedShard(0, split_factor=mesh2.size(1)), Shard(0)], src_data_rank=None)
    for make in (_adamw(2, "batch", stability="clamp"), _muon_stacks):
        assert _exchanges(lambda: _clamps_match(_compare(make, mesh2, seed=33, shapes=experts, scale=2.0,
                                                         place=by_expert))) == 0
    # Experts over "tp", each one's rows over "dp".
    inside = lambda i, t: distribute_tensor(t.clone(), mesh2, [Shard(1), Shard(0)])  # noqa: E731
    assert _exchanges(lambda: _clamps_match(_compare(_adamw(2, "batch", stability="clamp"), mesh2, seed=34,
                                                     shapes=experts, scale=2.0, place=inside))) > 0


def _clamps_match(compared, some: bool = False):
    """The clamp counts of one process and of the spread run agree (where the optimizer clamps; ``some``:
    and it clamped)."""
    expected, actual, _, _ = compared
    counts = {name: int(record.count) for name, record in getattr(expected, "clamped", {}).items()}
    assert not some or any(counts.values()), "the scenario does not clamp"
    assert {name: int(record.count) for name, record in getattr(actual, "clamped", {}).items()} == counts


def _scenario_2d_model(mesh, rank, world):
    """FSDP2 over tensor parallelism on a module, as torchtitan sets it up (parallelize_module on "tp",
    then fully_shard on "dp"): SpectralAdamW, SpectralDecay attached to AdamW and SpectralMuon match one
    process. 42 hidden units: 21 per tp rank (torch's tensor parallelism needs even shards for its
    forward), which FSDP2 splits 11/10.

    Unlike the scenarios above, the gradients are not the same bits: the row-wise layer's output is
    the sum of the tp ranks' partial products, in another order, a few ulps (1e-7) of each gradient.
    Adam's update moves by as much, within ``TOLERANCE``. Muon's momentum here has rank 6 at most (6
    inputs), and its polar iteration raises the rounding-level singular values of the rest towards 1:
    those directions differ between the runs, so Muon gets ``rtol=1e-4, atol=1e-5`` (measured: 1.2e-6
    on weights of order 0.1)."""
    spread = _fsdp_over_tp_module(_mesh_2d(world))
    _compare_modules(lambda sharded: _two_layers(42, spread if sharded else None),
                     [("SpectralAdamW", _adamw(2), TOLERANCE), ("AdamW, decay attached", _attached_adamw, TOLERANCE),
                      ("SpectralMuon", _model_muon, dict(rtol=1e-4, atol=1e-5))], steps=4)


def _scenario_2d_checkpoint_across_meshes(mesh, rank, world, folder: Path):
    """A DCP checkpoint of FSDP2 over tensor parallelism loads on another mesh shape: saved on 2 x 2
    (dp x tp), resumed on 4 x 1, and saved on 4 x 1, resumed on 2 x 2; each resumed run matches one
    process's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {shape: init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")) for shape in ((2, 2), (4, 1))}

    def setup(shape=None):
        net = _two_layers(42, None if shape is None else _fsdp_over_tp_module(meshes[shape]))
        return net, SpectralAdamW(net.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)

    reference, expected = setup()
    _train([(reference, expected)], 3)
    for saved_on, resumed_on in (((2, 2), (4, 1)), ((4, 1), (2, 2))):
        checkpoint = folder / f"2d-{saved_on[0]}x{saved_on[1]}"
        net, optimizer = setup(saved_on)
        _train([(net, optimizer)], 2)
        dcp.save({"model": net.state_dict(), "optimizer": get_optimizer_state_dict(net, optimizer)},
                 checkpoint_id=checkpoint)
        net, optimizer = setup(resumed_on)
        state = {"model": net.state_dict(), "optimizer": get_optimizer_state_dict(net, optimizer)}
        dcp.load(state, checkpoint_id=checkpoint)
        net.load_state_dict(state["model"])
        set_optimizer_state_dict(net, optimizer, state["optimizer"])
        _train([(net, optimizer)], 1)
        for a, b in zip(net.parameters(), reference.parameters()):
            # Tensor parallelism sums the row-wise layer's products in another order: a few ulps of
            # each gradient, which Adam's update carries (see _scenario_2d_model).
            torch.testing.assert_close(_whole(a.detach()), b.detach(), **TOLERANCE,
                                       msg=lambda text: f"saved on {saved_on}, resumed on {resumed_on}: {text}")


def _scenario_hsdp(mesh, rank, world):
    """A 2-d mesh replicated over one dim and sharded over the other (HSDP, and TP under DDP): each replica
    group's owners compute its matrices, and the result is one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh2 = init_device_mesh("cpu", (2, world // 2))
    for seed, (make, dim) in enumerate([(_adamw(2), 0), (_muon, 1)], start=29):
        _compare(make, mesh2, seed=seed, place=lambda i, t, dim=dim: distribute_tensor(
            t.clone(), mesh2, [Replicate(), Shard(dim if t.ndim >= 2 else 0)]))


def _scenario_qk_cap(mesh, rank, world):
    """spectral_ops.qk_cap_ on DTensor weights (FSDP2's Shard(0), uneven: 18 rows; FSDP2 over tensor parallelism's
    strided shard on the 2-d mesh), with a key per query head and with shared keys: each gathered whole, capped
    alike on every rank, each rank's rows written back, bitwise the call on plain tensors in one process."""
    from torch.distributed.tensor import Shard

    from spectral_ops import qk_cap_

    generator = torch.Generator().manual_seed(40)
    for kv in (6, 3):
        q, k = torch.randn(6 * 3, 16, generator=generator), torch.randn(kv * 3, 16, generator=generator)
        expected_q, expected_k = q.clone(), k.clone()
        bounds = qk_cap_(expected_q, expected_k, 6, 1.0, num_kv_heads=kv)  # on plain tensors
        cap = float(bounds.median())
        expected_q, expected_k = q.clone(), k.clone()
        expected = qk_cap_(expected_q, expected_k, 6, cap, num_kv_heads=kv)
        assert not torch.equal(expected_q, q)  # some heads are over the cap
        for place in (lambda i, t: _spread(t, mesh, Shard(0)), _fsdp_over_tp(_mesh_2d(world))):
            spread_q, spread_k = place(0, q), place(0, k)
            torch.testing.assert_close(qk_cap_(spread_q, spread_k, 6, cap, num_kv_heads=kv), expected, rtol=0, atol=0)
            assert torch.equal(_whole(spread_q), expected_q) and torch.equal(_whole(spread_k), expected_k)


def _scenarios(folder: Path, world: int) -> dict:
    from torch.distributed.tensor import Replicate

    scenarios = {
        **{f"decay p={p}": (lambda p: lambda mesh, rank, world: _compare(_adamw(p), mesh, seed=p))(p)
           for p in (0, 1, 2, 4)},
        "muon head-wise and fused QKV": lambda mesh, rank, world: _compare(_muon, mesh, seed=11),
        # The owners compute each matrix's update power from its own step count (a schedule).
        "muon with a scheduled update power": lambda mesh, rank, world: _compare(
            lambda params, **o: _muon(params, update_power=lambda step: (0.25, -0.2)[step], **o), mesh, seed=22),
        "sgd": lambda mesh, rank, world: _compare(lambda params, **o: SpectralSGD(
            params, lr=5e-2, momentum=0.9, nesterov=True, p=2, spectral_weight_decay=0.5, matrix_view="flatten", **o),
            mesh, seed=12),
        "stacks decayed per matrix": lambda mesh, rank, world: _compare(_adamw(2, "batch"), mesh, seed=20,
                                                                        shapes=STACKS),
        "muon on stacks, head-wise and fused": lambda mesh, rank, world: _compare(
            _muon_stacks, mesh, seed=21, shapes=[(3, 48, 16), (5, 8, 8), (5, 8, 8), (41,)]),
        "stacks clamped per matrix": _scenario_clamp_stacks,
        "experts stay where they live": _scenario_experts_stay_where_they_live,
        # Tensor parallelism's placements: Shard(1) is RowwiseParallel's (a matrix's columns; a stack's
        # rows of each matrix, or a conv bank's input channels); uneven where the dim does not divide.
        "tensor parallel Shard(1)": lambda mesh, rank, world: _compare(_adamw(2), mesh, seed=25,
                                                                       place=_on_dim_1(mesh)),
        "muon tensor parallel Shard(1)": lambda mesh, rank, world: _compare(_muon, mesh, seed=26,
                                                                            place=_on_dim_1(mesh)),
        "stacks sharded inside their matrices": lambda mesh, rank, world: _compare(
            _adamw(2, "batch", stability="clamp"), mesh, seed=27, shapes=STACKS, place=_on_dim_1(mesh), scale=2.0),
        "muon on stacks sharded inside their matrices": lambda mesh, rank, world: _compare(
            _muon_stacks, mesh, seed=28, shapes=[(3, 48, 16), (5, 8, 8), (41,)], place=_on_dim_1(mesh)),
        "stochastic rounding keeps replicas equal": _scenario_stochastic_rounding_keeps_replicas_equal,
        **{f"band {mode}": (lambda mode: lambda mesh, rank, world: _compare(_band(mode), mesh, seed=13))(mode)
           for mode in ("top", "two_band")},
        "capturable": lambda mesh, rank, world: _compare(_adamw(2, capturable=True, stability="clamp"), mesh, seed=14),
        "fewer matrices than ranks": lambda mesh, rank, world: _compare(_adamw(2), mesh, seed=15, shapes=[(5, 3)]),
        "more matrices than ranks": lambda mesh, rank, world: _compare(_adamw(2), mesh, seed=16,
                                                                       shapes=[(9, 6)] * 7 + [(6, 9)] * 3),
        "replicated dtensor": lambda mesh, rank, world: _compare(
            _adamw(2), mesh, seed=17, place=lambda i, t: _spread(t, mesh, Replicate())),
        "muon replicated by ddp": lambda mesh, rank, world: _compare(
            _muon, mesh, seed=18, place=_replicated, process_group=dist.group.WORLD),
        "two process groups": _scenario_two_groups,
        "ddp splits the work": _scenario_ddp_splits_the_work,
        "skip agreed": _scenario_skip,
        "error raised everywhere": _scenario_error,
        "clamps agreed": _scenario_clamp,
        "the step waits for gloo to let go": _scenario_step_waits_for_gloo_to_let_go,
        "every buffer handed to gloo is lent": _scenario_every_buffer_handed_to_gloo_is_lent,
        "fsdp model": _scenario_fsdp_model,
        "qk cap on dtensors": _scenario_qk_cap,
        "checkpoint": lambda mesh, rank, world: _scenario_checkpoint(mesh, rank, world, folder),
    }
    scenarios["hsdp: replicated over one mesh dim, sharded over the other"] = _scenario_hsdp
    # FSDP2 over tensor parallelism: a 2 x world/2 mesh sharded over both dims, 4 steps each.
    fsdp_over_tp = lambda mesh, rank, world: _fsdp_over_tp(_mesh_2d(world))  # noqa: E731
    scenarios.update({
        "2-d: parts": _scenario_2d_parts,
        "2-d: decay p=2": lambda mesh, rank, world: _compare(_adamw(2), _mesh_2d(world), seed=30, steps=4,
                                                             place=fsdp_over_tp(mesh, rank, world)),
        "2-d: muon head-wise and fused QKV": lambda mesh, rank, world: _compare(
            _muon, _mesh_2d(world), seed=31, steps=4, place=fsdp_over_tp(mesh, rank, world)),
        "2-d: muon p=0 head-wise and fused QKV": lambda mesh, rank, world: _compare(
            lambda params, **o: _muon(params, p=0, **o), _mesh_2d(world), seed=36, steps=4,
            place=fsdp_over_tp(mesh, rank, world)),
        "3-d: replicated over one dim, FSDP2 over tensor parallelism on the others": _scenario_3d,
        "2-d: decay attached to AdamW": lambda mesh, rank, world: _compare(
            _attached_adamw, _mesh_2d(world), seed=32, steps=4, place=fsdp_over_tp(mesh, rank, world)),
        "2-d: skip, error and clamps agreed": _scenario_2d_agreements,
        "2-d: a strided shard alone (parts of several runs)": _scenario_strided_alone,
        "2-d: experts": _scenario_2d_experts,
        "2-d: fsdp2 over tensor parallel model": _scenario_2d_model,
    })
    if world == 4:
        scenarios["2-d: checkpoint across mesh shapes"] = lambda mesh, rank, world: \
            _scenario_2d_checkpoint_across_meshes(mesh, rank, world, folder)
    return scenarios


def _worker(rank: int, world: int, folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, scenario in _scenarios(Path(folder), world).items():
        try:
            scenario(mesh, rank, world)
            results[name] = "ok"
        except Exception:  # reported per scenario by the tests below
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


# ----------------------------------------------------------------------------- the test side

SCENARIOS = list(_scenarios(Path(), 2))


@pytest.fixture(scope="module")
def shared_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def results(shared_folder):
    """Per world size, per rank, each scenario's outcome (the 2-process run first: the 4-process one
    loads its checkpoint)."""
    return {world: run_ranks(_worker, world, str(shared_folder)) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_spread_parameters_match_one_process(results, world, scenario):
    failures = [f"rank {rank}:\n{outcome[scenario]}" for rank, outcome in enumerate(results[world])
                if outcome[scenario] != "ok"]
    assert not failures, "\n".join(failures)


def test_a_checkpoint_of_fsdp2_over_tensor_parallelism_loads_across_mesh_shapes(results):
    name = "2-d: checkpoint across mesh shapes"  # 4 processes: 2 x 2 and 4 x 1
    failures = [f"rank {rank}:\n{outcome[name]}" for rank, outcome in enumerate(results[4]) if outcome[name] != "ok"]
    assert not failures, "\n".join(failures)


def test_a_shards_part_is_torch_chunks():
    """Shard(0)'s split (part_of on a 1-d mesh) is torch.chunk's: ceil(rows / world) each until the rows
    run out, the last ranks with fewer or none."""
    from torch.distributed.tensor import Shard

    for rows in (1, 5, 8, 41, 64):
        for world in (1, 2, 3, 4, 8):
            chunks = [chunk.tolist() for chunk in torch.arange(rows).chunk(world)]
            parts = [[row for start, stop in part_of((rows,), [Shard(0)], (world,), (rank,))[0]
                      for row in range(start, stop)] for rank in range(world)]
            assert parts == chunks + [[]] * (world - len(chunks))


def test_local_slice_is_the_intersection_with_the_rows_held():
    """Rows a rank holds as runs: one (Shard), several (a strided shard), or none."""
    for start, stop in ((0, 41), (10, 25), (16, 32), (40, 41)):
        for runs in (((0, 21),), ((21, 41),), ((33, 41),), ((41, 41),), ((0, 11), (21, 31)), ((11, 21), (31, 41)), ()):
            held = [row for first, end in runs for row in range(first, end)]
            assert held[local_slice(start, stop, runs)] == [row for row in held if start <= row < stop]


def test_owners_follow_the_longest_processing_time_rule():
    """Each job (largest first) goes to the least loaded rank, so the largest load is within the
    rule's bound of the optimum: at most the mean plus the largest job, and 4/3 of the optimum."""
    generator = torch.Generator().manual_seed(0)
    costs = (torch.rand(37, generator=generator) * 10 + 1).tolist()
    owners, loads = assign_owners(costs, 8)
    assert [sum(c for c, o in zip(costs, owners) if o == r) for r in range(8)] == pytest.approx(loads)
    assert max(loads) <= sum(costs) / 8 + max(costs)
    # Same costs, same owners: every rank computes the assignment alone.
    assert assign_owners(costs, 8) == (owners, loads)
    # Starting loads count: a rank that took more earlier in the step gets less now.
    owners, loads = assign_owners([1.0] * 4, 2, loads=[10.0, 0.0])
    assert owners == [1, 1, 1, 1]



def test_work_waiting_on_an_exchange_takes_its_results_in_once_it_has_run():
    """Submit, then collect (#45): a generator runs up to the job it submits, and takes the results in
    when the exchange runs, each source's by position (here: whole matrices, computed where they are)."""
    exchange = Exchange()
    sources = [torch.ones(2, 3), torch.zeros(0, 3), torch.full((2, 3), 2.0)]
    taken = []

    def tripled(positions, wholes):
        return [3 * whole for whole in wholes]

    def work():
        results = yield exchange.submit(tripled, sources, [None] * 3, [1.0] * 3, here=[True] * 3)
        taken.extend(results)

    exchange.wait(work())
    assert not taken
    exchange.run()
    assert [result.tolist() for result in taken] == [[[3.0] * 3] * 2, [], [[6.0] * 3] * 2]

    def waits_twice():
        yield exchange.submit(tripled, sources, [None] * 3, [1.0] * 3, here=[True] * 3)
        yield exchange.submit(tripled, sources, [None] * 3, [1.0] * 3, here=[True] * 3)

    exchange.wait(waits_twice())
    with pytest.raises(RuntimeError, match="yields once"):
        exchange.run()

# ----------------------------------------------------------------------------- the harness (process_results)


def _aborted(rank: int, world: int, when: str) -> dict:
    """Aborted before its result (a crash), or after it, at exit, as torch's Gloo teardown may be."""
    if when == "before":
        os.abort()
    atexit.register(os.abort)
    return {"rank": rank}


# One process per launch: a rank that dies while another still connects would fail that one too.
def test_a_rank_aborted_before_writing_its_result_fails_the_launch():
    with pytest.raises(AssertionError, match=r"^rank 0 exited with code -6 before writing its result$"):
        run_ranks(_aborted, 1, "before", interpreter_exit=True)


def test_a_rank_aborted_after_writing_its_result_is_tolerated_with_a_warning():
    with pytest.warns(RuntimeWarning, match="rank 0 wrote its result, then was aborted"):
        assert run_ranks(_aborted, 1, "after", interpreter_exit=True) == [{"rank": 0}]


@pytest.mark.parametrize("exit_codes, written, failure", [
    ([0, 0], [0, 1], None),
    ([-signal.SIGABRT, 0], [0, 1], None),  # torch's teardown abort, after the work: tolerated
    ([-signal.SIGABRT, 0], [1], "rank 0 exited with code -6 before writing its result"),
    ([0, 0], [0], "rank 1 exited with code 0 before writing its result"),
    ([None, 0], [1], "rank 0 was still running at the timeout before writing its result"),
    ([1, 0], [0, 1], "rank 0 wrote its result, then exited with code 1"),
    ([-signal.SIGSEGV, 0], [0, 1], "rank 0 wrote its result, then exited with code -11"),
    ([0, None], [0, 1], "rank 1 wrote its result, then did not exit by the timeout"),
])
def test_judge_passes_a_rank_by_its_result_and_tolerates_only_an_abort_after_it(tmp_path, exit_codes, written,
                                                                               failure):
    for rank in written:
        (tmp_path / f"{rank}.json").write_text(json.dumps({"rank": rank}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if failure is None:
            assert judge(exit_codes, tmp_path) == [{"rank": 0}, {"rank": 1}]
        else:
            with pytest.raises(AssertionError, match=f"^{failure}$"):
                judge(exit_codes, tmp_path)
