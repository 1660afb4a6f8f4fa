"""The optimizer a run config asks for, with per-module powers and coefficients (SPEC 4)."""

from __future__ import annotations

from ..optim import SpectralAdamW, SpectralMuon, SpectralSGD, param_groups_by_module

OPTIMIZERS = {"adamw": SpectralAdamW, "muon": SpectralMuon, "sgd": SpectralSGD}


def _first(*values):
    return next(v for v in values if v is not None)


def param_groups(model, config) -> list[dict]:
    """Role groups: attention and MLP matrices with their own ``p``/``lambda_p``; V optionally with
    an extra rule (SPEC 7.5); Q/K/V head-wise or full under Muon; vectors and embeddings without
    decay (through Muon's internal AdamW when the optimizer is Muon)."""
    common = {"lr": config.lr, "weight_decay": config.weight_decay, "convention": config.convention,
              "p0_mode": config.p0_mode, "stability": config.stability}

    def rule(p, lam):
        return {**common, "p": _first(p, config.p), "spectral_weight_decay": _first(lam, config.spectral_weight_decay)}

    overrides = {
        "attention": rule(config.p_attention, config.lambda_attention),
        "mlp": rule(config.p_mlp, config.lambda_mlp),
        "matrix": rule(None, None),
    }
    if config.p_v is not None or config.lambda_v is not None:
        overrides["v"] = rule(_first(config.p_v, config.p_attention, config.p),
                              _first(config.lambda_v, config.lambda_attention, config.spectral_weight_decay))
    if config.qkv_recipe:
        if config.optimizer != "muon" or len(config.qkv_recipe) != 3 or set(config.qkv_recipe) - {"H", "F"}:
            raise ValueError(f"qkv_recipe {config.qkv_recipe!r} needs optimizer='muon' and three letters H/F")
        for role, letter in zip("qkv", config.qkv_recipe):
            overrides.setdefault(role, dict(overrides["attention"]))
            overrides[role]["heads"] = config.n_heads if letter == "H" else None
    non_matrix = {"lr": config.vector_lr or config.lr, "weight_decay": 0.0}
    if config.optimizer == "muon":
        non_matrix["algorithm"] = "adamw"
    return param_groups_by_module(model, overrides, non_matrix=non_matrix)


def build_optimizer(model, config, process_group=None):
    """``process_group``: the group over which ``model``'s plain parameters are replicated (DDP's), so
    that the spectral work is split over its ranks; FSDP2's sharded parameters carry their own."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {config.optimizer!r}")
    options = {"process_group": process_group}
    if config.optimizer == "muon":
        on_gpu = next(model.parameters()).device.type == "cuda"
        options["precision"] = config.muon_precision or ("bf16" if on_gpu else "fp32")
    return OPTIMIZERS[config.optimizer](param_groups(model, config), lr=config.lr, **options)
