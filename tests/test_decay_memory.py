"""The workspace of one decay against the matrix size (issue #17), measured on CPU with
torch.profiler's allocation events (bench/decay_memory.py), and bounded by the temporaries the
algorithm holds at its peak. Each bound is tight to within ``SLACK``, far below one copy of a weight,
so an extra full-size temporary fails it (the last tests check that it does).

The bounds hold on any CPU because they bound the tensors alone: the scratch a product allocates and
frees inside itself depends on the CPU (oneDNN's bf16 kernels on CPUs with native bf16 reorder their
operands into buffers whose size follows their own blocking, ~1.5x a small decay's tensors; MKL's fp32
GEMM and AVX2 CPUs allocate none). That scratch is bounded separately, by the largest that a bare torch
product of the decay's shapes and dtype allocates on this machine, measured in the same run."""

import importlib.util
from pathlib import Path

import pytest
import torch

import spectral_ops
import spectral_ops.decay
import spectral_ops.plan
from spectral_ops.provenance import machine_line

_spec = importlib.util.spec_from_file_location("decay_memory", Path(__file__).parents[1] / "bench" / "decay_memory.py")
decay_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decay_memory)

# 0-d tensors (norms, scales, the finiteness flags): a few bytes each, whatever the matrix size.
SLACK = 1024

SHAPES = [(1, (48, 32)), (1, (32, 48)), (1, (40, 40)), (3, (24, 16))]  # tall, wide, square, a list


def workspace_bound(count: int, shape, dtype: torch.dtype, p: int) -> int:
    """The bytes the CPU (torch backend) decay holds at its peak, from the plan (spectral_ops/plan.py).

    In the wide orientation ``X`` is ``r x N`` (``r = min(m, n)``); every temporary is an ``r x N`` or
    an ``r x r``. Units: ``rN``/``rr``, one of them in the compute dtype fp32; ``o`` the operand's share of
    it (1 for fp32 weights, 1/2 for bf16, whose products run in bf16 under ``precision=None``).

    * p = 1: no spectral direction, and no allocation: every dtype is scaled in place
      (``decay.multiply_``; bf16 by ``Tensor.mul_``, which rounds each product once).
    * The decay is computed in a copy of the weights, their dtype (``decay.prepare_decay``: the stack
      of a same-shape list, the clone of a lone weight), so that every new value can be checked
      before any weight is written. Every shape group's copy stays alive until the commit.
    * The plan holds, for fp32, ``Xn = X / ||X||_F`` (rN; ``X`` is a view of the copy, the operand
      ``Xo`` is ``Xn``); for bf16, the fp32 ``X`` (rN) and the operand ``Xo`` (o rN), while ``Xn``,
      rounded into ``Xo``, lives only while the plan is made (``init``: X, Xn and Xo at once).
    * The Polar Express loop (even p and 0): the plan, the iterate (o rN; the previous one is freed
      once the next exists, except the first, which starts from ``Xo``), and four o rr: the Gram, the
      first step's scaled copy, this step's ``A`` and ``b A + c A^2``.
    * The direction (p >= 2): the plan, ``Q`` for even p (o rN), the Gram squares the plan caches (one
      per binary digit of ``k = p // 2``, o rr each), the product (o rN) and, for bf16, its fp32 copy.
    * The epilogue ``W <- keep X + step D`` (torch backend), the plan freed: ``D`` and the new value
      (2 rN), and for bf16 the fp32 ``X`` (rN).
    """
    m, n = shape
    r, N = min(m, n), max(m, n)
    rN, rr, weights = 4 * count * r * N, 4 * count * r * r, count * m * n * dtype.itemsize
    low = dtype != torch.float32
    o = dtype.itemsize / 4
    if p == 1:
        return 0
    k, even = p // 2, p % 2 == 0
    plan = 1 + (o if low else 0)
    init = (2 + o) * rN if low else 0
    polar = (plan + o) * rN + 4 * o * rr if even else 0
    direction = (plan + (o if even else 0) + o + (1 if low else 0)) * rN + k.bit_length() * o * rr if p >= 2 else 0
    epilogue = (2 + (1 if low else 0)) * rN
    return int(weights + max(init, polar, direction, epilogue))


def measured(count, shape, dtype, p) -> "decay_memory.Peak":
    return decay_memory.peak(decay_memory.decay_call(decay_memory.weights(count, shape, dtype), p), repeats=1)


def test_the_measurement_sees_a_temporary_once_it_is_freed_and_counts_its_peak_not_its_total():
    def two_temporaries_in_turn():
        a = torch.empty(1000)
        del a
        b = torch.empty(500)
        c = torch.empty(500)
        del b, c

    assert 4000 <= decay_memory.peak(two_temporaries_in_turn).tensors <= 4000 + SLACK


