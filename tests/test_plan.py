"""The planner: orders, in-flight activations, candidates, and one prediction held against a run."""

from __future__ import annotations

import gc
import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.outputs.timeline import write_schedule_csv
from runner.pipeline.ops import Op
from runner.pipeline.schedule import schedule_order
from runner.pipeline.simulate import peak_in_flight, simulate
from runner.plan.calibrate import Calibration, calibrate, solve_action_overhead
from runner.plan.costs import ChildCost, stage_costs
from runner.plan.planner import plan
from runner.plan.probe import (
    PROBED,
    Fit,
    Measured,
    Observation,
    deferred_steps,
    fit,
    predicted_pipelines,
    probe_layouts,
    probe_steps,
)
from runner.plan.report import fit_line
from runner.validate import validate

from helpers.cli import run_cli
from helpers.config import EXAMPLES, TINY, compose
from helpers.plan import FIXED


def _ops(text: str) -> list[Op]:
    return [Op(int(a[0]), a[1], int(a[2:])) for a in text.split()]


def test_in_flight_activations_follow_the_schedule():
    assert peak_in_flight(schedule_order("gpipe", 2, 4, 1)) == {0: 4, 1: 4}  # all m
    assert peak_in_flight(schedule_order("1f1b", 4, 8, 1)) == {0: 4, 1: 3, 2: 2, 3: 1}  # p - rank
    order = schedule_order("1f1b", 2, 4, 1)  # torch declares the last rank's forwards as 1..m
    assert [op.name for op in order[1]] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    assert peak_in_flight({0: _ops("0F0 0F1 0B0 0F2 0B1 0B2"), 1: _ops("1F0 1B0 1F1 1B1")}) == {0: 2, 1: 1}
    # Split backward: an I frees nothing, the W does.
    assert peak_in_flight({0: _ops("0F0 0F1 0I0 0I1 0W0 0W1")}) == {0: 2}
    assert peak_in_flight({0: _ops("0F0 0I0 0W0 0F1 0I1 0W1")}) == {0: 1}
    # In bytes per stage-microbatch (two stages on one rank): the peak of bytes, not of counts.
    assert peak_in_flight({0: _ops("0F0 2F0 2B0 0F1 0B0 0B1")}, {0: 10.0, 2: 1.0}) == {0: 20.0}


def test_stage_costs_put_the_first_stages_whole_backward_in_its_weight_step():
    child = {name: ChildCost(forward_s=1.0, backward_s=2.0, input_backward_s=1.2, weight_backward_s=1.1,
                             saved_bytes=0, output_bytes=0) for name in ("embed", "block0", "block1", "head")}
    costs = stage_costs([("embed", "block0"), ("block1", "head")], child)
    # torch runs no input backward for the first stage (the batch takes no gradient): its W does it all.
    assert (costs[(0, "F")], costs[(0, "B")], costs[(0, "I")], costs[(0, "W")]) == (2.0, 4.0, 0.0, 4.0)
    # Elsewhere I and W as timed (together more than B: W runs one autograd pass per parameter group).
    assert costs[(1, "I")] == pytest.approx(2.4) and costs[(1, "W")] == pytest.approx(2.2)


def test_child_costs_time_the_split_backward_as_torchs_stages_run_it():
    import torch

    from runner.plan.costs import measure_child_costs

    def live_tensors() -> int:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    before = live_tensors()
    costs = measure_child_costs(compose(*TINY, "train.batch_size=8"), 4, 2, torch.device("cpu"))
    # Nothing of the timed model outlives the timing: its saved-bytes hook kept each saved tensor
    # itself, and a unit's output saved by its own node (attention's) held its graph in a cycle no
    # collection frees (each runner.plan in a process kept a model and a microbatch's activations).
    assert live_tensors() == before
    first, *rest = costs.values()
    assert first.input_backward_s == first.weight_backward_s == 0.0  # token ids take no gradient
    assert all(c.forward_s > 0 and c.backward_s > 0 and c.input_backward_s > 0 and c.weight_backward_s > 0
               and c.update_s > 0 for c in rest)


