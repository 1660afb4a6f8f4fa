"""Run configuration: presets, and overrides from a JSON file or the command line.

Every field can be overridden: ``--config run.json`` sets any subset of fields, then
``--FIELD VALUE`` flags (``--d-model 256``) win over it. ``tiny`` and ``small`` are CPU demos;
``paper8`` and ``paper12`` are the protocols of SPEC 7.4 and 7.5 (see ``PROTOCOL_PRESETS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path


@dataclass
class TrainConfig:
    """Everything a run depends on; FIELD_HELP below says what each field means."""

    preset: str = "tiny"
    # model
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    mlp_hidden: int = 0
    seq_len: int = 128
    tied_embeddings: bool = False
    # data
    data: str | None = None
    vocab_size: int = 0
    allow_stand_in_data: bool = False
    batch_size: int = 16
    grad_accum: int = 1
    val_batches: int = 8
    # optimisation
    optimizer: str = "adamw"
    lr: float = 3e-3
    vector_lr: float = 0.0
    steps: int = 300
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    convention: str = "decoupled"
    p: int = 1
    spectral_weight_decay: float = 0.0
    p_attention: int | None = None
    p_mlp: int | None = None
    lambda_attention: float | None = None
    lambda_mlp: float | None = None
    qkv_recipe: str = ""
    p_v: int | None = None
    lambda_v: float | None = None
    p0_mode: str = "explicit"
    stability: str = "clamp"
    qk_cap: float = 0.0
    qk_clip: float = 0.0
    # Muon's orthogonalisation; None: bf16 on a GPU (torch.optim.Muon's), fp32 on a CPU, where bf16
    # matmuls without native bf16 arithmetic are ~100x slower than fp32.
    muon_precision: str | None = None
    # logging and checkpoints
    log_every: int = 50
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_skipped_steps: int = 3
    out_dir: str = "runs/run"
    seed: int = 0
    device: str = "auto"
    # several processes, one per GPU, started by torchrun: FSDP2 shards the model, DDP replicates it,
    # tensor parallelism (under FSDP2) splits each block over groups of tp processes
    fsdp: bool = False
    ddp: bool = False
    tp: int = 1
    notes: dict = field(default_factory=dict)

    def model_config(self, vocab_size: int = 0):
        """The model's shape; ``vocab_size`` is the corpus's (the loop passes it), else this config's,
        else bytes'."""
        from .data import BYTE_VOCAB
        from .model import ModelConfig

        return ModelConfig(vocab_size=vocab_size or self.vocab_size or BYTE_VOCAB, n_layers=self.n_layers,
                           d_model=self.d_model, n_heads=self.n_heads, mlp_hidden=self.mlp_hidden,
                           max_seq_len=self.seq_len,
                           tied_embeddings=self.tied_embeddings)


def evaluation_steps(steps: int, log_every: int) -> list[int]:
    """The steps after which the loop validates and logs: every ``log_every``-th, and the last."""
    return sorted({*range(log_every, steps + 1, log_every), steps})


def log_every_for(steps: int, evaluations: int) -> int:
    """The cadence that validates exactly ``evaluations`` times in ``steps`` (the last step included)."""
    log_every = math.ceil(steps / evaluations)
    if len(evaluation_steps(steps, log_every)) != evaluations:
        raise ValueError(f"no cadence validates exactly {evaluations} times in {steps} steps")
    return log_every


def batches_for(tokens: int, batch_size: int, seq_len: int) -> int:
    """Micro-batches of ``batch_size`` sequences of ``seq_len`` holding exactly ``tokens`` tokens."""
    batches, left = divmod(tokens, batch_size * seq_len)
    if left:
        raise ValueError(f"{tokens} tokens are not a whole number of {batch_size} x {seq_len} batches")
    return batches


# SPEC 7.5, in the units it states them: 524,288 tokens per step, validation on 10.49M tokens
# (10,485,760 = 20 such steps, modded-nanogpt's val_tokens), 164 validations over the 16,204 steps.
PAPER12_SEQ_LEN, PAPER12_BATCH_SIZE = 4096, 16
PAPER12_STEP_TOKENS = 524_288
PAPER12_VALIDATION_TOKENS = 10_485_760
PAPER12_VALIDATIONS = 164
PAPER12_STEPS = 16_204

