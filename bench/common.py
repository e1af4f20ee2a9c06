"""What several sections share: the models they run, the schedules in display order, the Hydra
composition of a config, and small statistics."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
ZERO_BUBBLE = ["interleaved_zb", "zbv", "dualpipev"]
MIB = 2**20
_SHAPE = ["model.dim=256", "model.n_layers=8", "train.seq_len=128"]  # every run also gets device=<--device>
# Efficiency and scaling: 64 samples per step, so a stage's forward on one microbatch stays near or
# above 20 ms on CPU down to m=16 at pp=4 with 2 stages per rank (one block per stage); a message
# (a microbatch's activations) costs well under a millisecond over loopback gloo.
SWEEP_MODEL = [*_SHAPE, "train.batch_size=64"]
# The other sections (ratios at pp=2, m=8: 4 samples per microbatch, 35-150 ms per stage forward).
MODEL = [*_SHAPE, "train.batch_size=32"]


def compose(overrides: Sequence[str]):
    """The run's config for these overrides, composed by Hydra from the checkout's ``conf/``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import runner.compose  # noqa: F401  (registers the schemas)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float] | None:
    """Least squares y = a + b x: (a, b, Pearson r), or None for fewer than 3 distinct x."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    r = sxy / (sxx * syy) ** 0.5 if syy > 0 else 0.0
    return my - b * mx, b, r


def steady(step_times: Sequence[float], skip: int = 1) -> float | None:
    """Median step time after the first ``skip`` steps (shape inference, compilation, warm-up)."""
    rest = list(step_times[skip:])
    return statistics.median(rest) if rest else None


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def find(runs: Iterable[Mapping[str, Any]], **keys: Any) -> Mapping[str, Any] | None:
    """The first successful run whose fields equal ``keys``."""
    return next((r for r in runs if all(r.get(k) == v for k, v in keys.items()) and r.get("status") == "ok"), None)
