"""The training loop: data, model, optimizer, schedule, logging, checkpoints. Read top to bottom."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import monitor
from .config import PROTOCOL_PRESETS, TrainConfig, evaluation_steps, to_dict
from .data import Corpus, load_corpus, train_batch, validation_batches
from .model import Transformer
from .optimizers import build_optimizer
from .schedule import lr_multiplier

CHECKPOINT = "checkpoint.pt"
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


@torch.no_grad()
def validation_nats(model, batches, device) -> float:
    """Mean cross-entropy over the fixed validation windows, in nats per token."""
    was_training = model.training
    model.eval()
    losses = []
    for inputs, targets in batches:
        with autocast(device):
            logits = model(inputs.to(device))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def checkpoint_paths(out: Path, keep: int) -> list[Path]:
    """Newest first: ``checkpoint.pt``, then ``checkpoint.1.pt``, ... (``keep`` in all)."""
    return [out / CHECKPOINT] + [out / f"checkpoint.{index}.pt" for index in range(1, keep)]


def skipped_updates(optimizer) -> int:
    """The optimizer's skipped updates so far (read only when there are counters: after a skip)."""
    return sum(int(count) for count in getattr(optimizer, "skipped", {}).values())


def clamped_updates(optimizer) -> int:
    """The matrices whose spectral coefficient the stability clamp reduced so far (each is also logged
    with its factor on the ``spectral_ops.decay`` logger)."""
    return sum(int(record.count) for record in getattr(optimizer, "clamped", {}).values())


def check_finite_weights(model, step: int, out: Path) -> None:
    """Stop a run whose weights went non-finite before it measures or checkpoints them."""
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise FloatingPointError(f"step {step}: the weights are not finite (lower the lr?); stopping before "
                                 f"measuring or checkpointing them (the last checkpoint in {out} is kept)")


def save_checkpoint(out: Path, model, optimizer, step: int, history: list, config: TrainConfig) -> None:
    """Write to a temporary file, shift the older checkpoints down (the oldest drops out), then
    rename: a crash never leaves a half-written checkpoint, and one cut between the shift and the
    rename leaves the previous checkpoint as ``checkpoint.1.pt``, where resuming looks next."""
    check_finite_weights(model, step, out)
    paths = checkpoint_paths(out, config.keep_checkpoints)
    temporary = paths[0].with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "history": history, "config": to_dict(config)}, temporary)
    for older, newer in reversed(list(zip(paths[1:], paths[:-1]))):
        if newer.exists():
            os.replace(newer, older)
    os.replace(temporary, paths[0])


def load_checkpoint(out: Path, keep: int, device) -> dict | None:
    """The newest checkpoint that loads, warning about each one that does not (naming the file);
    None when there is none. Raises when every one there is unreadable."""
    found = [path for path in checkpoint_paths(out, keep) if path.exists()]
    for path in found:
        try:
            state = torch.load(path, map_location=device, weights_only=False)
            missing = {"model", "optimizer", "step", "history"} - set(state)
            if missing:
                raise KeyError(f"no {sorted(missing)}")
            return state
        except Exception as error:  # a torn or corrupt file: fall back to the previous one
            warnings.warn(f"cannot resume from {path} ({type(error).__name__}: {error}); trying an older "
                          "checkpoint", RuntimeWarning, stacklevel=2)
    if found:
        raise RuntimeError(f"no checkpoint in {out} can be loaded: {', '.join(map(str, found))}")
    return None


def check_resumable(out: Path, config: TrainConfig, force: bool) -> None:
    """A resumed run continues the same run: a changed config is refused unless ``force``."""
    path = out / "config.json"
    if force or not path.exists():
        return
    # A key the saved config lacks was added since: that run used its default.
    saved, now = {**to_dict(TrainConfig()), **json.loads(path.read_text())}, to_dict(config)
    changed = sorted(key for key in set(saved) | set(now) if saved.get(key) != now.get(key))
    if changed:
        details = ", ".join(f"{key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in changed)
        raise ValueError(f"--resume: the config differs from {path} ({details}); pass --force to resume "
                         "with the new one anyway")


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
    the newest loadable checkpoint there (``force``: even with a changed config)."""
    if config.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be >= 1, got {config.keep_checkpoints}")
    corpus = load_corpus(config.data, vocab_size=config.vocab_size)
    check_protocol_data(config, corpus)  # before anything is written: a refused run leaves no trace
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resumable(out, config, force)
    (out / "config.json").write_text(json.dumps(to_dict(config), indent=2) + "\n")
    device = pick_device(config.device)

    torch.manual_seed(config.seed)
    model = Transformer(config.model_config(corpus.vocab_size)).to(device)
    optimizer = build_optimizer(model, config)
    start, history = 0, []
    state = load_checkpoint(out, config.keep_checkpoints, device) if resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    elif resume:
        print(f"{out}: nothing to resume (no checkpoint); starting from step 0", file=sys.stderr)

    validation = validation_batches(corpus, config.val_batches, config.batch_size, config.seq_len)
    loss_key, from_nats = VALIDATION_KEYS[corpus.unit]
    evaluations = set(evaluation_steps(config.steps, config.log_every))
    probe = monitor.probe_tokens(validation).to(device)  # fixed tokens for the attention and V metrics
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, desc=out.name,
               disable=not progress, dynamic_ncols=True)
    skipping = 0  # steps in a row with a skipped update
    for step in bar:
        multiplier = lr_multiplier(step, config.steps, config.warmup_steps, config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * multiplier  # peak_lr: the lr the optimizer built the group with

        train_loss = 0.0
        for micro in range(config.grad_accum):
            inputs, targets = train_batch(corpus, step * config.grad_accum + micro, config.batch_size,
                                          config.seq_len, config.seed)
            with autocast(device):
                logits = model(inputs.to(device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
            (loss / config.grad_accum).backward()
            train_loss += loss.item() / config.grad_accum
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        if not math.isfinite(train_loss):  # stop before anything trained on it is checkpointed
            raise FloatingPointError(f"step {step}: the training loss is {train_loss}; stopping (lower the lr? "
                                     f"the last checkpoint in {out} is kept)")
        skips_before = skipped_updates(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        skipping = skipping + 1 if skipped_updates(optimizer) > skips_before else 0
        if config.max_skipped_steps and skipping >= config.max_skipped_steps:
            raise FloatingPointError(f"step {step}: the optimizer skipped updates with non-finite gradients in "
                                     f"{skipping} steps in a row; stopping (lower the lr? the last checkpoint in "
                                     f"{out} is kept)")
        bar.set_postfix(loss=f"{train_loss:.3f}")

        done = step + 1
        if done in evaluations:
            check_finite_weights(model, done, out)
            record = {"step": done, "train_loss": train_loss, "lr_multiplier": multiplier,
                      "skipped_updates": skipped_updates(optimizer),
                      "clamped_updates": clamped_updates(optimizer),
                      loss_key: validation_nats(model, validation, device) * from_nats}
            record.update(monitor.weight_metrics(model, optimizer))
            record.update(monitor.activation_metrics(model, probe))
            history.append(record)
            write_logs(out, history)
        if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps:
            save_checkpoint(out, model, optimizer, done, history, config)
    if history and progress:
        print(f"{out}: {summary_line(history[-1])}")
    return history