def test_a_products_scratch_is_set_apart_but_its_result_and_torchs_copies_are_not():
    a = torch.randn(64, 48).to(torch.bfloat16)
    result = a.numel() * a.element_size() * 64 // 48  # a @ a.mT is 64 x 64
    bare = decay_memory.peak(lambda: a @ a.mT)
    assert result <= bare.tensors <= result + SLACK and bare.total == bare.tensors + bare.scratch
    # torch copies an operand with no unit stride before its product: a tensor (of its own op), counted.
    strided = torch.randn(96, 128)[::2, ::2]
    copied = decay_memory.peak(lambda: torch.mm(a.float(), strided))
    assert copied.tensors >= 4 * (64 * 64 + strided.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("count, shape", [(1, (256, 256)), (3, (64, 96))], ids=["one", "list"])
def test_p1_allocates_no_copy_of_the_weights(count, shape, dtype):
    assert measured(count, shape, dtype, 1).total <= workspace_bound(count, shape, dtype, 1) + SLACK


@pytest.mark.parametrize("p", [0, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("count, shape", SHAPES, ids=["tall", "wide", "square", "list"])
def test_a_spectral_decay_stays_within_the_temporaries_of_the_plan(count, shape, dtype, p):
    peak = measured(count, shape, dtype, p)
    bound = workspace_bound(count, shape, dtype, p)
    assert peak.tensors <= bound + SLACK, (f"{peak.tensors} bytes of tensors, "
                                           f"{peak.tensors / bound:.2f}x the plan's {bound}")
    # The direction and the epilogue's result exist at once whatever the plan: at least 2 r x N in fp32.
    assert peak.tensors >= 2 * 4 * count * min(shape) * max(shape)
    library = decay_memory.product_scratch(count, shape, dtype)
    assert peak.scratch <= library + SLACK, f"a product's scratch of {peak.scratch} bytes, a bare product's {library}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_p1_spectral_adamw_step_allocates_what_torch_adamw_does(dtype):
    """The default step (no rollback record): Adam's denominators, allocated before the first write, as torch's."""
    shape = (64, 96)
    ours = decay_memory.peak(decay_memory.optimizer_step(decay_memory.weights(2, shape, dtype), 1))
    torchs = decay_memory.peak(decay_memory.optimizer_step(decay_memory.weights(2, shape, dtype), None))
    assert ours.total <= torchs.total + SLACK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rollback_record_is_one_copy_of_what_the_step_writes(dtype):
    """A step with rollback=True copies what it writes before its first write, and holds the copy
    until its last: the weights and both moments, three copies of the weights (and their 0-d counts), on
    top of torch's step. Not one byte of a fourth: the bound is tighter than one more copy."""
    shape = (64, 96)
    weights = decay_memory.weights(2, shape, dtype)
    record = 3 * sum(w.numel() * w.element_size() for w in weights)
    ours = decay_memory.peak(decay_memory.optimizer_step(weights, 1, rollback=True))
    torchs = decay_memory.peak(decay_memory.optimizer_step(decay_memory.weights(2, shape, dtype), None))
    assert torchs.total + record <= ours.total <= torchs.total + record + SLACK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("p", [1, 2])
def test_one_extra_copy_of_the_weights_breaks_the_bound(monkeypatch, dtype, p):
    # The bounds are only worth something if they are tighter than the regression they guard against.
    count, shape = (1, (48, 32)) if p > 1 else (1, (256, 256))
    target, name = (spectral_ops.plan, "decay_") if p > 1 else (spectral_ops.decay, "multiply_")
    original = getattr(target, name)

    def with_a_copy(*args, **kwargs):
        weights = args[1] if p > 1 else args[0][0]
        copy = weights.clone()  # noqa: F841 (held through the call)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, with_a_copy)
    assert measured(count, shape, dtype, p).tensors > workspace_bound(count, shape, dtype, p) + SLACK


def test_the_generator_script_writes_its_table_and_json(tmp_path):
    rows = decay_memory.main(["--shapes", "24x16", "2@16x24", "--powers", "1", "2", "--repeats", "1",
                              "--out-md", str(tmp_path / "table.md"), "--out-json", str(tmp_path / "table.json")])
    assert {row["case"] for row in rows} == {"spectral_decay_", "band top, tau 1", "torch AdamW step",
                                             "SpectralAdamW step"}
    assert "\n| case | shape | dtype | p |" in (tmp_path / "table.md").read_text()
    assert machine_line() in (tmp_path / "table.md").read_text()
    import json

    assert len(json.loads((tmp_path / "table.json").read_text())["rows"]) == len(rows)
    for row in rows:
        if row["case"] == "spectral_decay_":
            count, shape = decay_memory.parse_shape(row["shape"])
            dtype = decay_memory.DTYPES[row["dtype"]]
            assert row["tensor_bytes"] <= workspace_bound(count, shape, dtype, row["p"]) + SLACK
            assert row["tensor_bytes"] + row["product_scratch_bytes"] >= row["peak_bytes"] >= row["tensor_bytes"]
