"""User-style model factories for tests."""

from collections import OrderedDict

from torch import nn

from runner.models import mlp


def dropout_mlp(**kwargs) -> nn.Sequential:
    """Random in training mode: pipelined and unsplit gradients differ, so verify must fail."""
    model = mlp(**kwargs)
    children = list(model.named_children())
    return nn.Sequential(OrderedDict(children[:2] + [("drop", nn.Dropout(0.5))] + children[2:]))


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
