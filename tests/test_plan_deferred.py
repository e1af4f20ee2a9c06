"""Plans without the barrier of this host and of a target (``plan.barrier=false``): each candidate
scored by ``train.optimizer_sync=deferred``'s steady step (``runner.pipeline.simulate.deferred_step``:
steps back to back, each rank's update between its own steps, the loss/norm all-reduce waited for a
step later), its command running deferred; what still cannot run refused before anything is timed.
In-process, fixed costs; the plan run against a real deferred run is in the slow tier."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from runner.errors import ConfigError
from runner.pipeline.schedule import schedule_order
from runner.pipeline.simulate import compute_floor, deferred_step, simulate
from runner.plan.__main__ import plan_in
from runner.plan.costs import ChildCost
from runner.plan.planner import DEFERRED, plan
from runner.plan.target import plan_target

from helpers.cli import run_cli
from helpers.config import TINY, compose
from helpers.plan import FIXED

P, M = 4, 8
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _makespan(order) -> float:
    return max(a.end for a in simulate(order, COSTS, num_stages=P))


def test_the_deferred_step_overlaps_what_the_barrier_serializes_and_keeps_what_it_cannot():
    update = {r: 0.5 for r in range(P)}
    for name in ("1f1b", "gpipe"):  # rank 0 runs from the step's first action to its last: nothing overlaps
        order = schedule_order(name, P, M, 1)
        assert deferred_step(order, COSTS, num_stages=P, update_s=update) == pytest.approx(_makespan(order) + 0.5)
    zbh2 = schedule_order("zbh2", P, M, 1)
    barrier = _makespan(zbh2) + 0.5 + 0.1  # the pipeline, the all-reduce, the slowest update
    overlapped = deferred_step(zbh2, COSTS, num_stages=P, update_s=update, reduce_s=0.1)
    # ZB-H2's ramps overlap the next step's: shorter than the barrier's step, never under the busiest
    # rank's compute plus its own update (a rank runs its update between its own steps).
    assert compute_floor(zbh2, COSTS) + 0.5 <= overlapped < barrier * 0.9, (overlapped, barrier)
    # The slowest rank bounds the steady state: rank 2's long update is in every step.
    slow = deferred_step(zbh2, COSTS, num_stages=P, update_s={**update, 2: 10.0})
    assert slow >= M * (COSTS["F"] + COSTS["I"] + COSTS["W"]) + 10.0 - 1e-9
    # The deferred validation waits for step k-1's all-reduce in step k: one longer than a step
    # serializes the steps at its own length.
    assert deferred_step(zbh2, COSTS, num_stages=P, update_s=update, reduce_s=100.0) == pytest.approx(100.0)
    # Varying action times: every step waits for its slowest draw, so the mean step is longer.
    assert deferred_step(zbh2, COSTS, num_stages=P, update_s=update, jitter=0.2) > overlapped


def _fixed_children(monkeypatch) -> None:
    """Child costs in seconds (both halves of the model alike, an update per child, no snapshot), not
    timed ones: the barrier and barrier-free plans compared on the same numbers."""
    def cost(f: float) -> ChildCost:
        return ChildCost(forward_s=f, backward_s=2 * f, input_backward_s=1.1 * f, weight_backward_s=f, saved_bytes=1,
                         output_bytes=1, update_s=f / 4)

    times = {"embed": 0.05, **{f"block{i}": 1.0 for i in range(6)}, "norm": 0.05, "head": 1.0}
    monkeypatch.setattr("runner.plan.planner.measure_child_costs", lambda *args: {n: cost(f) for n, f in times.items()})


@pytest.mark.timeout(120)
def test_a_plan_of_this_host_without_the_barrier_scores_the_deferred_steady_step_and_runs_deferred(monkeypatch):
    _fixed_children(monkeypatch)
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]",
              "plan.weight_grad_fraction=0.5", "plan.schedules=[1f1b,zbh1,zbh2]"]
    with_barrier, _, _, _ = plan(compose(*common))
    without, _, _, _ = plan(compose(*common, "plan.barrier=false"))

    def key(c):
        return c.schedule, c.microbatches, c.stages_per_rank, tuple(c.split_points or ())

    barrier = {key(c): c for c in with_barrier if c.valid}
    free = {key(c): c for c in without if c.valid}
    assert set(free) == set(barrier) and {k[0] for k in free} == {"1f1b", "zbh1", "zbh2"}
    assert all(c.overrides[-1] == DEFERRED for c in without)  # what was scored is what runs
    assert not any(DEFERRED in c.overrides for c in with_barrier)
    ratios = {}
    for k, c in free.items():
        p = c.prediction()
        # Nothing beyond what the barrier's step holds (the pipeline, the all-reduce, the slowest update) ...
        assert p.step_s <= barrier[k].prediction().step_s * (1 + 1e-6), k
        # ... and the pipeline overlapped is never under the busiest rank's compute.
        assert p.lower_bound_s <= p.pipeline_s * (1 + 1e-9) and c.after_pipeline_s >= 0
        ratios[k[0]] = p.step_s / barrier[k].prediction().step_s
    # 1F1B's first rank spans its step: only the all-reduce and the other ranks' updates go; ZB-H2 overlaps.
    print(f"barrier-free / barrier step: {ratios}")
    assert ratios["1f1b"] > 0.97 and ratios["zbh2"] < ratios["1f1b"] - 0.02, ratios
    # The table and the plan rank by the barrier-free step.
    times = [c.predicted_step_time_s for c in without if c.valid and c.fits_memory]
    assert times == sorted(times)
    # A step validated at its own end (here the last of train.steps=5) overlaps nothing: the barrier's
    # step (no snapshot in these children), and over the run one step in five takes it.
    for k, c in free.items():
        assert c.commit_step_s == pytest.approx(barrier[k].prediction().step_s, rel=1e-9), k
        assert c.amortized_step_s == pytest.approx(c.predicted_step_time_s + (c.commit_step_s - c.predicted_step_time_s)
                                                   / 5, rel=1e-9)
        assert barrier[k].commit_step_s is None and barrier[k].amortized_step_s is None


def test_plan_barrier_false_refuses_what_cannot_run_deferred(tmp_path):
    cases = [
        (["train.optimizer_sync=barrier"], r"plan.barrier=false with train.optimizer_sync=barrier.*Fix: drop"),
        (["verify=true", "checkpoint.resume=latest"], r"verify=true and checkpoint.resume=latest.*Fix: verify=false"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            plan_in(compose(*TINY, "plan.barrier=false", *overrides), tmp_path, ["plan.barrier=false", *overrides])


def test_a_target_plan_without_the_barrier_overlaps_pipelines_and_pays_the_snapshot_where_nothing_overlaps():
    # Wide enough and a free link, so that compute, not the 10 us message of a microsecond action, makes the step.
    common = [*TINY, "model.dim=256", "train.seq_len=128", "plan.target=nvidia a100", "plan.world_size=2",
              "plan.microbatches=[4]", "plan.comm_latency_s=0", "plan.comm_bandwidth=1e15"]
    barrier = {(c.schedule, c.pp, c.dp_mode, c.microbatches): c for c in plan_target(compose(*common)).candidates
               if c.valid}
    free = [c for c in plan_target(compose(*common, "plan.barrier=false")).candidates if c.valid]
    assert {(c.schedule, c.pp, c.dp_mode, c.microbatches) for c in free} == set(barrier)
    assert all(c.overrides[-1] == DEFERRED for c in free) and any(c.recommended for c in free)
    for c in free:
        b = barrier[(c.schedule, c.pp, c.dp_mode, c.microbatches)]
        assert c.step_time_s is not None and b.step_time_s is not None and b.optimizer_s is not None
        if c.pp == 1:  # one rank: nothing to overlap; the update also takes its snapshot (12 bytes/parameter)
            assert c.step_time_s == pytest.approx(b.step_time_s + b.optimizer_s * 24 / 36, rel=1e-6)
    # ZB-H2's drain overlaps the next step's warm-up: shorter than with the barrier, snapshot and all;
    # 1F1B's first rank spans its step: only the snapshot is added.
    for c in free:  # a step validated at its own end overlaps nothing: the barrier's step and the snapshot
        b = barrier[(c.schedule, c.pp, c.dp_mode, c.microbatches)]
        assert c.commit_step_s == pytest.approx(b.step_time_s + b.optimizer_s * 24 / 36, rel=1e-6)
        assert c.amortized_step_s == pytest.approx(c.step_time_s + (c.commit_step_s - c.step_time_s) / 5, rel=1e-9)
    [zbh2] = [c for c in free if c.schedule == "zbh2"]
    [one_f_one_b] = [c for c in free if c.schedule == "1f1b"]
    assert zbh2.step_time_s is not None and one_f_one_b.step_time_s is not None
    assert zbh2.step_time_s < barrier[("zbh2", 2, "none", 4)].step_time_s * 0.98
    assert one_f_one_b.step_time_s > barrier[("1f1b", 2, "none", 4)].step_time_s


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_plan_cli_without_the_barrier_probes_deferred_and_its_recommendation_runs_near_its_steady_step(tmp_path):
    common = [*TINY, "parallel.pp=2", "train.batch_size=8"]
    planned = run_cli(*common, "plan.microbatches=[4]", "plan.barrier=false", "plan.probe_seconds=2",
                      "hydra.run.dir=plan", module="runner.plan", cwd=tmp_path, check=True)
    assert "steps without the barrier (plan.barrier=false)" in planned.stdout
    assert "steady steps without the barrier (train.optimizer_sync=deferred, summary.json bubble.steady)" \
        in planned.stdout
    model = json.loads((tmp_path / "plan" / "fit.json").read_text())
    assert all(p["step"] == "bubble.steady" for p in model["probes"])  # the probes ran deferred
    probe = json.loads((tmp_path / "plan" / "probes" / "1f1b_m4" / "summary.json").read_text())
    assert probe["bubble"]["steady"]["step_s"] > 0
    [recommended] = [r for r in json.loads((tmp_path / "plan" / "plan.json").read_text()) if r["recommended"]]
    best = shlex.split(re.search(r"best(?: \(tied\))?: python -m runner (.*)", planned.stdout).group(1))
    assert best[-1] == DEFERRED
    longer = [o for o in best if not o.startswith("train.steps=")]  # 10 steps recorded: bubble.steady over 9
    run_cli(*longer, "train.steps=14", "profile.wait=2", "profile.warmup=0", "profile.active=10", "hydra.run.dir=run",
            cwd=tmp_path, check=True)
    steady = json.loads((tmp_path / "run" / "summary.json").read_text())["bubble"]["steady"]["step_s"]
    ratio = recommended["predicted_step_time_s"] / steady
    # Loose on purpose, as the barrier's CLI test: 2 shared cores and a millisecond-scale model.
    print(f"predicted / measured steady step without the barrier: {ratio:.2f}")
    assert 0.1 < ratio < 10


def test_rehearsed_candidates_without_the_barrier_are_scored_by_deferreds_steady_step_with_their_updates():
    """``plan.rehearse=true plan.barrier=false``: accepted, and a rehearsed candidate's step is
    ``deferred_step`` of the rehearsal's action costs (times the slowdown) in its order, each pipeline
    rank's rehearsed update (times the slowdown) plus its collectives between its steps, and the
    all-reduce (one message) a step later: ZB-H2 at pp=4 then beats its barrier step, 1F1B does not."""
    from types import SimpleNamespace

    from runner.plan.calibrate import Calibration
    from runner.plan.planner import Candidate, check_barrier_free
    from runner.plan.rehearsed import cost_from_rehearsal

    check_barrier_free(compose(*TINY, "plan.barrier=false", "plan.rehearse=true"), ["plan.rehearse=true"])
    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=0.0, corunning_slowdown=2.0)
    stage_costs = {f"{s}{k}": v * 1e-3 for s in range(P) for k, v in COSTS.items()}
    updates = {str(p): 0.25e-3 for p in range(P)}
    step = {"step_s": 1.0, "stage_costs_s": stage_costs, "collectives_s": 1e-4, "optimizer_s": 0.2e-3,
            "deferred": {"update_s": updates, "update_collectives_s": {str(p): 0.5e-3 for p in range(P)}}}
    report = {"step": step, "ranks": [{"rank": p} for p in range(P)]}
    layout = SimpleNamespace(num_stages=P, pp=P, microbatches=M, stage_to_rank={s: s for s in range(P)}, tied=())
    costs = {(s, k): v * 2e-3 for s in range(P) for k, v in COSTS.items()}
    for name in ("zbh2", "1f1b"):
        order = schedule_order(name, P, M, 1)
        free, kept = (Candidate(name, M, 1, [], valid=True) for _ in range(2))
        cost_from_rehearsal(free, layout, order, report, calibration, 1e-4, {s: 1.0 for s in range(P)}, None,
                            barrier=False)
        cost_from_rehearsal(kept, layout, order, report, calibration, 1e-4, {s: 1.0 for s in range(P)}, None)
        expected = deferred_step(order, costs, num_stages=P, comm_s=1e-4, update_s={p: 1e-3 for p in range(P)},
                                 reduce_s=1e-4)
        assert free.predicted_step_time_s == pytest.approx(expected, rel=1e-12)
        assert free.pipeline_s == pytest.approx(deferred_step(order, costs, num_stages=P, comm_s=1e-4), rel=1e-12)
        assert free.rehearsal["scored_by"] == "deferred steady step" and kept.rehearsal["scored_by"] == "barrier"
        if name == "zbh2":
            assert free.predicted_step_time_s < kept.predicted_step_time_s * 0.95
        else:
            assert free.predicted_step_time_s > kept.predicted_step_time_s
    with pytest.raises(ValueError, match="no deferred step"):
        cost_from_rehearsal(Candidate("1f1b", M, 1, [], valid=True), layout, order,
                            {"step": {k: v for k, v in step.items() if k != "deferred"}}, calibration, 1e-4, {}, None,
                            barrier=False)


def test_rehearsed_candidates_of_a_tied_model_take_the_sum_with_the_barrier_as_without_it():
    """A rehearsed candidate whose first and last pipeline ranks hold a tied weight's copies: with
    the barrier its step takes the sum after the pipeline where they meet, priced by the calibrated
    all-reduce as the step without the barrier prices it (``tied_meetings``); 1F1B's first rank ends
    its step last either way, so both steps grow by exactly that all-reduce, the pipeline by nothing."""
    from types import SimpleNamespace

    from runner.layout import TiedSpan
    from runner.plan.calibrate import Calibration
    from runner.plan.planner import Candidate
    from runner.plan.rehearsed import cost_from_rehearsal

    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=0.0, allreduce_latency_s=3e-4,
                              allreduce_bandwidth=2e9)
    stage_costs = {f"{s}{k}": v * 1e-3 for s in range(P) for k, v in COSTS.items()}
    step = {"step_s": 1.0, "stage_costs_s": stage_costs, "collectives_s": 1e-4, "optimizer_s": 0.2e-3,
            "deferred": {"update_s": {str(p): 0.25e-3 for p in range(P)},
                         "update_collectives_s": {str(p): 0.0 for p in range(P)}}}
    report = {"step": step, "ranks": [{"rank": p} for p in range(P)]}
    order, meet = schedule_order("1f1b", P, M, 1), 3e-4 + 8000 / 2e9
    got = {}
    for tied in ((), (TiedSpan((0, P - 1), 8000),)):
        layout = SimpleNamespace(num_stages=P, pp=P, microbatches=M, stage_to_rank={s: s for s in range(P)}, tied=tied)
        for barrier in (True, False):
            c = Candidate("1f1b", M, 1, [], valid=True)
            cost_from_rehearsal(c, layout, order, report, calibration, 1e-4, {s: 1.0 for s in range(P)}, None,
                                barrier=barrier)
            got[bool(tied), barrier] = c
    for barrier in (True, False):
        untied, tied_c = got[False, barrier], got[True, barrier]
        assert tied_c.predicted_step_time_s - untied.predicted_step_time_s == pytest.approx(meet, rel=1e-9), barrier
        assert tied_c.pipeline_s == untied.pipeline_s and tied_c.bubble == untied.bubble
    assert got[True, True].after_pipeline_s == pytest.approx(meet + 1e-4 + 0.2e-3, rel=1e-9)


def _step_bounds(timeline, rank: int, k: int) -> tuple[float, float]:
    """Rank ``rank``'s step ``k`` in a ``_deferred_timeline``: its first action's start, its last's end."""
    mine = [a for a in timeline if a.rank == rank and a.op.microbatch // M == k]
    return min(a.start for a in mine), max(a.end for a in mine)


def test_a_tied_weight_makes_its_ranks_meet_after_every_backward_and_the_deferred_step_keeps_it():
    """``model.tie_embeddings`` with the embedding on the first pipeline rank and the head on the
    last: ``Trainer.step`` sums the tied gradient between them after every backward (it blocks), so
    neither starts step k+1 before the other has ended step k's backward, the sum and its own
    update. Untied, ZB-H2's first rank starts its next step while the last still drains: the
    meeting costs more than its all-reduce. One rank holding both ends (V placements) meets nobody."""
    from runner.pipeline.simulate import _deferred_timeline

    zbh2 = schedule_order("zbh2", P, M, 1)
    update, meet = {r: 0.5 for r in range(P)}, 0.25
    tied = _deferred_timeline(zbh2, COSTS, num_stages=P, update_s=update, meetings=[((0, P - 1), meet)])
    untied = _deferred_timeline(zbh2, COSTS, num_stages=P, update_s=update)
    for k in range(1, 8):
        for rank, other in ((0, P - 1), (P - 1, 0)):
            assert _step_bounds(tied, rank, k)[0] >= _step_bounds(tied, other, k - 1)[1] + meet + 0.5 - 1e-9, (k, rank)
    assert all(_step_bounds(untied, 0, k)[0] < _step_bounds(untied, P - 1, k - 1)[1] for k in range(1, 8))
    free = deferred_step(zbh2, COSTS, num_stages=P, update_s=update)
    met = deferred_step(zbh2, COSTS, num_stages=P, update_s=update, meetings=[((0, P - 1), meet)])
    print(f"zbh2 pp={P}: steady step {free:.3f} untied, {met:.3f} tied (a sum of {meet})")
    assert met > free + meet - 1e-9
    # 1F1B's first rank ends its step last anyway: the meeting adds its all-reduce, nothing more.
    one = schedule_order("1f1b", P, M, 1)
    assert deferred_step(one, COSTS, num_stages=P, update_s=update, meetings=[((0, P - 1), meet)]) == pytest.approx(
        deferred_step(one, COSTS, num_stages=P, update_s=update) + meet)
    zbv = schedule_order("zbv", 2, M, 2)
    assert deferred_step(zbv, COSTS, num_stages=4, meetings=[((0,), 5.0)]) == deferred_step(zbv, COSTS, num_stages=4)


def test_the_layout_knows_which_pipeline_ranks_hold_a_tied_weight_and_the_plan_prices_their_meeting():
    from runner.layout import TiedSpan
    from runner.plan.calibrate import Calibration
    from runner.plan.link import tied_meetings
    from runner.validate import validate

    tie = [*TINY, "model.tie_embeddings=true", "train.batch_size=8", "parallel.microbatches=4"]
    vocab, dim = 48, 32
    assert validate(compose(*tie, "parallel.pp=2", "schedule=1f1b")).layout.tied == (
        TiedSpan((0, 1), 4 * vocab * dim),)
    assert validate(compose(*tie, "parallel.pp=2", "schedule=zbv")).layout.tied == ()  # both ends on rank 0
    assert validate(compose(*TINY, "train.batch_size=8", "parallel.pp=2", "parallel.microbatches=4")).layout.tied == ()
    fsdp = validate(compose(*tie, "parallel.pp=2", "schedule=1f1b", "parallel.dp=2", "parallel.dp_mode=fsdp"))
    assert fsdp.layout.tied == (TiedSpan((0, 1), 2 * vocab * dim),)  # a shard each: half the rows
    calibration = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=0.0, allreduce_latency_s=3e-4,
                              allreduce_bandwidth=2e9)
    # two ranks: the calibrated all-reduce between two ranks, exactly (a ring of two messages)
    assert tied_meetings((TiedSpan((0, 3), 8000),), calibration.all_reduce_link()) == [
        ((0, 3), pytest.approx(3e-4 + 8000 / 2e9))]


