"""The training loop: data, model, optimizer, schedule, logging, checkpoints. Read top to bottom."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import monitor
from .config import TrainConfig, to_dict
from .data import load_corpus, train_batch, validation_batches
from .model import Transformer
from .optimizers import build_optimizer
from .schedule import lr_multiplier

CHECKPOINT = "checkpoint.pt"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 autocast on GPUs; CPUs train in fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


@torch.no_grad()
def validation_bits_per_byte(model, batches, device) -> float:
    """Mean cross-entropy over the fixed validation windows, in bits per byte (tokens are bytes)."""
    was_training = model.training
    model.eval()
    losses = []
    for inputs, targets in batches:
        with autocast(device):
            logits = model(inputs.to(device))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses) / math.log(2)


def save_checkpoint(path: Path, model, optimizer, step: int, history: list, config: TrainConfig) -> None:
    """Write to a temporary file, then rename: a crash never leaves a half-written checkpoint."""
    temporary = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "history": history, "config": to_dict(config)}, temporary)
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


def summary_line(record: dict) -> str:
    return (f"step {record['step']}: val {record['val_bpb']:.4f} bits/byte, "
            f"MLP stable rank {record['mlp_expand/stable_rank']:.2f}/{record['mlp_project/stable_rank']:.2f}, "
            f"QK stable rank {record['qk/stable_rank']:.2f}, attention entropy {record['attention/entropy']:.3f}")


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> list[dict]:
    """Train one run into ``config.out_dir``; returns the logged records."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(config), indent=2) + "\n")
    device = pick_device(config.device)

    torch.manual_seed(config.seed)
    corpus = load_corpus(config.data)
    model = Transformer(config.model_config()).to(device)
    optimizer = build_optimizer(model, config)
    start, history = 0, []
    if resume and (out / CHECKPOINT).exists():
        state = torch.load(out / CHECKPOINT, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]

    validation = validation_batches(corpus, config.val_batches, config.batch_size, config.seq_len)
    probe = validation[0][0][:4].to(device)  # fixed tokens for the attention and V metrics
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, desc=out.name,
               disable=not progress, dynamic_ncols=True)
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
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{train_loss:.3f}")

        done = step + 1
        if done % config.log_every == 0 or done == config.steps:
            record = {"step": done, "train_loss": train_loss, "lr_multiplier": multiplier,
                      "val_bpb": validation_bits_per_byte(model, validation, device)}
            record.update(monitor.weight_metrics(model, optimizer))
            record.update(monitor.activation_metrics(model, probe))
            history.append(record)
            write_logs(out, history)
        if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps:
            save_checkpoint(out / CHECKPOINT, model, optimizer, done, history, config)
    if history and progress:
        print(f"{out}: {summary_line(history[-1])}")
    return history