def test_plan_ranks_valid_candidates_and_explains_invalid_ones():
    cfg = compose(*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[2,4]", "plan.repeats=1")
    candidates, timelines, _, _ = plan(cfg)
    valid = [c for c in candidates if c.valid]
    assert {c.schedule for c in valid} >= {"gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"}
    times = [c.predicted_step_time_s for c in valid]
    assert times == sorted(times) and all(t > 0 for t in times) and candidates[: len(valid)] == valid
    assert all(0 <= c.bubble < 1 and len(c.peak_activations) == 2 for c in valid)
    assert all(c.reason for c in candidates if not c.valid)  # e.g. DualPipeV with m=2 < 4 stages
    assert all(id(c) in timelines for c in valid)
    limited, _, _, _ = plan(compose(*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]",
                                 "plan.repeats=1", "plan.memory_limit=1"))
    assert not any(c.fits_memory for c in limited if c.valid)


def test_plan_also_tries_the_split_that_balances_measured_time(monkeypatch):
    # A large vocabulary makes the embedding heavy in parameters (what the run's own split
    # balances: here embed + 3 blocks | 3 blocks + norm + head) but, in these child costs, light
    # in time, and the head heavy in time.
    def cost(f: float) -> ChildCost:
        return ChildCost(forward_s=f, backward_s=2 * f, input_backward_s=f, weight_backward_s=f, saved_bytes=1,
                         output_bytes=1)

    times = {"embed": 0.001, **{f"block{i}": 1.0 for i in range(6)}, "norm": 0.001, "head": 3.5}
    monkeypatch.setattr("runner.plan.planner.measure_child_costs", lambda *args: {n: cost(f) for n, f in times.items()})
    candidates, _, _, _ = plan(compose(*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]",
                                    "data.vocab_size=8192", "schedule=gpipe"))
    own, by_time = sorted((c for c in candidates if c.schedule == "gpipe" and c.valid),
                          key=lambda c: c.split_points is not None)
    assert own.split_points is None and own.stage_sizes == [4, 5]  # 3.0 | 6.5 s of forward
    assert by_time.split_points == ["block5"] and by_time.stage_sizes == [6, 3]  # 5.0 | 4.5 s
    assert by_time.overrides[-1] == "parallel.split_points=[block5]"
    # GPipe, m=4, 2 stages: the forwards end after one forward of the faster stage and four of the
    # slower, the backwards (twice as long) after as much again twice over; messages cost < 1 ms.
    assert own.predicted_step_time_s == pytest.approx(3 * (3.001 + 4 * 6.501), abs=0.01)
    assert by_time.predicted_step_time_s == pytest.approx(3 * (4 * 5.001 + 4.501), abs=0.01)


def test_plan_warns_when_ranks_outnumber_the_cores_or_the_host_is_busy(monkeypatch, caplog):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})  # this process may use one core
    monkeypatch.setattr("os.getloadavg", lambda: (4.0, 3.0, 2.0))
    plan(compose(*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]", "plan.repeats=1"))
    assert "2 ranks on 1 CPU cores take turns" in caplog.text
    assert "the 1-minute load average is 4.0 on 1 CPU cores" in caplog.text


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_plan_cli_writes_its_files_and_its_synthesized_schedule_runs_near_the_prediction(tmp_path):
    common = [*TINY, "parallel.pp=2", "train.batch_size=8", "train.steps=8"]
    planned = run_cli(*common, "plan.microbatches=[4]", "plan.synthesize=true", "plan.search_budget=40",
                      "hydra.run.dir=plan", module="runner.plan", cwd=tmp_path, check=True)
    records = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert {"schedule", "microbatches", "stages_per_rank", "overrides", "valid", "predicted_step_time_s",
            "bubble", "peak_activations", "lower_bound_s", "tie", "recommended", "search"} <= set(records[0])
    timeline = json.loads((tmp_path / "plan" / "plan_timeline.json").read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in timeline)
    # Calibrated and probed for real: a run per placement, kept under probes/, the model fitted to them.
    model = json.loads((tmp_path / "plan" / "fit.json").read_text())
    assert [p["label"] for p in model["probes"]] == ["1f1b m=4", "interleaved_1f1b m=4", "zbv m=4"]
    assert all(p["measured_pipeline_s"] > 0 and p["measured_step_s"] > 0 for p in model["probes"])
    assert sum(p["fitted_pipeline_s"] for p in model["probes"]) == pytest.approx(
        sum(p["measured_pipeline_s"] for p in model["probes"]), rel=0.02)
    assert model["forward_scale"] > 0 and model["backward_scale"] > 0 and "fitted to 3 run(s)" in planned.stdout
    assert json.loads((tmp_path / "plan" / "probes" / "zbv_m4" / "summary.json").read_text())["schedule"] == "zbv"
    [recommended] = [r for r in records if r["recommended"]]
    best = shlex.split(re.search(r"best(?: \(tied\))?: python -m runner (.*)", planned.stdout).group(1))
    assert best[-len(recommended["overrides"]):] == recommended["overrides"]
    # The searched schedule's line runs the CSV it wrote into the plan directory.
    searched = next(r for r in records if r["schedule"] == "synthesized" and r["valid"])
    line = shlex.split(re.search(r"fastest synthesized: python -m runner (.*)", planned.stdout).group(1))
    assert line[-len(searched["overrides"]):] == searched["overrides"]
    assert (tmp_path / "plan" / Path(searched["search"]["csv"]).name).is_file()
    run_cli(*line, "hydra.run.dir=run", cwd=tmp_path, check=True)
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())["step_time_s"]
    ratio = searched["predicted_step_time_s"] / measured
    # Loose on purpose: CI's 2 shared cores and a millisecond-scale model; BENCHMARKS.md is where
    # the prediction is judged. The ratio is in the test output (-rA) for the record.
    print(f"predicted / measured step time: {ratio:.2f}")
    assert 0.1 < ratio < 10


