"""Cautious spectral decay (SPEC 11): ``W <- W - lr (u + lambda_p 1[u * S_p(W) >= 0] S_p(W))``, element-wise,
``u`` the step's own update, and the ordinary ``lambda_1 W`` term masked the same way by ``u * W``.

The oracle is a by-hand step: ``S_p`` from the FP64 SVD (:mod:`spectral_ops.reference`), ``u`` the
optimizer's own (Adam's by hand; SGD's and Muon's from the same optimizer without decay), in float64.
At ``p = 1`` it is cautious weight decay (Chen et al. 2025, arXiv 2510.12402), checked against a by-hand
CWD step and against heavyball's ``cautious_weight_decay`` (pytorch-optimizer 4.1 has none: its
``cautious`` flags mask the update by the gradient, C-Optim, not the decay).
"""

from __future__ import annotations

import pytest
import torch
from test_optim_capturable import gradients, host_reads_forbidden

import spectral_ops as so
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD
from spectral_ops.reference import spectral_power_svd

from integration_recipes import framework
from optim_models import tiny_model

LR, LAMBDA_1, LAMBDA_P = 0.05, 0.3, 0.2
BETAS, EPS = (0.9, 0.999), 1e-8


def cautious(u, term):
    """The by-hand masked term: ``term`` where ``u * term >= 0``, else 0 (SPEC 11)."""
    return torch.where(u * term >= 0, term, 0.0)


def adam(moments, grad, step):
    """Adam's update ``u`` (``W <- W - lr u``) by hand, its moments advanced in place."""
    m, v = moments
    m.mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
    return (m / (1 - BETAS[0] ** step)) / ((v / (1 - BETAS[1] ** step)).sqrt() + EPS)


def fp64_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(12, 7, dtype=torch.float64, generator=generator)),
            torch.nn.Parameter(torch.randn(7, dtype=torch.float64, generator=generator))]


def fp64_gradients(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(param.shape, dtype=param.dtype, generator=generator) for param in params]


def by_hand_adam(params, p, steps, lambda_1=LAMBDA_1, lambda_p=LAMBDA_P):
    """``steps`` cautious AdamW steps by hand; the masks' fractions kept, per term, for the checks."""
    weights = [param.detach().clone() for param in params]
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    kept = []
    for step in range(1, steps + 1):
        for w, m, grad in zip(weights, moments, fp64_gradients(params, step)):
            u = adam(m, grad, step)
            terms = [lambda_1 * w] + ([lambda_p * spectral_power_svd(w, p)] if w.ndim == 2 else [])
            kept += [(u * term >= 0).double().mean().item() for term in terms]
            w -= LR * (u + sum(cautious(u, term) for term in terms))
    return weights, kept


def run(optimizer, params, steps):
    for step in range(1, steps + 1):
        for param, grad in zip(params, fp64_gradients(params, step)):
            param.grad = grad
        optimizer.step()


# FP64 throughout: the plan's S_p agrees with the SVD's to ~1e-15 of s_max^p (p = 4 multiplies the
# rounding of s by 4), and a step adds lr * lambda_p times it; 1e-12 of the largest entry a step
# writes leaves room for the 3 steps' roundings and nothing for a wrong mask, which moves an entry by
# lr * lambda * |term| (~1e-2 here).
def assert_fp64_close(actual, expected, p):
    scale = max(1.0, max(LR * LAMBDA_P * spectral_power_svd(w, p).abs().max().item() for w in expected if w.ndim == 2))
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("p", [0, 2, 4])
@pytest.mark.parametrize("form", ["adamw", "attached-adamw"])
def test_a_cautious_step_is_the_by_hand_step_in_fp64(form, p):
    params = fp64_params()
    expected, kept = by_hand_adam(params, p, steps=3)
    if form == "adamw":
        optimizer = SpectralAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=LAMBDA_1, p=p,
                                  spectral_weight_decay=LAMBDA_P, stability="ignore", cautious=True)
    else:  # torch's AdamW, no decay of its own; both terms in the attached decay, the vector's too
        optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        SpectralDecay(params, p=p, spectral_weight_decay=LAMBDA_P, ordinary_weight_decay=LAMBDA_1,
                      stability="ignore", cautious=True).attach(optimizer)
    run(optimizer, params, steps=3)
    assert all(0.2 < fraction < 0.8 for fraction in kept)  # every mask keeps some entries and drops others
    assert_fp64_close(params, expected, p)


