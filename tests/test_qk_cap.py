"""The spectral QK cap (SPEC 11): ``qk_cap_`` against the FP64 SVD, its hook ``QKCap``, and ``--qk-cap``.

Tolerances. The bound after the cap: each clipped factor's top mode is ``t (1 + e)``, ``e`` the clip's rounding
(the difference of two ``s_max``-sized terms: about 1e-6 in fp32, 1e-14 in fp64) and, for a shared key, the
``s_max`` estimate's error (within 4e-7 of the SVD's); the promise is 1e-4 in fp32, and 1e-10 in fp64 leaves
the same room. bf16 weights are capped in fp32 and rounded once: a factor's rounding ``E`` moves ``s_max`` by at
most ``||E||_2 <= ||E||_F <= 2^-9 ||W||_F <= 2^-9 sqrt(d_h) t``. The clip itself against the oracle: fp32's
route errs by its rounding of ``s_max`` (docs/api.md, "Thresholded ops": a few 1e-6), fp64's by 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from spectral_ops import qk_cap_, reference
from spectral_ops.linalg import matrix_with_spectrum, relative_error
from spectral_ops.optim import QKCap
from spectral_ops.qk_cap import attention_pairs
from spectral_ops.train import Transformer, preset
from spectral_ops.train.model import ModelConfig, apply_rotary

H, D_H, D = 4, 8, 32  # 4 query heads of size 8 over 32 inputs
PRODUCT_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}
CLIP_TOLERANCE = {torch.float64: 1e-11, torch.float32: 2e-5}


def head_norms(W: torch.Tensor, heads: int) -> torch.Tensor:
    """``s_max`` of each head's rows, by the FP64 SVD."""
    return torch.linalg.matrix_norm(W.detach().double().unflatten(0, (heads, -1)), 2)


def weights(num_kv: int, dtype=torch.float64, seed: int = 0):
    """q and k weights whose heads' singular values are ``scale * SPECTRUM`` with scales far apart, and the cap
    between the pairs' products (no product within 10% of it): heads 1 and 3 over the cap, 0 and 2 within, with
    their gaps in place for the Gram route (no mode within 3% below a threshold). Under GQA heads 2 and 3 share a
    key, one over the cap and one within."""
    spectrum = torch.tensor([1.0, 0.9, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05], dtype=torch.float64)
    q_scales = torch.tensor([1.0, 2.0, 1.1, 1.5])
    k_scales = {4: torch.tensor([1.0, 1.6, 0.9, 1.7]), 2: torch.tensor([1.0, 1.2]), 1: torch.tensor([1.0])}[num_kv]
    q = matrix_with_spectrum((H, D_H, D), q_scales[:, None].double() * spectrum, seed=seed)
    k = matrix_with_spectrum((num_kv, D_H, D), k_scales[:, None].double() * spectrum, seed=seed + 1)
    return q.flatten(0, 1).to(dtype), k.flatten(0, 1).to(dtype)


