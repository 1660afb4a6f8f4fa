"""The owner compute's traffic and load balance (bench/dist_traffic.py, issue #18's goals): the balance
goal on paper12 with 8 ranks, the byte counts against a count by hand, and the reproduction of the
optimizer's owners and sends against a real step whose collectives are recorded (a fake process group:
every rank's view of the step in one process, no communication). On 2-d meshes (issue #32): the
placements and parts against those torch gives a model under TP and FSDP2, the parts covering each
matrix, the bytes against a count by hand, against a real step on a 2x2 mesh, and against the 1-d
mesh of as many ranks."""

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from spectral_ops import plan
from spectral_ops.optim import SpectralAdamW, SpectralMuon, distributed
from spectral_ops.train.config import preset
from spectral_ops.train.model import ModelConfig, Transformer, fully_shard_blocks
from spectral_ops.train.optimizers import build_optimizer

_spec = importlib.util.spec_from_file_location("dist_traffic", Path(__file__).parents[1] / "bench" / "dist_traffic.py")
dist_traffic = importlib.util.module_from_spec(_spec)
sys.modules["dist_traffic"] = dist_traffic  # its dataclass looks its module up there
_spec.loader.exec_module(dist_traffic)


@pytest.mark.parametrize("setting", list(dist_traffic.SETTINGS["paper12"]))
def test_paper12_owner_balance_goal_on_8_ranks(setting):
    row = dist_traffic.traffic_row("paper12", setting, 8)
    assert row["owner_matrices"] > 8  # the goal is about sharing work, not about one matrix per rank
    assert row["balance"] <= dist_traffic.BALANCE_GOAL


def meta_matrices(shapes):
    with torch.device("meta"):
        return [torch.nn.Parameter(torch.empty(shape)) for shape in shapes]


def test_sharded_and_replicated_bytes_match_a_count_by_hand():
    # A 7x3 and a 5x2 matrix with p = 2 decay on 3 ranks. Shard(0) rows: 7 -> (3, 3, 1), 5 -> (2, 2, 1).
    # The 7x3 costs more, so it goes to rank 0 and the 5x2 to rank 1 (each the least loaded so far).
    optimizer = SpectralAdamW(meta_matrices([(7, 3), (5, 2)]), p=2, spectral_weight_decay=0.1)
    maps = dist_traffic.owner_maps(optimizer)
    dist_traffic.assign_step(maps, dist_traffic.Mesh(3))
    assert [m.owners for m in maps] == [[0, 1]]
    # Rank 0 sends its 2 rows of the 5x2 to rank 1 (4) and returns the 7x3's rows 3 + 1 (12);
    # rank 1 sends its 3 rows of the 7x3 (9) and returns 2 + 1 rows of the 5x2 (6);
    # rank 2 sends 1 row of each (3 + 2).
    assert dist_traffic.sharded_sends(maps, dist_traffic.Mesh(3)) == [4 + 12, 9 + 6, 3 + 2]
    # Replicated: one round per shape, owned by one rank, so each rank's part is the whole matrix
    # (padding for the two others) and a ring all-gather sends (W - 1) parts per rank.
    sent, padding, rounds = dist_traffic.replicated_sends(maps, 3)
    assert (sent, rounds) == (2 * 21 + 2 * 10, 2)
    assert padding == pytest.approx(2 * (21 - 21 / 3) + 2 * (10 - 10 / 3))


def test_muon_with_spectral_decay_sends_update_and_weight():
    # p = 1: only the update travels; p = 2: the weight too, so every count doubles.
    shapes = [(8, 4)] * 4
    sends = {}
    for p in (1, 2):
        optimizer = SpectralMuon(meta_matrices(shapes), p=p, spectral_weight_decay=0.1)
        maps = dist_traffic.owner_maps(optimizer)
        dist_traffic.assign_step(maps, dist_traffic.Mesh(4))
        sends[p] = dist_traffic.sharded_sends(maps, dist_traffic.Mesh(4))
    # Four 8x4 matrices on 4 ranks, one each: a rank sends 3 x 2 rows out and returns 3 x 2 rows.
    assert sends[1] == [2 * 3 * 2 * 4] * 4
    assert sends[2] == [2 * value for value in sends[1]]