def test_plan_takes_the_runs_csv_schedule_and_reports_a_deadlocking_one_as_invalid(tmp_path):
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]", "plan.repeats=1",
              "schedule=csv"]
    # Rank 0 waits for the backward of microbatch 0, which rank 1 runs after microbatch 1's, whose
    # forward rank 0 runs after that backward: each rank waits on the other.
    deadlock = tmp_path / "deadlock.csv"
    deadlock.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    candidates, _, _, _ = plan(compose(*common, f"schedule.csv={deadlock}"))
    [csv] = [c for c in candidates if c.schedule == "csv"]
    assert not csv.valid and "not a valid schedule" in csv.reason and csv.microbatches == 2  # the file's m
    assert sum(c.valid for c in candidates) > 10  # the built-in schedules are still planned
    # A CSV holding ZBV's order is predicted exactly as ZBV (same costs, same order), and its
    # overrides run the file.
    zbv_csv = EXAMPLES / "zbv_pp2_m4.csv"
    candidates, _, _, _ = plan(compose(*common, f"schedule.csv={zbv_csv}"))
    # The run's own split (a split balancing the measured times joins when it differs: it depends on
    # the timings, so it is left out here).
    found = {(c.schedule, c.stages_per_rank): c for c in candidates
             if c.valid and c.microbatches == 4 and c.split_points is None}
    assert found[("csv", 2)].predicted_step_time_s == pytest.approx(found[("zbv", 2)].predicted_step_time_s)
    assert found[("csv", 2)].peak_activations == found[("zbv", 2)].peak_activations
    assert found[("csv", 2)].overrides == ["schedule=csv", f"schedule.csv={zbv_csv}", "parallel.microbatches=4",
                                           "parallel.stages_per_rank=null"]


def _observations(truth: Fit, calibration: Calibration) -> list[Observation]:
    """Three runs (1F1B, interleaved 1F1B, ZBV at m=4) made of ``truth``: their recorded action
    costs are the overhead plus the scaled compute, their pipelines also pay the gap, their steps
    the scaled rest."""
    out = []
    for name, spr in PROBED:
        stages = 2 * spr
        compute = {}
        for s in range(stages):  # a heavier last stage (the head), I + W a little over B
            f = 0.002 * (3 if s == stages - 1 else 1)
            compute.update({(s, "F"): f, (s, "B"): 2 * f, (s, "I"): 1.2 * f if s else 0.0, (s, "W"): f if s else 2 * f})
        order = schedule_order(name, 2, 4, spr)
        # The gap lies between the recorded actions, not inside them.
        recorded = {k: v - truth.gap_s for k, v in truth.action_costs(compute, calibration.action_overhead_s).items()}
        run = Measured(name, [[f"u{s}"] for s in range(stages)], 4, order, recorded, 0.0, 0.0)
        observation = Observation(run, compute, 4096, rest_s=0.003)
        [pipeline] = predicted_pipelines([observation], truth, calibration)
        run = replace(run, pipeline_s=pipeline, step_s=pipeline + 0.003 * truth.rest_scale)
        out.append(replace(observation, measured=run))
    return out


