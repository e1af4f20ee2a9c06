"""User-style model factories for tests."""

from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from runner.models.builtin import mlp


def dropout_mlp(**kwargs) -> nn.Sequential:
    """Random in training mode: pipelined and unsplit gradients differ, so verify must fail."""
    model = mlp(**kwargs)
    children = list(model.named_children())
    return nn.Sequential(OrderedDict(children[:2] + [("drop", nn.Dropout(0.5))] + children[2:]))


class RecordedDropout(nn.Module):
    """Dropout (p 0.5) that saves the first mask it draws in training to ``<masks>/<name>.pt``."""

    def __init__(self, masks: str, name: str):
        super().__init__()
        self.file = Path(masks) / f"{name}.pt"

    def forward(self, x):
        if not self.training or x.device.type == "meta":
            return x
        keep = torch.rand_like(x) >= 0.5
        if not self.file.exists():
            torch.save(keep, self.file)
        return x * keep * 2.0


def recorded_dropout_mlp(*, masks: str, **kwargs) -> nn.Sequential:
    """``mlp`` with a ``RecordedDropout`` after every block, its masks saved into ``masks``."""
    layers = []
    for name, child in mlp(**kwargs).named_children():
        layers.append((name, child))
        if name.startswith("block"):
            layers.append((f"{name}_drop", RecordedDropout(masks, name)))
    return nn.Sequential(OrderedDict(layers))


class Explode(nn.Module):
    """Fails on real data only: the pre-spawn shape check (on the meta device) passes."""

    def forward(self, x):
        if x.device.type != "meta":
            raise RuntimeError("boom from the user's model")
        return x


def exploding_mlp(**kwargs) -> nn.Sequential:
    children = list(mlp(**kwargs).named_children())
    return nn.Sequential(OrderedDict(children[:-1] + [("explode", Explode())] + children[-1:]))


def not_sequential(**kwargs) -> nn.Module:
    return nn.Linear(2, 2)


def mismatched_mlp(**kwargs) -> nn.Sequential:
    """block0 widens the activations; block1 still expects the model width."""
    children = list(mlp(**kwargs).named_children())
    dim = kwargs["dim"]
    return nn.Sequential(OrderedDict(children[:1] + [("widen", nn.Linear(dim, 2 * dim))] + children[1:]))


def z_loss_cross_entropy(logits, targets):
    """A user loss: cross-entropy plus PaLM's z-loss on the softmax normaliser."""
    import torch.nn.functional as F

    logits = logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return ce + 0.1 * logits.logsumexp(-1).pow(2).mean()


def per_token_loss(logits, targets):
    """Wrong on purpose: not reduced to a scalar."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


class ShortBatches:
    """A user dataset that returns the wrong sequence length."""

    def __init__(self, *, vocab_size: int, seed: int, **unused):
        self.vocab_size = vocab_size

    def batch(self, step, batch_size, seq_len, *, split="train"):
        import torch

        x = torch.zeros(batch_size, seq_len - 1, dtype=torch.long)
        return x, x


class Nested(nn.Module):
    """A user model that is not an nn.Sequential: blocks in a ModuleList, run by its own forward.
    With ``residual``, the forward adds each block's input to its output, which the blocks listed
    as pipeline units do not: ``verify`` must tell the two apart."""

    def __init__(self, *, vocab_size: int, dim: int = 16, n_layers: int = 4, residual: bool = False, **unused):
        super().__init__()
        self.residual = residual
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x) if self.residual else layer(x)
        return self.head(self.norm(x))


def nested(**kwargs) -> nn.Module:
    return Nested(**kwargs)
