"""What each stage module of a rank takes and returns on its first forward: the activations a
pipeline sends between stages (under sequence parallelism, each tp rank's slice of the sequence),
and the logits the loss takes (under loss parallelism, a DTensor sharded on the vocabulary)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

from runner.hooks import Hook


class StageShapes(Hook):
    """Rank 0's stages, by their first unit: the input's shape, the output's type and local shape
    (into ``summary.json`` as ``stage_shapes``)."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, Any]] = {}

    def begin_step(self, trainer, state) -> None:
        if not state.first:
            return
        for module in trainer.modules:
            module.register_forward_hook(lambda m, args, out, name=module.units[0]: self._record(name, args, out))

    def _record(self, name: str, args: tuple, out: Any) -> None:
        if name not in self.seen and args[0].device.type != "meta":  # not torch's shape inference
            local = out.to_local() if isinstance(out, DTensor) else out
            self.seen[name] = {"input": list(args[0].shape), "output": type(out).__name__,
                               "output_local": list(local.shape)}

    def summary(self) -> dict[str, Any]:
        return {"stage_shapes": self.seen}


def stage_shapes() -> list[Hook]:
    return [StageShapes()]
