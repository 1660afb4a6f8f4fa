"""Sequential grids of runs and their summary table (SPEC 7.4-7.6).

A grid is ``p`` x coefficient (every matrix decays with ``lambda_p S_p``), or a list of named recipes
x coefficient, optionally x peak lr. Each run trains into ``OUT/<name>``; the summary is written as
``summary.md``, ``summary.csv`` and ``summary.json`` and printed.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from .config import TrainConfig
from .loop import train


def _recipe(name: str, lam: float) -> dict:
    """SPEC 7.5 (head-wise vs full V under Muon, ordinary WD 0.1) and 7.6 (module-wise powers,
    independent convention, no ordinary WD) as config overrides at coefficient ``lam``."""
    muon_wd = {"optimizer": "muon", "weight_decay": 0.1, "convention": "decoupled"}
    independent = {"optimizer": "muon", "weight_decay": 0.0, "convention": "independent"}
    recipes = {
        "HHH": {**muon_wd, "qkv_recipe": "HHH"},
        "HHF": {**muon_wd, "qkv_recipe": "HHF"},
        "HHF+p2V": {**muon_wd, "qkv_recipe": "HHF", "p_v": 2, "lambda_v": lam},
        "p1": {**independent, "p": 1, "spectral_weight_decay": lam},
        "pA0pM2": {**independent, "p_attention": 0, "p_mlp": 2, "lambda_attention": lam, "lambda_mlp": lam},
    }
    if name not in recipes:
        raise ValueError(f"unknown recipe {name!r}; choose from {sorted(recipes)}")
    return recipes[name]


RECIPES = ("HHH", "HHF", "HHF+p2V", "p1", "pA0pM2")


def grid(base: TrainConfig, out: Path, *, powers=(), coefficients=(0.0,), recipes=(), lrs=()) -> list[TrainConfig]:
    configs = []
    for lr in lrs or (base.lr,):
        lr_tag = f"_lr{lr:g}" if lrs else ""
        for lam in coefficients:
            if recipes:
                for name in recipes:
                    overrides = _recipe(name, lam)
                    configs.append(dataclasses.replace(base, lr=lr, **overrides, out_dir=str(out / f"{name}_lam{lam:g}{lr_tag}"),
                                                       notes={"recipe": name, "coefficient": lam}))
            else:
                for p in powers:
                    configs.append(dataclasses.replace(base, lr=lr, p=p, spectral_weight_decay=lam,
                                                       out_dir=str(out / f"p{p}_lam{lam:g}{lr_tag}"),
                                                       notes={"p": p, "coefficient": lam}))
    return configs


SUMMARY_COLUMNS = {
    "val_bpb": "val bits/byte",
    "mlp_expand/stable_rank": "MLP expand SR",
    "mlp_project/stable_rank": "MLP project SR",
    "qk/stable_rank": "QK SR",
    "attention/entropy": "attn entropy",
    "attention/max_probability": "attn max p",
    "mlp_expand/effective_rank": "MLP expand eRank",
    "v/activation_effective_rank": "V act. eRank",
    "v/cross_head_cka": "cross-head CKA",
    "mlp_expand/frobenius_norm": "MLP expand ||W||_F",
}


def summarise(configs, histories) -> list[dict]:
    rows = []
    for config, history in zip(configs, histories):
        row = {"run": Path(config.out_dir).name, **config.notes, "lr": config.lr}
        row.update({key: history[-1][key] for key in SUMMARY_COLUMNS})
        rows.append(row)
    return rows


def markdown_table(rows) -> str:
    keys = list(rows[0])
    header = [SUMMARY_COLUMNS.get(k, k) for k in keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return "\n".join(lines)


def write_summary(rows, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(out / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return table


def run_sweep(base: TrainConfig, out: Path, **grid_options) -> list[dict]:
    configs = grid(base, out, **grid_options)
    histories = [train(config) for config in configs]
    rows = summarise(configs, histories)
    print(write_summary(rows, out))
    return rows
