"""The training loop: data, model, optimizer, schedule, logging, checkpoints. Read top to bottom.

Under ``--fsdp`` or ``--ddp`` it runs as one of the processes ``torchrun`` starts, one per GPU (or a few
on a CPU, with Gloo): each takes its share of the rows of every batch (under ``--tp``, each group of
``tp`` processes that splits the blocks), so that together they train on the single-process run's
batches; losses are averaged over the processes, the metrics see whole weights and activations, only
rank 0 writes files, and checkpoints are ``torch.distributed.checkpoint`` folders.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from ..optim import QKCap
from ..optim.distributed import lend, let_go, local, whole
from ..progress import progress as progress_bar  # `progress` is the flag that turns it off
from . import monitor
from .config import PROTOCOL_PRESETS, TrainConfig, computed_differences, evaluation_steps, read_config_file, to_dict
from .data import Corpus, load_corpus, train_batch, validation_batches
from .model import Transformer, fully_shard_blocks, tensor_parallel_blocks
from .optimizers import build_optimizer
from .qk_clip import QKClip, checked_threshold
from .schedule import lr_multiplier

CHECKPOINT = "checkpoint.pt"
# Under --fsdp/--ddp: torch.distributed.checkpoint folders (checkpoint.dcp, checkpoint.1.dcp, ...), each
# with every process's shards and rank 0's RUN_STATE: step, history, config, and the optimizer's skip
# and clamp counts (its count_state), which DCP's optimizer state dict, torch's keys only, leaves out.
SHARDED = ".dcp"
RUN_STATE = "run.pt"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The validation loss's log key, by what a token is, and its conversion from nats: bits per byte on
# bytes (SPEC 7.4's unit), nats per token on a tokeniser's tokens (the write-ups' NLL).
VALIDATION_KEYS = {"byte": ("val_bpb", 1 / math.log(2)), "token": ("val_nats_per_token", 1.0)}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 autocast on GPUs; CPUs train in fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def validation_key(record: dict) -> str:
    """The validation-loss key a logged record holds."""
    return next(key for key, _ in VALIDATION_KEYS.values() if key in record)


@dataclass(frozen=True)
class Processes:
    """This process's place in the run: rank ``rank`` of the ``world_size`` processes of an ``--fsdp``
    or ``--ddp`` run (``mode``), or the only process (``mode`` None), on ``device``. Under ``--fsdp``,
    ``mesh`` lays the processes out as ``("dp",)``, or under ``--tp`` as ``("dp", "tp")``: groups of
    ``tensor_parallel`` consecutive ranks, each group holding one copy of the model split between them."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    mode: str | None = None
    tensor_parallel: int = 1
    mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.mode is not None

    @property
    def main(self) -> bool:
        """Rank 0, the one process that writes the run's files and shows its progress."""
        return self.rank == 0

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.tensor_parallel > 1 else None

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's rows of a batch: consecutive equal shares, one per data-parallel group (the
        processes of one copy of the model: one, or ``tensor_parallel``, which need the same rows), so
        that the groups together take the single-process run's batch, and the mean of their mean
        losses is its mean loss."""
        groups = self.world_size // self.tensor_parallel
        share = batch.shape[0] // groups
        group = self.rank // self.tensor_parallel  # init_device_mesh's order: rank = dp * tp_size + tp
        return batch[group * share:(group + 1) * share]

    def mean(self, value: float) -> float:
        """The mean over the processes (a collective: every process calls it). Under ``--tp`` the
        processes of a group hold the same value, so this is also the mean over the groups, without a
        collective of its own on the "dp" mesh dim."""
        if not self.distributed:
            return value
        # A run's last collective: lent, so that Gloo's threads never need Python for its buffer at the exit.
        total = lend(None, torch.tensor(value, dtype=torch.float64, device=self.device))
        dist.all_reduce(total)
        mean = total.item() / self.world_size
        let_go([total])
        return mean

    def every(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process, so that all take the same branch (a collective)."""
        if not self.distributed:
            return flag
        value = lend(None, torch.tensor(float(flag), device=self.device))
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        agreed = bool(value.item())
        let_go([value])
        return agreed

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def parallel_mode(config: TrainConfig) -> str | None:
    """``"fsdp"``, ``"ddp"`` or None (one process), after the checks that need no processes."""
    if config.fsdp and config.ddp:
        raise ValueError("--fsdp and --ddp exclude each other (FSDP shards the model, DDP replicates it); pass one")
    if config.tp < 1:
        raise ValueError(f"--tp {config.tp}: the processes that split each block must be 1 or more")
    if config.tp > 1 and not config.fsdp:
        raise ValueError(f"--tp {config.tp} splits the blocks of a model that FSDP2 shards over the groups of "
                         "processes: pass --fsdp with it")
    if config.qk_clip and (config.fsdp or config.ddp):
        raise ValueError(f"--qk-clip {config.qk_clip} runs on one process: its per-head maxima would need a maximum "
                         "over the processes first, and FSDP2 shards the heads' rows; drop --qk-clip, or --fsdp/--ddp")
    if config.n_heads % config.tp:
        raise ValueError(f"--tp {config.tp}: the {config.n_heads} attention heads do not split over {config.tp} "
                         "processes (each computes n_heads / tp of them); pass a --tp that divides n_heads")
    return "fsdp" if config.fsdp else "ddp" if config.ddp else None