def test_the_fit_recovers_the_scales_gap_and_rest_its_runs_were_made_of():
    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=3e-4, busy_delay_s=5e-4)
    truth = Fit(forward_scale=1.3, backward_scale=1.1, gap_s=4e-4, rest_scale=1.6)
    fitted = fit(_observations(truth, calibration), calibration)
    assert fitted.forward_scale == pytest.approx(1.3) and fitted.backward_scale == pytest.approx(1.1)
    assert fitted.gap_s == pytest.approx(4e-4, rel=1e-3) and fitted.rest_scale == pytest.approx(1.6)
    for probe in fitted.probes:  # each run's own pipeline and step, reproduced
        assert probe["fitted_pipeline_s"] == pytest.approx(probe["measured_pipeline_s"], rel=1e-3)
        assert probe["fitted_step_s"] == pytest.approx(probe["measured_step_s"], rel=1e-3)
    # Unfitted, a candidate's actions cost the co-running slowdown times their timings, as before probes.
    unfitted = Fit.unfitted(replace(calibration, corunning_slowdown=1.5))
    assert unfitted.action_costs({(0, "F"): 0.002, (0, "W"): 0.004}, 3e-4) == {
        (0, "F"): pytest.approx(3.3e-3), (0, "W"): pytest.approx(6.3e-3)}
    # A probe lasts plan.probe_seconds as predicted, 8-60 recorded steps after a third as many skipped.
    assert probe_steps(0.01, 4.0) == (80, 60) and probe_steps(2.0, 4.0) == (10, 8) and probe_steps(0.2, 4.0) == (26, 20)
    # The three placements at the smallest microbatch count, and 1F1B at the largest.
    assert probe_layouts([2, 4, 8]) == [("1f1b", 1, 2), ("interleaved_1f1b", 2, 2), ("zbv", 2, 2), ("1f1b", 1, 8)]
    assert probe_layouts([4]) == [("1f1b", 1, 4), ("interleaved_1f1b", 2, 4), ("zbv", 2, 4)]


def test_without_the_barrier_the_fit_recovers_the_updates_from_the_deferred_runs_steady_steps():
    # Probes of a plan.barrier=false plan run train.optimizer_sync=deferred: their step is
    # summary.json's bubble.steady steady step, and the updates between a rank's steps are fitted to it.
    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=3e-4, busy_delay_s=5e-4)
    truth = Fit(forward_scale=1.3, backward_scale=1.1, gap_s=4e-4, rest_scale=1.6)
    observations = []
    for o in _observations(truth, calibration):
        o = replace(o, updates_s={0: 0.004, 1: 0.001})  # rank 0 holds the embedding's update too
        steady = deferred_steps(o, truth, calibration)
        observations.append(replace(o, measured=replace(o.measured, deferred=True, steady_s=steady)))
    fitted = fit(observations, calibration)
    assert fitted.gap_s == pytest.approx(4e-4, rel=1e-3) and fitted.rest_scale == pytest.approx(1.6, rel=1e-3)
    for probe, o in zip(fitted.probes, observations):  # measured vs predicted: the steady step, not step_time_s
        assert probe["step"] == "bubble.steady" and probe["measured_step_s"] == o.measured.steady_s
        assert probe["fitted_step_s"] == pytest.approx(o.measured.steady_s, rel=1e-3)
    assert "steady steps without the barrier (train.optimizer_sync=deferred, summary.json bubble.steady) predicted" \
        in fit_line(fitted)
    # A steady step that the pipelines alone already fill leaves the updates nothing: 0, not negative.
    short = [replace(o, measured=replace(o.measured, steady_s=o.measured.pipeline_s * 0.5)) for o in observations]
    assert fit(short, calibration).rest_scale == 0.0


