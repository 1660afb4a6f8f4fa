"""The spectral QK cap (SPEC 11): ``qk_cap_``, a data-free bound on every attention logit, in place.

The API layer's part: validation, the heads as stacks of matrices (views), one call of the plan
(:func:`spectral_ops.plan.qk_cap`, where the algorithm is) and the write of the heads it changed. A
``DTensor`` weight (FSDP2, tensor parallelism) is gathered whole on every rank, capped there (every rank
computes the same bits), and each rank writes its own part back. Also a model's reading of its attention
pairs (:func:`attention_pairs`), which needs no optimizer (``optim.QKCap`` applies the cap to them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import dispatch, plan
from ._checks import check_coefficient, check_count, check_finite, check_matrix
from .decay import _check_writable
from .linalg import compute_dtype
from .ops import check_method, check_precision
from .precision import outside_autocast

if dist.is_available():
    from torch.distributed.tensor import DTensor, distribute_tensor
else:  # a torch built without torch.distributed: every weight is a plain tensor
    DTensor = ()


def check_heads(q_weight, k_weight, num_heads, num_kv_heads) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, d_h)``, every shape checked against the others."""
    for weight, name in ((q_weight, "q_weight"), (k_weight, "k_weight")):
        check_matrix(weight, name)
        if weight.dim() != 2:
            raise ValueError(f"{name} must be a 2-D (out_features, in_features) weight as nn.Linear stores it, got "
                             f"shape {tuple(weight.shape)}")
    if q_weight.dtype != k_weight.dtype:
        raise TypeError(f"q_weight is {q_weight.dtype} and k_weight {k_weight.dtype}: pass the two projections "
                        "of one attention, of one dtype")
    if q_weight.device != k_weight.device:
        raise ValueError(f"q_weight is on {q_weight.device} and k_weight on {k_weight.device}: pass the two "
                         "projections of one attention, on one device")
    num_heads = check_count(num_heads, "num_heads")
    num_kv_heads = num_heads if num_kv_heads is None else check_count(num_kv_heads, "num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}: each key head "
                         "serves num_heads / num_kv_heads query heads (GQA); pass the model's head counts")
    rows, columns = q_weight.shape
    if rows % num_heads:
        raise ValueError(f"q_weight has {rows} rows, which do not split into num_heads={num_heads} heads; pass the "
                         "query projection's weight (num_heads * head_dim rows) and its head count")
    head_dim = rows // num_heads
    if tuple(k_weight.shape) != (num_kv_heads * head_dim, columns):
        raise ValueError(f"k_weight has shape {tuple(k_weight.shape)}, but num_kv_heads={num_kv_heads} heads of "
                         f"q_weight's head_dim {head_dim} over its {columns} inputs make "
                         f"({num_kv_heads * head_dim}, {columns}); pass the key projection's weight and the model's "
                         "num_kv_heads (num_key_value_heads)")
    return num_heads, num_kv_heads, head_dim


