"""The stability experiment's definitions, on planted series and runs (its --quick outputs are checked in
test_experiments.py, with the other experiments')."""

import math

import pytest
import torch

from spectral_ops.experiments import stability, stability_measures


def test_a_spike_is_a_rise_above_1_5x_the_lowest_loss_before_it_counted_once_per_episode():
    losses = [5.0, 4.0, 3.0, 2.0, 2.9, 3.1, 3.2, 2.0, 2.0, 4.0, 1.9]
    # 3.1 and 3.2 exceed 1.5 x 2.0 (one episode); 4.0 another; 2.9 does not
    assert stability_measures.loss_spikes(losses) == 2
    assert stability_measures.worst_loss_ratio(losses) == pytest.approx(2.0)
    falling = [3.0, 2.0, 1.0]
    assert stability_measures.loss_spikes(falling) == 0 and stability_measures.worst_loss_ratio(falling) == 1.0


def planted(final=2.0, first=5.0):
    """A loss falling from ``first`` to 2.0 over 20 steps, 10 steps at 2.0 (its best 10-step mean), then 10
    steps at ``final``."""
    return torch.linspace(first, 2.0, 20).tolist() + [2.0] * 10 + [final] * 10


@pytest.mark.parametrize("losses, finite, entropy, reasons", [
    (planted(), True, 0.3, []),
    (planted(), True, 0.05, ["entropy collapse"]),
    (planted(final=2.3), True, 0.3, ["loss above its best"]),  # 2.3 > (1 + 10%) x 2.0
    (planted(final=2.1), True, 0.3, []),  # within the margin
    (planted(final=2.3), True, 0.05, ["entropy collapse", "loss above its best"]),
    (planted(final=9.0), True, 0.3, ["diverged"]),  # above the first loss
    (planted()[:-1] + [math.nan], True, 0.3, ["diverged"]),
    (planted(), False, 0.3, ["diverged"]),  # non-finite weights
])
def test_the_unstable_rule_on_planted_runs(losses, finite, entropy, reasons):
    assert stability_measures.instability(losses, finite, entropy) == reasons


def test_round_to_nearest_per_channel_quantization():
    W = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    W[3] = 0  # a zero row stays zero
    for bits in (8, 4):
        Q = stability_measures.quantized(W, bits)
        levels = 2 ** (bits - 1) - 1
        scale = W.abs().amax(dim=1, keepdim=True) / levels
        codes = Q / torch.where(scale > 0, scale, 1)
        # every entry on its row's grid of 2 levels + 1 values, each row's largest entry exactly kept, and
        # rounding to nearest: within half a step
        torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)
        assert codes.abs().max() <= levels + 1e-4
        assert torch.equal(Q.abs().amax(dim=1), W.abs().amax(dim=1))
        assert ((W - Q).abs() <= scale / 2 + 1e-7).all() and torch.equal(Q[3], W[3])


def test_the_cap_bounds_every_logit_by_tau_at_unit_rms_inputs():
    config = stability.preset_config("tiny")
    d, head_dim = config.d_model, config.d_model // config.n_heads
    cap = stability.cap_for(100.0, config)
    # SPEC 11: |logit| <= ||x_i|| ||x_j|| s_q s_k / sqrt(d_h), with ||x|| = sqrt(D) at unit RMS
    assert d * cap / math.sqrt(head_dim) == pytest.approx(100.0)


def test_matched_decay_is_the_baselines_at_s0():
    config = stability.preset_config("tiny")
    s0 = {"attention": 0.45, "mlp": 0.62}
    for name in ("adamw-p1", "adamw-p2", "adamw-p4"):
        method = stability.METHODS[name]
        matched = stability.matched_config(config, method, s0)
        for family, coefficient in (("attention", matched.lambda_attention), ("mlp", matched.lambda_mlp)):
            if method.p == 1:
                assert matched.weight_decay == stability.LAMBDA_1 and coefficient is None
            else:  # the top mode at s0 decays by lambda_p s0^p = lambda_1 s0
                assert matched.weight_decay == 0 and matched.p == method.p
                assert coefficient * s0[family] ** method.p == pytest.approx(stability.LAMBDA_1 * s0[family])


def test_an_unknown_method_is_refused_before_any_run():
    with pytest.raises(ValueError, match="unknown stability methods"):
        stability.check_available(["adamw-p3"])
    stability.check_available(list(stability.METHODS))


def test_the_stability_options_belong_to_it_alone(tmp_path):
    from spectral_ops.experiments.__main__ import main

    with pytest.raises(SystemExit):
        main(["polar-accuracy", "--out", str(tmp_path), "--workers", "2"])
