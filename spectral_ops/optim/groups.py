"""Parameter groups by module role, the SPEC 4 recipes, and the width-transfer rule.

Roles are recognised from parameter names by regular expressions (override any of them):
``q``, ``k``, ``v``, ``o`` (attention projections), ``mlp_in``, ``mlp_out`` (MLP matrices),
``embedding``, ``head`` (output layer), other matrices ``matrix``, and everything else ``vector``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from .._checks import check_choice
from ..decay import Band
from ..decay_options import CONVENTIONS
from ..matrix_views import matrix_view_of

ROLE_PATTERNS = {
    "q": r"(^|\.)(q_proj|wq|query|to_q|q)\.weight$",
    "k": r"(^|\.)(k_proj|wk|key|to_k|k)\.weight$",
    "v": r"(^|\.)(v_proj|wv|value|to_v|v)\.weight$",
    "o": r"(^|\.)(o_proj|out_proj|wo|to_out|proj|o)\.weight$",
    "mlp_in": r"(^|\.)(gate_proj|up_proj|w1|w3|fc1|c_fc|fc_in|expand)\.weight$",
    "mlp_out": r"(^|\.)(down_proj|w2|fc2|c_proj|fc_out|project)\.weight$",
    "embedding": r"(^|\.)(embed\w*|wte|wpe|tok_embeddings|token_embedding)\.weight$",
    "head": r"(^|\.)(lm_head|head|output)\.weight$",
}
ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_ROLES = ("mlp_in", "mlp_out")
# Parameters that Muon does not update and the width rule treats as vector-like.
NON_MATRIX_ROLES = ("embedding", "head", "vector")


def parameter_role(name: str, param: torch.Tensor, patterns=None) -> str:
    """The role of one named parameter (first matching pattern; 1-D parameters are vectors)."""
    if param.ndim < 2:
        return "vector"
    for role, pattern in {**ROLE_PATTERNS, **(patterns or {})}.items():
        if re.search(pattern, name):
            return role
    return "matrix"


def param_groups_by_module(model: torch.nn.Module, overrides=None, *, patterns=None,
                           non_matrix=None) -> list[dict]:
    """One parameter group per role present in ``model`` (and per ``matrix_view`` within a role), each
    tagged with ``"role"`` and holding torch's ``"param_names"`` (so that messages name a parameter by
    its module path). Parameters of more than two dimensions get the group key ``matrix_view`` from
    their module (:func:`matrix_view_of`): a convolution's filters ``"flatten"``, other stacks ``"batch"``.

    ``overrides`` maps a role (or ``"attention"`` / ``"mlp"`` for all of theirs) to group options,
    e.g. from :func:`module_wise_powers` or :func:`full_v_extra_decay`. Non-matrix roles get the
    ``non_matrix`` options, by default ``{"algorithm": "adamw", "weight_decay": 0.0}``: SpectralMuon's
    usual set-up (the other optimizers have no ``algorithm`` key; pass ``non_matrix={"weight_decay": 0.0}``).
    """
    overrides = overrides or {}
    known = {*ROLE_PATTERNS, *(patterns or {}), "matrix", "vector", "attention", "mlp"}
    unknown = sorted(set(overrides) - known)
    if unknown:  # a typo would otherwise leave its options silently unused
        raise ValueError(f"overrides name unknown roles {unknown}; known: {sorted(known)}")
    non_matrix = {"algorithm": "adamw", "weight_decay": 0.0} if non_matrix is None else non_matrix
    by_role: dict[tuple, list] = {}
    seen = set()  # a parameter shared by two modules (tied weights) is listed once, as named_parameters does
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                name = f"{module_name}.{param_name}" if module_name else param_name
                key = (parameter_role(name, param, patterns), matrix_view_of(module, param))
                by_role.setdefault(key, []).append((name, param))
    groups = []
    for (role, matrix_view), named in by_role.items():
        options = dict(non_matrix) if role in NON_MATRIX_ROLES else {}
        if matrix_view is not None:
            options["matrix_view"] = matrix_view
        family = "attention" if role in ATTENTION_ROLES else "mlp" if role in MLP_ROLES else None
        options.update(overrides.get(family, {}) if family else {})
        options.update(overrides.get(role, {}))
        # param_names (torch's key) lets the optimizer name a parameter by its module path.
        groups.append({"params": [param for _, param in named], "param_names": [name for name, _ in named],
                       "role": role, **options})
    return groups


def module_wise_powers(p_attention=0, p_mlp=2, lambda_attention=1e-4, lambda_mlp=1e-4) -> dict:
    """SPEC 4 recipe: attention ``p_A = 0``, MLP ``p_M = 2``, independent convention, no ordinary WD."""
    common = {"convention": "independent", "weight_decay": 0.0}
    return {
        "attention": {**common, "p": p_attention, "spectral_weight_decay": lambda_attention},
        "mlp": {**common, "p": p_mlp, "spectral_weight_decay": lambda_mlp},
    }


def full_v_extra_decay(lambda_v, heads, ordinary_weight_decay=0.1) -> dict:
    """SPEC 4 recipe ``HHF + p=2``: head-wise Q/K, full-matrix V with ``lambda_v S_2(W_V)`` on top of
    ordinary WD 0.1, everything lr-coupled."""
    common = {"convention": "decoupled", "weight_decay": ordinary_weight_decay}
    return {
        "q": {**common, "heads": heads},
        "k": {**common, "heads": heads},
        "v": {**common, "heads": None, "p": 2, "spectral_weight_decay": lambda_v},
        "o": common,
        "mlp": common,
    }


def width_decay_factor(base_width: int, width: int, convention: str = "decoupled") -> float:
    """The factor on every decay coefficient (``lambda_1``, ``lambda_p``, a band's ``spectral_weight_decay_bot``)
    of a matrix-like group moved from ``base_width`` to ``width`` with ``lr ~ 1/d``.

    SPEC 4 keeps the steady state ``s_1 ~ sqrt(lr / lambda_1) d^0.75`` of AdamW fixed across widths with
    ``lr ~ 1/d`` and ``lambda_1 ~ sqrt(d)`` under the ``"decoupled"`` convention, whose per-step shrink
    is ``eta_t lr lambda_1 ~ d^-1/2``. Under ``"independent"`` the shrink is ``eta_t lambda_1``, with no
    lr in it: the same steady state, and the same per-step shrink, need ``lambda_1 ~ d^-1/2``. (Scaling
    it by ``sqrt(d)`` there would make the shrink grow like ``sqrt(d)`` and ``s_1`` fall like ``d^-1/2``.)

    ``lambda_p`` takes the same factor for every ``p``. The balance heuristic ``s* ~ (lr / lambda_p)^(1/(p+1))``
    (SPEC 4) is the energy balance of a random-walk update (``lr^2 ||D||_F^2`` in per step) against the
    decay (``lr lambda_p sum_i s_i^(p+1)`` out); its width factor, calibrated by ``p = 1``, is
    ``s*^(p+1) ~ (lr / lambda_p) d^1.5``, which stays constant across widths iff ``lambda_p ~ lr d^1.5 ~ sqrt(d)``.
    Put otherwise: the rule keeps ``s = Theta(1)`` across widths, and there ``lambda_p S_p`` shrinks each
    mode like an ordinary decay with coefficient ``lambda_p s^(p-1)``, which transfers like ``lambda_1``
    exactly when ``lambda_p`` does. This is a heuristic: ``python -m spectral_ops.experiments
    width-transfer`` measures it for ``p = 3``.
    """
    if base_width <= 0 or width <= 0:
        raise ValueError(f"widths must be positive, got base_width={base_width}, width={width}")
    check_choice(convention, "convention", CONVENTIONS)
    ratio = width / base_width
    return math.sqrt(ratio) if convention == "decoupled" else 1.0 / math.sqrt(ratio)


def width_scaled_hyperparameters(lr: float, weight_decay: float, base_width: int, width: int, kind: str = "matrix",
                                 convention: str = "decoupled"):
    """``(lr, weight_decay)`` transferred from ``base_width`` to ``width`` under muP-style scaling.

    Matrix-like parameters: ``lr ~ 1/d``, and the decay coefficient times :func:`width_decay_factor`:
    ``sqrt(d)`` under ``convention="decoupled"``, ``d^-1/2`` under ``"independent"`` (either way the
    per-step shrink goes as ``d^-1/2``). Vector-like parameters (gains, biases): ``lr = Theta(1)`` and
    no weight decay.
    """
    if kind == "matrix":
        return lr * base_width / width, weight_decay * width_decay_factor(base_width, width, convention)
    if kind == "vector":
        return lr, 0.0
    raise ValueError(f"kind must be 'matrix' or 'vector', got {kind!r}")


def scaled_decay(group: dict, factor: float) -> None:
    """Multiply every decay coefficient ``group`` sets by ``factor``, in place."""
    for key in ("weight_decay", "spectral_weight_decay"):
        if key in group:
            group[key] = group[key] * factor
    if group.get("band") is not None:
        band = Band.coerce(group["band"])
        group["band"] = dataclasses.replace(band, spectral_weight_decay_bot=band.spectral_weight_decay_bot * factor)


def width_transfer(groups, base_width: int, width: int, *, convention: str = "decoupled") -> list[dict]:
    """SPEC 4 width rule, from ``base_width`` to ``width``; returns new groups.

    Matrix-like groups get ``lr * base/width`` (and so do their ``peak_lr`` and a scheduler's
    ``initial_lr``, which set ``eta_t = lr / peak_lr`` under the independent convention), and every
    decay coefficient they set (``weight_decay``, ``spectral_weight_decay``, a band's
    ``spectral_weight_decay_bot``) times :func:`width_decay_factor` of their convention: ``sqrt(width/base)``
    when decoupled, ``sqrt(base/width)`` when independent, the same for every ``p`` (see there why).
    ``convention`` is the one of groups that do not set theirs (the optimizer's default). A band's
    ``tau`` is a singular value, which the rule keeps Theta(1), so it stays.

    Vector-like groups (roles embedding, head, vector, or ``algorithm="adamw"``) keep their lr and
    get no decay. A matrix group must set ``lr`` and ``weight_decay``: the optimizer's defaults would
    apply to it unscaled. A coefficient left to the optimizer's defaults is not scaled.
    """
    width_decay_factor(base_width, width, convention)  # checks the widths and the default convention
    ratio = base_width / width
    scaled = []
    for group in groups:
        group = dict(group)
        if group.get("role") in NON_MATRIX_ROLES or group.get("algorithm") == "adamw":
            group.setdefault("weight_decay", 0.0)  # 0 rather than the optimizer's default
            group.setdefault("spectral_weight_decay", 0.0)
            scaled_decay(group, 0.0)
        else:
            if "lr" not in group or "weight_decay" not in group:
                raise ValueError(f"matrix group {group.get('role', '?')!r} needs explicit lr and weight_decay to scale")
            for key in ("lr", "peak_lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * ratio
            scaled_decay(group, width_decay_factor(base_width, width, group.get("convention", convention)))
        scaled.append(group)
    return scaled
