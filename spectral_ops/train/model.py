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

# The side computation of an observed forward forms each sequence's (heads, seq, seq) scores in fp32,
# a few sequences at a time: at most this many scores at once (64 MiB), so that a long sequence
# (paper12's 4096 tokens: 6 heads x 4096^2 = 1e8 scores per sequence) is observed one sequence at a time.
OBSERVED_SCORES = 2**24


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


@dataclass(frozen=True)
class AttentionObservation:
    """What the training forwards of one attention module showed since it was last read, per head
    (:meth:`Attention.take_observation`): the largest attention logit, the scaled pre-softmax score
    ``q_i . k_j / sqrt(d_h)`` over every sequence and every causal pair ``j <= i`` (Kimi K2's ``S_max^h``,
    the logit QK-Clip compares with its threshold); the attention entropy ``H(row) / log(#keys)``
    (:func:`spectral_ops.metrics.attention_entropy`: 0 = every query on one key, 1 = uniform) summed over
    the sequences, each sequence's mean over its queries; and the largest norm of an input row ``x_i``,
    which with the weights' spectral norms bounds every logit (SPEC 11)."""

    max_logit: torch.Tensor  # (heads,) fp32
    entropy_sum: torch.Tensor  # (heads,)
    sequences: int
    max_input_norm: torch.Tensor  # () fp32

    @property
    def entropy(self) -> torch.Tensor:
        """Per head, the mean over the observed sequences of each one's mean entropy over its queries."""
        return self.entropy_sum / self.sequences

    def merged(self, other: "AttentionObservation") -> "AttentionObservation":
        """This observation and ``other`` together (the micro-batches of one step)."""
        return AttentionObservation(torch.maximum(self.max_logit, other.max_logit),
                                    self.entropy_sum + other.entropy_sum, self.sequences + other.sequences,
                                    torch.maximum(self.max_input_norm, other.max_input_norm))


@torch.no_grad()
def observe_attention(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> AttentionObservation:
    """The :class:`AttentionObservation` of one forward: its input ``x`` (batch, seq, D) and its rotated
    queries and keys ``q``, ``k`` (batch, heads, seq, head_dim). The scores are formed again in fp32
    outside autocast, the kernel that computed the output (SDPA) reporting none of them. The entropy is
    :func:`spectral_ops.metrics.attention_entropy`'s (each row's normalised by the log of its key count, the
    first query, which sees one key, left out), in fp32: a metric, at twice the speed of its fp64."""
    batch, heads, seq, head_dim = q.shape
    causal = torch.zeros(seq, seq, device=q.device).masked_fill(
        ~torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    log_keys = torch.log(torch.arange(2, seq + 1, dtype=torch.float32, device=q.device))
    chunk = max(1, OBSERVED_SCORES // (heads * seq * seq))
    max_logits, entropy_sums = [], []
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, batch, chunk):
            queries, keys = (t[start:start + chunk].float().flatten(0, 1) for t in (q, k))
            scores = torch.baddbmm(causal.expand(len(queries), seq, seq), queries, keys.transpose(-1, -2),
                                   alpha=1 / math.sqrt(head_dim)).view(-1, heads, seq, seq)
            max_logits.append(scores.amax(dim=(0, 2, 3)))
            rows = torch.special.entr(scores.softmax(-1)).sum(-1)[..., 1:]  # (sequences, heads, seq - 1)
            # Summed over the queries, then / (seq - 1): 0 for a single query, as metrics' safe ratio.
            entropy_sums.append((rows / log_keys).sum(-1).sum(0) / max(seq - 1, 1))
        max_input_norm = torch.linalg.vector_norm(x.float(), dim=-1).max()
    return AttentionObservation(torch.stack(max_logits).amax(0), torch.stack(entropy_sums).sum(0), batch,
                                max_input_norm)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.keep_probabilities = False  # set by the metric logger to capture attention maps
        self.probabilities = None
        # Set by QK-Clip and the stability experiment: each training-mode forward is then observed on the
        # side (observe_attention), merged into `observation` until take_observation() reads it. Eval-mode
        # forwards (validation, the metric logger's probe) are not: QK-Clip acts on what the step's own
        # forward saw, as Kimi K2 defines it.
        self.observe_logits = False
        self.observation: AttentionObservation | None = None

    def take_observation(self) -> AttentionObservation | None:
        """What the training forwards showed since the last call (None: no observed forward), forgotten here."""
        observation, self.observation = self.observation, None
        return observation

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
        if self.observe_logits and self.training:
            observed = observe_attention(x, q, k)
            self.observation = observed if self.observation is None else self.observation.merged(observed)
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