def test_a_tied_sum_has_one_price_whoever_predicts_the_step():
    """The planner's probes and candidates (the calibration's all-reduce link, or its message where
    ``plan.comm_*`` are given), ``plan.target`` (its link) and the rehearsal's composed step
    (``plan.comm_*``) price a tied weight's gradient sum by one function: a ring all-reduce between
    the ranks holding a copy, 2(n-1) messages of 1/n of its bytes, a latency each."""
    from runner.layout import TiedSpan
    from runner.plan.calibrate import Calibration
    from runner.plan.link import Link, ring_all_reduce_s, tied_meetings
    from runner.rehearse.compose import _meetings
    from runner.validate import validate

    resolved = validate(compose(*TINY, "model.tie_embeddings=true", "train.batch_size=8", "parallel.microbatches=4",
                                "parallel.pp=2", "schedule=1f1b"))
    grad = 4 * 48 * 32
    ring = [((0, 1), pytest.approx(2 * 1e-4 + grad / 1e9, rel=1e-12))]
    given = Calibration(latency_s=1e-4, bandwidth=1e9, action_overhead_s=0.0)
    measured = Calibration(latency_s=7e-5, bandwidth=3e8, action_overhead_s=0.0, allreduce_latency_s=2e-4,
                           allreduce_bandwidth=1e9)  # two ranks' all-reduce: two messages of 1e-4
    assert tied_meetings(resolved.layout.tied, Link(1e-4, 1e9)) == ring  # plan.target's link
    assert tied_meetings(resolved.layout.tied, given.all_reduce_link()) == ring
    assert tied_meetings(resolved.layout.tied, measured.all_reduce_link()) == ring
    assert _meetings(resolved, 1e-4, 1e9) == ring  # the rehearsal's composed step
    three = tied_meetings((TiedSpan((0, 2, 3), 9000),), Link(1e-4, 1e9))
    assert three == [((0, 2, 3), pytest.approx(4 * (1e-4 + 3000 / 1e9), rel=1e-12))]
    assert ring_all_reduce_s(9000, 3, Link(1e-4, 1e9), gather=True) == pytest.approx(2 * (1e-4 + 3000 / 1e9))
    assert ring_all_reduce_s(9000, 1, Link(1e-4, 1e9)) == 0.0


