"""The planner with tensor parallelism: the pp x dp x tp layouts of the same ranks as candidates
(``plan.search_degrees``), tp's collectives costed from a calibrated all-reduce, and the layouts
tp cannot shard refused with validate's reason. In process: fixed message costs, no probes."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.plan.calibrate import Calibration
from runner.plan.costs import ChildCost
from runner.plan.tp_cost import collective_s, degree_variants, tp_child_at, tp_child_costs, unit_collectives

from helpers.config import TINY, compose
from helpers.plan import FIXED

DIM, VOCAB = 32, 48  # TINY's
MEASURED = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=0.0, allreduce_latency_s=3e-4,
                       allreduce_bandwidth=5e8)


def test_every_pp_dp_tp_of_the_ranks_is_a_variant_and_replicas_stay_in_step():
    cfg = compose(*TINY, "parallel.pp=4", "plan.search_degrees=true")
    variants = degree_variants(cfg)
    degrees = [(v.parallel.pp, v.parallel.dp, v.parallel.tp) for v in variants]
    assert degrees[0] == (4, 1, 1)  # the run's own first
    assert sorted(degrees) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert all(v.parallel.dp_mode == ("ddp" if v.parallel.dp > 1 else "none") for v in variants)
    assert degree_variants(compose(*TINY, "parallel.pp=4")) == [compose(*TINY, "parallel.pp=4")]  # off by default


def test_the_built_in_transformers_collectives_per_microbatch():
    units = unit_collectives(compose(*TINY))
    block = units["block0"]
    # Rowwise attention output and feed-forward down projection: an all-reduce each in the forward;
    # colwise qkv and up projection: an all-reduce of their input gradient each in the backward.
    assert block.forward_all_reduce == (DIM, DIM) and block.backward_all_reduce == (DIM, DIM)
    assert 0.95 < block.sharded_fraction < 1  # all but the norms' parameters
    assert units["embed"].forward_all_reduce == (DIM,) and units["embed"].backward_all_reduce == ()
    assert units["head"].forward_all_gather == (VOCAB,) and units["head"].backward_all_reduce == (DIM,)
    assert units["norm"].sharded_fraction == 0 and units["norm"].forward_all_reduce == ()


def test_an_all_reduce_costs_as_calibrated_between_two_ranks_and_as_a_ring_beyond():
    """The measured all-reduce between two ranks is a ring of two messages: exactly its cost at
    2 ranks; 2(tp-1) messages of 1/tp of the bytes beyond; an all-gather the ring's second half.
    Unmeasured (``plan.comm_*`` given), the same ring of the link's messages."""
    assert collective_s(MEASURED, 1e6, 2) == pytest.approx(3e-4 + 1e6 / 5e8)
    assert collective_s(MEASURED, 1e6, 4) == pytest.approx(3 * 3e-4 + 1.5e6 / 5e8)
    assert collective_s(MEASURED, 1e6, 2, gather=True) == pytest.approx(1.5e-4 + 0.5e6 / 5e8)
    assert collective_s(MEASURED, 1e6, 4, gather=True) == pytest.approx(3 * 1.5e-4 + 0.75e6 / 5e8)
    unmeasured = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=0.0)  # plan.comm_* given
    assert collective_s(unmeasured, 1e6, 2) == pytest.approx(2 * 1e-4 + 1e6 / 1e9)
    assert collective_s(unmeasured, 1e6, 1) == 0.0


def test_tp_divides_a_blocks_compute_and_adds_its_collectives():
    cfg = compose(*TINY, "parallel.pp=2", "parallel.tp=2")
    child = {name: ChildCost(forward_s=1e-3, backward_s=2e-3, input_backward_s=1e-3, weight_backward_s=1e-3,
                             saved_bytes=1000, output_bytes=64) for name in unit_collectives(cfg)}
    costs = tp_child_costs(child, cfg, MEASURED, microbatch_size=2)
    f = unit_collectives(cfg)["block0"].sharded_fraction
    share, reduce_s = 1 - f / 2, collective_s(MEASURED, DIM * 4 * 2 * 16, 2)  # 2 x 16 tokens of DIM floats
    block = costs["block0"]
    assert block.forward_s == pytest.approx(1e-3 * share + 2 * reduce_s)
    assert block.backward_s == pytest.approx(2e-3 * share + 2 * reduce_s)
    assert block.input_backward_s == pytest.approx(1e-3 * share + 2 * reduce_s)
    assert block.weight_backward_s == pytest.approx(1e-3 * share)  # the weight gradients stay local
    assert costs["norm"] == child["norm"] and block.output_bytes == 64  # messages between stages stay whole
    assert tp_child_costs(child, compose(*TINY, "parallel.pp=2"), MEASURED, 2) == child
    # The probes of a tp run are fitted against the same costs (microbatches of 16 / 8 = 2 samples).
    at = tp_child_at(lambda m: child, compose(*TINY, "parallel.pp=2", "parallel.tp=2", "train.batch_size=16"), MEASURED)
    assert at(8) == costs