def test_the_fit_of_deferred_probes_of_a_tied_model_keeps_the_tied_meeting_out_of_the_updates():
    """Probes of a tied model (its embedding and head on pipeline ranks 0 and 1, not under ZBV's V)
    meet after every backward: their steady steps hold that meeting, which the fit takes as such
    (``Observation.meetings``, from ``Layout.tied``), so the updates' scale is the truth's; left out,
    the fit would put the meeting into the updates."""
    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=3e-4, busy_delay_s=5e-4)
    truth = Fit(forward_scale=1.3, backward_scale=1.1, gap_s=4e-4, rest_scale=1.6)
    observations = []
    for o in _observations(truth, calibration):
        meetings = [] if o.measured.label == "zbv" else [((0, 1), 0.003)]
        o = replace(o, updates_s={0: 0.004, 1: 0.001}, meetings=meetings)
        steady = deferred_steps(o, truth, calibration)  # with o.meetings
        observations.append(replace(o, measured=replace(o.measured, deferred=True, steady_s=steady)))
    assert fit(observations, calibration).rest_scale == pytest.approx(1.6, rel=1e-3)
    assert fit([replace(o, meetings=[]) for o in observations], calibration).rest_scale > 1.6 * 1.05


def test_the_fit_of_barrier_probes_of_a_tied_model_keeps_the_tied_sum_out_of_the_rest():
    """With the barrier a tied model's step holds the tied gradient's sum after the pipeline (its
    ranks 0 and 1 are every rank here: its seconds exactly; not under ZBV's V), which the planner now
    predicts as such: the fit takes it out of the measured rest, so the rest's scale is the truth's
    and each probe's fitted step its measured one; left in, the rest would count it twice."""
    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=3e-4, busy_delay_s=5e-4)
    truth = Fit(forward_scale=1.3, backward_scale=1.1, gap_s=4e-4, rest_scale=1.6)
    observations = []
    for o in _observations(truth, calibration):
        meet = 0.0 if o.measured.label == "zbv" else 0.003
        o = replace(o, meetings=[((0, 1), meet)] if meet else [])
        observations.append(replace(o, measured=replace(o.measured, step_s=o.measured.step_s + meet)))
    fitted = fit(observations, calibration)
    assert fitted.rest_scale == pytest.approx(1.6, rel=1e-6)
    for probe in fitted.probes:
        assert probe["fitted_step_s"] == pytest.approx(probe["measured_step_s"], rel=1e-6), probe["label"]
    assert fit([replace(o, meetings=[]) for o in observations], calibration).rest_scale > 1.6 * 1.2


def _previous_run(run_dir: Path, layout, order, *, forward_s: float, backward_s: float, pipeline_s: float,
                  step_s: float) -> None:
    """The files a finished run leaves that the planner reads: its stages and recorded bubble,
    the order it executed and its step times."""
    run_dir.mkdir()
    steps = [4, 5, 6]
    summary = {"stages": {str(i): list(s) for i, s in enumerate(layout.stages)}, "microbatches": layout.microbatches,
               "step_time_s": step_s, "bubble": {
                   "steps": steps, "pipeline_step_s": pipeline_s,
                   "mean_costs_s": {f"{s}{k}": forward_s if k == "F" else backward_s for s in range(2) for k in "FB"}}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    write_schedule_csv(run_dir / "schedule.csv", order)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_time_s": step_s if i in steps else 9.0})
                                                   + "\n" for i in range(1, 7)))