@contextlib.contextmanager
def launched(config: TrainConfig):
    """The run's :class:`Processes`: the single process, or under ``--fsdp``/``--ddp`` the one of
    torchrun's that this is, in the process group (NCCL on its GPU ``cuda:LOCAL_RANK``, Gloo on CPUs),
    started unless one is up already (a sweep's earlier run in this process, or the caller's)."""
    mode = parallel_mode(config)
    started = all(name in os.environ for name in TORCHRUN_VARIABLES)
    if mode is None:
        if started and int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError(f"started by torchrun as {os.environ['WORLD_SIZE']} processes without --fsdp or "
                               "--ddp: each would train the whole single-process run into the same folder; pass "
                               "--fsdp or --ddp")
        yield Processes(pick_device(config.device))
        return
    if not started:
        raise RuntimeError(f"--{mode} trains with one process per GPU, started by torchrun, which sets "
                           f"{', '.join(TORCHRUN_VARIABLES)} (unset here). Launch it as: torchrun --standalone "
                           f"--nproc-per-node NUMBER_OF_GPUS -m spectral_ops.train --{mode} ...")
    rank, world_size, local_rank = (int(os.environ[name]) for name in TORCHRUN_VARIABLES)
    if world_size % config.tp:
        raise ValueError(f"--tp {config.tp} does not divide the {world_size} processes into groups of {config.tp}; "
                         f"pass a --tp that divides {world_size}")
    groups = world_size // config.tp
    if config.batch_size % groups:
        takers = f"{groups} groups of {config.tp} processes" if config.tp > 1 else f"{groups} processes"
        raise ValueError(f"--{mode}: batch_size {config.batch_size} does not split over {takers} (each takes "
                         f"batch_size / {groups} rows of every batch); pass a multiple of {groups}")
    device = pick_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    starting = not dist.is_initialized()
    if starting:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    mesh = None
    if mode == "fsdp":
        shape, names = ((groups, config.tp), ("dp", "tp")) if config.tp > 1 else ((world_size,), ("dp",))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    try:
        yield Processes(device, rank, world_size, mode, config.tp, mesh)
    finally:
        # A Gloo group is left to the process's exit: torch's Gloo destroy_process_group() sometimes
        # aborts a process whose work is done ("terminate called without an active exception", exit code
        # -6), which would fail a finished run, and Gloo needs no teardown (torch does not warn without
        # one). An NCCL group is destroyed, as torch asks (it warns at exit otherwise), by whoever started it.
        if starting and dist.get_backend() == "nccl":
            dist.destroy_process_group()