@pytest.fixture
def fake_ranks():
    """``start(rank, world_size)``: this process plays ``rank`` of a fake group (collectives do nothing).
    Destroying it is safe, unlike a Gloo group's teardown (see process_results.py): the fake backend
    has no worker threads to outlive it, and each rank's group must go before the next one starts."""

    def start(rank, world_size):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        return init_device_mesh("cpu", (world_size,))

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


class Recorder:
    """What a real step does: the costs and owners of each ``assign_owners`` call of ``Exchange.run``
    and the elements this rank sends to the others (all-to-all: its sizes for the other ranks;
    all-gather: its part, W - 1 times). The received buffers are filled with finite values, as the
    other ranks would fill them."""

    def __init__(self, monkeypatch):
        self.owner_calls, self.sent = [], 0
        assign_owners = distributed.assign_owners

        def record_owners(costs, world_size, loads=None):
            owners, new_loads = assign_owners(costs, world_size, loads)
            self.owner_calls.append((list(costs), list(owners)))
            return owners, new_loads

        def all_to_all_single(output, source, output_sizes, input_sizes, group=None, async_op=False):
            self.sent += sum(input_sizes) - input_sizes[dist.get_rank(group)]
            output.copy_(torch.randn(output.shape))
            return Done()

        def all_gather_single(output, source, group=None, async_op=False):
            self.sent += (dist.get_world_size(group) - 1) * source.numel()
            output.copy_(torch.randn(output.shape))
            return Done()

        monkeypatch.setattr(distributed, "assign_owners", record_owners)
        monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
        # The package's one call site of the all-gather, whichever name the running torch gives it
        # (all_gather_single from 2.13, all_gather_into_tensor before).
        monkeypatch.setattr(distributed, "_all_gather_single", all_gather_single)


class Done:
    def wait(self):
        pass


def spread_copy(optimizer, mesh, rank, sharded):
    """The optimizer's groups over new parameters holding this rank's part (a Shard(0) DTensor, or the
    whole tensor under DDP), each with a gradient."""
    torch.manual_seed(rank)

    def spread(param):
        value = torch.randn(param.shape)
        if sharded:
            (runs,) = distributed.part_of(param.shape[:1], [Shard(0)], (mesh.size(),), (rank,))
            start, stop = runs[0] if runs else (0, 0)
            value = DTensor.from_local(value[start:stop], mesh, [Shard(0)], run_check=False,
                                       shape=param.shape, stride=param.stride())
        copy = torch.nn.Parameter(value)
        copy.grad = torch.randn_like(value) if not sharded else DTensor.from_local(
            torch.randn_like(value.to_local()), mesh, [Shard(0)], run_check=False, shape=param.shape,
            stride=param.stride())
        return copy

    groups = [{**group, "params": [spread(param) for param in group["params"]]} for group in optimizer.param_groups]
    return type(optimizer)(groups, process_group=None if sharded else dist.group.WORLD)


