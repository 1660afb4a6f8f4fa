"""A decoder-only Transformer small enough to read in one sitting.

RMSNorm, rotary position embeddings, SwiGLU MLPs and *separate* Q/K/V projections, so that head-wise
vs full-matrix updates and per-module decay powers apply to each projection on its own. Parameter
names follow the conventions ``spectral_ops.optim.param_groups_by_module`` recognises
(``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``gate_proj``/``up_proj``/``down_proj``, ``embed``,
``lm_head``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    mlp_hidden: int = 0  # 0: the SwiGLU default, 8/3 d rounded up to a multiple of 64
    max_seq_len: int = 128
    tied_embeddings: bool = False
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of an even size (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 64 * math.ceil(8 * self.d_model / 3 / 64)

    def parameter_count(self) -> int:
        """Parameters by formula (the tests check the module against it)."""
        d, h, v = self.d_model, self.hidden, self.vocab_size
        per_layer = 4 * d * d + 3 * d * h + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm gains
        head = 0 if self.tied_embeddings else v * d
        return v * d + self.n_layers * per_layer + d + head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, base: float, device=None):
    inverse_frequencies = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inverse_frequencies)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate pairs (x_even, x_odd) by position-dependent angles. x: (batch, heads, seq, head_dim)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.keep_probabilities = False  # set by the metric logger to capture attention maps
        self.probabilities = None

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape

        # The heads this process holds: all of them, or under tensor parallelism its share (the
        # projections' local columns), hence -1 rather than n_heads.
        def heads(t):
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q = apply_rotary(heads(self.q_proj(x)), cos, sin)
        k = apply_rotary(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        if self.keep_probabilities:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            self.probabilities = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            out = self.probabilities.to(v.dtype) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, h = config.d_model, config.hidden
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm, self.mlp_norm = RMSNorm(config.d_model), RMSNorm(config.d_model)
        self.attention, self.mlp = Attention(config), SwiGLU(config)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = None if config.tied_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.max_seq_len, config.head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        x = self.norm(x)
        return x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)


def fully_shard_blocks(model: Transformer, mesh) -> Transformer:
    """FSDP2 over ``mesh``: each block is its own unit (its weights are whole only for its forward and
    backward), then the root takes the rest (embedding, final norm, head). Shards in place."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tensor_parallel_blocks(model: Transformer, mesh) -> Transformer:
    """Tensor parallelism over the 1-d ``mesh``, torchtitan's plan without sequence parallelism: in each
    block Q, K, V and the MLP's gate and up are split by output rows (each process computes its heads
    and its share of the hidden units; ``n_heads`` must be a multiple of ``mesh``'s size), O and down by
    input columns (their partial outputs are summed across ``mesh``). The embedding, the norms and the
    head stay whole on every process. In place."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in ("attention.q_proj", "attention.k_proj", "attention.v_proj",
                                                  "mlp.gate_proj", "mlp.up_proj")}
    plan.update({name: RowwiseParallel() for name in ("attention.o_proj", "mlp.down_proj")})
    for block in model.layers:
        parallelize_module(block, mesh, plan)
    return model