@pytest.mark.parametrize("name", ["sgd-nesterov", "muon"])
def test_sgd_and_muon_mask_by_their_own_update(name):
    """``u`` is what each optimizer adds: read here from the same optimizer without decay, one step."""
    def build(params, **decay):
        if name == "muon":
            return SpectralMuon(params, lr=LR, precision="fp64", **decay)
        return SpectralSGD(params, lr=LR, momentum=0.9, nesterov=True, **decay)

    p = 2
    params, plain = (fp64_params()[:1] if name == "muon" else fp64_params() for _ in range(2))
    before = [param.detach().clone() for param in params]
    run(build(plain, weight_decay=0.0), plain, steps=1)
    run(build(params, weight_decay=LAMBDA_1, p=p, spectral_weight_decay=LAMBDA_P, stability="ignore", cautious=True),
        params, steps=1)
    expected = []
    for w, after in zip(before, plain):
        u = (w - after.detach()) / LR
        terms = [LAMBDA_1 * w] + ([LAMBDA_P * spectral_power_svd(w, p)] if w.ndim == 2 else [])
        expected.append(w - LR * (u + sum(cautious(u, term) for term in terms)))
    assert_fp64_close(params, expected, p)


@pytest.mark.parametrize("coefficient", ["weight_decay", "spectral_weight_decay"])
@pytest.mark.parametrize("form", ["adamw", "attached-adamw"])
def test_at_p_1_it_is_cautious_weight_decay(form, coefficient):
    """At ``p = 1`` (``S_1(W) = W``) either coefficient is CWD's ``lambda``: ``x <- x - lr (u + lambda
    1[u x >= 0] x)``, by hand (the spectral one on the matrix only: a vector has no ``S_p``)."""
    params = fp64_params()
    decay = {"weight_decay": 0.0, "spectral_weight_decay": 0.0, coefficient: 0.5}
    expected, _ = by_hand_adam(params, 1, steps=3, lambda_1=decay["weight_decay"],
                               lambda_p=decay["spectral_weight_decay"])
    if form == "adamw":
        optimizer = SpectralAdamW(params, lr=LR, betas=BETAS, eps=EPS, p=1, cautious=True, **decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        SpectralDecay(params, p=1, spectral_weight_decay=decay["spectral_weight_decay"],
                      ordinary_weight_decay=decay["weight_decay"], cautious=True).attach(optimizer)
    run(optimizer, params, steps=3)
    assert_fp64_close(params, expected, 1)


@pytest.mark.parametrize("form", ["adamw", "attached-adamw"])
def test_at_p_1_it_is_heavyballs_cautious_weight_decay(monkeypatch, form):
    """heavyball's AdamW with ``cautious_weight_decay=True`` (``d = decay * (sign bits equal)``, then
    ``p (1 - d lr) - lr u``): five fp32 steps. Each side rounds each weight a few times a step, an eps of
    it each (weights below 3 here): 16 eps of 3 over five steps; a mask of a different entry would move
    it by lr * lambda * |x| ~ 1e-2."""
    heavyball = framework("heavyball")
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)  # eager: compiling it costs seconds on a CPU
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(16, 8, generator=generator), torch.randn(8, generator=generator)]

    def trajectory(build):
        params = [torch.nn.Parameter(tensor.clone()) for tensor in start]
        optimizer = build(params)
        gradients = torch.Generator().manual_seed(1)
        for _ in range(5):
            for param in params:
                param.grad = torch.randn(param.shape, generator=gradients)
            optimizer.step()
        return [param.detach() for param in params]

    theirs = trajectory(lambda ps: heavyball.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.5,
                                                   cautious_weight_decay=True))
    if form == "adamw":
        ours = trajectory(lambda ps: SpectralAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.5, cautious=True))
    else:
        def attached(ps):
            host = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
            SpectralDecay(ps, ordinary_weight_decay=0.5, cautious=True).attach(host)
            return host
        ours = trajectory(attached)
    uncautious = trajectory(lambda ps: SpectralAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.5))
    for a, b, c in zip(ours, theirs, uncautious):
        torch.testing.assert_close(a, b, rtol=0, atol=16 * 3 * torch.finfo(torch.float32).eps)
        assert (a - c).abs().max() > 1e-2  # the masks matter here