@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp", "ddp"])
@pytest.mark.parametrize("overrides", [
    dict(optimizer="muon", qkv_recipe="HHF", p=2, spectral_weight_decay=0.01, p_v=0, lambda_v=0.01),
    dict(optimizer="adamw", p=2, spectral_weight_decay=0.01),
], ids=["muon-hhf", "adamw"])
def test_reproduces_the_owners_and_sends_of_a_real_step(fake_ranks, monkeypatch, overrides, sharded):
    # The loop's groups on a 1-layer model of width 64 with 4 heads: 3 ranks split its 64 rows unevenly.
    config = preset("tiny", n_layers=1, d_model=64, seq_len=16, muon_precision="fp32", **overrides)
    optimizer = build_optimizer(Transformer(config.model_config(256)), config)
    world_size = 3
    maps = dist_traffic.owner_maps(optimizer)
    # q, k, v, o, mlp_in, mlp_out: Muon's directions and the p != 1 decay of each (AdamW: the decay).
    assert len(maps) == (12 if overrides["optimizer"] == "muon" else 6)
    dist_traffic.assign_step(maps, dist_traffic.Mesh(world_size))
    expected = dist_traffic.sharded_sends(maps, dist_traffic.Mesh(world_size)) if sharded else None
    for rank in range(world_size):
        mesh = fake_ranks(rank, world_size)
        recorder = Recorder(monkeypatch)
        spread_copy(optimizer, mesh, rank, sharded).step()
        # One assignment for the whole step (one process group), over every job's matrices in job order.
        assert recorder.owner_calls == [([c for m in maps for c in m.costs], [o for m in maps for o in m.owners])]
        if sharded:
            assert recorder.sent == expected[rank]
        else:
            assert recorder.sent == dist_traffic.replicated_sends(maps, world_size)[0]


@pytest.mark.parametrize("overrides", [
    dict(optimizer="muon", qkv_recipe="HHF", p=2, spectral_weight_decay=0.01, p_v=0, lambda_v=0.01),
    dict(optimizer="adamw", p=2, spectral_weight_decay=0.01),
], ids=["muon-hhf", "adamw"])
def test_reproduces_the_sends_of_a_real_step_on_a_2d_mesh(fake_ranks, monkeypatch, overrides):
    # The same model on a 2x2 (dp x tp) mesh, each parameter placed as TP and FSDP2 place it: what each
    # rank sends in a recorded step is the model's count.
    config = preset("tiny", n_layers=1, d_model=64, seq_len=16, muon_precision="fp32", **overrides)
    model = Transformer(config.model_config(256))
    optimizer = build_optimizer(model, config)
    traffic_mesh = dist_traffic.Mesh(2, 2, dist_traffic.tensor_parallel_dims(model))
    maps = dist_traffic.owner_maps(optimizer)
    dist_traffic.assign_step(maps, traffic_mesh)
    expected = dist_traffic.sharded_sends(maps, traffic_mesh)
    assert min(expected) > 0  # every rank holds parts of the matrices, so every rank sends
    for rank in range(4):
        fake_ranks(rank, 4)
        # Names of each rank's own: DTensor takes a mesh equal to one it met (the same ranks and names)
        # for that one, and the fake ranks before this one's meshes hold groups that are gone.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(f"dp{rank}", f"tp{rank}"))
        torch.manual_seed(rank)

        def spread(param):
            placements = traffic_mesh.placements(param)
            copy = torch.nn.Parameter(distribute_tensor(torch.randn(param.shape), mesh, placements, src_data_rank=None))
            copy.grad = distribute_tensor(torch.randn(param.shape), mesh, placements, src_data_rank=None)
            return copy

        groups = [{**group, "params": [spread(param) for param in group["params"]]}
                  for group in optimizer.param_groups]
        recorder = Recorder(monkeypatch)
        type(optimizer)(groups).step()
        assert recorder.sent == expected[rank], rank


def test_cli_writes_markdown_json_and_csv(tmp_path):
    rows = dist_traffic.main(["--out", str(tmp_path), "--presets", "paper8", "--world-sizes", "2", "--meshes", "2x2"])
    assert len(rows) == 2 * len(dist_traffic.SETTINGS["paper8"])
    for suffix in ("md", "json", "csv"):
        assert (tmp_path / f"dist-traffic.{suffix}").stat().st_size > 0
    assert "Decision: owner compute" in (tmp_path / "dist-traffic.md").read_text()
    for bad in (["--world-sizes", "1"], ["--meshes", "1x4"], ["--meshes", "2by2"]):
        with pytest.raises(SystemExit):
            dist_traffic.main(["--out", str(tmp_path), *bad])