@outside_autocast
@torch.no_grad()
def qk_cap_(q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, cap, *, num_kv_heads: int | None = None,
            method: str = "auto", precision: str | None = None) -> torch.Tensor:
    """Cap every attention head's ``s_max(W_q^h) s_max(W_k^g)`` at ``cap``, in place; returns that bound per q
    head *before* the cap (``(num_heads,)``, float32; float64 for float64 weights), for a monitor to log.

    Whatever the data, a head's logit between positions ``i`` and ``j`` is then at most ``||x_i|| ||x_j|| cap``
    (rotary embeddings or not; divided by ``sqrt(d_h)`` where the attention scales its logits so): docs/api.md,
    "The spectral QK cap", also for the bound after an RMSNorm.

    ``q_weight`` is ``(num_heads * d_h, D)`` and ``k_weight`` ``(num_kv_heads * d_h, D)``, as ``nn.Linear``
    stores them (``num_kv_heads`` None: ``num_heads``); q head ``h`` reads k head ``h // (num_heads /
    num_kv_heads)`` (GQA; MQA is ``num_kv_heads=1``). A fused QKV projection is capped through row slices of its
    weight, which are views: ``qk_cap_(qkv.weight[:H * d_h], qkv.weight[H * d_h:(H + KV) * d_h], H, cap,
    num_kv_heads=KV)`` writes the fused weight (a ``DTensor``'s slice is a copy: under FSDP2 split the
    projections, or cap the gathered weight yourself).

    **The split.** A pair over the cap has its factors clipped, ``U min(s, t) V^T``: the same singular vectors,
    the modes above ``t`` set to ``t``, the rest as they were. With a key head per query head (MHA) at
    ``t_q = sqrt(cap a / b)`` and ``t_k = sqrt(cap b / a)`` (``a``, ``b`` their ``s_max``): both shrink by the
    same factor ``sqrt(cap / (a b))``, so ``t_q t_k = cap`` exactly, whatever the estimates of ``a`` and ``b``,
    and the pair's balance is kept (QK-Clip's square-root split). A key shared by a group (GQA, MQA) is never
    touched: each over-cap q head is clipped at ``t_q = cap / b`` (Kimi K2's rule for MLA's shared rotary key).
    A pair within the cap is bitwise unchanged, its q rows and its k rows, even where another of its group is
    over: only the changed heads' rows are written (none where no pair is over).

    **Accuracy.** ``s_max`` comes from the Gram (16 squarings, then a Rayleigh quotient: within 4e-7 of the
    FP64 SVD's in fp32) on the Gram route, from the SVD on the SVD route. Afterwards every pair's product is
    at most ``cap`` to 1e-4 (fp32, measured about 1e-6; fp64 to about 1e-12). bf16/fp16 weights are capped in
    fp32 and rounded once: their own rounding ``E`` (``2^-9`` of each entry for bf16) can leave ``s_max`` of the
    rounded factor above its threshold by ``||E||_2 <= 2^-9 ||W||_F`` (measured up to 1.7e-3 of the cap with both
    factors rounded, docs/api.md). On the Gram route
    (a GPU's; ``method="gram"``) the projector sits 1% below each threshold, so that every mode at or above it
    is capped however close it was; a mode within about 2% below a threshold may move up towards it, never
    beyond it (the SVD route is exact there).

    ``method``: ``"auto"`` as :func:`spectral_ops.spectral_clip` takes it (the SVD on a CPU, the Gram route on a
    GPU), ``"gram"`` (no SVD, Polar Express and the sign iteration, per-head batched), ``"svd"`` or ``"eigh"``.
    ``precision``: as spectral_clip's (None: fp32 operands, fp64 for float64 weights). Which pairs are over is
    read on the host (one sync), so the call is not capturable. Everything is checked before the first write
    (shapes, head counts, dtypes, devices, ``cap`` a finite number > 0, finite weights, writable memory): an
    error leaves both weights as they were.

    A ``DTensor`` weight (FSDP2's ``Shard(0)``, tensor parallelism's, FSDP2 over it) is gathered whole on every
    rank (a collective: every rank calls this), capped there, and each rank writes its own part of the changed
    heads' rows.
    """
    num_heads, num_kv_heads, head_dim = check_heads(q_weight, k_weight, num_heads, num_kv_heads)
    cap = float(check_coefficient(cap, "cap", positive=True))
    check_method(method)
    check_precision(precision)
    locals_ = [w.to_local() if isinstance(w, DTensor) else w for w in (q_weight, k_weight)]
    _check_writable(locals_, ["q_weight", "k_weight"])
    q_whole, k_whole = (w.full_tensor() if isinstance(w, DTensor) else w for w in (q_weight, k_weight))
    check_finite([q_whole], "q_weight")
    check_finite([k_whole], "k_weight")
    bounds_dtype = compute_dtype(q_weight.dtype)
    if q_whole.numel() == 0:
        return torch.zeros(num_heads, dtype=bounds_dtype, device=q_whole.device)
    Q, K = q_whole.unflatten(0, (num_heads, head_dim)), k_whole.unflatten(0, (num_kv_heads, head_dim))
    outcome = plan.qk_cap(dispatch.kernels_for("qk_cap_", Q), Q, K, cap, None, None, precision, method)
    # Both sides are computed before either is written: a failure leaves both as they were.
    for weight, whole, heads, values in ((q_weight, q_whole, outcome.q_heads, outcome.q_values),
                                         (k_weight, k_whole, outcome.k_heads, outcome.k_values)):
        if values is not None:
            _write_heads(weight, whole, heads, values, head_dim)
    return outcome.bounds.to(bounds_dtype)


