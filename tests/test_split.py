"""Splitting: every child lands in exactly one stage, stage modules keep the full model's
parameter names, and each rank's stage initialises to exactly the unsplit model's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import ConfigError
from runner.models.split import (
    MetaModel,
    build_meta_model,
    check_init,
    materialize,
    plan_split,
    split_by_cost,
)
from runner.models.units import SequentialSpec

from helpers.config import TINY, compose

CPU = torch.device("cpu")


def _full(cfg, seed=0):
    meta = build_meta_model(cfg.model)
    return materialize(meta, meta.unit_names, seed=seed, device=CPU)


@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_stages_rebuild_the_unsplit_model_exactly(model):
    cfg = compose(*TINY, f"model={model}")
    full = dict(_full(cfg).named_parameters())
    meta = build_meta_model(cfg.model)
    stages = plan_split(meta, 4, None)
    seen = {}
    for names in reversed(stages):  # build in another order than the model's: init must not care
        stage = materialize(build_meta_model(cfg.model), names, seed=0, device=CPU)
        seen.update(stage.named_parameters())
    assert seen.keys() == full.keys()  # full names, nothing dropped, nothing renamed
    for name, p in full.items():
        assert torch.equal(seen[name], p), name
    assert not torch.equal(_full(cfg, seed=1).get_parameter("block0.ffn.up.weight"),
                           full["block0.ffn.up.weight"])


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5, 9])
def test_balanced_split_covers_every_child_once_in_order(num_stages):
    meta = build_meta_model(compose(*TINY).model)
    stages = plan_split(meta, num_stages, None)
    assert len(stages) == num_stages and all(stages)
    assert [n for s in stages for n in s] == meta.unit_names
    blocks = [sum(n.startswith("block") for n in s) for s in stages]
    if num_stages in (2, 3):  # parameter balance puts the 6 blocks evenly
        assert max(blocks) - min(blocks) <= 1


def test_split_by_cost_minimises_the_costliest_stage():
    names = ["embed", "block0", "block1", "block2", "head"]
    assert split_by_cost(names, [10.0, 1.0, 1.0, 1.0, 10.0], 3) == ["block0", "head"]  # 10 | 3 | 10
    assert split_by_cost(names, [0.1, 1.0, 1.0, 1.0, 1.0], 2) == ["block2"]  # 2.1 | 2


def test_explicit_split_points_are_used_as_given():
    meta = build_meta_model(compose(*TINY).model)
    stages = plan_split(meta, 3, ["block2", "norm"])
    assert stages == (("embed", "block0", "block1"), ("block2", "block3", "block4", "block5"), ("norm", "head"))


def test_tied_weights_stay_tied_inside_a_stage_and_copies_start_equal_across_stages():
    cfg = compose(*TINY, "model.tie_embeddings=true")
    stage = _full(cfg)
    assert stage.get_parameter("head.weight") is stage.get_parameter("embed.tok.weight")
    meta = build_meta_model(cfg.model)
    first, last = plan_split(meta, 2, None)
    head = materialize(build_meta_model(cfg.model), last, seed=0, device=CPU).get_parameter("head.weight")
    assert torch.equal(head, stage.get_parameter("embed.tok.weight"))  # the embedding's value, as unsplit


@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_a_tied_builtin_starts_near_a_uniform_guess_and_an_untied_one_keeps_torchs_init(model):
    # Tied, the token table is the head: at torch's N(0, 1) the logits were ~sqrt(dim) = 5.7 wide
    # and the first loss 19.6 (transformer; mlp 20.3) where ln(48) = 3.87. At the head's scale,
    # N(0, 1/dim): 4.34 (4.36). Untied, nothing changes: torch's N(0, 1) table, 4.13 (4.13).
    x, y = torch.randint(48, (2, 8, 16), generator=torch.Generator().manual_seed(1))
    for tied, (std, loss) in {"true": (32 ** -0.5, 4.34), "false": (1.0, 4.13)}.items():
        stage = _full(compose(*TINY, f"model={model}", "model.n_layers=2", f"model.tie_embeddings={tied}"))
        table = stage.get_parameter("embed.tok.weight")
        assert table.std().item() == pytest.approx(std, rel=0.05)
        assert stage.get_parameter("head.weight") is table if tied == "true" else table.std() > 0.9
        logits = stage.spec.run(stage, stage.units, x, {})
        assert F.cross_entropy(logits.flatten(0, 1), y.flatten()).item() == pytest.approx(loss, abs=0.03)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.weight


def test_every_module_the_runner_cannot_initialise_is_listed_before_launch():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _Scale(), nn.Linear(3, 3), _Scale())
    with pytest.raises(ConfigError, match=r"2 module\(s\).*1 \(_Scale\), 3 \(_Scale\).*reset_parameters"):
        check_init(MetaModel(model, SequentialSpec(model), []))