@pytest.mark.timeout(120)
def test_a_plan_without_the_barrier_of_a_tied_model_adds_its_ranks_meeting(monkeypatch):
    """The same children and layout, tied and not: the tied candidates' steady steps are longer by
    at least the tied gradient's all-reduce (exactly that where the first rank ends its step last:
    1F1B), as ``Layout.tied`` and the calibrated all-reduce price it; the probes' fit takes the same
    meetings (``Observation.meetings``)."""
    _fixed_children(monkeypatch)
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]",
              "plan.weight_grad_fraction=0.5", "plan.schedules=[1f1b,zbh1]", "plan.barrier=false"]
    untied, _, _, _ = plan(compose(*common))
    tied, _, _, _ = plan(compose(*common, "model.tie_embeddings=true"))
    meet = 2 * 2e-4 + 4 * 48 * 32 / 1e9  # no all-reduce measured: a ring of two of FIXED's messages

    def key(c):
        return c.schedule, tuple(c.split_points or ()), tuple(sorted(c.stage_costs_s.items()))

    before = {key(c): c for c in untied if c.valid}
    pairs = [(before[key(c)], c) for c in tied if c.valid and key(c) in before]
    assert {a.schedule for a, _ in pairs} == {"1f1b", "zbh1"}
    for a, b in pairs:
        assert a.predicted_step_time_s is not None and b.predicted_step_time_s is not None
        added = b.predicted_step_time_s - a.predicted_step_time_s
        if a.schedule == "1f1b":
            assert added == pytest.approx(meet, rel=1e-6), a.schedule
        else:
            assert added >= meet * (1 - 1e-6), a.schedule
        assert b.pipeline_s == a.pipeline_s  # the pipeline alone has no meeting: what it adds is after it


