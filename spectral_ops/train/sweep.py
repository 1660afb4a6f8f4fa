"""Sequential grids of runs and their summary table (SPEC 7.4-7.6).

A grid is ``p`` x coefficient (every matrix decays with ``lambda_p S_p``), or a list of named recipes,
optionally x peak lr. The SPEC 7.5 recipes take the coefficient ``lambda_V`` (only ``HHF+p2V`` uses
it); the SPEC 7.6 module-wise recipes take ``lambda_A`` x ``lambda_M``, two separate axes. Each run
trains into ``OUT/<name>``; the summary is written as ``summary.md``, ``summary.csv`` and
``summary.json`` and printed. A grid over several recipes also writes ``matched_loss.{md,json}``:
the closest-loss pair across recipes, side by side (SPEC 7.6).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np

from ..reporting import markdown_table, with_machine
from .config import TrainConfig
from .loop import train, validation_key

# SPEC 7.6: alpha in {8e-4, 2.529822e-3, 8e-3} and lambda_A, lambda_M in {8e-5, 2.529822e-4, 8e-4}. The
# middle values are the geometric midpoints sqrt(8e-4 * 8e-3) and sqrt(8e-5 * 8e-4), which the SPEC
# prints to 7 digits: computed here, not pasted.
MODULE_WISE_LRS = tuple(np.geomspace(8e-4, 8e-3, 3).tolist())
MODULE_WISE_COEFFICIENTS = tuple(np.geomspace(8e-5, 8e-4, 3).tolist())
MODULE_WISE_STEPS = 7268
# SPEC 7.6 recipes: (p_A, p_M) under Muon, independent convention, no ordinary WD. p = 1 "spectral"
# decay is the ordinary decay (S_1(W) = W), here with separate attention and MLP coefficients.
MODULE_WISE_POWERS = {"p1": (1, 1), "pA0pM2": (0, 2)}

_MUON_WD = {"optimizer": "muon", "weight_decay": 0.1, "convention": "decoupled"}
# SPEC 7.5 recipes under Muon with ordinary WD 0.1, lr-coupled; only HHF+p2V uses lambda_V.
V_RECIPES = {
    "HHH": {**_MUON_WD, "qkv_recipe": "HHH"},
    "HHF": {**_MUON_WD, "qkv_recipe": "HHF"},
    "HHF+p2V": {**_MUON_WD, "qkv_recipe": "HHF", "p_v": 2},
}
RECIPES = (*V_RECIPES, *MODULE_WISE_POWERS)

# Sweep defaults that reproduce a SPEC 7 protocol: grid axes, and config fields (under the config
# file and the flags). Coefficient response (7.4): p in {0, 1, 2, 4} at the fixed lambda = 0.01 and
# at the sweep's ends 0.003 and 0.03 (the SPEC names no points in between).
PROTOCOLS = {
    "coefficient-response": {"grid": {"powers": (0, 1, 2, 4), "coefficients": (0.003, 0.01, 0.03)}, "config": {}},
    "module-wise": {"grid": {"recipes": tuple(MODULE_WISE_POWERS), "lrs": MODULE_WISE_LRS,
                             "attention_coefficients": MODULE_WISE_COEFFICIENTS,
                             "mlp_coefficients": MODULE_WISE_COEFFICIENTS},
                    "config": {"steps": MODULE_WISE_STEPS}},
}


def module_wise_recipe(name: str, lambda_attention: float, lambda_mlp: float) -> dict:
    """SPEC 7.6 recipe ``name`` as config overrides."""
    p_attention, p_mlp = MODULE_WISE_POWERS[name]
    return {"optimizer": "muon", "weight_decay": 0.0, "convention": "independent", "p_attention": p_attention,
            "p_mlp": p_mlp, "lambda_attention": lambda_attention, "lambda_mlp": lambda_mlp}


def _recipe_points(name: str, coefficients, attention_coefficients, mlp_coefficients):
    """(run name, notes, config overrides) of each grid point of one recipe."""
    if name in MODULE_WISE_POWERS:
        for lam_a, lam_m in itertools.product(attention_coefficients, mlp_coefficients):
            yield (f"{name}_lamA{lam_a:g}_lamM{lam_m:g}", {"recipe": name, "lambda_A": lam_a, "lambda_M": lam_m},
                   module_wise_recipe(name, lam_a, lam_m))
    elif name not in V_RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {list(RECIPES)}")
    elif "p_v" in V_RECIPES[name]:
        for lam in coefficients:
            yield f"{name}_lam{lam:g}", {"recipe": name, "lambda_V": lam}, {**V_RECIPES[name], "lambda_v": lam}
    else:  # lambda_V does not enter: one run, not one per coefficient
        yield name, {"recipe": name}, V_RECIPES[name]


# The grid's axes where neither the caller nor a protocol sets them (the CLI's defaults too).
GRID_DEFAULTS = {"powers": (0, 1, 2, 4), "coefficients": (0.01,), "recipes": (), "lrs": (),
                 "attention_coefficients": MODULE_WISE_COEFFICIENTS, "mlp_coefficients": MODULE_WISE_COEFFICIENTS}


def grid(base: TrainConfig, out: Path, *, powers=GRID_DEFAULTS["powers"], coefficients=GRID_DEFAULTS["coefficients"],
         recipes=GRID_DEFAULTS["recipes"], lrs=GRID_DEFAULTS["lrs"],
         attention_coefficients=GRID_DEFAULTS["attention_coefficients"],
         mlp_coefficients=GRID_DEFAULTS["mlp_coefficients"]) -> list[TrainConfig]:
    if recipes:
        points = [point for name in recipes
                  for point in _recipe_points(name, coefficients, attention_coefficients, mlp_coefficients)]
    else:
        points = [(f"p{p}_lam{lam:g}", {"p": p, "coefficient": lam}, {"p": p, "spectral_weight_decay": lam})
                  for p in powers for lam in coefficients]
    configs = []
    for lr in lrs or (base.lr,):
        lr_tag = f"_lr{lr:g}" if lrs else ""
        for name, notes, overrides in points:
            configs.append(dataclasses.replace(base, lr=lr, **overrides, out_dir=str(out / f"{name}{lr_tag}"),
                                               notes=notes))
    return configs


# Every column a summary may show: the validation loss comes in nats per token or bits per byte.
COLUMN_NAMES = {
    "val_nats_per_token": "val nats/token",
    "val_bpb": "val bits/byte",
    "mlp_gate/stable_rank": "MLP gate SR",
    "mlp_up/stable_rank": "MLP up SR",
    "mlp_down/stable_rank": "MLP down SR",
    "qk/stable_rank": "QK SR",
    "attention/entropy": "attn entropy",
    "attention/max_probability": "attn max p",
    "mlp_gate/effective_rank": "MLP gate eRank",
    "mlp_up/effective_rank": "MLP up eRank",
    "v/activation_effective_rank": "V act. eRank",
    "v/cross_head_cka": "cross-head CKA",
    "mlp_up/frobenius_norm": "MLP up ||W||_F",
}


def summarise(configs, histories) -> list[dict]:
    rows = []
    for config, history in zip(configs, histories):
        row = {"run": Path(config.out_dir).name, **config.notes, "lr": config.lr}
        row.update({key: history[-1][key] for key in COLUMN_NAMES if key in history[-1]})
        rows.append(row)
    return rows


def _columns(rows) -> list[str]:
    """Every key of the rows, in first-seen order (recipes note different coefficients)."""
    return list(dict.fromkeys(key for row in rows for key in row))


def summary_table(rows) -> str:
    """The runs as a markdown table: a column per key any row has (blank where a row lacks it)."""
    keys = _columns(rows)
    return markdown_table([COLUMN_NAMES.get(k, k) for k in keys], [[row.get(k, "") for k in keys] for row in rows])


def closest_loss_pair(rows) -> tuple[dict, dict] | None:
    """The two runs of different recipes whose validation losses are closest (SPEC 7.6 compares
    their geometry); None when the rows hold fewer than two recipes."""
    loss = validation_key(rows[0])
    pairs = [(a, b) for a, b in itertools.combinations(rows, 2) if a.get("recipe") != b.get("recipe")]
    return min(pairs, key=lambda pair: abs(pair[0][loss] - pair[1][loss])) if pairs else None


def write_summary(rows, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    table = summary_table(rows)
    (out / "summary.md").write_text(with_machine(table))
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(out / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=_columns(rows))
        writer.writeheader()
        writer.writerows(rows)
    pair = closest_loss_pair(rows)
    if pair is None:
        return table
    loss = validation_key(rows[0])
    gap = abs(pair[0][loss] - pair[1][loss])
    matched = (f"# Matched loss\n\nThe closest-loss pair across recipes ({COLUMN_NAMES[loss]} {gap:.4g} apart), "
               f"its geometry side by side; `python -m spectral_ops.train report {out / pair[0]['run']} "
               f"{out / pair[1]['run']}` plots its spectra.\n\n{summary_table(list(pair))}\n")
    (out / "matched_loss.md").write_text(with_machine(matched))
    (out / "matched_loss.json").write_text(json.dumps({"loss_key": loss, "gap": gap, "runs": list(pair)},
                                                      indent=2) + "\n")
    return f"{table}\n\n{matched}"


def run_sweep(base: TrainConfig, out: Path, **grid_options) -> list[dict]:
    configs = grid(base, out, **grid_options)
    histories = [train(config) for config in configs]
    rows = summarise(configs, histories)
    print(write_summary(rows, out))
    return rows