def test_plan_fits_its_cost_model_to_a_previous_run(tmp_path, monkeypatch):
    # Fixed child timings (milliseconds, both stages alike), not measured ones: under load a timed
    # stage could read 10x its peer, the pooled scale then gives the light stage a negative gap,
    # which the cost model clamps at 0, and the fit no longer adds up to the run it was given.
    def cost(f: float) -> ChildCost:
        return ChildCost(forward_s=f, backward_s=2 * f, input_backward_s=f, weight_backward_s=f, saved_bytes=1,
                         output_bytes=1, update_s=f / 10)

    times = {"embed": 2e-4, **{f"block{i}": 1e-3 for i in range(6)}, "norm": 1e-4, "head": 1e-3}
    monkeypatch.setattr("runner.plan.planner.measure_child_costs", lambda *args: {n: cost(f) for n, f in times.items()})
    cfg = compose(*TINY, "parallel.pp=2", "train.batch_size=8", "schedule=1f1b", "parallel.microbatches=4")
    layout = validate(cfg).layout
    # A "previous run" of the 1F1B layout whose actions took 1 s per forward and 2 s per backward,
    # its pipeline 16 s (1 s more than its actions and messages: the gap) and its step 16.5 s.
    _previous_run(tmp_path / "run", layout, schedule_order("1f1b", 2, 4, 1), forward_s=1.0, backward_s=2.0,
                  pipeline_s=16.0, step_s=16.5)
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.repeats=1"]
    candidates, _, _, model = plan(compose(*common, "plan.microbatches=[2,4]", f"plan.costs={tmp_path / 'run'}"))
    by_name = {(c.schedule, c.microbatches): c for c in candidates if c.valid and c.split_points is None}
    # Its own layout is predicted as it ran, pipeline and step; every other layout with the same model.
    one_f_one_b = by_name[("1f1b", 4)]
    assert one_f_one_b.pipeline_s == pytest.approx(16.0, rel=1e-3)
    assert one_f_one_b.predicted_step_time_s == pytest.approx(16.5, rel=1e-3)
    assert model is not None and model.rest_scale > 1  # 0.5 s after the pipeline: far more than timed here
    # Per kind, its actions add up to the run's (the scale is pooled over stages), plus the gap.
    costs = one_f_one_b.stage_costs_s
    assert costs["0F"] + costs["1F"] == pytest.approx(2 * 1.0 + 2 * model.gap_s)
    assert costs["0B"] + costs["1B"] == pytest.approx(2 * 2.0 + 2 * model.gap_s)
    # Every layout, at either microbatch count, is predicted with the run's scales: in seconds, not
    # in the milliseconds its children took here.
    assert {m for _, m in by_name} == {2, 4} and all(c.predicted_step_time_s > 5 for c in by_name.values())
    with pytest.raises(ConfigError, match=r"plan.costs='.*nowhere'.*Fix: point it at a run directory"):
        plan(compose(*common, "plan.microbatches=[4]", f"plan.costs={tmp_path / 'nowhere'}"))


def test_the_action_overhead_is_solved_from_a_pipeline_step():
    order = schedule_order("1f1b", 2, 8, 1)
    step = max(a.end for a in simulate(order, {"F": 0.003, "B": 0.003}, num_stages=2, comm_s=0.001))
    assert solve_action_overhead(step, comm_s=0.001) == pytest.approx(0.003)
    assert solve_action_overhead(0.0, comm_s=0.001) == 0.0  # faster than messages alone: no overhead


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_calibration_measures_messages_and_the_runtime_on_two_ranks():
    measured = calibrate(2**20, repeats=5)
    assert 0 < measured.latency_s < 0.05  # loopback gloo: tens of microseconds to a few ms on a busy host
    assert 1e7 < measured.bandwidth < 1e12
    assert 0 <= measured.action_overhead_s < 0.05 and 1 <= measured.corunning_slowdown < 4
    assert 0 <= measured.busy_delay_s < 0.05 and 0 < measured.action_jitter < 2  # 2 shared cores: loose
    assert 0 < measured.allreduce_latency_s < 0.05 and 1e7 < measured.allreduce_bandwidth < 1e12  # tp's
    idle = measured.latency_s + 2**20 / measured.bandwidth
    assert measured.message_s(2**20) == pytest.approx(idle + measured.busy_delay_s)
    # The delay waits out the sender's compute: never longer than one of its actions.
    assert measured.message_s(2**20, sender_action_s=0.0) == pytest.approx(idle)


# The CPU case keeps the GPU one from rotting between GPU runs (it once named a removed attribute).
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plan_times_children_on_the_device_a_run_would_use(device):
    import torch

    from runner.models.split import build_meta_model
    from runner.plan.costs import measure_child_costs

    cfg = compose(*TINY, "train.batch_size=8")
    costs = measure_child_costs(cfg, 4, 3, torch.device(device, 0) if device == "cuda" else torch.device(device))
    assert list(costs) == build_meta_model(cfg.model).unit_names  # one entry per unit
    assert all(c.forward_s > 0 and c.backward_s >= 0 and c.saved_bytes > 0 for c in costs.values())
    assert all(c.input_backward_s > 0 and c.weight_backward_s > 0 for c in list(costs.values())[1:])
    if device == "cuda" and torch.cuda.device_count() >= 2:  # NCCL between two GPUs
        measured = calibrate(2**20, device="cuda", repeats=5)
        assert 0 < measured.latency_s < 0.05 and measured.bandwidth > 1e8
