"""Small deterministic models and a training loop shared by the optimizer tests."""

import torch


def tiny_model(seed=0, bias=True):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=bias), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=bias))


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator)


def train(model, optimizer, steps, start=0, scheduler=None):
    """Run ``steps`` steps and return the parameters after each one."""
    history = []
    for step in range(start, start + steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def assert_same_trajectory(history_a, history_b, atol):
    for step, (a, b) in enumerate(zip(history_a, history_b)):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa, pb, rtol=0, atol=atol, msg=lambda m: f"step {step}: {m}")