# ----- options


def test_cautious_is_a_validated_group_option_kept_in_the_state_dict():
    model = tiny_model()
    optimizer = SpectralAdamW([{"params": model[0].parameters(), "cautious": True}, {"params": model[2].parameters()}],
                              lr=1e-2, p=2, spectral_weight_decay=0.5)
    assert [group["cautious"] for group in optimizer.param_groups] == [True, False]
    loaded = SpectralAdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=1e-2)
    loaded.load_state_dict(optimizer.state_dict())
    assert [group["cautious"] for group in loaded.param_groups] == [True, False]
    with pytest.raises(TypeError, match="cautious must be True or False, got 1"):
        SpectralSGD(model.parameters(), cautious=1)
    optimizer.param_groups[1]["cautious"] = "yes"  # set after construction: refused before the step writes
    gradients(model, 0)
    with pytest.raises(TypeError, match="cautious must be True or False"):
        optimizer.step()


def test_a_group_without_cautious_steps_as_before():
    """Per group: a cautious group beside a plain one leaves the plain one's step bit for bit (one step:
    the gradients of a second would differ)."""
    plain_model, mixed_model = tiny_model(), tiny_model()
    plain = SpectralAdamW(plain_model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    mixed = SpectralAdamW([{"params": mixed_model[0].parameters(), "cautious": True},
                           {"params": mixed_model[2].parameters()}], lr=1e-2, p=2, spectral_weight_decay=0.5)
    for model, optimizer in ((plain_model, plain), (mixed_model, mixed)):
        gradients(model, 0)
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(plain_model[2].parameters(), mixed_model[2].parameters()))
    assert not torch.equal(plain_model[0].weight, mixed_model[0].weight)


@pytest.mark.parametrize("make, error, match", [
    (lambda ps: SpectralAdamW(ps, p=0, spectral_weight_decay=0.1, p0_mode="prox", cautious=True), ValueError,
     "p0_mode='prox' soft-thresholds the spectrum instead"),
    (lambda ps: SpectralSGD([torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))], cautious=True), TypeError,
     "complex"),
], ids=["prox", "complex"])
def test_forms_without_a_signed_decay_term_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make(tiny_model().parameters())


def test_a_standalone_spectral_decay_has_no_update_to_be_cautious_with():
    model = tiny_model()
    decay = SpectralDecay(model.parameters(), p=2, spectral_weight_decay=0.5, lr=1e-2, cautious=True)
    before = [param.detach().clone() for param in model.parameters()]
    with pytest.raises(ValueError, match=r"no update: attach it"):
        decay.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ----- capturable (atomic: the cautious case of tests/test_optim_atomic.py)


def _attached(model, **options):
    host = torch.optim.SGD(model.parameters(), lr=options.pop("lr"), momentum=0.9)
    SpectralDecay([p for p in model.parameters() if p.ndim == 2], **options).attach(host)
    return host


CAPTURABLE = {
    "adamw": lambda m, **o: SpectralAdamW(m.parameters(), weight_decay=0.1, **o),
    "sgd": lambda m, **o: SpectralSGD(m.parameters(), momentum=0.9, nesterov=True, weight_decay=0.1, **o),
    "muon-heads": lambda m, **o: SpectralMuon([m[0].weight], heads=2, weight_decay=0.1, precision="fp32", **o),
    "attached": lambda m, **o: _attached(m, ordinary_weight_decay=0.1, **o),
}