def test_with_the_barrier_a_tied_weights_sum_starts_when_the_last_of_its_ranks_ends_its_backward():
    """``Trainer.step`` sums the tied gradient after the pipeline's backward, before the norm's
    all-reduce: with the barrier the step waits for it where its ranks meet. Over every rank the sum
    follows the pipeline's end: its seconds added exactly. 1F1B's first rank ends last, so a sum
    between ranks 1 and 2, which end earlier, hides under it unless it is longer than their wait;
    one rank holding both ends (V placements) meets nobody."""
    from runner.pipeline.simulate import expected_makespan

    one = schedule_order("1f1b", P, M, 1)
    ends = {r: max(a.end for a in simulate(one, COSTS, num_stages=P) if a.rank == r) for r in range(P)}
    assert ends[0] == _makespan(one) > max(ends[1], ends[2])
    assert expected_makespan(one, COSTS, num_stages=P, meetings=[(tuple(range(P)), 0.25)]) == pytest.approx(
        _makespan(one) + 0.25)
    assert expected_makespan(one, COSTS, num_stages=P, meetings=[((0, P - 1), 0.25)]) == pytest.approx(
        _makespan(one) + 0.25)
    hidden = _makespan(one) - max(ends[1], ends[2])
    assert expected_makespan(one, COSTS, num_stages=P, meetings=[((1, 2), hidden / 2)]) == _makespan(one)
    assert expected_makespan(one, COSTS, num_stages=P, meetings=[((1, 2), hidden + 1.0)]) == pytest.approx(
        _makespan(one) + 1.0)
    zbv = schedule_order("zbv", 2, M, 2)
    assert expected_makespan(zbv, COSTS, num_stages=4, meetings=[((0,), 5.0)]) == expected_makespan(
        zbv, COSTS, num_stages=4)
    # Varying action times: the sum over every rank still adds its seconds to each draw's end.
    assert expected_makespan(one, COSTS, num_stages=P, jitter=0.2, meetings=[(tuple(range(P)), 0.25)]) == (
        pytest.approx(expected_makespan(one, COSTS, num_stages=P, jitter=0.2) + 0.25))