PRESETS = {
    # A CPU demo: a couple of minutes on 2 cores.
    "tiny": dict(n_layers=2, d_model=128, n_heads=4, seq_len=128, batch_size=16, steps=300,
                 warmup_steps=30, lr=3e-3, log_every=50),
    # A CPU sweep point: ~10 minutes per run on 2 cores.
    "small": dict(n_layers=4, d_model=192, n_heads=3, seq_len=128, batch_size=16, steps=800,
                  warmup_steps=80, lr=3e-3, log_every=100),
    # SPEC 7.4 (coefficient response): 8 layers, width 512, and SPEC 1.5's base rule alone: every
    # matrix decays by lambda_p S_p(W) with the fixed lambda_p = 0.01 scaled by the schedule eta_t only
    # (the independent convention, the rule as 1.5 writes it), no ordinary decay under it. p = 1 here;
    # the sweep sets p in {0, 1, 2, 4}. SPEC 7.4 does not state the optimizer, lr, schedule, sequence,
    # batch or steps: they are 7.5's (Muon, 0.005, 256 warm-up steps, cosine to 0.1x, no clip, seed 42).
    "paper8": dict(n_layers=8, d_model=512, n_heads=4, seq_len=1024, batch_size=64, steps=5000,
                   warmup_steps=256, min_lr_ratio=0.1, optimizer="muon", lr=0.005, vector_lr=0.005,
                   weight_decay=0.0, convention="independent", p=1, spectral_weight_decay=0.01,
                   grad_clip=0.0, seed=42, log_every=250, checkpoint_every=1000, val_batches=16),
    # SPEC 7.5 (head-wise vs full V): 12 layers, width 768, head dim 128, sequence 4096, 524,288 tokens
    # per step, 16,204 steps, peak lr 0.005, 256 warm-up steps, cosine to 0.1x, ordinary WD 0.1 lr-coupled,
    # Muon (scale 0.2 sqrt(max(d_in, d_out))), the HHH baseline (the sweep's recipes set HHF, HHF + p=2 V).
    "paper12": dict(n_layers=12, d_model=768, n_heads=768 // 128, seq_len=PAPER12_SEQ_LEN,
                    batch_size=PAPER12_BATCH_SIZE,
                    grad_accum=PAPER12_STEP_TOKENS // (PAPER12_BATCH_SIZE * PAPER12_SEQ_LEN),
                    steps=PAPER12_STEPS, warmup_steps=256, min_lr_ratio=0.1, optimizer="muon", lr=0.005,
                    vector_lr=0.005, weight_decay=0.1, convention="decoupled", qkv_recipe="HHH", grad_clip=0.0,
                    seed=42, val_batches=batches_for(PAPER12_VALIDATION_TOKENS, PAPER12_BATCH_SIZE, PAPER12_SEQ_LEN),
                    log_every=log_every_for(PAPER12_STEPS, PAPER12_VALIDATIONS), checkpoint_every=2000),
}
# Presets that reproduce a SPEC 7 protocol: they refuse the default byte corpus, a stand-in for the
# protocol's data, unless allow_stand_in_data says to use it anyway.
PROTOCOL_PRESETS = {"paper8": "SPEC 7.4", "paper12": "SPEC 7.5"}


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return TrainConfig(preset=name, **{**PRESETS[name], **overrides})


def _parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