def _write_heads(weight: torch.Tensor, whole: torch.Tensor, heads: torch.Tensor, values: torch.Tensor,
                 head_dim: int) -> None:
    """Write ``values`` into the rows of ``heads`` of ``weight`` (``whole`` is its whole value: itself, or a
    DTensor's gathered copy), and no other row."""
    if not isinstance(weight, DTensor):
        weight.unflatten(0, (-1, head_dim)).index_copy_(0, heads, values)
        return
    # Every rank holds the same new whole and the same rows to write: its part of each is taken locally
    # (src_data_rank=None: no collective), for any placements, and only the changed rows' elements written.
    whole.unflatten(0, (-1, head_dim)).index_copy_(0, heads, values)
    rows = torch.zeros(whole.shape[0] // head_dim, dtype=torch.bool, device=whole.device)
    rows[heads] = True
    changed = rows.repeat_interleave(head_dim)[:, None].expand(whole.shape).contiguous()
    part, changed_part = (distribute_tensor(tensor, weight.device_mesh, weight.placements, src_data_rank=None)
                          .to_local() for tensor in (whole, changed))
    local = weight.to_local()
    local[changed_part] = part[changed_part]


# How a model's pairs are given where attention_pairs cannot read them.
GIVEN_PAIRS = "spectral_ops.optim.QKCap(pairs=[(q_weight, k_weight, num_heads, num_kv_heads), ...], cap=...)"


def _head_dim(module: torch.nn.Module, name: str) -> int:
    """The head size of the attention ``module``: its ``head_dim``, else its ``config.head_dim``, else its
    ``config.hidden_size // config.num_attention_heads`` (Hugging Face's default)."""
    config = getattr(module, "config", None)
    for value in (getattr(module, "head_dim", None), getattr(config, "head_dim", None)):
        if value is not None:
            return value
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if hidden is not None and heads:
        return hidden // heads
    raise ValueError(f"cannot tell the head size of {name or 'the model'} ({type(module).__name__}): it has no "
                     "head_dim attribute, nor a config with head_dim or hidden_size and num_attention_heads; give "
                     f"it one, or give the pairs yourself: {GIVEN_PAIRS}")


def attention_pairs(model: torch.nn.Module, required: bool = True) -> dict[str, tuple]:
    """``{module path: (q_weight, k_weight, num_heads, num_kv_heads)}`` for every module of ``model`` with
    ``q_proj`` and ``k_proj`` children holding a ``.weight`` (Llama-style Hugging Face models' ``self_attn``,
    the reference model's ``attention``), with the head counts from its head size (:func:`_head_dim`). A
    model with none raises where ``required`` (a cap with nothing to cap is a mistake), else gives ``{}``."""
    pairs = {}
    for name, module in model.named_modules():
        q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if not (isinstance(getattr(q, "weight", None), torch.Tensor) and isinstance(getattr(k, "weight", None),
                                                                                    torch.Tensor)):
            continue
        head_dim = _head_dim(module, name)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"{name}: its head size must be an integer >= 1, got {head_dim!r}")
        rows = {"q_proj": q.weight.shape[0], "k_proj": k.weight.shape[0]}
        uneven = {child: count for child, count in rows.items() if count % head_dim}
        if uneven:
            raise ValueError(f"{name}: the rows of {', '.join(f'{c} ({n})' for c, n in uneven.items())} do not split "
                             f"into heads of its head size {head_dim}; give the pairs yourself: {GIVEN_PAIRS}")
        pairs[name] = (q.weight, k.weight, rows["q_proj"] // head_dim, rows["k_proj"] // head_dim)
    if not pairs and required:
        raise ValueError(f"{type(model).__name__} has no module with q_proj and k_proj children holding a weight "
                         f"(Llama-style attention); give the pairs yourself: {GIVEN_PAIRS}")
    return pairs