@pytest.mark.timeout(120)
def test_a_plan_with_the_barrier_of_a_tied_model_adds_the_sum_the_plan_without_it_counts(monkeypatch):
    """The same children and layout, tied and not, with the barrier: at pp=2 the tied gradient's
    sum is between every rank after the pipeline, so each tied candidate's step is longer by exactly
    its all-reduce (the calibrated price ``tied_meetings`` gives the plan without the barrier) and
    its pipeline unchanged; ZBV holds both ends on rank 0: unchanged. Without the barrier a step
    validated at its own end overlaps nothing: the barrier's step, sum and all."""
    _fixed_children(monkeypatch)
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]",
              "plan.weight_grad_fraction=0.5", "plan.schedules=[1f1b,zbh1,zbv]"]
    untied, _, _, _ = plan(compose(*common))
    tied, _, _, _ = plan(compose(*common, "model.tie_embeddings=true"))
    free, _, _, _ = plan(compose(*common, "model.tie_embeddings=true", "plan.barrier=false"))
    meet = 2 * 2e-4 + 4 * 48 * 32 / 1e9  # no all-reduce measured: a ring of two of FIXED's messages

    def key(c):
        return c.schedule, c.stages_per_rank, tuple(c.split_points or ()), tuple(sorted(c.stage_costs_s.items()))

    before, without = {key(c): c for c in untied if c.valid}, {key(c): c for c in free if c.valid}
    pairs = [(before[key(c)], c) for c in tied if c.valid and key(c) in before]
    assert {a.schedule for a, _ in pairs} == {"1f1b", "zbh1", "zbv"}
    for a, b in pairs:
        step_a, step_b = a.prediction().step_s, b.prediction().step_s
        if a.schedule == "zbv":
            assert step_b == step_a and b.after_pipeline_s == a.after_pipeline_s
        else:
            assert step_b - step_a == pytest.approx(meet, rel=1e-6), a.schedule
            assert b.after_pipeline_s - a.after_pipeline_s == pytest.approx(meet, rel=1e-6)
        assert b.pipeline_s == a.pipeline_s and b.bubble == a.bubble
        assert without[key(b)].commit_step_s == pytest.approx(step_b, rel=1e-9), a.schedule


