"""TensorBoard: scalars under ``<run dir>/tensorboard`` (``logger=tensorboard``)."""

from __future__ import annotations

from pathlib import Path

from runner.outputs.loggers import Logger


class TensorBoardLogger(Logger):
    EXTRA = "tensorboard"

    @staticmethod
    def requires(options) -> list[str]:
        return ["tensorboard"]

    def __init__(self, *, run_dir: Path, hparams: dict, name: str, group: str | None):
        from torch.utils.tensorboard import SummaryWriter  # optional extra: runner[tensorboard]

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, final: dict[str, float], step: int, *, failed: bool, artifacts: list[Path]) -> None:
        self.log(final, step)
        self.writer.close()