# The --help line of each config flag.
FIELD_HELP = {
    "n_layers": "Transformer blocks",
    "d_model": "model width",
    "n_heads": "attention heads",
    "mlp_hidden": "SwiGLU hidden width (0: 8/3 d_model rounded up to a multiple of 64)",
    "seq_len": "tokens per training sequence",
    "tied_embeddings": "share the input embedding and the output head",
    "data": "a text file or folder (bytes), or a modded-nanogpt .bin token shard or folder of them ('val' in "
            "the name: validation) to train on (none: the Python standard library's source)",
    "vocab_size": "vocabulary of token shards (0: GPT-2's 50257; their header has none); bytes use 256",
    "allow_stand_in_data": "let paper8/paper12 run on the default byte corpus, a stand-in for their protocol's data",
    "batch_size": "sequences per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "val_batches": "micro-batches per validation",
    "optimizer": "adamw, muon or sgd",
    "lr": "peak lr of the matrices (and of everything under adamw/sgd)",
    "vector_lr": "peak lr of Muon's internal AdamW (embeddings, norms, head); 0: same as --lr",
    "steps": "optimizer steps",
    "warmup_steps": "linear warm-up steps before the cosine decay",
    "min_lr_ratio": "cosine floor, as a fraction of the peak lr",
    "grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "weight_decay": "ordinary weight decay lambda_1 on matrices",
    "convention": "decoupled (decay scaled by lr) or independent (by lr / peak lr)",
    "p": "spectral power of every matrix unless overridden below",
    "spectral_weight_decay": "spectral coefficient lambda_p",
    "p_attention": "spectral power of the attention matrices (SPEC 4 module-wise recipe)",
    "p_mlp": "spectral power of the MLP matrices (SPEC 4 module-wise recipe)",
    "lambda_attention": "lambda_p of the attention matrices",
    "lambda_mlp": "lambda_p of the MLP matrices",
    "qkv_recipe": "Muon: H (head-wise) or F (full) for Q, K and V, e.g. HHF",
    "p_v": "extra spectral power for V on top of the ordinary decay (SPEC 7.5)",
    "lambda_v": "lambda_p of that extra V rule",
    "p0_mode": "p = 0 as an explicit step or as exact soft-thresholding (prox)",
    "stability": "p > 1 stability guard: raise, warn, clamp or ignore. clamp, as the optimizers default to: an "
                 "unattended run should shrink a too-large step, not stop at it; each clamp is logged with its factor "
                 "(spectral_ops.decay logger) and counted in optimizer.clamped",
    "qk_cap": "cap every attention head's s_max(W_q) s_max(W_k) at this after each step (spectral_ops.optim.QKCap: "
              "a data-free bound on the logits, docs/api.md); 0: no cap",
    "qk_clip": "Kimi K2's QK-Clip threshold tau on the attention logits (after the 1/sqrt(d_h) scale): after each "
               "step, a head whose largest logit in that step's forward exceeded tau has its W_q and W_k rows scaled "
               "by sqrt(tau / logit) (0: off; one process only)",
    "muon_precision": "Muon's orthogonalisation precision (none: bf16 on a GPU, fp32 on a CPU)",
    "log_every": "steps between validations, log lines and metrics (and the last step)",
    "checkpoint_every": "steps between checkpoints (0: only at the end)",
    "keep_checkpoints": "checkpoints kept (checkpoint.pt, checkpoint.1.pt, ...): --resume falls back to an "
                        "older one when the newest cannot be loaded",
    "max_skipped_steps": "stop after this many steps in a row in which the optimizer skipped an update with a "
                         "non-finite gradient (0: never stop; each skip is logged)",
    "out_dir": "run folder: config, metrics, checkpoint",
    "seed": "random seed",
    "device": "auto (cuda if available), cpu or cuda",
    "fsdp": "shard parameters, gradients and optimizer state over the processes torchrun starts (FSDP2's "
            "fully_shard, one unit per block); each process takes batch_size / processes rows of every batch",
    "ddp": "replicate the model on each process torchrun starts (DistributedDataParallel); the spectral work "
           "is split over the processes; each takes batch_size / processes rows of every batch",
    "tp": "with --fsdp: tensor parallelism over groups of this many processes, on a (processes / tp, tp) mesh "
          "(\"dp\", \"tp\"); each block's attention heads and MLP hidden units are split over a group, which takes "
          "the same batch_size / (processes / tp) rows of every batch; n_heads must be a multiple of it",
}

_PARSERS = {"int": int, "float": float, "str": str, "bool": _parse_bool}
CLI_FIELDS = [f for f in fields(TrainConfig) if f.name not in ("preset", "notes")]


def _parser_for(annotation: str):
    """``"int"`` -> int; ``"int | None"`` -> int, or None for the word "none"."""
    base, _, optional = annotation.partition(" | ")
    parse = _PARSERS[base]
    return (lambda text: None if text.lower() == "none" else parse(text)) if optional else parse


def _field_help(f) -> str:
    """The field's --help line with its default under the default preset (tiny), and whether the
    other presets set it."""
    default = PRESETS["tiny"].get(f.name, f.default)
    by_preset = any(f.name in values for name, values in PRESETS.items() if name != "tiny")
    return f"{FIELD_HELP[f.name]} (default: {default!r}{'; other presets set their own' if by_preset else ''})"