@pytest.mark.parametrize("name", CAPTURABLE)
def test_a_capturable_cautious_step_reads_nothing_back_and_matches_eager(name):
    """No host read after the first step; the same numbers as eager (the device decisions and the
    device Adam change the rounding by a few ulps at most)."""
    models = tiny_model(), tiny_model()
    optimizers = [CAPTURABLE[name](model, lr=torch.tensor(1e-2), p=2, spectral_weight_decay=0.5, stability="clamp",
                                   cautious=True, capturable=capturable)
                  for model, capturable in zip(models, (False, True))]
    for step in range(2):
        for model, optimizer in zip(models, optimizers):
            gradients(model, step)
            if step and optimizer is optimizers[1]:
                with host_reads_forbidden():
                    optimizer.step()
            else:
                optimizer.step()
    for a, b in zip(*(model.parameters() for model in models)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_attached_form_keeps_one_copy_of_the_decayed_weights_between_the_hooks():
    """The memory of the attached form: between the host's step pre- and post-hook, one copy of each
    matrix it decays (and of its increment, as without ``cautious``), nothing more."""
    model = tiny_model()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    decay = SpectralDecay([model[0].weight, model[2].weight], p=2, spectral_weight_decay=0.5, cautious=True)
    decay.attach(host)
    gradients(model, 0)
    held = []
    host.register_step_pre_hook(lambda *args: held.append(decay._planned))  # runs after the decay's pre-hook
    host.step()
    (record,) = held[0].prepared
    assert sorted(copy.numel() for copy in record.before.values()) == sorted([8 * 16, 16 * 4])
    assert all(copy.dtype == torch.float32 for copy in record.before.values())


def test_a_band_decay_is_masked_as_its_term():
    """A band's direction is the term: masked by its agreement with ``u`` (the top band at tau, p=2)."""
    params = fp64_params()
    band = so.Band(tau=1.5)
    expected = [param.detach().clone() for param in params]
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in expected]
    optimizer = SpectralAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, p=2,
                              spectral_weight_decay=LAMBDA_P, band=band, stability="ignore", cautious=True)
    run(optimizer, params, steps=1)
    for w, m, grad in zip(expected, moments, fp64_gradients(params, 1)):
        u = adam(m, grad, 1)
        term = LAMBDA_P * so.reference.band_direction_svd(w, 1.5, 2) if w.ndim == 2 else torch.zeros_like(w)
        w -= LR * (u + cautious(u, term))
    assert_fp64_close(params, expected, 2)


def _spectral_of(w, p, view=None, heads=1):
    """``S_p`` of the matrices a decay takes in ``w``: a conv filter's one matrix (``"flatten"``), a
    stack's each (``"batch"``), or each head's rows."""
    if view == "flatten":
        return spectral_power_svd(w.reshape(w.shape[0], -1), p).reshape(w.shape)
    rows = w.shape[-2] // heads
    return torch.cat([spectral_power_svd(w[..., h * rows:(h + 1) * rows, :], p) for h in range(heads)], dim=-2)


@pytest.mark.parametrize("case", ["conv-channels-last", "stack", "muon-heads"])
def test_targets_that_are_views_of_their_parameter_read_u_through_the_same_views(case):
    """The decay takes a parameter's matrices as views of it (a stack's matrices, a head's rows) or as a
    copy (a channels-last filter's matrix): ``u`` is read through the same views, by hand in FP64."""
    shape, view, heads = {"conv-channels-last": ((6, 3, 2, 2), "flatten", 1), "stack": ((3, 5, 4), "batch", 1),
                          "muon-heads": ((8, 5), None, 2)}[case]
    p, start = 2, torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    if case == "conv-channels-last":
        start = start.to(memory_format=torch.channels_last)
    params, plain = [torch.nn.Parameter(start.clone())], [torch.nn.Parameter(start.clone())]

    def build(ps, **decay):
        if case == "muon-heads":
            return SpectralMuon(ps, lr=LR, precision="fp64", heads=heads, **decay)
        return SpectralAdamW(ps, lr=LR, matrix_view=view, **decay)

    run(build(plain, weight_decay=0.0), plain, steps=1)
    run(build(params, weight_decay=LAMBDA_1, p=p, spectral_weight_decay=LAMBDA_P, stability="ignore", cautious=True),
        params, steps=1)
    u = (start - plain[0].detach()) / LR
    terms = LAMBDA_1 * start, LAMBDA_P * _spectral_of(start, p, view, heads)
    expected = start - LR * (u + sum(cautious(u, term) for term in terms))
    torch.testing.assert_close(params[0].detach(), expected, rtol=0, atol=1e-12)
