"""Spectral metrics (SPEC 3): what a decay rule did to the weights and to the activations.

Matrix metrics take one ``(m, n)`` tensor or a batch ``(..., m, n)`` and return float64 tensors of
shape ``(...)`` (0-d for one matrix). Spectra are ``torch.linalg.svdvals`` in float64, whatever the
weight's dtype. With ``q = s / sum s`` and ``q2 = s^2 / sum s^2``, ``H(q) = -sum q log q`` and
``0 log 0 = 0``. A zero matrix has rank 0 in every sense: its stable rank, effective ranks,
entropy and top-k energy are all 0.

Model-level helpers: a per-module table of the matrix metrics, the QK-product stable rank per head,
attention entropy and maximum probability from attention probabilities, and the V activation
effective rank and cross-head linear CKA from V outputs captured with forward hooks, or from a
checkpoint's V weights applied to a reference model's V inputs (fixed inputs).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .linalg import compute_dtype


def singular_values(W: torch.Tensor) -> torch.Tensor:
    """Singular values of ``(..., m, n)`` in float64, descending, shape ``(..., min(m, n))``."""
    return torch.linalg.svdvals(W.to(torch.float64))


def default_rank_tolerance(shape, dtype: torch.dtype) -> float:
    """Relative tolerance below which a singular value counts as zero: ``max(m, n) * eps``.

    The round-off level of an SVD of the matrix, as ``torch.linalg.matrix_rank`` uses. ``eps`` is
    that of the precision the package computes the weight in (float32 for float16/bfloat16: their
    own eps times the size would declare every mode zero).
    """
    return max(shape[-2:]) * torch.finfo(compute_dtype(dtype)).eps


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0 (the zero-matrix convention)."""
    nonzero = denominator > 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, 1.0), 0.0)


def _distribution(weights: torch.Tensor) -> torch.Tensor:
    return _safe_ratio(weights, weights.sum(-1, keepdim=True))


