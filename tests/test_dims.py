"""The one owner of the parallel layout (``runner.parallel.dims.ParallelDims``): each rank's coordinates,
the groups along each dimension, the one check of the degrees against the ranks a job has, and the
resolver the SLURM launcher config counts its tasks with. In-process: pure arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

import runner.compose  # noqa: F401  registers the world_size resolver
from runner.errors import ConfigError
from runner.parallel.dims import Coords, ParallelDims
from runner.parallel.mesh import build_mesh
from runner.ranks.dist import DistEnv

DIMS = ParallelDims(pp=2, dp=3, dp_mode="ddp")


def test_ranks_in_torchtitan_order_pp_outermost_then_dp_then_tp():
    # tp = 1: rank r is replica r % dp of pipeline rank r // dp.
    assert DIMS.world_size == 6 and list(DIMS.degrees.items()) == [("pp", 2), ("dp", 3), ("tp", 1)]
    assert [DIMS.coords(r) for r in range(6)] == [Coords(pp=r // 3, dp=r % 3, tp=0) for r in range(6)]
    # tp, once above 1, is innermost: consecutive ranks (one node's fast links).
    wide = ParallelDims(pp=2, dp=2, tp=2)
    assert [wide.coords(r) for r in (0, 1, 2, 5)] == [Coords(0, 0, 0), Coords(0, 0, 1), Coords(0, 1, 0),
                                                       Coords(1, 0, 1)]
    assert wide.ranks_of("tp", 5) == [4, 5] and wide.ranks_of("dp", 5) == [5, 7] and wide.ranks_of("pp", 5) == [1, 5]
    assert wide.mesh_dims == {"pp": 2, "dp": 2, "tp": 2}
    assert [DIMS.rank_of(DIMS.coords(r)) for r in range(6)] == list(range(6))
    with pytest.raises(ValueError, match=r"rank 6 outside 0\.\.5"):
        DIMS.coords(6)


def test_groups_along_each_dimension():
    assert DIMS.ranks_of("pp", 4) == [1, 4]  # replica 1's pipeline, by pipeline rank
    assert DIMS.ranks_of("dp", 3) == [3, 4, 5]  # pipeline rank 1 in every replica
    assert DIMS.ranks_of("tp", 3) == [3]
    assert DIMS.groups_of("pp") == [[0, 3], [1, 4], [2, 5]]
    assert DIMS.groups_of("dp") == [[0, 1, 2], [3, 4, 5]]
    # The mesh has pp and dp (even at degree 1), not tp while it is 1: no process groups for it.
    assert list(DIMS.mesh_dims.items()) == [("pp", 2), ("dp", 3)]
    assert ParallelDims(pp=4, dp=1).mesh_dims == {"pp": 4, "dp": 1}


def test_built_once_from_the_config_and_counted_by_the_slurm_resolver():
    cfg = OmegaConf.create({"parallel": {"pp": 2, "dp": 3, "dp_mode": "ddp", "microbatches": 4},
                            "tasks": "${world_size:${parallel}}"})
    assert ParallelDims.from_config(cfg.parallel) == DIMS
    assert cfg.tasks == 6
    cfg.parallel.tp = 2
    assert ParallelDims.from_config(cfg.parallel).tp == 2 and cfg.tasks == 12


def test_the_product_check_names_the_keys_the_values_and_the_fix():
    DIMS.check(6)
    with pytest.raises(ConfigError) as info:
        DIMS.check(9, started_by="torchrun", restart="--nproc-per-node 6")
    assert str(info.value) == ("torchrun started 9 ranks but parallel.pp=2 x parallel.dp=3 = 6. "
                               "Fix: --nproc-per-node 6, or parallel.pp=3.")
    with pytest.raises(ConfigError) as info:
        DIMS.check(4)
    assert str(info.value) == ("the launcher started 4 ranks but parallel.pp=2 x parallel.dp=3 = 6. "
                               "Fix: start 6 ranks, or parallel.pp and parallel.dp and parallel.tp whose product is 4.")
    with pytest.raises(ConfigError, match=r"parallel.pp=2 x parallel.dp=1 x parallel.tp=2 = 4. Fix: start 4 ranks"):
        ParallelDims(pp=2, dp=1, tp=2).check(6)


def test_the_mesh_reads_its_coordinates_from_the_owner_and_checks_the_ranks():
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    mesh = build_mesh(env, ParallelDims(pp=1, dp=1))
    assert (mesh.pp, mesh.dp, mesh.pp_rank, mesh.dp_rank) == (1, 1, 0, 0)
    assert mesh.pp_group is None and mesh.dp_mesh is None and mesh.group("dp") is None
    with pytest.raises(ConfigError, match=r"the launcher started 1 ranks but parallel.pp=2 x parallel.dp=1 = 2"):
        build_mesh(env, ParallelDims(pp=2, dp=1))


def test_the_planner_calibrates_on_the_cores_of_two_ranks_of_one_pipeline():
    from runner.checkpoint.config import CheckpointConfig
    from runner.config import EvalConfig, TrainConfig
    from runner.layout import Layout, ResolvedRun
    from runner.outputs.config import ProfileConfig
    from runner.plan.planner import _neighbour_cpus

    layout = Layout(schedule="1f1b", csv=None, pp=2, microbatches=2, stages=(("a",), ("b",)),
                    stage_to_rank={0: 0, 1: 1})
    cpus = tuple((c,) for c in range(6))
    resolved = ResolvedRun(layout=layout, dims=DIMS, batch_size=12, seq_len=4, steps=1, device="cpu",
                           threads_per_rank=1, rank_cpus=cpus, run_dir=None, resume=None, verify=False,
                           verify_steps=2, train=TrainConfig(), eval=EvalConfig(), checkpoint=CheckpointConfig(),
                           profile=ProfileConfig())
    assert _neighbour_cpus(resolved) == [(0,), (3,)]  # pipeline ranks 0 and 1 of replica 0: ranks 0 and 3
    assert _neighbour_cpus(dataclasses.replace(resolved, rank_cpus=None)) is None


def test_torchrun_with_other_ranks_than_the_degrees_is_a_config_error_before_the_process_group(monkeypatch):
    from runner.launch import _join_torchrun
    from runner.ranks.clock import StartupClock
    from runner.validate import validate

    from helpers.config import TINY, compose

    cfg = compose(*TINY, "parallel.pp=2", "parallel.dp=3", "parallel.dp_mode=ddp", "parallel.microbatches=2",
                  "train.batch_size=12")
    resolved = validate(cfg)
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as info:
        _join_torchrun(resolved, cfg, StartupClock())  # raises before init_distributed: no process group
    assert str(info.value) == ("torchrun started 9 ranks but parallel.pp=2 x parallel.dp=3 = 6. "
                               "Fix: --nproc-per-node 6, or parallel.pp=3.")
