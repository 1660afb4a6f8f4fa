"""The precisions of the iterations' operands, and what ``precision=None`` means (SPEC 1.2).

A precision decides the dtype of an iteration's operands: every product takes them in that dtype,
accumulates in fp32 (fp64 for ``"fp64"``) and rounds its result to it, as torch.optim.Muon's bf16
iteration does. It sits below dispatch and the plan: both read it. An enclosing autocast decides
nothing (:func:`outside_autocast`).
"""

from __future__ import annotations

import functools

import torch

from ._compile import constant_when_traced

PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
OPERAND_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                  "fp16": torch.float16}
# torch.set_float32_matmul_precision's settings, read as precisions for float32 weights.
FLOAT32_MATMUL_PRECISIONS = {"highest": "fp32", "high": "tf32", "medium": "bf16"}


def outside_autocast(function):
    """``function`` run with every enclosing autocast switched off: its precision is the package's alone
    (``precision=``, the weight's dtype), never a forward's autocast, which a framework may step an optimizer
    inside (Lightning's manual optimization, a loop's ``with torch.autocast(...)`` around the whole step).
    Under one, the products would run in the autocast's dtype (a bf16 decay of fp32 weights), and a weight of
    the other half dtype would be refused by torch itself (``torch.stack`` of bf16 tensors under an fp16
    autocast: "Unexpected floating ScalarType in at::autocast::prioritize"). Every public entry that computes
    (each op, the decay, an optimizer's step) takes it, so the result is bitwise the one outside."""
    @functools.wraps(function)
    def without_autocast(*args, **kwargs):
        # The device types the package computes on, each with an autocast state of its own. Entering the
        # switches costs ~10 us a call: only under an autocast.
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return function(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return function(*args, **kwargs)
    return without_autocast


def resolve_precision(precision: str | None, dtype: torch.dtype) -> str:
    """``precision=None``, defined once: follow the weight's dtype, and for float32 weights torch's own
    ``torch.get_float32_matmul_precision()`` (``"highest"``: fp32, ``"high"``: tf32, ``"medium"``: bf16)."""
    if precision is not None:
        return precision
    if dtype == torch.float64:
        return "fp64"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return _float32_precision()


def clip_precision(precision: str | None, dtype: torch.dtype) -> str:
    """``spectral_clip``'s ``precision=None``: fp32 operands (fp64 for float64 weights), whatever the weight's
    dtype or torch's float32 matmul setting. Its result is a difference of ``s_max``-sized terms,
    ``W - P_top(max) (W - max Q)``, so an operand's rounding lands on the clipped modes magnified by
    ``s_max / max`` (bf16 operands: 0.22 at ``max = s_max / 100`` on a Gaussian 256 x 512, fp32 ones 1.7e-3,
    the bf16 result's own rounding), and its lift needs the polar factor down to the zero cutoff, which
    no bf16, fp16 or tf32 iteration resolves. On a GPU fp32 operands take about twice the time of bf16
    ones; ``precision="bf16"`` (or another) still asks for those operands, with their accuracy."""
    if precision is not None:
        return precision
    return "fp64" if dtype == torch.float64 else "fp32"


@constant_when_traced
def _float32_precision() -> str:
    """torch's float32 matmul setting as a precision. Under torch.compile it is read once, when a
    graph is traced (as Inductor reads it), since reading it is not traceable."""
    try:
        return FLOAT32_MATMUL_PRECISIONS[torch.get_float32_matmul_precision()]
    except RuntimeError:  # the per-backend API (torch.backends.cuda.matmul.fp32_precision) is in use
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