def parallelise(model: Transformer, processes: Processes) -> torch.nn.Module:
    """What a training step runs: under FSDP the model itself, changed in place (under ``--tp`` each
    block split over the "tp" mesh dim first), then sharded (each block, then the root) over the "dp"
    dim; under DDP its wrapper, else the model."""
    if processes.mode == "fsdp":
        if processes.tensor_parallel_mesh is not None:
            tensor_parallel_blocks(model, processes.tensor_parallel_mesh)
        return fully_shard_blocks(model, processes.mesh["dp"])
    if processes.mode == "ddp":
        on_gpu = processes.device.type == "cuda"
        return DistributedDataParallel(model, device_ids=[processes.device] if on_gpu else None)
    return model


def load_corpus_once(config: TrainConfig, processes: Processes) -> Corpus:
    """The corpus, its token cache built by rank 0 before the others read it (two processes writing
    one cache file would tear it)."""
    if not processes.main:
        processes.barrier()
    corpus = load_corpus(config.data, vocab_size=config.vocab_size)
    if processes.main:
        processes.barrier()
    return corpus


@torch.no_grad()
def validation_nats(model, batches, processes: Processes) -> float:
    """Mean cross-entropy over the fixed validation windows, in nats per token (each process
    evaluates its rows of every window: a collective under ``--fsdp``/``--ddp``)."""
    device = processes.device
    was_training = model.training
    model.eval()
    losses = []
    for inputs, targets in batches:
        with autocast(device):
            logits = model(processes.rows(inputs).to(device))
        targets = processes.rows(targets).to(device)
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item())
    model.train(was_training)
    return processes.mean(sum(losses) / len(losses))


def checkpoint_paths(out: Path, keep: int, suffix: str = ".pt") -> list[Path]:
    """Newest first: ``checkpoint.pt``, then ``checkpoint.1.pt``, ... (``keep`` in all; ``suffix``
    ``SHARDED``: the folders of ``--fsdp``/``--ddp`` runs)."""
    stem = Path(CHECKPOINT).stem
    return [out / f"{stem}{suffix}"] + [out / f"{stem}.{index}{suffix}" for index in range(1, keep)]