def test_commit_steps_are_the_last_evaluated_saved_and_verified_steps_and_amortize_the_steady_step():
    from runner.plan.planner import Candidate, committed_steps

    assert committed_steps(compose(*TINY, "train.steps=10")) == (1, 10)
    assert committed_steps(compose(*TINY, "train.steps=10", "eval.every=4", "checkpoint.every=5")) == (4, 10)
    assert committed_steps(compose(*TINY, "train.steps=10", "eval.every=4", "verify=true", "verify_steps=1")) == (
        5, 10)  # 1 and 2 compared, 4 and 8 evaluated, 10 the last
    assert committed_steps(compose(*TINY, "train.steps=12", "eval.every=2", "checkpoint.every=3")) == (8, 12)
    assert committed_steps(compose(*TINY, "train.steps=1000000000", "eval.every=1000")) == (1000000, 1000000000)
    c = Candidate("zbh2", 4, 1, [], valid=True, predicted_step_time_s=1.0, commit_step_s=1.5)
    c.amortize(4, 10)
    assert c.amortized_step_s == pytest.approx(1.2)
    barrier = Candidate("zbh2", 4, 1, [], valid=True, predicted_step_time_s=1.0)
    barrier.amortize(4, 10)  # with the barrier every step is its own commit: nothing to add
    assert barrier.amortized_step_s is None