# Second spellings of a field's flag. torchrun from torch 2.15 reads ``--p`` (anywhere on its command
# line, the script's arguments included) as an ambiguous abbreviation of its own ``--print-completion``
# and refuses the launch before the script runs: under torchrun, ``--power`` passes through.
FLAG_ALIASES = {"p": ("--power",)}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--preset``, ``--config FILE.json`` and one ``--field-name`` flag per config field (a
    boolean one alone means true), with the spellings of :data:`FLAG_ALIASES`."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=argparse.SUPPRESS,
                        help="starting point (default: tiny)")
    parser.add_argument("--config", type=Path, help="JSON file with any subset of the fields")
    for f in CLI_FIELDS:
        flag = {"nargs": "?", "const": True} if f.type == "bool" else {}
        parser.add_argument("--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ()), dest=f.name,
                            type=_parser_for(f.type),
                            default=argparse.SUPPRESS, metavar=f.type.split(" ")[0].upper(),
                            help=_field_help(f), **flag)


def read_config_file(path: Path, fix: str) -> dict:
    """The fields in the JSON file ``path``; one that does not hold a JSON object (torn, edited) is refused
    with an error that names it and says ``fix``."""
    try:
        values = json.loads(path.read_text())
    except ValueError as error:  # not JSON, or not text (UnicodeDecodeError)
        raise ValueError(f"{path} is unreadable ({type(error).__name__}: {error}): {fix}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} holds a JSON {type(values).__name__}, not an object of config fields: {fix}")
    return values


def config_from_arguments(args: argparse.Namespace, defaults: dict | None = None) -> TrainConfig:
    """Preset, then ``defaults`` (a sweep protocol's), then the JSON file, then the command-line flags."""
    overrides = read_config_file(args.config, "correct it") if getattr(args, "config", None) else {}
    unknown = set(overrides) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise ValueError(f"{args.config}: unknown config fields {sorted(unknown)}")
    overrides.update({f.name: getattr(args, f.name) for f in CLI_FIELDS if hasattr(args, f.name)})
    name = getattr(args, "preset", None) or overrides.pop("preset", "tiny")
    overrides.pop("preset", None)
    return preset(name, **{**(defaults or {}), **overrides})


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


# The fields that say where a run is kept and how it is logged, checkpointed and guarded, never what it
# computes: they leave every step's weights and losses as they are (test_train.py,
# test_a_moved_run_folder_resumes_with_other_run_keeping_fields_to_the_same_numbers). A resume compares every
# other field, with the run's config.json and with its checkpoint's, so a moved or copied run folder resumes as
# it is. device, muon_precision and the parallel layout (fsdp, ddp, tp) are compared: they change the arithmetic
# (bf16 autocast on a GPU, the orthogonalisation's precision, the order of the sums over processes).
RUN_KEEPING_FIELDS = frozenset({"out_dir", "log_every", "checkpoint_every", "keep_checkpoints", "max_skipped_steps",
                                "allow_stand_in_data"})


class NotSaved:
    """A field a saved config lacks, as a refusal shows it: the field was added since that run, which used
    its default, or the file was edited. Never the default itself, which the file does not say."""

    def __init__(self, default):
        self.default = default

    def __repr__(self) -> str:
        return f"missing from the saved config (its default is {self.default!r})"


def computed_differences(saved: dict, config: TrainConfig) -> dict[str, tuple]:
    """``{field: (saved value, config's value)}`` for each field outside :data:`RUN_KEEPING_FIELDS` in which a
    saved config (a run's config.json, a checkpoint's) differs from ``config``. A field the saved config lacks
    was added since (that run used its default: the same run when ``config`` has it too) or edited out; where
    ``config`` differs from the default, its saved value is a :class:`NotSaved`, named as missing."""
    defaults, now = to_dict(TrainConfig()), to_dict(config)
    differences = {}
    for key in sorted((set(saved) | set(now)) - RUN_KEEPING_FIELDS):
        old = saved.get(key, defaults.get(key))
        if old != now.get(key):
            differences[key] = (saved[key] if key in saved else NotSaved(old), now.get(key))
    return differences