def clip_gradients(parameters, max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_``, for parameters on different device meshes too: under ``--tp``
    the split matrices live on the 2-d mesh and the rest on its "dp" dim, whose norms torch cannot stack
    together. Each mesh's norm is taken whole first (one collective per mesh)."""
    by_mesh = {}
    for parameter in parameters:
        if parameter.grad is not None:
            by_mesh.setdefault(getattr(parameter, "device_mesh", None), []).append(parameter)
    norms = [whole(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def skipped_updates(optimizer) -> int:
    """The optimizer's skipped updates so far (read only when there are counters: after a skip)."""
    return sum(int(count) for count in getattr(optimizer, "skipped", {}).values())


def clamped_updates(optimizer) -> int:
    """The matrices whose spectral coefficient the stability clamp reduced so far (each is also logged
    with its factor on the ``spectral_ops.decay`` logger)."""
    return sum(int(record.count) for record in getattr(optimizer, "clamped", {}).values())


def check_finite_weights(model, step: int, out: Path, processes: Processes | None = None) -> None:
    """Stop a run whose weights went non-finite before it measures or checkpoints them (on every
    process, when one of them holds a non-finite shard)."""
    finite = all(torch.isfinite(local(p)).all() for p in model.parameters())
    if not (processes.every(finite) if processes else finite):
        raise FloatingPointError(f"step {step}: the weights are not finite (lower the lr?); stopping before "
                                 f"measuring or checkpointing them (the last checkpoint in {out} is kept)")


def save_checkpoint(out: Path, model, optimizer, step: int, history: list, config: TrainConfig,
                    qk_cap: QKCap | None = None) -> None:
    """Write to a temporary file, shift the older checkpoints down (the oldest drops out), then
    rename: a crash never leaves a half-written checkpoint, and one cut between the shift and the
    rename leaves the previous checkpoint as ``checkpoint.1.pt``, where resuming looks next. ``qk_cap``:
    the run's (``--qk-cap``), whose state goes in too."""
    check_finite_weights(model, step, out)
    paths = checkpoint_paths(out, config.keep_checkpoints)
    temporary = paths[0].with_suffix(".tmp")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "history": history,
             "config": to_dict(config), **qk_cap_state(qk_cap)}
    write_aside(temporary, lambda handle: torch.save(state, handle))
    install_checkpoint(temporary, paths)


def write_aside(temporary: Path, write) -> None:
    """``write(handle)`` into the file ``temporary``, flushed to disk, or no file at all: a write that fails
    (a full disk, an interrupt) removes it, and an OSError is raised again naming the file, its reason and
    that nothing was replaced. torch.save is handed a Python file, not the path: its own file writer reports
    a full disk as "basic_ios::clear: iostream error"."""
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno is not None:
            raise OSError(error.errno, f"{error.strerror}: writing {temporary} failed and was removed; the files "
                                       f"in {temporary.parent} are as they were (free space, then run again with "
                                       "--resume)", str(temporary)) from error
        raise


def install_checkpoint(temporary: Path, paths: list[Path]) -> None:
    """Shift the checkpoints at ``paths`` down (the oldest drops out), then rename ``temporary`` to the
    newest. A folder cannot be renamed over, so the oldest is removed first: with two or more kept,
    some complete checkpoint is under a checkpoint's name at every instant."""
    if paths[-1].is_dir():
        shutil.rmtree(paths[-1])
    for older, newer in reversed(list(zip(paths[1:], paths[:-1]))):
        if newer.exists():
            os.replace(newer, older)
    os.replace(temporary, paths[0])


def sharded_state(model, optimizer) -> dict:
    """The model's and the optimizer's state as ``torch.distributed.checkpoint`` saves and loads it:
    by parameter name, each process's shards (the same names under FSDP and DDP)."""
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def qk_cap_state(qk_cap: QKCap | None) -> dict:
    """What a checkpoint holds of the run's QK cap: its state dict, under ``"qk_cap"``, where there is one."""
    return {} if qk_cap is None else {"qk_cap": qk_cap.state_dict()}


def save_sharded_checkpoint(out: Path, model, optimizer, step: int, history: list, config: TrainConfig,
                            processes: Processes, qk_cap: QKCap | None = None) -> None:
    """:func:`save_checkpoint` for ``--fsdp``/``--ddp`` (a collective): every process writes its shards
    into a temporary folder, rank 0 adds the run state, and once all are done rank 0 moves the folder
    into place, so a folder under a checkpoint's name is complete."""
    check_finite_weights(model, step, out, processes)
    paths = checkpoint_paths(out, config.keep_checkpoints, SHARDED)
    temporary = paths[0].with_suffix(".tmp")
    if processes.main and temporary.exists():
        shutil.rmtree(temporary)  # an interrupted save's
    processes.barrier()
    error = None
    try:
        dcp.save(sharded_state(model, optimizer), checkpoint_id=temporary)  # raises on every process, or none
        if processes.main:
            # The counts agree on every process (the optimizer agrees on each skip and clamp).
            run = {"step": step, "history": history, "config": to_dict(config), **optimizer.count_state(),
                   **qk_cap_state(qk_cap)}
            write_aside(temporary / RUN_STATE, lambda handle: torch.save(run, handle))
    except Exception as caught:
        error = caught
    # Every process learns whether all wrote their part, so that none waits for one that failed.
    if not processes.every(error is None):
        if processes.main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise error or RuntimeError(f"saving the checkpoint {temporary} failed on another process (its log says "
                                    f"why); the checkpoints in {out} are as they were")
    if processes.main:
        install_checkpoint(temporary, paths)
    processes.barrier()


def load_sharded_checkpoint(out: Path, config: TrainConfig, model, optimizer, processes: Processes,
                            force: bool) -> dict | None:
    """:func:`load_checkpoint` for ``--fsdp``/``--ddp`` (a collective): the newest checkpoint folder that
    loads on every process, checked to be this run's, loaded into ``model`` and ``optimizer``; returns
    its run state."""
    found = [path for path in checkpoint_paths(out, config.keep_checkpoints, SHARDED) if path.is_dir()]
    for path in found:
        state, error = sharded_state(model, optimizer), None
        try:
            dcp.load(state, checkpoint_id=path)  # raises on every process when it fails on one
            run = torch.load(path / RUN_STATE, map_location="cpu", weights_only=False)
            missing = {"step", "history"} - set(run)
            if missing:
                raise KeyError(f"no {sorted(missing)} in {RUN_STATE}")
        # A torn or corrupt folder: fall back to the previous one.
        except dcp.CheckpointException as caught:  # every process's error (not an Exception): the first
            error = min(caught.failures.items())[1][0]
        except Exception as caught:
            error = caught
        if processes.every(error is None):
            check_same_run(path / RUN_STATE, run, config, force)  # every process read the same run state
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
            optimizer.load_count_state(run)
            return run
        if processes.main:
            reason = f"{type(error).__name__}: {error}" if error else "it does not load on another process"
            warnings.warn(f"cannot resume from {path} ({reason}); trying an older checkpoint", RuntimeWarning,
                          stacklevel=2)
    if found:
        raise RuntimeError(f"no checkpoint in {out} can be loaded: {', '.join(map(str, found))}")
    return None


def load_checkpoint(out: Path, config: TrainConfig, device, force: bool) -> dict | None:
    """The newest checkpoint that loads, warning about each one that does not (naming the file), and
    checked to be this run's (:func:`check_same_run`); None when there is none. Raises when every one
    there is unreadable."""
    found = [path for path in checkpoint_paths(out, config.keep_checkpoints) if path.exists()]
    for path in found:
        try:
            state = torch.load(path, map_location=device, weights_only=False)
            missing = {"model", "optimizer", "step", "history"} - set(state)
            if missing:
                raise KeyError(f"no {sorted(missing)}")
        except Exception as error:  # a torn or corrupt file: fall back to the previous one
            warnings.warn(f"cannot resume from {path} ({type(error).__name__}: {error}); trying an older "
                          "checkpoint", RuntimeWarning, stacklevel=2)
            continue
        # Another run's checkpoint is whole: refused, not passed over for an older one.
        check_same_run(path, state, config, force)
        return state
    if found:
        raise RuntimeError(f"no checkpoint in {out} can be loaded: {', '.join(map(str, found))}")
    return None


def refuse_changed_config(source: Path, saved: dict, config: TrainConfig) -> None:
    """A resumed run continues the same run: refuse a saved config (``source``'s) that differs from
    ``config`` in what the run computes; where the run lives and how it is logged may change."""
    differences = computed_differences(saved, config)
    if differences:
        details = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in differences.items())
        raise ValueError(f"--resume: the config differs from {source} ({details}); pass --force to resume with "
                         "this one anyway, or another --out-dir to start a new run")


def check_resumable(out: Path, config: TrainConfig, force: bool) -> None:
    """The run folder's config.json, if any, is this run's (unless ``force``)."""
    path = out / "config.json"
    if force or not path.exists():
        return
    refuse_changed_config(path, read_config_file(path, "restore it; or delete it, and the checkpoint's own "
                                                       "config is compared instead; or pass --force to resume "
                                                       "without comparing (config.json is then rewritten)"), config)


def check_same_run(path: Path, state: dict, config: TrainConfig, force: bool) -> None:
    """A checkpoint (its ``state``, read from ``path``) is this run's (unless ``force``): the config it
    embeds, which every checkpoint this loop writes does, computes what ``config`` does."""
    if force:
        return
    if "config" not in state:
        raise ValueError(f"--resume: {path} embeds no config (every checkpoint this loop writes does: this one "
                         "was written or edited elsewhere), so it cannot be shown to be this run's; pass --force "
                         "to resume from it anyway, or another --out-dir to start a new run")
    refuse_changed_config(path, state["config"], config)


def write_config(out: Path, config: TrainConfig) -> None:
    """config.json, atomically (written aside, flushed to disk, renamed over the old one): a crash leaves
    the old file or the new one, never a torn one."""
    path = out / "config.json"
    temporary = path.with_suffix(".json.tmp")
    write_aside(temporary, lambda handle: handle.write((json.dumps(to_dict(config), indent=2) + "\n").encode()))
    os.replace(temporary, path)


def write_logs(out: Path, history: list) -> None:
    """metrics.jsonl and metrics.csv, rewritten from the history (so a resumed run has no duplicates)."""
    with open(out / "metrics.jsonl", "w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in history)
    columns = list(dict.fromkeys(key for record in history for key in record))
    with open(out / "metrics.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(history)


def check_protocol_data(config: TrainConfig, corpus: Corpus) -> None:
    """A SPEC 7 preset on the default byte corpus reproduces nothing: refuse, or with
    ``allow_stand_in_data`` warn, saying how many epochs of it the run would read."""
    if config.preset not in PROTOCOL_PRESETS or config.data is not None:
        return
    epochs = config.steps * config.grad_accum * config.batch_size * config.seq_len / len(corpus.train)
    message = (f"preset {config.preset} follows {PROTOCOL_PRESETS[config.preset]}, but no --data was given: the "
               f"default corpus, {corpus.description}, is a stand-in ({len(corpus.train) / 1e6:.1f}M training bytes; "
               f"this run would read it {epochs:.0f} times)")
    if not config.allow_stand_in_data:
        raise ValueError(f"{message}. Pass --data (token shards or text), or --allow-stand-in-data to run on it anyway")
    warnings.warn(f"{message}: its results do not reproduce the protocol", RuntimeWarning, stacklevel=3)


def summary_line(record: dict) -> str:
    key = validation_key(record)
    unit = "bits/byte" if key == "val_bpb" else "nats/token"
    return (f"step {record['step']}: val {record[key]:.4f} {unit}, "
            f"MLP gate/up/down stable rank {record['mlp_gate/stable_rank']:.2f}/{record['mlp_up/stable_rank']:.2f}/"
            f"{record['mlp_down/stable_rank']:.2f}, "
            f"QK stable rank {record['qk/stable_rank']:.2f}, attention entropy {record['attention/entropy']:.3f}")


def train(config: TrainConfig, *, resume: bool = False, force: bool = False, progress: bool = True) -> list[dict]:
    """Train one run into ``config.out_dir``; returns the logged records. ``resume`` continues from
    the newest loadable checkpoint there (``force``: even when its config, or OUT_DIR/config.json, differs
    from ``config`` in what the run computes, or config.json is unreadable). Under ``--fsdp`` or
    ``--ddp``, every process torchrun started calls this."""
    if config.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be >= 1, got {config.keep_checkpoints}")
    with launched(config) as processes:
        corpus = load_corpus_once(config, processes)
        check_protocol_data(config, corpus)  # before anything is written: a refused run leaves no trace
        if config.qk_clip:
            checked_threshold(config.qk_clip)
        out = Path(config.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            check_resumable(out, config, force)
        return run_steps(config, corpus, out, processes, resume, force, progress)


def run_steps(config: TrainConfig, corpus: Corpus, out: Path, processes: Processes, resume: bool, force: bool,
              progress: bool) -> list[dict]:
    device = processes.device
    torch.manual_seed(config.seed)  # the same initial weights on every process
    model = Transformer(config.model_config(corpus.vocab_size)).to(device)
    network = parallelise(model, processes)
    optimizer = build_optimizer(model, config, process_group=dist.group.WORLD if processes.mode == "ddp" else None)
    # After each step: a step that raised caps nothing. Under --fsdp every process caps the gathered heads alike.
    qk_cap = QKCap(model=model, cap=config.qk_cap).attach(optimizer) if config.qk_cap else None
    qk_clip = QKClip(model, config.qk_clip) if config.qk_clip else None
    spectral = monitor.weight_monitor(model, optimizer)
    start, history = 0, []
    if processes.distributed:
        state = load_sharded_checkpoint(out, config, model, optimizer, processes, force) if resume else None
    else:
        state = load_checkpoint(out, config, device, force) if resume else None
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    if state is not None:
        start, history = state["step"], state["history"]
        if qk_cap is not None and "qk_cap" in state:  # absent only from a run resumed with --force
            qk_cap.load_state_dict(state["qk_cap"])
    elif resume and processes.main:
        print(f"{out}: nothing to resume (no checkpoint); starting from step 0", file=sys.stderr)
    # After the checkpoint is accepted, so that a refused resume leaves the folder as it was.
    processes.barrier()  # every process has read the old config.json before rank 0 replaces it
    if processes.main:
        write_config(out, config)

    validation = validation_batches(corpus, config.val_batches, config.batch_size, config.seq_len)
    loss_key, from_nats = VALIDATION_KEYS[corpus.unit]
    evaluations = set(evaluation_steps(config.steps, config.log_every))
    probe = monitor.probe_tokens(validation).to(device)  # fixed tokens for the attention and V metrics
    bar = progress_bar(range(start, config.steps), initial=start, total=config.steps, desc=out.name, unit="step",
                       disable=not (progress and processes.main))
    skipping = 0  # steps in a row with a skipped update
    for step in bar:
        multiplier = lr_multiplier(step, config.steps, config.warmup_steps, config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * multiplier  # peak_lr: the lr the optimizer built the group with

        train_loss = 0.0
        for micro in range(config.grad_accum):
            inputs, targets = (processes.rows(rows) for rows in train_batch(
                corpus, step * config.grad_accum + micro, config.batch_size, config.seq_len, config.seed))
            # DDP averages the gradients over the processes once, at the last micro-batch.
            last = micro == config.grad_accum - 1
            with network.no_sync() if processes.mode == "ddp" and not last else contextlib.nullcontext():
                with autocast(device):
                    logits = network(inputs.to(device))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
                (loss / config.grad_accum).backward()
            train_loss += loss.item() / config.grad_accum
        train_loss = processes.mean(train_loss)
        if config.grad_clip:
            clip_gradients(model.parameters(), config.grad_clip)
        if not math.isfinite(train_loss):  # stop before anything trained on it is checkpointed
            raise FloatingPointError(f"step {step}: the training loss is {train_loss}; stopping (lower the lr? "
                                     f"the last checkpoint in {out} is kept)")
        skips_before = skipped_updates(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if qk_clip:  # after the step, on the logits of this step's forward (SPEC 11)
            qk_clip.step()
        skipping = skipping + 1 if skipped_updates(optimizer) > skips_before else 0
        if config.max_skipped_steps and skipping >= config.max_skipped_steps:
            raise FloatingPointError(f"step {step}: the optimizer skipped updates with non-finite gradients in "
                                     f"{skipping} steps in a row; stopping (lower the lr? the last checkpoint in "
                                     f"{out} is kept)")
        bar.set_postfix(loss=f"{train_loss:.3f}")

        done = step + 1
        if done in evaluations:
            check_finite_weights(model, done, out, processes)
            record = {"step": done, "train_loss": train_loss, "lr_multiplier": multiplier,
                      "skipped_updates": skipped_updates(optimizer),
                      "clamped_updates": clamped_updates(optimizer),
                      loss_key: validation_nats(model, validation, processes) * from_nats}
            record.update(monitor.weight_metrics(model, optimizer, spectral))
            record.update(monitor.activation_metrics(model, probe, processes.tensor_parallel_mesh))
            history.append(record)
            if processes.main:
                write_logs(out, history)
        if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps:
            if processes.distributed:
                save_sharded_checkpoint(out, model, optimizer, done, history, config, processes, qk_cap)
            else:
                save_checkpoint(out, model, optimizer, done, history, config, qk_cap)
    if history and progress and processes.main:
        print(f"{out}: {summary_line(history[-1])}")
    return history
