"""The reference model's observation of its attention logits and entropies, and QK-Clip on it (SPEC 11)."""

import math

import pytest
import torch

from spectral_ops import metrics
from spectral_ops.train.model import ModelConfig, Transformer, apply_rotary
from spectral_ops.train.qk_clip import QKClip

CONFIG = ModelConfig(n_layers=1, d_model=32, n_heads=4, max_seq_len=16)


def model_and_tokens(seed=0, batch=3, seq=16):
    torch.manual_seed(seed)
    model = Transformer(CONFIG)
    with torch.no_grad():  # larger QK weights than the init's: logits of order 1-10, distinct per head
        for linear in (model.layers[0].attention.q_proj, model.layers[0].attention.k_proj):
            linear.weight.mul_(torch.linspace(5, 40, CONFIG.d_model)[:, None])
    return model, torch.randint(0, CONFIG.vocab_size, (batch, seq))


def logits_by_hand(model, tokens):
    """The scaled causal scores of layer 0, (batch, heads, seq, seq), from its captured input."""
    attention = model.layers[0].attention
    x, cos, sin = metrics.capture(model, ["layers.0.attention"], tokens)["layers.0.attention"].args
    batch, seq, _ = x.shape

    def heads(t):
        return apply_rotary(t.view(batch, seq, -1, attention.head_dim).transpose(1, 2), cos, sin)

    q, k = heads(attention.q_proj(x)), heads(attention.k_proj(x))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return ((q @ k.transpose(-1, -2)) / math.sqrt(attention.head_dim)).masked_fill(~causal, float("-inf")), x


def observed(model, tokens):
    attention = model.layers[0].attention
    attention.observe_logits = True
    with torch.no_grad():
        output = model(tokens)
    return output, attention.take_observation()


def test_the_observation_is_the_max_scaled_logit_and_the_metrics_entropy_and_leaves_the_output_bitwise():
    model, tokens = model_and_tokens()
    with torch.no_grad():
        plain = model(tokens)
    output, observation = observed(model, tokens)
    assert torch.equal(output, plain)  # the SDPA path is untouched
    with torch.no_grad():
        scores, x = logits_by_hand(model, tokens)
    # fp32 scores formed by another product order: a few roundoffs of logits of order 10.
    torch.testing.assert_close(observation.max_logit, scores.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    expected = metrics.attention_entropy(scores.softmax(-1), causal=True).mean(0)  # fp64, per head
    torch.testing.assert_close(observation.entropy.double(), expected, rtol=0, atol=1e-5)  # fp32 entropies
    assert observation.sequences == len(tokens)
    torch.testing.assert_close(observation.max_input_norm, torch.linalg.vector_norm(x, dim=-1).max())
    assert len(set(observation.max_logit.tolist())) == CONFIG.n_heads and 0 < observation.entropy.min()
    assert not observation.max_logit.requires_grad


def test_micro_batches_merge_into_the_observation_of_the_whole_batch_and_eval_forwards_are_not_observed():
    model, tokens = model_and_tokens(batch=4)
    _, whole = observed(model, tokens)
    attention = model.layers[0].attention
    with torch.no_grad():
        model(tokens[:1]), model(tokens[1:])
        model.eval()(tokens)  # validation: not observed
    merged = attention.take_observation()
    assert torch.equal(merged.max_logit, whole.max_logit) and merged.sequences == whole.sequences
    torch.testing.assert_close(merged.entropy, whole.entropy)
    assert attention.take_observation() is None  # taken: forgotten


def test_qk_clip_brings_a_head_over_tau_to_tau_and_leaves_the_others_bitwise():
    model, tokens = model_and_tokens()
    _, before = observed(model, tokens)
    tau = float(before.max_logit.median())
    over = before.max_logit > tau
    assert over.any() and not over.all()
    attention = model.layers[0].attention
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    clip = QKClip(model, tau)
    factors = clip.step([before])
    torch.testing.assert_close(factors[0], torch.where(over, tau / before.max_logit, 1.0))
    assert clip.clipped == int(over.sum())
    _, after = observed(model, tokens)
    # The logit is bilinear in W_q^h and W_k^h: scaling each by sqrt(tau / m) scales it by tau / m, so the
    # same input's largest logit is tau to fp32's rounding; the other heads compute exactly what they did.
    torch.testing.assert_close(after.max_logit[over], torch.full((int(over.sum()),), tau), rtol=1e-5, atol=0)
    assert torch.equal(after.max_logit[~over], before.max_logit[~over])
    rows = over.repeat_interleave(attention.head_dim)
    for name, parameter in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            assert torch.equal(parameter[~rows], weights[name][~rows])
            assert not torch.equal(parameter[rows], weights[name][rows])
        else:
            assert torch.equal(parameter, weights[name])


def test_qk_clip_reads_the_models_own_observation_and_refuses_what_it_cannot_clip():
    model, tokens = model_and_tokens()
    clip = QKClip(model, 1e-3)  # turns the observation on
    with pytest.raises(RuntimeError, match="observed no training forward"):
        clip.step()
    with torch.no_grad():
        model(tokens)
    assert (clip.step() < 1).all()
    for tau in (0, -1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="positive finite logit"):
            QKClip(model, tau)
    weights = [p.detach().clone() for p in model.parameters()]
    _, observation = observed(model, tokens)
    poisoned = type(observation)(observation.max_logit.clone().fill_(math.nan), observation.entropy_sum,
                                 observation.sequences, observation.max_input_norm)
    with pytest.raises(FloatingPointError, match="no weight was scaled"):
        clip.step([poisoned])
    with pytest.raises(ValueError, match="one observation per layer"):
        clip.step([observation, observation])
    negative = type(observation)(-observation.max_logit, observation.entropy_sum, observation.sequences,
                                 observation.max_input_norm)
    assert torch.equal(clip.step([negative]), torch.ones(1, CONFIG.n_heads))  # m_h <= tau: untouched
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
