"""SPEC 3 metrics on inputs whose answer is known by construction.

Tolerances: every metric is computed from a float64 SVD of at most 64 x 64 matrices, accurate to
~r * eps * s_1 ~ 1e-14 relative; 1e-12 leaves two orders of margin. Inputs built in float32 are
checked against their own float64 spectrum, so the same bound applies.
"""

import math

import pytest
import torch

from spectral_ops import metrics
from spectral_ops.linalg import matrix_with_spectrum

TOL = 1e-12
RANK_METRICS = ("algebraic_rank", "stable_rank", "effective_rank", "output_energy_rank", "top_k_energy",
                "spectral_entropy")


def close(value, expected, tol=TOL):
    return abs(float(value) - float(expected)) <= tol * max(1.0, abs(float(expected)))


@pytest.mark.parametrize("shape", [(6, 6), (9, 4), (4, 9)])
def test_orthonormal_matrix_has_full_flat_spectrum(shape):
    W = matrix_with_spectrum(shape, torch.ones(min(shape)))
    r = min(shape)
    m = metrics.matrix_metrics(W, top_k=2)
    for name in ("algebraic_rank", "stable_rank", "effective_rank", "output_energy_rank"):
        assert close(m[name], r), name
    assert close(m["spectral_entropy"], 1.0)
    assert close(m["top_k_energy"], 2 / r)
    assert close(m["spectral_norm"], 1.0)
    assert close(m["frobenius_norm"], math.sqrt(r))
    assert close(metrics.frobenius_norm(W), math.sqrt(r))
    assert close(metrics.spectral_norm(W), 1.0)


def test_identity():
    identity = torch.eye(5)
    assert int(metrics.algebraic_rank(identity)) == 5
    assert close(metrics.stable_rank(identity), 5) and close(metrics.effective_rank(identity), 5)
    assert close(metrics.spectral_entropy(identity), 1.0)


def test_rank_one_matrix():
    u, v = torch.randn(7, 1, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64)
    W = 3.0 * u @ v
    assert int(metrics.algebraic_rank(W)) == 1
    assert close(metrics.stable_rank(W), 1.0)
    assert close(metrics.effective_rank(W), 1.0)
    assert close(metrics.output_energy_rank(W), 1.0)
    assert close(metrics.top_k_energy(W, 1), 1.0)
    # The zero modes are round-off (~1e-16 of s_1); their entropy terms are ~1e-14 at most.
    assert abs(float(metrics.spectral_entropy(W))) < 1e-12
    assert close(metrics.spectral_norm(W), torch.linalg.vector_norm(u) * torch.linalg.vector_norm(v) * 3.0)


def test_prescribed_spectrum():
    # s = (2, 1, 1, 0): q = (1/2, 1/4, 1/4, 0), q2 = (4/6, 1/6, 1/6, 0), R = 4 including the zero mode.
    W = matrix_with_spectrum((6, 4), [2.0, 1.0, 1.0, 0.0])
    H_q = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    H_q2 = -(4 / 6 * math.log(4 / 6) + 2 / 6 * math.log(1 / 6))
    m = metrics.matrix_metrics(W, top_k=1)
    assert int(m["algebraic_rank"]) == 3
    assert close(m["stable_rank"], 6 / 4)
    assert close(m["effective_rank"], math.exp(H_q))
    assert close(m["output_energy_rank"], math.exp(H_q2))
    assert close(m["top_k_energy"], 4 / 6)
    assert close(m["spectral_entropy"], H_q / math.log(4))
    assert close(m["frobenius_norm"], math.sqrt(6))


def test_single_functions_agree_with_the_table_of_one_svd():
    W = matrix_with_spectrum((10, 7), torch.logspace(0, -2, 7), seed=3)
    m = metrics.matrix_metrics(W, top_k=3)
    assert close(metrics.stable_rank(W), m["stable_rank"])
    assert close(metrics.effective_rank(W), m["effective_rank"])
    assert close(metrics.output_energy_rank(W), m["output_energy_rank"])
    assert close(metrics.top_k_energy(W, 3), m["top_k_energy"])
    assert close(metrics.spectral_entropy(W), m["spectral_entropy"])
    assert int(metrics.algebraic_rank(W)) == int(m["algebraic_rank"]) == 7