def _entropy(weights: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(_distribution(weights)).sum(-1)


def _exp_entropy(weights: torch.Tensor) -> torch.Tensor:
    return torch.where(weights.sum(-1) > 0, torch.exp(_entropy(weights)), 0.0)


def spectrum_metrics(s: torch.Tensor, shape=None, dtype: torch.dtype = torch.float64, top_k: int = 8,
                     rtol: float | None = None) -> dict:
    """Every SPEC 3 matrix metric from a descending spectrum ``(..., r)`` (one SVD serves them all).

    ``shape`` is the matrix shape, for ``R = min(m, n)`` and the rank tolerance (default ``(r, r)``);
    ``dtype`` the matrix's dtype, for the default tolerance.
    """
    s = torch.as_tensor(s, dtype=torch.float64)
    shape = (s.shape[-1], s.shape[-1]) if shape is None else shape
    energy = s**2
    total_energy = energy.sum(-1)
    r = min(shape[-2:])
    tolerance = default_rank_tolerance(shape, dtype) if rtol is None else rtol
    return {
        "algebraic_rank": (s > tolerance * s[..., :1]).sum(-1),
        "stable_rank": _safe_ratio(total_energy, s[..., 0] ** 2),
        "effective_rank": _exp_entropy(s),
        "output_energy_rank": _exp_entropy(energy),
        "top_k_energy": _safe_ratio(energy[..., :top_k].sum(-1), total_energy),
        # R = min(m, n) counts zero modes too; with a single mode there is no spread to measure.
        "spectral_entropy": _entropy(s) / math.log(r) if r > 1 else torch.zeros_like(total_energy),
        "spectral_norm": s[..., 0],
        "frobenius_norm": total_energy.sqrt(),
    }


def _metric(W: torch.Tensor, name: str, *, top_k: int = 1, rtol=None) -> torch.Tensor:
    return spectrum_metrics(singular_values(W), W.shape, W.dtype, top_k, rtol)[name]


def algebraic_rank(W: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Number of singular values above ``rtol * s_1``; default :func:`default_rank_tolerance`."""
    return _metric(W, "algebraic_rank", rtol=rtol)


def stable_rank(W: torch.Tensor) -> torch.Tensor:
    """``||W||_F^2 / ||W||_2^2``: between 1 and the rank, scale-invariant."""
    return _metric(W, "stable_rank")


def effective_rank(W: torch.Tensor) -> torch.Tensor:
    """``exp H(s / sum s)`` (eRank)."""
    return _metric(W, "effective_rank")


def output_energy_rank(W: torch.Tensor) -> torch.Tensor:
    """``exp H(s^2 / sum s^2)``: the effective rank of the output covariance under white inputs."""
    return _metric(W, "output_energy_rank")


def top_k_energy(W: torch.Tensor, k: int) -> torch.Tensor:
    """Share of ``||W||_F^2`` in the ``k`` largest modes."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return _metric(W, "top_k_energy", top_k=k)


def spectral_entropy(W: torch.Tensor) -> torch.Tensor:
    """``H(s / sum s) / log min(m, n)``, in ``[0, 1]``; 1 for a flat full-rank spectrum."""
    return _metric(W, "spectral_entropy")


def spectral_norm(W: torch.Tensor) -> torch.Tensor:
    """``||W||_2 = s_1``."""
    return singular_values(W)[..., 0]


def frobenius_norm(W: torch.Tensor) -> torch.Tensor:
    """``||W||_F = sqrt(sum s^2)``, in float64."""
    return torch.linalg.matrix_norm(W.to(torch.float64))


def matrix_metrics(W: torch.Tensor, top_k: int = 8, rtol: float | None = None) -> dict:
    """Every SPEC 3 matrix metric of ``W`` from one SVD: a dict of float64 tensors of shape ``(...)``."""
    return spectrum_metrics(singular_values(W), W.shape, W.dtype, top_k, rtol)


# ---------------------------------------------------------------------------------------------
# Shape distance and effective learning rate
# ---------------------------------------------------------------------------------------------

def _spectra(layers, rtol):
    """One float64 spectrum per layer, with the relative tolerance below which a mode counts as zero."""
    if isinstance(layers, torch.Tensor):
        layers = [layers] if layers.dim() <= 2 else list(layers.reshape(-1, *layers.shape[-2:]))
    result = []
    for layer in layers:
        if layer.dim() == 1:
            s = torch.sort(layer.to(torch.float64), descending=True).values
            tolerance = default_rank_tolerance((s.numel(), s.numel()), torch.float64)
        else:
            s = singular_values(layer)
            tolerance = default_rank_tolerance(layer.shape, layer.dtype)
        result.append((s, tolerance if rtol is None else rtol))
    return result


def shape_distance(a, b, rtol: float | None = None) -> float:
    """``D_shape``: mean over layers and modes of ``|log10 r_i(a) - log10 r_i(b)|``, ``r = s / s_1``.

    ``a`` and ``b`` are matching lists of matrices or of spectra (1-D), or one batched tensor each.
    Each layer contributes the mean over its modes, then layers are averaged, so a large layer does
    not outweigh the others. Modes that are zero (below ``rtol`` of ``s_1``, default
    :func:`default_rank_tolerance`) in either spectrum have no logarithm and are left out, and so is
    a layer with no non-zero mode in common (e.g. one decayed to zero); NaN if no layer is left.
    """
    spectra_a, spectra_b = _spectra(a, rtol), _spectra(b, rtol)
    if len(spectra_a) != len(spectra_b) or not spectra_a:
        raise ValueError(f"need the same non-zero number of layers, got {len(spectra_a)} and {len(spectra_b)}")
    per_layer = []
    for (sa, tol_a), (sb, tol_b) in zip(spectra_a, spectra_b):
        if sa.shape != sb.shape:
            raise ValueError(f"layer spectra differ in length: {sa.numel()} vs {sb.numel()}")
        ra, rb = _safe_ratio(sa, sa[:1]), _safe_ratio(sb, sb[:1])
        kept = (ra > tol_a) & (rb > tol_b)
        if bool(kept.any()):
            per_layer.append((torch.log10(ra[kept]) - torch.log10(rb[kept])).abs().mean())
    return float(torch.stack(per_layer).mean()) if per_layer else math.nan


def stable_rank_change_percent(a, b) -> float:
    """Mean over layers of ``100 (SR(b_l) / SR(a_l) - 1)``: how much each layer's stable rank moved
    from ``a`` to ``b``, in percent (SPEC 7.4). ``a`` and ``b`` are matching lists of matrices."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"need the same non-zero number of layers, got {len(a)} and {len(b)}")
    ratios = [stable_rank(W_b) / stable_rank(W_a) for W_a, W_b in zip(a, b)]
    return float(100 * (torch.stack(ratios) - 1).mean())


@dataclass(frozen=True)
class EffectiveLR:
    """The SPEC 3 effective-lr proxy and, given the actual update, its split along and across ``W``.

    ``proxy = lr / ||W||_F``. ``tangential = ||dW_perp||_F / ||W||_F`` with ``dW_perp`` the part of the
    update orthogonal to ``W`` (Frobenius inner product): the angle the weight turns by, which is
    what a scale-invariant loss feels. ``radial = <dW, W> / ||W||_F^2``: the relative norm change.
    """

    proxy: torch.Tensor
    tangential: torch.Tensor | None = None
    radial: torch.Tensor | None = None


def effective_lr(W: torch.Tensor, lr: float, update: torch.Tensor | None = None) -> EffectiveLR:
    """Effective learning rate of ``W`` (``(..., m, n)``) at lr ``eta_t * alpha``; ``update`` is ``W_new - W``.

    A zero ``W`` has no direction to turn: its values are inf/NaN.
    """
    W64 = W.to(torch.float64)
    norm = torch.linalg.matrix_norm(W64)
    proxy = lr / norm
    if update is None:
        return EffectiveLR(proxy)
    update = update.to(torch.float64)
    radial = (update * W64).sum((-2, -1)) / norm**2
    perpendicular = update - radial[..., None, None] * W64
    return EffectiveLR(proxy, torch.linalg.matrix_norm(perpendicular) / norm, radial)


# ---------------------------------------------------------------------------------------------
# Model-level helpers
# ---------------------------------------------------------------------------------------------

def module_metrics_table(model: torch.nn.Module, top_k: int = 8) -> list[dict]:
    """One row per 2-D parameter of ``model``: its module name (``.weight`` dropped), shape and metrics."""
    rows = []
    for name, parameter in model.named_parameters():
        if parameter.dim() != 2:
            continue
        metrics = matrix_metrics(parameter.detach(), top_k=top_k)
        row = {"module": name.removesuffix(".weight"), "shape": "x".join(map(str, parameter.shape))}
        row.update({key: value.item() for key, value in metrics.items()})
        rows.append(row)
    return rows


def qk_stable_rank(W_Q: torch.Tensor, W_K: torch.Tensor, n_heads: int, n_kv_heads: int | None = None) -> torch.Tensor:
    """Stable rank of ``W_Q,h^T W_K,h`` for each head ``h``, shape ``(n_heads,)``.

    ``W_Q`` is ``(n_heads * head_dim, d_model)`` and ``W_K`` ``(n_kv_heads * head_dim, d_model)``
    (``nn.Linear`` layout); with grouped-query attention head ``h`` uses key head
    ``h // (n_heads / n_kv_heads)``. The ``d x d`` product has rank at most ``head_dim``: with
    ``W_Q,h^T = U_Q R_Q`` and ``W_K,h^T = U_K R_K`` (reduced QR) its singular values are those of
    the ``head_dim x head_dim`` matrix ``R_Q R_K^T``.
    """
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if W_Q.shape[0] % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"cannot split W_Q {tuple(W_Q.shape)} into {n_heads} heads over {n_kv_heads} key heads")
    head_dim = W_Q.shape[0] // n_heads
    if W_K.shape != (n_kv_heads * head_dim, W_Q.shape[1]):
        raise ValueError(f"W_K has shape {tuple(W_K.shape)}, expected {(n_kv_heads * head_dim, W_Q.shape[1])}")
    queries = W_Q.to(torch.float64).reshape(n_heads, head_dim, -1)
    keys = W_K.to(torch.float64).reshape(n_kv_heads, head_dim, -1)
    keys = keys.repeat_interleave(n_heads // n_kv_heads, dim=0)
    _, R_Q = torch.linalg.qr(queries.mT)
    _, R_K = torch.linalg.qr(keys.mT)
    return spectrum_metrics(singular_values(R_Q @ R_K.mT), (head_dim, head_dim), torch.float64, 1)["stable_rank"]


def _attended_keys(probs: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean ``(..., q, k)``: which keys each query may attend to."""
    n_queries, n_keys = probs.shape[-2:]
    if mask is not None:
        return mask.to(torch.bool).expand(probs.shape)
    if causal:
        # With a cache of earlier keys, query i sits at position i + (k - q).
        positions = torch.arange(n_queries, device=probs.device)[:, None] + (n_keys - n_queries)
        return (torch.arange(n_keys, device=probs.device)[None, :] <= positions).expand(probs.shape)
    return torch.ones_like(probs, dtype=torch.bool)


def _per_query_mean(values: torch.Tensor, key_counts: torch.Tensor) -> torch.Tensor:
    """Mean over queries that attend to at least 2 keys (a single key is attended with certainty)."""
    informative = key_counts > 1
    return _safe_ratio(torch.where(informative, values, 0.0).sum(-1), informative.sum(-1).to(values.dtype))


def attention_entropy(probs: torch.Tensor, causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over queries of ``H(row) / log(#keys attended)``, shape ``probs.shape[:-2]``.

    ``probs`` is ``(..., q, k)`` with rows summing to 1 over the attended keys. ``mask`` (True =
    attended, broadcastable) or ``causal=True`` tells how many keys each query saw; queries that saw
    one key carry no information and are left out. 0 = every query on one key, 1 = uniform.
    """
    probs = probs.to(torch.float64)
    key_counts = _attended_keys(probs, causal, mask).sum(-1)
    entropy = torch.special.entr(probs).sum(-1)
    normalised = _safe_ratio(entropy, torch.log(key_counts.to(torch.float64)))
    return _per_query_mean(normalised, key_counts)


def mean_max_attention(probs: torch.Tensor, causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over queries of the largest attention probability (same query selection as :func:`attention_entropy`)."""
    probs = probs.to(torch.float64)
    key_counts = _attended_keys(probs, causal, mask).sum(-1)
    return _per_query_mean(probs.amax(-1), key_counts)


V_SAMPLE_TOKENS = 1024  # SPEC 7.5: tokens sampled per layer for the V activation metrics


def sample_tokens(outputs: torch.Tensor, n_tokens: int | None = V_SAMPLE_TOKENS, seed: int = 0) -> torch.Tensor:
    """``(..., tokens, features)`` flattened to ``(N, features)`` in float64, then ``n_tokens`` rows drawn.

    The rows are drawn without replacement by a generator seeded with ``seed``, so the draw depends
    on ``N`` and ``seed`` alone: every layer, and every checkpoint measured on the same tokens, gets
    the same token positions. ``n_tokens=None`` or ``N <= n_tokens`` keeps every row.
    """
    Z = outputs.reshape(-1, outputs.shape[-1])
    if n_tokens is not None and Z.shape[0] > n_tokens:  # pick the rows first: only they are widened
        rows = torch.randperm(Z.shape[0], generator=torch.Generator().manual_seed(seed))[:n_tokens]
        Z = Z[rows.to(Z.device)]
    return Z.to(torch.float64)


def v_activation_effective_rank(outputs: torch.Tensor, n_tokens: int | None = V_SAMPLE_TOKENS,
                                seed: int = 0) -> torch.Tensor:
    """SPEC 3/7.5 V activation eRank: ``exp H(s / sum s)`` of the whole projection's centred output.

    ``outputs`` is ``(..., tokens, n_heads * head_dim)``, all heads together; leading dimensions are
    pooled as tokens, ``n_tokens`` of them sampled (:func:`sample_tokens`), and the per-feature mean
    over those tokens removed before the SVD (uncentred, the mean direction would count as one
    dominant mode). A 0-d float64 tensor.
    """
    Z = sample_tokens(outputs, n_tokens, seed)
    return _exp_entropy(singular_values(Z - Z.mean(0)))


def linear_cka(Zi: torch.Tensor, Zj: torch.Tensor) -> torch.Tensor:
    """``||Zi^T Zj||_F^2 / (||Zi^T Zi||_F ||Zj^T Zj||_F)`` on centred ``(N, d)`` representations (SPEC 3)."""
    Zi = Zi.to(torch.float64) - Zi.to(torch.float64).mean(-2, keepdim=True)
    Zj = Zj.to(torch.float64) - Zj.to(torch.float64).mean(-2, keepdim=True)
    cross = torch.linalg.matrix_norm(Zi.mT @ Zj) ** 2
    return _safe_ratio(cross, torch.linalg.matrix_norm(Zi.mT @ Zi) * torch.linalg.matrix_norm(Zj.mT @ Zj))


def mean_cross_head_cka(outputs: torch.Tensor, n_heads: int) -> float:
    """Mean linear CKA over all pairs of heads of ``(..., tokens, n_heads * head_dim)`` outputs."""
    if n_heads < 2:
        raise ValueError(f"cross-head CKA needs at least 2 heads, got {n_heads}")
    heads = sample_tokens(outputs, None).reshape(-1, n_heads, outputs.shape[-1] // n_heads).transpose(0, 1)
    pairs = list(itertools.combinations(range(n_heads), 2))
    return float(torch.stack([linear_cka(heads[i], heads[j]) for i, j in pairs]).mean())


def v_activation_metrics(v_outputs, n_heads: int, n_tokens: int | None = V_SAMPLE_TOKENS, seed: int = 0) -> dict:
    """A model's V activation metrics (SPEC 7.5) from each layer's V-projection output.

    ``activation_effective_rank``: :func:`v_activation_effective_rank`; ``cross_head_cka``:
    :func:`mean_cross_head_cka` (NaN with one head). Both on the same ``n_tokens`` sampled tokens of
    each layer, then averaged over layers.
    """
    samples = [sample_tokens(v, n_tokens, seed) for v in v_outputs]
    rank = torch.stack([v_activation_effective_rank(Z, None) for Z in samples]).mean()
    cka = sum(mean_cross_head_cka(Z, n_heads) for Z in samples) / len(samples) if n_heads > 1 else math.nan
    return {"activation_effective_rank": float(rank), "cross_head_cka": cka}


def fixed_input_v_metrics(v_inputs, v_weights, n_heads: int, n_tokens: int | None = V_SAMPLE_TOKENS,
                          seed: int = 0) -> dict:
    """:func:`v_activation_metrics` of a checkpoint's V weights applied to fixed inputs (SPEC 7.5).

    ``v_inputs`` are what a reference model's V projections received, one ``(..., d_model)`` tensor
    per layer (e.g. ``capture(reference, names, tokens)[name].args[0]``); ``v_weights`` the
    checkpoint's ``(n_heads * head_dim, d_model)`` V weights, one per layer (``nn.Linear`` layout, no
    bias). Every checkpoint is then measured on identical inputs, so a difference comes from its V
    weights, not from what its earlier layers fed them. Sampling the inputs picks the same rows as
    sampling the outputs would; the product is taken in float64.
    """
    if len(v_inputs) != len(v_weights):
        raise ValueError(f"{len(v_inputs)} layers of inputs but {len(v_weights)} V weights")
    outputs = [sample_tokens(x, n_tokens, seed) @ W.to(torch.float64).T for x, W in zip(v_inputs, v_weights)]
    return v_activation_metrics(outputs, n_heads, None)


@dataclass
class Capture:
    """What one module received and returned in a forward pass."""

    args: tuple
    kwargs: dict
    output: object


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


@torch.no_grad()
def capture(model: torch.nn.Module, module_names, *args, **kwargs) -> dict[str, Capture]:
    """Run ``model(*args, **kwargs)`` once and return each named module's inputs and output.

    Forward hooks are removed afterwards, also when the forward raises. Tensors are detached.
    """
    captured = {}

    def hook_for(name):
        def hook(module, hook_args, hook_kwargs, output):
            captured[name] = Capture(tuple(map(_detached, hook_args)),
                                     {k: _detached(v) for k, v in hook_kwargs.items()}, _detached(output))
        return hook

    handles = [model.get_submodule(name).register_forward_hook(hook_for(name), with_kwargs=True)
               for name in module_names]
    try:
        model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in module_names if name not in captured]
    if missing:
        raise RuntimeError(f"modules {missing} were not called in the forward pass")
    return captured


@torch.no_grad()
def fixed_input_outputs(source: torch.nn.Module, target: torch.nn.Module,
                        module_names, *args, **kwargs) -> dict[str, object]:
    """Outputs of ``target``'s modules on the inputs ``source``'s same-named modules received.

    The "fixed inputs" comparison: activations of two checkpoints measured on identical inputs,
    so a difference comes from the modules' weights, not from what earlier layers fed them.
    """
    inputs = capture(source, module_names, *args, **kwargs)
    return {name: target.get_submodule(name)(*c.args, **c.kwargs) for name, c in inputs.items()}