@pytest.mark.timeout(300)
def test_the_planner_predicts_tp_layouts_and_skips_those_whose_heads_do_not_divide():
    from runner.plan.planner import plan
    from runner.plan.report import label, table

    cfg = compose(*TINY, *FIXED, "parallel.pp=4", "train.batch_size=8", "model.n_heads=2", "plan.microbatches=[4]",
                  "plan.repeats=1", "plan.search_degrees=true", "schedule=1f1b")
    candidates, _, _, _ = plan(cfg)
    by_degrees: dict[tuple, list] = {}
    for c in candidates:
        d = c.degrees or {"pp": 4, "dp": 1, "tp": 1}
        by_degrees.setdefault((d["pp"], d["dp"], d["tp"]), []).append(c)
    # dp=4: a replica's 2 rows hold no 4 microbatches, so no candidate there
    assert set(by_degrees) == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}
    assert len(by_degrees[(1, 2, 2)]) == 1  # pp=1 trains the unsplit model: one schedule stands for all
    tp2 = [c for c in by_degrees[(2, 1, 2)] if c.valid]
    assert tp2 and all(c.overrides[:2] == ["parallel.pp=2", "parallel.tp=2"] for c in tp2)
    assert not any(c.valid for c in by_degrees[(1, 1, 4)])  # 2 heads over 4 shards
    assert all("parallel.tp=4 does not divide model.n_heads=2" in c.reason for c in by_degrees[(1, 1, 4)])
    # The same pipeline with tp=2 computes each block on half the weights and adds the all-reduces:
    # its stages' costs are not those of pp=2 without tp.
    pp2 = next(c for c in by_degrees[(2, 2, 1)] if c.valid and c.schedule == "1f1b")
    tp = next(c for c in tp2 if c.schedule == "1f1b")
    assert tp.stage_costs_s != pp2.stage_costs_s and tp.predicted_step_time_s > 0
    assert label(tp).endswith(" pp=2 dp=1 tp=2") and "pp=2 dp=1 tp=2" in table(candidates)  # the report names them
    assert pp2.overrides[:3] == ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp"]


# -- plan.rehearse: tp and FSDP layouts costed from a rehearsal (runner.plan.rehearsed) ----------------
def _fake_rehearsal(calls: list, pp: int, fail_on: str | None = None):
    """A rehearsal.json as ``python -m runner rehearse=on`` writes it, for any layout: every stage's
    F 10 ms, B 20 ms, I 12 ms, W 8 ms; 2 ms of tp/dp collectives and 3 ms of optimizer step."""
    def rehearse(overrides, run_dir):
        calls.append((list(overrides), run_dir))
        given = dict(o.split("=", 1) for o in overrides)
        if fail_on is not None and given.get("schedule") == fail_on:
            raise RuntimeError("exit code 1: rank 0 failed")
        stages = int(given.get("parallel.pp", pp)) * int(given["parallel.stages_per_rank"])
        costs = {f"{s}{k}": v for s in range(stages) for k, v in {"F": 0.01, "B": 0.02, "I": 0.012, "W": 0.008}.items()}
        return {"ranks": [{"rank": 0}, {"rank": 2}],
                "step": {"step_s": 1.0, "stage_costs_s": costs, "collectives_s": 0.002, "optimizer_s": 0.003}}
    return rehearse