@pytest.mark.parametrize("scale", [1e-3, 7.0])
def test_shape_metrics_are_scale_invariant_and_norms_homogeneous(scale):
    W = matrix_with_spectrum((12, 8), torch.logspace(0, -3, 8), seed=1)
    a, b = metrics.matrix_metrics(W), metrics.matrix_metrics(scale * W)
    for name in RANK_METRICS:
        assert close(a[name], b[name]), name
    assert close(b["spectral_norm"], scale * a["spectral_norm"])
    assert close(b["frobenius_norm"], scale * a["frobenius_norm"])


def test_batched_input_gives_per_matrix_results():
    batch = torch.stack([matrix_with_spectrum((8, 5), torch.logspace(0, -k, 5), seed=k) for k in range(1, 4)])
    batched = metrics.matrix_metrics(batch.reshape(3, 1, 8, 5))
    for i in range(3):
        single = metrics.matrix_metrics(batch[i])
        for name, value in single.items():
            assert close(batched[name][i, 0], value), name


def test_algebraic_rank_tolerance_default_and_explicit():
    # A float32 product of rank 3: its other singular values are float32 round-off, ~1e-7 of s_1,
    # inside the default tolerance max(m, n) * eps32 ~ 1.9e-6. At a float64-level tolerance that
    # round-off is real content of the stored matrix and counts.
    generator = torch.Generator().manual_seed(0)
    A, B = torch.randn(16, 3, generator=generator), torch.randn(3, 12, generator=generator)
    assert int(metrics.algebraic_rank(A @ B)) == 3
    assert int(metrics.algebraic_rank(A @ B, rtol=1e-12)) == 12
    assert int(metrics.algebraic_rank(A.double() @ B.double())) == 3
    spaced = matrix_with_spectrum((5, 5), [1.0, 0.6, 0.4, 0.2, 0.1])
    assert int(metrics.algebraic_rank(spaced, rtol=0.5)) == 2  # counts s_i > 0.5 s_1
    # Half precision is measured at the package's compute precision (float32), not at its own eps.
    assert int(metrics.algebraic_rank(torch.eye(64, dtype=torch.bfloat16))) == 64


def test_zero_matrix_has_rank_zero_everywhere():
    m = metrics.matrix_metrics(torch.zeros(4, 3))
    assert all(float(value) == 0.0 for value in m.values())


def test_shape_distance():
    a = torch.tensor([1.0, 0.1], dtype=torch.float64)
    b = torch.tensor([1.0, 0.01], dtype=torch.float64)
    # |log10 1 - log10 1| = 0 and |log10 0.1 - log10 0.01| = 1: mean 0.5.
    assert close(metrics.shape_distance([a], [b]), 0.5)
    # Each layer's mean over modes, then the mean over layers: (0.5 + 0) / 2.
    assert close(metrics.shape_distance([a, a], [b, a]), 0.25)
    W = matrix_with_spectrum((9, 6), torch.logspace(0, -2, 6), seed=2)
    assert metrics.shape_distance([W], [W]) == 0.0
    assert close(metrics.shape_distance([W], [5.0 * W]), 0.0)  # only the shape s / s_1 counts
    # A matrix and its spectrum are interchangeable.
    V = matrix_with_spectrum((9, 6), torch.logspace(0, -1, 6), seed=4)
    assert close(metrics.shape_distance([W], [V]), metrics.shape_distance([metrics.singular_values(W)], [V]))
    # Zero modes have no logarithm and are left out.
    with_zero = torch.tensor([1.0, 0.1, 0.0], dtype=torch.float64)
    assert close(metrics.shape_distance([with_zero], [torch.tensor([1.0, 0.01, 0.001], dtype=torch.float64)]), 0.5)
    # A layer decayed to zero has no shape: it is left out, and alone it gives NaN.
    zero = torch.zeros(2, dtype=torch.float64)
    assert close(metrics.shape_distance([a, zero], [b, a]), 0.5)
    assert math.isnan(metrics.shape_distance([zero], [a]))
    with pytest.raises(ValueError):
        metrics.shape_distance([a], [a, a])