def cap_between(q, k, num_kv) -> tuple[float, torch.Tensor]:
    """A cap with half the pairs over it, away from every product, and the products before."""
    products = head_norms(q, H) * head_norms(k, num_kv).repeat_interleave(H // num_kv)
    low, high = products.sort().values[H // 2 - 1:H // 2 + 1]
    assert high / low > 1.2
    return float((low * high).sqrt()), products


def head_rows(W, heads):
    return W.unflatten(0, (heads, -1))


@pytest.mark.parametrize("num_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("method", ["gram", "svd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_every_pair_is_within_the_cap_and_pairs_within_it_are_bitwise_unchanged(num_kv, method, dtype):
    q, k = weights(num_kv, dtype)
    cap, before = cap_between(q, k, num_kv)
    q_before, k_before = q.clone(), k.clone()
    bounds = qk_cap_(q, k, H, cap, num_kv_heads=num_kv, method=method)
    assert bounds.dtype == dtype and bounds.shape == (H,)
    # The bound before the cap, as the FP64 SVD has it: q head h reads k head h // (H / KV).
    assert relative_error(bounds, before) < PRODUCT_TOLERANCE[dtype] / 10
    after = head_norms(q, H) * head_norms(k, num_kv).repeat_interleave(H // num_kv)
    assert bool((after <= cap * (1 + PRODUCT_TOLERANCE[dtype])).all()), (after / cap).tolist()
    over = before > cap
    for h in range(H):
        assert torch.equal(head_rows(q, H)[h], head_rows(q_before, H)[h]) != bool(over[h]), h
    if num_kv == H:  # each key head is its pair's: clipped with it, or left bitwise
        for h in range(H):
            assert torch.equal(head_rows(k, H)[h], head_rows(k_before, H)[h]) != bool(over[h]), h
    else:  # a shared key is never touched, even where a sibling of its group is over the cap
        assert torch.equal(k, k_before)


@pytest.mark.parametrize("num_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("method", ["gram", "svd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_changed_factor_is_its_clip_at_the_split_threshold(num_kv, method, dtype):
    """``U min(s, t) V^T``: the same singular vectors, the modes above ``t`` at ``t``, those below as they were,
    with ``t_q = sqrt(cap a / b)``, ``t_k = sqrt(cap b / a)`` (MHA) or ``t_q = cap / b`` (GQA)."""
    q, k = weights(num_kv, dtype, seed=3)
    cap, _ = cap_between(q, k, num_kv)
    a, b = head_norms(q, H), head_norms(k, num_kv).repeat_interleave(H // num_kv)
    q_before, k_before = q.clone(), k.clone()
    qk_cap_(q, k, H, cap, num_kv_heads=num_kv, method=method)
    for h in torch.nonzero(a * b > cap)[:, 0].tolist():
        shrink = math.sqrt(cap / (a[h] * b[h]))
        t_q = float(a[h] * shrink) if num_kv == H else cap / float(b[h])
        expected = reference.spectral_clip_svd(head_rows(q_before, H)[h].double(), high=t_q)
        assert relative_error(head_rows(q, H)[h], expected) < CLIP_TOLERANCE[dtype], h
        s_before = torch.linalg.svdvals(head_rows(q_before, H)[h].double())
        s_after = torch.linalg.svdvals(head_rows(q, H)[h].double())
        torch.testing.assert_close(s_after, s_before.clamp(max=t_q), rtol=CLIP_TOLERANCE[dtype], atol=0)
        if num_kv == H:
            t_k = float(b[h] * shrink)
            assert t_q * t_k == pytest.approx(cap, rel=1e-12)
            expected = reference.spectral_clip_svd(head_rows(k_before, H)[h].double(), high=t_k)
            assert relative_error(head_rows(k, H)[h], expected) < CLIP_TOLERANCE[dtype], h


def test_a_mode_just_above_its_threshold_is_capped_on_the_gram_route():
    """A threshold 1e-4 below the top mode, among 63 modes at 0.9 of it: a projector at the threshold itself
    leaves 1.6e-5 of the excess (the mode is within its design's resolution); the cap's, 1% below, none."""
    spectrum = torch.cat([torch.ones(1), torch.full((63,), 0.9)]).double()
    q = matrix_with_spectrum((2, 64, 128), spectrum).flatten(0, 1)
    k = matrix_with_spectrum((64, 128), spectrum, seed=1)
    q_before, cap = q.clone(), 1 - 1e-4
    qk_cap_(q, k, 2, cap, num_kv_heads=1, method="gram")  # s_max(W_k) = 1: t_q = cap
    assert float(head_norms(q, 2).max() * head_norms(k, 1)) <= cap * (1 + PRODUCT_TOLERANCE[torch.float64])
    expected = reference.spectral_clip_svd(q_before.unflatten(0, (2, 64)), high=cap)
    assert relative_error(q.unflatten(0, (2, 64)), expected) < CLIP_TOLERANCE[torch.float64]


def test_bf16_weights_are_capped_to_their_rounding():
    q, k = weights(2, torch.bfloat16)
    cap, before = cap_between(q.float(), k.float(), 2)
    qk_cap_(q, k, H, cap, num_kv_heads=2, method="gram")
    after = head_norms(q, H) * head_norms(k, 2).repeat_interleave(2)
    rounding = 2.0**-9 * math.sqrt(D_H)  # the shared key is untouched: only q's rounding moves the product
    assert bool((after <= cap * (1 + rounding) * (1 + PRODUCT_TOLERANCE[torch.float32])).all())


def test_fused_qkv_is_capped_in_place_through_row_views():
    num_kv = 2
    q, k = weights(num_kv)
    v = torch.randn(num_kv * D_H, D, dtype=torch.float64)
    qkv = torch.nn.Linear(D, (H + 2 * num_kv) * D_H, bias=False, dtype=torch.float64)
    with torch.no_grad():
        qkv.weight.copy_(torch.cat([q, k, v]))
    cap, _ = cap_between(q, k, num_kv)
    qk_cap_(q, k, H, cap, num_kv_heads=num_kv)  # the same call on separate weights: what the fused one must become
    weight = qkv.weight
    qk_cap_(weight[:H * D_H], weight[H * D_H:(H + num_kv) * D_H], H, cap, num_kv_heads=num_kv)
    assert torch.equal(weight[:H * D_H], q) and torch.equal(weight[H * D_H:(H + num_kv) * D_H], k)
    assert torch.equal(weight[(H + num_kv) * D_H:], v) and weight.requires_grad


@pytest.mark.parametrize("change, error, match", [
    (dict(num_heads=3, num_kv_heads=1), ValueError, "do not split into num_heads=3"),
    (dict(num_kv_heads=3), ValueError, "not a multiple of num_kv_heads=3"),
    (dict(num_kv_heads=1), ValueError, "k_weight has shape"),
    (dict(num_heads=0), ValueError, "num_heads must be an integer >= 1"),
    (dict(num_heads=4.0), ValueError, "num_heads must be an integer"),
    (dict(cap=0.0), ValueError, "cap must be > 0"),
    (dict(cap=math.inf), ValueError, "cap must be finite"),
    (dict(cap="1"), TypeError, "cap must be a real number"),
    (dict(k=lambda q, k: k.float()), TypeError, "q_weight is torch.float64 and k_weight torch.float32"),
    (dict(q=lambda q, k: q[None]), ValueError, "q_weight must be a 2-D"),
    (dict(k=lambda q, k: k[:, :16]), ValueError, r"k_weight has shape \(16, 16\)"),
    (dict(k=lambda q, k: q[8:24]), ValueError, "overlap in memory"),
    (dict(k=lambda q, k: k.index_fill(1, torch.tensor([3]), math.nan)), ValueError, "k_weight contains NaN"),
    (dict(method="qr"), ValueError, "method must be one of"),
])
def test_errors_come_before_any_write(change, error, match):
    """q has heads over the cap: an error raised after its write would show in it."""
    q, k = weights(2)
    cap, _ = cap_between(q, k, 2)
    q_before, k_before = q.clone(), k.clone()
    arguments = dict(num_heads=H, cap=cap, num_kv_heads=2)
    arguments.update({key: value for key, value in change.items() if key not in ("q", "k")})
    wrong = {key: change[key](q, k) if key in change else value for key, value in (("q", q), ("k", k))}
    with pytest.raises(error, match=match):
        qk_cap_(wrong["q"], wrong["k"], arguments.pop("num_heads"), arguments.pop("cap"), **arguments)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_bounds_bound_every_logit_of_the_reference_model_after_an_rmsnorm():
    """docs/api.md's conversion: ``|logit| <= ||x_i|| ||x_j|| s_max(W_q^h) s_max(W_k^h) / sqrt(d_h)``, and
    with RMSNorm's ``||x|| <= sqrt(D) max|gamma|``, ``max logit <= D max|gamma|^2 cap / sqrt(d_h)``."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=16, n_layers=1, d_model=16, n_heads=2, max_seq_len=12)
    model = Transformer(config)
    block, attention = model.layers[0], model.layers[0].attention
    with torch.no_grad():
        attention.q_proj.weight.mul_(40)  # logits far from zero, and the cap binding
        block.attention_norm.weight.uniform_(0.5, 2.0)
    cap = 0.5 * float(qk_cap_(attention.q_proj.weight.clone(), attention.k_proj.weight.clone(), 2, 1e30).max())
    QKCap(model=model, cap=cap).step()
    x = block.attention_norm(model.embed(torch.randint(0, 16, (3, 12), generator=torch.Generator().manual_seed(1))))
    q = apply_rotary(attention.q_proj(x).view(3, 12, 2, -1).transpose(1, 2), model.rope_cos, model.rope_sin)
    k = apply_rotary(attention.k_proj(x).view(3, 12, 2, -1).transpose(1, 2), model.rope_cos, model.rope_sin)
    logits = (q @ k.mT / math.sqrt(config.head_dim)).detach().abs()
    norms = x.detach().norm(dim=-1)
    pair = head_norms(attention.q_proj.weight, 2) * head_norms(attention.k_proj.weight, 2)
    per_position = norms[:, None, :, None] * norms[:, None, None, :] * pair[None, :, None, None] / math.sqrt(8)
    assert bool((logits <= per_position * (1 + 1e-5)).all())
    gamma = float(block.attention_norm.weight.detach().abs().max())
    assert float(logits.max()) <= config.d_model * gamma**2 * cap / math.sqrt(config.head_dim) * (1 + 1e-4)


def tiny_model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=16, n_layers=2, d_model=16, n_heads=2, max_seq_len=8))


def test_qk_cap_attached_to_adamw_caps_after_each_real_step_and_rides_in_a_state_dict():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.3)
    pairs = attention_pairs(model)
    cap = 0.5 * min(float(head_norms(q, 2).max() * head_norms(k, 2).max()) for q, k, _, _ in pairs.values())
    capped = QKCap(model=model, cap=cap).attach(optimizer)
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        model(tokens).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for q, k, heads, _ in pairs.values():
            assert bool((head_norms(q, heads) * head_norms(k, heads) <= cap * (1 + 1e-4)).all())
    assert capped.steps == 2 and sum(capped.clipped.values()) >= 2
    before = [p.clone() for p in model.parameters()]

    def failing():
        raise RuntimeError("a step that raises")
    with pytest.raises(RuntimeError, match="a step that raises"):
        optimizer.step(failing)
    assert capped.steps == 2 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    state = capped.state_dict()
    restored = QKCap(model=tiny_model(), cap=1.0)
    restored.load_state_dict(state)
    assert (restored.cap, restored.steps, restored.clipped) == (cap, 2, capped.clipped)
    assert all(torch.equal(restored.bounds[name], capped.bounds[name]) for name in capped.bounds)
    with pytest.raises(ValueError, match="are not this QKCap's"):
        QKCap(pairs=[pairs["layers.0.attention"]], cap=1.0).load_state_dict(state)
    capped.detach()
    model(tokens).square().mean().backward()
    optimizer.step()
    assert capped.steps == 2


def test_pairs_are_found_in_the_reference_model_and_a_hugging_face_llama_with_gqa():
    assert {name: pair[2:] for name, pair in attention_pairs(tiny_model()).items()} == \
        {"layers.0.attention": (2, 2), "layers.1.attention": (2, 2)}
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8))
    pairs = attention_pairs(llama)
    assert {name: pair[2:] for name, pair in pairs.items()} == {"model.layers.0.self_attn": (4, 2)}
    q, k = pairs["model.layers.0.self_attn"][:2]
    assert q is llama.model.layers[0].self_attn.q_proj.weight and k is llama.model.layers[0].self_attn.k_proj.weight
    with torch.no_grad():
        q.mul_(30)
    cap = 0.5 * float(head_norms(q, 4).max() * head_norms(k, 2).max())
    QKCap(model=llama, cap=cap).step()
    assert bool((head_norms(q, 4) * head_norms(k, 2).repeat_interleave(2) <= cap * (1 + 1e-4)).all())


def test_a_model_without_attention_or_a_head_size_is_refused_by_name():
    with pytest.raises(ValueError, match="no module with q_proj and k_proj"):
        QKCap(model=torch.nn.Linear(4, 4), cap=1.0)
    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    holder = torch.nn.Sequential(attention)
    with pytest.raises(ValueError, match="cannot tell the head size of 0"):
        QKCap(model=holder, cap=1.0)
    attention.head_dim = 3
    with pytest.raises(ValueError, match=r"q_proj \(8\), k_proj \(4\) do not split into heads of its head size 3"):
        QKCap(model=holder, cap=1.0)
    with pytest.raises(TypeError, match="one of the two"):
        QKCap(cap=1.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        QKCap(model=tiny_model(), cap=0)


def test_qk_cap_flag_caps_a_training_run_and_its_state_goes_in_the_checkpoint(tmp_path, monkeypatch):
    from spectral_ops.train import data as data_module
    from spectral_ops.train.__main__ import main

    monkeypatch.setattr(data_module, "DEFAULT_CACHE", tmp_path / "cache")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"file{i}.txt").write_text("spectral decay of attention heads " * (40 + i))
    cap, out = 0.01, tmp_path / "run"
    flags = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--seq-len", "16", "--batch-size", "2",
             "--warmup-steps", "1", "--log-every", "2", "--val-batches", "1", "--lr", "0.1", "--data", str(corpus),
             "--out-dir", str(out), "--qk-cap", str(cap)]
    main([*flags, "--steps", "2"])
    main([*flags, "--steps", "3", "--resume", "--force"])  # --force: 3 steps where the run had 2
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["config"]["qk_cap"] == cap
    assert state["qk_cap"]["cap"] == cap and state["qk_cap"]["steps"] == 3  # counted on from the checkpoint
    assert sum(state["qk_cap"]["clipped"].values()) > 0
    model = Transformer(preset("tiny", **{k: state["config"][k] for k in ("n_layers", "d_model", "n_heads")})
                        .model_config(state["model"]["embed.weight"].shape[0]))
    model.load_state_dict(state["model"])
    for q, k, heads, kv in attention_pairs(model).values():
        assert bool((head_norms(q, heads) * head_norms(k, kv) <= cap * (1 + 1e-4)).all())
