"""QKCap: the spectral QK cap (:func:`spectral_ops.qk_cap_`) after every step of any optimizer.

``QKCap(model=model, cap=...).attach(optimizer)`` registers a step post-hook: once the host's step has
returned (a step that raised runs no post-hook, so nothing is capped after it), every attention's
``(W_q, W_k)`` pair is capped, ``s_max(W_q^h) s_max(W_k^g) <= cap``. It finds the pairs in a model's
attention modules by name (Llama-style ``q_proj``/``k_proj`` children, as Hugging Face's models and the
reference model name them) or takes them as given; ``.step()`` caps them on its own. Its state (the cap,
how many heads it clipped, each pair's last bounds) is in its ``state_dict``, for a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._checks import check_coefficient
from ..ops import check_method, check_precision
from ..qk_cap import attention_pairs, check_heads, qk_cap_


class QKCap:
    """Cap every ``(W_q, W_k)`` pair at ``cap`` (:func:`spectral_ops.qk_cap_`), after each step of an attached
    optimizer (:meth:`attach`), or at each :meth:`step`.

    ``pairs``: ``[(q_weight, k_weight, num_heads, num_kv_heads), ...]`` (``num_kv_heads`` may be left out or
    None: one key head per query head), named ``"0"``, ``"1"``, ..., or a mapping of names to them; or
    ``model``: the pairs of its attention modules (:func:`spectral_ops.qk_cap.attention_pairs`), named by module
    path. ``cap`` (required, a finite number > 0), ``method`` and ``precision`` as :func:`~spectral_ops.qk_cap_`
    takes them.

    After each application: :attr:`bounds`, each pair's bounds before it (per q head, as ``qk_cap_`` returns
    them); :attr:`clipped`, per pair, the q heads capped so far (those whose bound exceeded the cap, counted at
    every application); :attr:`steps`, the applications so far. :meth:`state_dict` holds the cap and these,
    and :meth:`load_state_dict` restores them (the loaded cap wins, as a torch optimizer's loaded
    hyper-parameters do)."""

    def __init__(self, pairs=None, *, model: torch.nn.Module | None = None, cap, method: str = "auto",
                 precision: str | None = None):
        if (pairs is None) == (model is None):
            raise TypeError("QKCap takes pairs=[(q_weight, k_weight, num_heads, num_kv_heads), ...] or model= "
                            "(whose attention modules hold them), one of the two")
        named = attention_pairs(model) if model is not None else \
            dict(pairs.items()) if isinstance(pairs, Mapping) else {str(i): pair for i, pair in enumerate(pairs)}
        self.pairs = {name: self._checked_pair(name, pair) for name, pair in named.items()}
        self.cap = float(check_coefficient(cap, "cap", positive=True))
        self.method, self.precision = check_method(method), check_precision(precision)
        self.steps = 0
        self.clipped = dict.fromkeys(self.pairs, 0)
        self.bounds: dict[str, torch.Tensor] = {}
        self._handle = None

    @staticmethod
    def _checked_pair(name: str, pair) -> tuple:
        if not isinstance(pair, (tuple, list)) or len(pair) not in (3, 4):
            raise TypeError(f"pair {name!r} must be (q_weight, k_weight, num_heads, num_kv_heads) (num_kv_heads may "
                            f"be left out), got {type(pair).__name__}")
        q, k, num_heads, *rest = pair
        num_kv_heads = rest[0] if rest else None
        try:
            num_heads, num_kv_heads, _ = check_heads(q, k, num_heads, num_kv_heads)
        except (TypeError, ValueError) as error:
            raise type(error)(f"pair {name!r}: {error}") from None
        return q, k, num_heads, num_kv_heads

    @torch.no_grad()
    def step(self) -> None:
        """Cap every pair now, one after the other: each is checked before it is written, so a pair that cannot
        be capped (a non-finite weight: the run diverged) raises with its weights as they were, after the pairs
        before it were capped."""
        for name, (q, k, num_heads, num_kv_heads) in self.pairs.items():
            bounds = qk_cap_(q, k, num_heads, self.cap, num_kv_heads=num_kv_heads, method=self.method,
                             precision=self.precision)
            self.bounds[name] = bounds
            self.clipped[name] += int((bounds > self.cap).sum())
        self.steps += 1

    def attach(self, optimizer: torch.optim.Optimizer) -> "QKCap":
        """Cap after every ``optimizer.step()`` that returns (a step post-hook); returns ``self``."""
        if not isinstance(optimizer, torch.optim.Optimizer) or not hasattr(optimizer, "_optimizer_step_post_hooks"):
            raise TypeError(f"QKCap.attach needs a torch.optim.Optimizer (it registers a step post-hook), got "
                            f"{type(optimizer).__name__}; call QKCap.step() after that optimizer's step instead")
        if self._handle is not None:
            raise RuntimeError("this QKCap is already attached; call detach() first")
        self._handle = optimizer.register_step_post_hook(lambda host, args, kwargs: self.step())
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle = None

    def state_dict(self) -> dict:
        return {"cap": self.cap, "steps": self.steps, "clipped": dict(self.clipped),
                "bounds": {name: bounds.detach().cpu() for name, bounds in self.bounds.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s: the same pairs (by name), every key checked before any is taken."""
        missing = {"cap", "steps", "clipped", "bounds"} - set(state)
        if missing:
            raise KeyError(f"not a QKCap state dict: no {sorted(missing)}")
        if set(state["clipped"]) != set(self.pairs) or not set(state["bounds"]) <= set(self.pairs):
            raise ValueError(f"the state dict's pairs {sorted(state['clipped'])} are not this QKCap's "
                             f"{sorted(self.pairs)}: load it into a QKCap over the same attention modules")
        cap = float(check_coefficient(state["cap"], "the state dict's cap", positive=True))
        devices = {name: pair[0].device for name, pair in self.pairs.items()}
        self.cap, self.steps, self.clipped = cap, int(state["steps"]), dict(state["clipped"])
        self.bounds = {name: bounds.to(devices[name]) for name, bounds in state["bounds"].items()}