def test_a_target_plan_without_the_barrier_of_a_tied_model_adds_the_meeting_of_its_first_and_last_rank(tmp_path,
                                                                                                         capsys):
    """``plan.target`` with ``model.tie_embeddings``: the candidates whose embedding and head sit on
    different ranks take the tied gradient's ring all-reduce between them (2 latencies + its fp32
    bytes over the link at 2 ranks) on their steady step, 1F1B exactly that; one rank (pp=1) or both
    ends on one rank (ZBV) nothing. The report says what the steps validated at their own end cost."""
    from runner.plan.target_report import run_target

    common = [*TINY, "model.dim=256", "train.seq_len=128", "plan.target=nvidia a100", "plan.world_size=2",
              "plan.microbatches=[4]", "plan.comm_latency_s=1e-4", "plan.comm_bandwidth=1e9", "plan.barrier=false"]
    untied = {(c.schedule, c.pp, c.dp_mode): c.step_time_s for c in plan_target(compose(*common)).candidates
              if c.valid}
    run_target(compose(*common, "model.tie_embeddings=true"), tmp_path, [])
    rows = json.loads((tmp_path / "plan.json").read_text())
    tied = {(r["schedule"], r["pp"], r["dp_mode"]): r["step_time_s"] for r in rows if r["valid"]}
    [best] = [r for r in rows if r["recommended"]]
    assert f"{best['commit_step_s'] * 1e3:.2f} ms there against {best['step_time_s'] * 1e3:.2f} ms steady" in \
        capsys.readouterr().out
    assert set(tied) == set(untied)
    meet = 2 * 1e-4 + 4 * 48 * 256 / 1e9
    assert tied[("1f1b", 2, "none")] - untied[("1f1b", 2, "none")] == pytest.approx(meet, rel=1e-6)
    assert tied[("zbh2", 2, "none")] - untied[("zbh2", 2, "none")] >= meet * (1 - 1e-6)
    for key in [k for k in tied if k[1] == 1 or k[0] == "zbv"]:
        assert tied[key] == pytest.approx(untied[key], rel=1e-12), key
    assert any(k[0] == "zbv" for k in tied)
