"""Built-in models. Both meet the contract every model must meet to be split into stages:

* the factory returns an ``nn.Sequential`` whose top-level children run one after another, each
  taking the previous child's single output tensor (and any keyword inputs of the batch, such as
  ``attention_mask``, that its forward names);
* the first child takes the token ids ``(batch, seq)`` (int64), the last returns logits
  ``(batch, seq, vocab_size)``;
* every parameter belongs to a module with ``reset_parameters()`` (all of ``torch.nn``'s layers
  have one), and there are no buffers that ``reset_parameters()`` does not rebuild: the runner
  builds the model on the meta device and initialises only the rank's own children.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["transformer", "mlp", "TP_PLAN"]

# Tensor parallelism (parallel.tp, runner.parallel.tp), in transformers' style names: the vocabulary rows of
# the token embedding and the head, each attention's heads and each feed-forward's hidden units;
# norms and the position table stay whole on every shard.
TP_PLAN = {
    "embed.tok": "embedding_rowwise",
    "block*.attn.qkv": "colwise",
    "block*.attn.proj": "rowwise",
    "block*.ffn.up": "colwise",
    "block*.ffn.down": "rowwise",
    "head": "colwise_gather_output",
}


class Table(nn.Embedding):
    """An ``nn.Embedding`` initialised N(0, ``std``) (torch's own: N(0, 1))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, std: float = 1.0):
        self.std = std  # read by reset_parameters, which nn.Embedding's __init__ calls
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)


class Embedding(nn.Module):
    """Token plus learned position embedding (a position table needs no buffer). A token table
    the head shares (``tied``) starts at the head's scale, N(0, 1/dim) (torchtitan's init of its
    output layer): at torch's N(0, 1) the logits were ~sqrt(dim) wide and the first loss ~5x
    ln(vocab_size)."""

    def __init__(self, vocab_size: int, max_seq_len: int, dim: int, *, tied: bool = False):
        super().__init__()
        self.tok = Table(vocab_size, dim, std=dim ** -0.5 if tied else 1.0)
        self.pos = nn.Embedding(max_seq_len, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_mult: int):
        super().__init__()
        self.up = nn.Linear(dim, ffn_mult * dim)
        self.down = nn.Linear(ffn_mult * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"model.dim={dim} is not divisible by model.n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        # Head-major (each head's q, k and v rows together, as Megatron fuses them): a tensor-parallel
        # shard of the rows holds whole heads with their q, k and v.
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them, or a tensor-parallel shard's (runner.parallel.tp)
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).unbind(3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # causal and not a padded key; a padded query attends to itself (no empty softmax row)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            allowed = causal & attention_mask[:, None, None, :]
            allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, dim: int, n_heads: int, ffn_mult: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_mult)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), attention_mask)
        return x + self.ffn(self.ffn_norm(x))


class MLPBlock(nn.Module):
    """Residual per-token feed-forward block (no mixing across positions)."""

    def __init__(self, dim: int, ffn_mult: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_mult)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


def _sequential(
    embed: Embedding, blocks: Sequence[nn.Module], dim: int, vocab_size: int, tie_embeddings: bool
) -> nn.Sequential:
    head = nn.Linear(dim, vocab_size, bias=False)
    if tie_embeddings:
        head.weight = embed.tok.weight
    children: list[tuple[str, nn.Module]] = [("embed", embed)]
    children += [(f"block{i}", block) for i, block in enumerate(blocks)]
    children += [("norm", nn.LayerNorm(dim)), ("head", head)]
    model = nn.Sequential(OrderedDict(children))
    model.tp_plan = dict(TP_PLAN)  # type: ignore[assignment]  # a plain attribute, read by runner.parallel.tp
    return model


def transformer(
    *,
    vocab_size: int,
    max_seq_len: int,
    dim: int,
    n_layers: int,
    n_heads: int,
    ffn_mult: int,
    tie_embeddings: bool = False,
) -> nn.Sequential:
    """Small decoder-only LM: ``embed, block0..block{n_layers-1}, norm, head``."""
    blocks = [Block(dim, n_heads, ffn_mult) for _ in range(n_layers)]
    embed = Embedding(vocab_size, max_seq_len, dim, tied=tie_embeddings)
    return _sequential(embed, blocks, dim, vocab_size, tie_embeddings)


def mlp(
    *,
    vocab_size: int,
    max_seq_len: int,
    dim: int,
    n_layers: int,
    ffn_mult: int,
    tie_embeddings: bool = False,
) -> nn.Sequential:
    """Token MLP: ``embed, block0..block{n_layers-1}, norm, head``; cheap, for quick runs."""
    blocks = [MLPBlock(dim, ffn_mult) for _ in range(n_layers)]
    embed = Embedding(vocab_size, max_seq_len, dim, tied=tie_embeddings)
    return _sequential(embed, blocks, dim, vocab_size, tie_embeddings)