def block_plan() -> dict:
    """torchtitan's plan for a reference Transformer block, as bench/dist_traffic.py models it."""
    return {f"{'attention' if name in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{name}":
            ColwiseParallel() if dim == 0 else RowwiseParallel()
            for name, dim in dist_traffic.TENSOR_PARALLEL_DIMS.items()}


def named_mesh(model) -> "dist_traffic.Mesh":
    """The traffic model's 2x2 mesh over ``model``'s parameters, found by name (TP replaces them)."""
    return dist_traffic.Mesh(2, 2, {param: dist_traffic.TENSOR_PARALLEL_DIMS[name.split(".")[-2]]
                                    for name, param in model.named_parameters()
                                    if name.split(".")[-2] in dist_traffic.TENSOR_PARALLEL_DIMS})


def test_placements_and_parts_are_those_of_tensor_parallelism_under_fsdp2(fake_ranks):
    # The reference model sharded as the loop's --tp will shard it, on each rank of a 2x2 mesh; widths
    # that split unevenly (a 42-wide MLP: 21 rows per TP rank, then 11 and 10 per dp rank; 51 tokens).
    for rank in range(4):
        fake_ranks(rank, 4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Transformer(ModelConfig(vocab_size=51, n_layers=1, d_model=24, n_heads=2, mlp_hidden=42))
        for block in model.layers:
            parallelize_module(block, mesh["tp"], block_plan())
        fully_shard_blocks(model, mesh["dp"])
        traffic_mesh = named_mesh(model)
        for name, param in model.named_parameters():
            placements = traffic_mesh.placements(param)
            # Not TP-sharded: FSDP2 places it over the dp mesh alone, as replicated over tp.
            expected = placements if param.device_mesh.ndim == 2 else (placements[0],)
            assert tuple(param.placements) == expected, name
            assert dist_traffic.part_sizes(param, traffic_mesh)[rank] == param.to_local().numel(), name


@pytest.mark.parametrize("preset_name", dist_traffic.PRESETS)
@pytest.mark.parametrize("dp, tp", dist_traffic.MESHES)
def test_parts_of_each_owner_group_cover_every_matrix_once(preset_name, dp, tp):
    _, model, _ = dist_traffic.meta_optimizer(preset_name, {})
    mesh = dist_traffic.Mesh(dp, tp, dist_traffic.tensor_parallel_dims(model))
    assert {dim for dim in mesh.tp_dims.values()} == {0, 1}
    for name, param in model.named_parameters():
        if param.ndim < 2:
            continue
        placements = mesh.placements(param)
        for group in dist_traffic.owner_groups(param, mesh):
            # Each rank's part as rectangles (a run of rows by a run of columns).
            boxes = [(rank, rows, cols) for rank in group
                     for runs in [distributed.part_of(param.shape, placements, mesh.sizes, mesh.coordinates()[rank])]
                     for rows in runs[0] for cols in runs[1]]
            parts = [dist_traffic.part_sizes(param, mesh)[rank] for rank in group]
            assert sum((rows[1] - rows[0]) * (cols[1] - cols[0]) for _, rows, cols in boxes) == sum(parts), name
            # No entry is held twice, so the parts, as large as the matrix together, cover it.
            for (rank, rows, cols), (other, other_rows, other_cols) in itertools.combinations(boxes, 2):
                assert not (overlap(rows, other_rows) and overlap(cols, other_cols)), (name, rank, other)
            assert sum(parts) == param.numel(), name


def overlap(run, other) -> bool:
    return max(run[0], other[0]) < min(run[1], other[1])


def test_2d_sends_match_a_count_by_hand():
    # On a 2x2 mesh (rank = 2 dp + tp): a 6x4 ColwiseParallel weight (TP rows 3 | 3, then FSDP2's 2 | 1 of
    # each) and a 4x8 RowwiseParallel one (rows 2 | 2 over dp, columns 4 | 4 over tp), p = 2 decay.
    colwise, rowwise = meta_matrices([(6, 4), (4, 8)])
    mesh = dist_traffic.Mesh(2, 2, {colwise: 0, rowwise: 1})
    assert [dist_traffic.part_sizes(param, mesh) for param in (colwise, rowwise)] == [[8, 8, 4, 4], [8] * 4]
    optimizer = SpectralAdamW([colwise, rowwise], p=2, spectral_weight_decay=0.1)
    maps = dist_traffic.owner_maps(optimizer)
    loads = dist_traffic.assign_step(maps, mesh)
    # The 4x8 costs more: rank 0 owns it, rank 1 the 6x4; ranks 2 and 3 own nothing.
    assert [m.owners for m in maps] == [[1, 0]]
    assert loads[2] == loads[3] == 0 and dist_traffic.imbalance(loads) == max(loads) / (sum(loads) / 4)
    # Rank 0: its 8 of the 6x4 out, the 4x8's 3 x 8 back; rank 1: 8 of the 4x8 out, the 6x4's 8 + 4 + 4
    # back; ranks 2 and 3: 4 of the 6x4 and 8 of the 4x8 each.
    assert dist_traffic.sharded_sends(maps, mesh) == [8 + 24, 8 + 16, 12, 12]
    # Distributed: each rank all-gathers its part over dp (padded to the dp group's largest: 8 of each
    # matrix), then both TP ranks all-reduce (ring over 2: 1x) each of the iteration's Grams, 4x4 here
    # (the 6x4's columns, the 4x8's rows), and ||X||_F. p = 2 iterates Polar Express's 8 steps on the
    # rectangle (aspect 1.5 and 2), one Gram each, the first shared with the direction's G Q.
    grams = len(optimizer.decay_options(optimizer.param_groups[0]).polar_coefficients)
    assert [block[2] for blocks in maps[0].blocks for block in blocks] == [grams, grams]
    assert dist_traffic.tensor_parallel_iteration_sends(maps, mesh) == [16 + 2 * (grams * 16 + 1)] * 4


def test_gram_count_follows_the_plan():
    # Muon's Polar Express: a Gram per step; p = 2's decay: the rectangle's steps, Gram space's restarts
    # (8 steps in blocks of 2, 3, 3: three Grams) where the plan takes it, a head of 128 x 768 (aspect 6).
    assert dist_traffic.gram_count("direction", (8, 8), {"ns_coefficients": None, "ns_steps": 5}, None) == 5
    optimizer = SpectralAdamW(meta_matrices([(4, 4)]), p=2, spectral_weight_decay=0.1)
    options = optimizer.decay_options(optimizer.param_groups[0])
    assert dist_traffic.gram_count("decay", (768, 768), None, options) == len(options.polar_coefficients)
    assert dist_traffic.gram_count("decay", (128, 768), None, options) == len(
        plan.restart_blocks(len(options.polar_coefficients)))


@pytest.mark.parametrize("dp, tp", [(2, 4), (4, 2)])
def test_2d_owner_compute_is_the_1d_of_as_many_ranks_where_parts_are_even(dp, tp):
    # paper12's widths split evenly over 8 ranks, so every rank holds an eighth of every matrix, as on a
    # 1-d mesh of 8: the same owners, loads and bytes (mean and busiest).
    setting = "muon HHF + p=2 V"
    flat = dist_traffic.traffic_row("paper12", setting, dp * tp)
    mesh = dist_traffic.mesh_traffic_row("paper12", setting, dp, tp)
    assert mesh["owner_bytes_mean"] == pytest.approx(flat["fsdp_owner_bytes_mean"])
    assert mesh["owner_bytes_max"] == pytest.approx(flat["fsdp_owner_bytes_max"])
    assert (mesh["balance"], mesh["max_owner_gflop"]) == (flat["balance"], flat["max_owner_gflop"])
    assert mesh["owner_bytes_max"] > mesh["owner_bytes_mean"]  # HHF's V: one more matrix than ranks' share
    assert mesh["max_owner_gflop"] / mesh["mean_owner_gflop"] == pytest.approx(mesh["balance"])
    assert mesh["distributed_bytes_mean"] > mesh["owner_bytes_mean"]