@pytest.mark.timeout(300)
def test_plan_rehearse_costs_tp_layouts_from_a_rehearsal_per_layout_with_the_planners_messages(tmp_path):
    from dataclasses import asdict

    from runner.plan.planner import plan
    from runner.plan.report import rehearsal_report

    cfg = compose(*TINY, *FIXED, "parallel.pp=2", "parallel.tp=2", "train.batch_size=8", "plan.microbatches=[4]",
                  "plan.repeats=1", "schedule=1f1b", "plan.rehearse=true")
    calls: list = []
    candidates, _, _, _ = plan(cfg, tmp_path, rehearse=_fake_rehearsal(calls, 2, fail_on="zbh1"))
    tp2 = [c for c in candidates if c.valid or c.rehearsal]
    # 1F1B at pp=2 x tp=2, 4 microbatches of F 10 ms + B 20 ms: (4 + 2 - 1) x 30 ms of pipeline, four
    # messages of the planner's (0.2 ms + bytes / 1 GB/s) on its path, + 2 + 3 ms after it.
    one = next(c for c in tp2 if c.schedule == "1f1b" and not c.split_points)
    assert one.costed_by == "rehearsal" and asdict(one)["costed_by"] == "rehearsal"  # as plan.json lists it
    message = one.rehearsal["message_s"]
    assert 2e-4 < message < 1e-3
    assert one.predicted_step_time_s == pytest.approx(0.15 + 4 * message + 0.005, rel=1e-6)
    assert one.stage_costs_s == {"0B": 0.02, "0F": 0.01, "0I": 0.012, "0W": 0.008,
                                 "1B": 0.02, "1F": 0.01, "1I": 0.012, "1W": 0.008}
    assert one.rehearsal["model_step_s"] != one.predicted_step_time_s and one.rehearsal["ranks"] == [0, 2]
    # One rehearsal per layout and kinds of action, run with the candidate's keys and the planner's link.
    assert len({str(d) for _, d in calls}) == len(calls)
    first = calls[0][0]  # the run's own degrees: no parallel.* of its own
    assert first[:3] == ["schedule=gpipe", "parallel.microbatches=4", "parallel.stages_per_rank=1"]
    assert first[3:] == ["plan.comm_latency_s=0.0002", "plan.comm_bandwidth=1000000000.0"]
    assert not any("schedule=1f1b" in o for o, _ in calls)  # GPipe's F and B, shared
    # A rehearsal that fails lists its candidates invalid, saying why (not ranked on the model's step).
    failed = [c for c in tp2 if c.schedule in ("zbh1", "zbh2")]  # one layout and kinds: one rehearsal
    assert failed and all(not c.valid and c.costed_by == "model" and "rank 0 failed" in c.reason for c in failed)
    assert all(c.costed_by == "rehearsal" for c in candidates if c.valid)
    lines = rehearsal_report(candidates, tmp_path)
    assert "costed by rehearsal" in lines[0] and any("zbh1" in line and "(not ranked)" in line for line in lines)


def test_plan_rehearse_is_for_tp_and_fsdp_layouts_and_refused_with_costs_given_instead():
    from runner.errors import ConfigError
    from runner.plan.planner import check_plan_keys
    from runner.plan.rehearsed import needs_rehearsal

    assert needs_rehearsal(compose(*TINY, "parallel.pp=2", "parallel.tp=2"))
    assert needs_rehearsal(compose(*TINY, "parallel.dp=2", "parallel.dp_mode=fsdp"))
    assert not needs_rehearsal(compose(*TINY, "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp"))

    with pytest.raises(ConfigError, match=r"plan.rehearse=true with plan.target=NVIDIA H100: .* Fix: "
                                          r"plan.rehearse=false, or drop plan.target"):
        check_plan_keys(compose(*TINY, "plan.rehearse=true", "plan.target='NVIDIA H100'"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(3600)
def test_plan_rehearse_end_to_end_lists_pp2_tp2_as_costed_by_rehearsal(tmp_path):
    """``python -m runner.plan ... plan.rehearse=true`` at pp=2 x tp=2: every valid candidate is
    costed from a real rehearsal (a process of its own per layout; 2 minutes each under load, so the
    slow tier), with the rehearsed stages' costs and the rehearsal's directory in plan.json."""
    import json

    from helpers.cli import run_cli

    out = tmp_path / "plan"
    done = run_cli(*TINY, *FIXED, "parallel.pp=2", "parallel.tp=2", "train.batch_size=8", "plan.microbatches=[4]",
                   "plan.repeats=1", "plan.rehearse=true", f"hydra.run.dir={out}", module="runner.plan", cwd=tmp_path,
                   timeout=3500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "costed by rehearsal" in done.stdout
    candidates = [c for c in json.loads((out / "plan.json").read_text()) if c["valid"]]
    one = next(c for c in candidates if c["schedule"] == "1f1b" and not c["split_points"])
    assert one["costed_by"] == "rehearsal" and one["rehearsal"]["ranks"] == [0, 2]
    report = json.loads((Path(one["rehearsal"]["dir"]) / "rehearsal.json").read_text())
    assert one["stage_costs_s"] == report["step"]["stage_costs_s"]  # plan.corunning_slowdown=1
    assert one["predicted_step_time_s"] > one["pipeline_s"] > 0
    assert all(c["costed_by"] == "rehearsal" for c in candidates)