def test_effective_lr_splits_the_update():
    W = matrix_with_spectrum((6, 4), [3.0, 2.0, 1.0, 1.0])
    norm = math.sqrt(15.0)
    assert close(metrics.effective_lr(W, 0.1).proxy, 0.1 / norm)
    radial = metrics.effective_lr(W, 0.1, update=-0.01 * W)
    assert close(radial.radial, -0.01) and float(radial.tangential) < 1e-15
    # An update orthogonal to W (Frobenius): rotate the spectrum's weight onto another mode.
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    orthogonal = U @ torch.diag(torch.tensor([1.0, -1.5, 0.0, 0.0], dtype=torch.float64)) @ Vh  # <., W> = 3 - 3 = 0
    result = metrics.effective_lr(W, 0.1, update=orthogonal)
    assert abs(float(result.radial)) < 1e-15
    assert close(result.tangential, math.sqrt(1.0 + 2.25) / norm)


def test_qk_stable_rank_per_head_matches_the_explicit_product():
    generator = torch.Generator().manual_seed(0)
    d_model, head_dim, n_heads = 16, 4, 4
    W_Q = torch.randn(n_heads * head_dim, d_model, generator=generator, dtype=torch.float64)
    W_K = torch.randn(n_heads * head_dim, d_model, generator=generator, dtype=torch.float64)
    result = metrics.qk_stable_rank(W_Q, W_K, n_heads)
    for h in range(n_heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        assert close(result[h], metrics.stable_rank(W_Q[rows].T @ W_K[rows]))
    # Grouped-query attention: two query heads per key head.
    W_K2 = W_K[: 2 * head_dim]
    grouped = metrics.qk_stable_rank(W_Q, W_K2, n_heads, n_kv_heads=2)
    for h in range(n_heads):
        rows, key_rows = slice(h * head_dim, (h + 1) * head_dim), slice((h // 2) * head_dim, (h // 2 + 1) * head_dim)
        assert close(grouped[h], metrics.stable_rank(W_Q[rows].T @ W_K2[key_rows]))
    # Equal orthonormal query and key rows: the product is a rank-head_dim projector.
    Q, _ = torch.linalg.qr(torch.randn(d_model, head_dim, generator=generator, dtype=torch.float64))
    assert close(metrics.qk_stable_rank(Q.T, Q.T, 1)[0], head_dim)


def test_attention_entropy_and_max_probability():
    q = 6
    uniform = torch.full((2, q, q), 1.0 / q, dtype=torch.float64)
    assert torch.allclose(metrics.attention_entropy(uniform), torch.ones(2, dtype=torch.float64))
    one_hot = torch.eye(q, dtype=torch.float64).expand(2, q, q)
    assert torch.all(metrics.attention_entropy(one_hot) == 0)
    assert torch.all(metrics.mean_max_attention(one_hot) == 1)
    # Causal and uniform over the keys each query sees: normalised entropy 1 for every query that
    # sees at least 2 keys (query 0 sees one and is left out); max probability 1/(i+1).
    causal = torch.tril(torch.ones(q, q, dtype=torch.float64))
    causal = causal / causal.sum(-1, keepdim=True)
    assert close(metrics.attention_entropy(causal, causal=True), 1.0)
    expected_max = sum(1.0 / (i + 1) for i in range(1, q)) / (q - 1)
    assert close(metrics.mean_max_attention(causal, causal=True), expected_max)
    mask = torch.tril(torch.ones(q, q, dtype=torch.bool))
    assert close(metrics.attention_entropy(causal, mask=mask), 1.0)
    # With a cache of 2 earlier keys, query i sees i + 3 keys.
    cached = torch.tril(torch.ones(q, q + 2, dtype=torch.float64), diagonal=2)
    cached = cached / cached.sum(-1, keepdim=True)
    assert close(metrics.attention_entropy(cached, causal=True), 1.0)


def _centred_with_spectrum(n_tokens, n_features, spectrum, mean, seed):
    """``U diag(spectrum) V^T + mean`` with the columns of ``U`` orthogonal to the all-ones vector,
    so that centring over tokens removes exactly ``mean`` and leaves the prescribed spectrum."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.cat([torch.ones(n_tokens, 1, dtype=torch.float64),
                     torch.randn(n_tokens, len(spectrum), generator=generator, dtype=torch.float64)], dim=1)
    U = torch.linalg.qr(raw)[0][:, 1:]
    V = torch.linalg.qr(torch.randn(n_features, len(spectrum), generator=generator, dtype=torch.float64))[0]
    return U @ torch.diag(torch.tensor(spectrum, dtype=torch.float64)) @ V.T + torch.tensor(mean, dtype=torch.float64)


def test_v_activation_effective_rank_is_spec3_erank_of_the_centred_whole_projection():
    # Centred output with singular values 3, 2, 1 over 4 features (2 heads of 2), plus a large mean.
    Z = _centred_with_spectrum(8, 4, [3.0, 2.0, 1.0], [5.0, -4.0, 3.0, 2.0], seed=5)
    q = [3 / 6, 2 / 6, 1 / 6]  # q = s / sum s
    by_hand = math.exp(-sum(qi * math.log(qi) for qi in q))
    assert close(metrics.v_activation_effective_rank(Z.reshape(2, 4, 4)), by_hand)
    # Uncentred, the mean is one more (dominant) mode and the answer is a different number.
    assert abs(float(metrics.effective_rank(Z)) - by_hand) > 0.1


def test_sample_tokens_is_deterministic_and_shared_by_the_metrics():
    Z = torch.randn(3, 50, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sample = metrics.sample_tokens(Z, 40, seed=7)
    rows = Z.reshape(150, 6)
    picked = [int(torch.nonzero((rows == row).all(1))[0]) for row in sample]
    assert sample.shape == (40, 6) and len(set(picked)) == 40  # 40 distinct rows of the input
    assert torch.equal(metrics.sample_tokens(Z, 40, seed=7), sample)
    assert not torch.equal(metrics.sample_tokens(Z, 40, seed=8), sample)
    assert torch.equal(metrics.sample_tokens(Z, 500), rows)  # fewer tokens than asked: all of them
    assert close(metrics.v_activation_effective_rank(Z, 40, seed=7), metrics.v_activation_effective_rank(sample, None))
    assert metrics.sample_tokens(torch.randn(2000, 3)).shape == (metrics.V_SAMPLE_TOKENS, 3)


def test_v_activation_metrics_average_the_layers():
    layers = [_centred_with_spectrum(16, 4, spectrum, [1.0, 0.0, 2.0, 0.0], seed=seed)
              for seed, spectrum in ((1, [1.0, 1.0, 1.0, 1.0]), (2, [1.0, 0.0, 0.0, 0.0]))]
    summary = metrics.v_activation_metrics(layers, n_heads=2)
    assert close(summary["activation_effective_rank"], (4.0 + 1.0) / 2)  # flat rank 4, and rank 1
    expected_cka = sum(metrics.mean_cross_head_cka(Z, 2) for Z in layers) / 2
    assert close(summary["cross_head_cka"], expected_cka)
    assert math.isnan(metrics.v_activation_metrics(layers, n_heads=1)["cross_head_cka"])


def test_fixed_input_v_metrics_apply_the_weights_to_the_given_inputs():
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 30, 5, generator=generator) for _ in range(2)]
    weights = [torch.randn(4, 5, generator=generator) for _ in range(2)]
    outputs = [x.double() @ W.double().T for x, W in zip(inputs, weights)]
    for n_tokens in (None, 20):  # sampling the inputs picks the rows sampling the outputs would
        fixed = metrics.fixed_input_v_metrics(inputs, weights, n_heads=2, n_tokens=n_tokens)
        direct = metrics.v_activation_metrics(outputs, n_heads=2, n_tokens=n_tokens)
        assert all(close(fixed[key], direct[key]) for key in direct)
    with pytest.raises(ValueError, match="layers"):
        metrics.fixed_input_v_metrics(inputs, weights[:1], n_heads=2)


def test_linear_cka():
    generator = torch.Generator().manual_seed(1)
    Z = torch.randn(200, 5, generator=generator, dtype=torch.float64)
    rotation, _ = torch.linalg.qr(torch.randn(5, 5, generator=generator, dtype=torch.float64))
    assert close(metrics.linear_cka(Z, Z), 1.0)
    # Invariant to rotations, isotropic scaling and shifts (outputs are centred).
    assert close(metrics.linear_cka(Z, 3.0 * Z @ rotation + 2.0), 1.0)
    # Centred representations with Zi^T Zj = 0 share nothing.
    # QR of centred columns gives orthonormal columns that are still centred.
    raw = torch.randn(200, 4, generator=generator, dtype=torch.float64)
    basis, _ = torch.linalg.qr(raw - raw.mean(0))
    assert abs(float(metrics.linear_cka(basis[:, :2], basis[:, 2:]))) < 1e-12
    identical_heads = torch.cat([Z, Z @ rotation], dim=-1)
    assert close(metrics.mean_cross_head_cka(identical_heads.reshape(2, 100, 10), n_heads=2), 1.0)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3), torch.nn.LayerNorm(3))


def test_capture_and_fixed_inputs():
    source, target = _model(0), _model(1)
    x = torch.randn(5, 4)
    captured = metrics.capture(source, ["0", "2"], x)
    assert torch.equal(captured["2"].args[0], torch.relu(source[0](x)).detach())
    assert torch.equal(captured["0"].output, source[0](x).detach())
    assert all(not source.get_submodule(name)._forward_hooks for name in ("0", "2"))
    fixed = metrics.fixed_input_outputs(source, target, ["2"], x)
    # target's layer 2 applied to what source's layer 2 received, not to target's own activations.
    assert torch.allclose(fixed["2"], target[2](torch.relu(source[0](x))))
    assert not torch.allclose(fixed["2"], metrics.capture(target, ["2"], x)["2"].output)


class _WithUnusedBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


def test_capture_rejects_modules_the_forward_never_calls():
    model = _WithUnusedBranch()
    with pytest.raises(RuntimeError, match="unused"):
        metrics.capture(model, ["used", "unused"], torch.randn(1, 2))
    assert not model.used._forward_hooks and not model.unused._forward_hooks


def test_module_metrics_table():
    model = _model(0)
    rows = metrics.module_metrics_table(model, top_k=2)
    assert [row["module"] for row in rows] == ["0", "2"]  # LayerNorm and biases are vectors
    assert rows[0]["shape"] == "6x4"
    expected = metrics.matrix_metrics(model[2].weight.detach(), top_k=2)
    assert all(close(rows[1][name], expected[name]) for name in expected)


def test_stable_rank_change_percent_is_the_mean_relative_change_over_layers():
    a = [torch.diag(torch.tensor([1.0, 1.0])), torch.diag(torch.tensor([2.0, 1.0]))]  # stable ranks 2, 1.25
    b = [torch.diag(torch.tensor([1.0, 0.0])), torch.diag(torch.tensor([1.0, 1.0]))]  # 1, 2
    assert close(metrics.stable_rank_change_percent(a, b), 100 * ((1 / 2 - 1) + (2 / 1.25 - 1)) / 2)
    assert metrics.stable_rank_change_percent(a, a) == 0.0
    with pytest.raises(ValueError, match="layers"):
        metrics.stable_rank_change_percent(a, b[:1])
