"""Profiles, timelines and bubbles: the window, the simulator and the formulas in-process; the
files of a real profiled run in test_cli (which already runs one)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining.schedules import get_schedule_class

from runner._torch import pp as _torch_pp
from runner.hooks import Hook
from runner.outputs.profile import Window, plan_window
from runner.outputs.timeline import (
    HostClock,
    clock_offsets,
    mean_costs,
    measured_bubble,
    measured_slices,
    plot_schedule,
    simulated_slices,
    steady_bubble,
    write_chrome_trace,
)
from runner.pipeline.ops import Op
from runner.pipeline.recorder import Action, Recorder, StepSpan
from runner.pipeline.registry import theoretical_bubble
from runner.pipeline.schedule import SCHEDULES, schedule_order
from runner.pipeline.simulate import (
    UNIT_COSTS,
    bubble_fractions,
    expected_makespan,
    repeat_steps,
    simulate,
    steady_step,
)

from helpers.cuda_stream import LATENCY, FakeStream


def test_profile_window_is_kept_when_it_fits_and_clamped_when_it_does_not():
    assert plan_window(1, 1, 3, 30) == (Window(1, 1, 3), False)
    assert plan_window(1, 1, 3, 4) == (Window(0, 1, 3), True)
    assert plan_window(2, 2, 3, 1) == (Window(0, 0, 1), True)
    window, _ = plan_window(1, 1, 3, 5)
    assert (window.first, window.last) == (2, 4)


@pytest.mark.parametrize("p,m,v,expected", [(2, 4, 1, 1 / 5), (4, 8, 1, 3 / 11), (2, 4, 2, 1 / 9), (4, 8, 2, 3 / 19)])
def test_theoretical_bubble_formulas(p, m, v, expected):
    schedule = "1f1b" if v == 1 else "interleaved_1f1b"
    assert theoretical_bubble(schedule, pp=p, microbatches=m, stages_per_rank=v) == pytest.approx(expected)
    assert theoretical_bubble("zbv", pp=p, microbatches=m, stages_per_rank=2) is None


def _declared_order(name: str, pp: int, m: int, spr: int) -> dict[int, list[Op]]:
    stages = _torch_pp.stand_in_stages(pp, pp * spr, spr)
    schedule = get_schedule_class(SCHEDULES[name].torch_class)(stages[0] if spr == 1 else stages, m)
    return {r: [Op(a.stage_index, a.computation_type.value, a.microbatch_index)
                for a in schedule.pipeline_order[r] if a is not None and a.is_compute_op]
            for r in range(pp)}


@pytest.mark.parametrize("name,pp,m,spr", [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1),
                                           ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2),
                                           ("looped_bfs", 2, 4, 2)])
def test_simulator_reproduces_the_closed_form_bubble_for_equal_stages(name, pp, m, spr):
    order = _declared_order(name, pp, m, spr)
    bubbles = bubble_fractions(simulate(order, {"F": 1.0, "B": 2.0}, num_stages=pp * spr))
    expected = theoretical_bubble(name, pp=pp, microbatches=m, stages_per_rank=spr)
    assert list(bubbles.values()) == pytest.approx([expected] * pp)


def test_zero_bubble_beats_1f1b_in_simulation_and_messages_cost_time():
    zb = bubble_fractions(simulate(_declared_order("interleaved_zb", 2, 4, 2), UNIT_COSTS, num_stages=4))
    interleaved = bubble_fractions(simulate(_declared_order("interleaved_1f1b", 2, 4, 2), UNIT_COSTS, num_stages=4))
    assert max(zb.values()) < min(interleaved.values())
    order = _declared_order("gpipe", 2, 4, 1)
    fast, slow = (max(a.end for a in simulate(order, UNIT_COSTS, num_stages=2, comm_s=c)) for c in (0.0, 0.5))
    assert slow == fast + 2 * 0.5  # one activation and one gradient message on the critical path


def test_varying_action_times_keep_their_mean_but_lengthen_a_pipeline():
    alone = {0: [Op(0, "F", mb) for mb in range(2000)]}  # one rank, nothing to wait for
    total = max(a.end for a in simulate(alone, {"F": 1.0}, num_stages=1, jitter=0.2, seed=3))
    assert total == pytest.approx(2000, rel=0.03)  # the draws' mean is the cost
    assert total != max(a.end for a in simulate(alone, {"F": 1.0}, num_stages=1, jitter=0.2, seed=4))
    order = schedule_order("1f1b", 2, 8, 1)
    steady = expected_makespan(order, {"F": 1.0, "B": 2.0}, num_stages=2)
    assert steady == (8 + 2 - 1) * 3.0  # no jitter: the step of mean times
    # With jitter a dependency waits for the later of its inputs: the mean step is longer, and
    # more so the more the times vary (a few percent at the 10-20% measured on CPU ranks).
    varied = [expected_makespan(order, {"F": 1.0, "B": 2.0}, num_stages=2, jitter=j) for j in (0.1, 0.2)]
    assert steady < varied[0] < varied[1] < 1.1 * steady


def test_simulator_refuses_an_order_that_cannot_progress():
    order = {0: [Op(0, "B", 0), Op(0, "F", 0)], 1: [Op(1, "F", 0), Op(1, "B", 0)]}
    with pytest.raises(ValueError, match="cannot progress"):
        simulate(order, UNIT_COSTS, num_stages=2)


def test_ranks_on_one_host_share_its_clock_and_other_hosts_are_mapped_through_wall_clocks():
    same = {0: HostClock("a", 1_000), 1: HostClock("a", 1_250)}  # a read skew between ranks of one host
    offsets, note = clock_offsets(same)
    assert offsets == {0: 0, 1: 0} and note.startswith("one host (a)")
    offsets, note = clock_offsets({**same, 2: HostClock("b", 5_000_000)})
    assert offsets == {0: 0, 1: 0, 2: 5_000_000 - 1_000} and "wall clock" in note and note.startswith("2 hosts")
    spans = {0: [StepSpan(3, 100, 200)], 1: [StepSpan(3, 150, 260)]}
    actions = {0: [Action(3, Op(0, "F", 0), 110, 120)], 1: [Action(3, Op(1, "F", 0), 160, 170)]}
    slices = measured_slices(actions, spans)  # one origin for every rank: the first step's start
    assert sorted((e["pid"], e["tid"], e["ts"]) for e in slices) == [(0, 0, 0.01), (0, 1, 0.0), (1, 0, 0.06),
                                                                      (1, 1, 0.05)]


def test_a_long_step_is_drawn_as_a_window_with_every_action_labelled(tmp_path):
    """pp=4, 16 microbatches, 2 stages per rank: 64 actions per rank in a step."""
    order = schedule_order("interleaved_1f1b", 4, 16, 2)
    slices = simulated_slices(simulate(order, {"F": 0.01, "B": 0.02}, num_stages=8, comm_s=0.001))
    for e in slices:
        e["args"]["step"] = 3
    write_chrome_trace(tmp_path / "timeline.json", slices, ranks=range(4))
    (tmp_path / "summary.json").write_text(json.dumps({"schedule": "interleaved_1f1b", "pp": 4, "microbatches": 16}))
    from runner.outputs.plot_timeline import draw

    shown, labelled = draw(tmp_path, tmp_path / "timeline.png", count=32)
    assert 4 * 32 <= shown <= 4 * 40 and labelled == shown  # "3F12": stage, kind and microbatch on every box
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    # The whole step as schedule.png draws it (unit costs): wide enough for every label too.
    assert plot_schedule(tmp_path / "schedule.png", simulate(order, UNIT_COSTS, num_stages=8), title="x") == 256


def test_measured_bubble_counts_a_rank_that_returns_early_as_idle_until_the_pipeline_ends():
    # Rank 1 (the last stage) returns at 6 while rank 0 drains until 10: the step lasts 10 for both.
    spans = {0: [StepSpan(1, 0, 10)], 1: [StepSpan(1, 1, 6)]}
    actions = {0: [Action(1, Op(0, "F", 0), 0, 4), Action(1, Op(0, "B", 0), 6, 10)],
               1: [Action(1, Op(1, "F", 0), 4, 5), Action(1, Op(1, "B", 0), 5, 6)]}
    assert measured_bubble(actions, spans) == pytest.approx([0.2, 0.8])


def test_the_steady_bubble_counts_overlapping_steps_once():
    # Rank 0 computes [10(k-1), 10k) in step k; rank 1 [10(k-1) + 5, 10k + 5): it is still in step k
    # when rank 0 begins step k + 1 (train.optimizer_sync=deferred). Both compute all the time: the
    # steady step is 10 with no bubble, where summing each step's span (15) counts 5 of it twice.
    actions = {r: [Action(k, Op(r, "F", 0), 10 * (k - 1) + 5 * r, 10 * k + 5 * r) for k in (1, 2, 3)] for r in (0, 1)}
    spans = {r: [StepSpan(a.step, a.start_ns, a.end_ns) for a in acts] for r, acts in actions.items()}
    assert steady_bubble(actions, spans) == (10.0, [0.0, 0.0], 2)
    assert measured_bubble(actions, spans) == pytest.approx([1 / 3, 1 / 3])
    # Rank 1 computing half of each step: half its steady step idle.
    halves = {0: actions[0], 1: [Action(a.step, a.op, a.start_ns, a.start_ns + 5) for a in actions[1]]}
    assert steady_bubble(halves, spans) == (10.0, [0.0, 0.5], 2)
    assert steady_bubble(actions, {r: v[:1] for r, v in spans.items()}) is None  # one step: no steady state
    assert steady_bubble(actions, {r: [v[0], v[2]] for r, v in spans.items()}) is None  # not consecutive


def test_the_steady_bubble_leaves_out_the_gap_after_an_evaluation_or_a_save():
    # Steps of 10 back to back, but an evaluation of 90 after step 2: the rank computes all the
    # time it trains. Counted as a steady gap, the evaluation made the step 40 and its bubble 0.75.
    ends = {1: 10, 2: 20, 3: 120, 4: 130}
    actions = {0: [Action(k, Op(0, "F", 0), end - 10, end) for k, end in ends.items()]}
    spans = {0: [StepSpan(k, end - 10, end) for k, end in ends.items()]}
    assert steady_bubble(actions, spans) == (40.0, [0.75], 0)  # what it reported before
    assert steady_bubble(actions, spans, {2}) == (10.0, [0.0], 0)
    assert steady_bubble(actions, {0: spans[0][:2]}, {1}) is None  # no training gap left


@pytest.mark.timeout(60)
def test_a_runs_steady_step_is_its_training_steps_not_its_evaluations_and_saves(tmp_path, monkeypatch):
    # A real pp=1 run recording steps 3..6; a save after step 3 (and 6) and an evaluation after
    # step 4 (and 6), each made to take 0.5 s: only the gap 5 -> 6 is a training step's.
    import time as _time

    from runner.checkpoint.checkpointer import Checkpointer
    from runner.ranks.dist import DistEnv
    from runner.train import Trainer
    from runner.validate import validate

    from helpers.config import TINY, compose

    for cls, name in ((Trainer, "evaluate"), (Checkpointer, "save")):
        slow = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, slow=slow, **k: _time.sleep(0.5) or slow(self, *a, **k))
    cfg = compose(*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.steps=6", "profile.active=4",
                  "eval.every=4", "eval.steps=1", "checkpoint.every=3")
    trainer = Trainer(validate(cfg, tmp_path), cfg, DistEnv(0, 1, torch.device("cpu")))
    summary = trainer.run().summary
    assert summary is not None and trainer.profiler.recorder.interrupted == {3, 4, 6}
    assert summary["bubble"]["steps"] == [3, 4, 5, 6] and len(summary["val_losses"]) == 2
    assert summary["bubble"]["steady"]["step_s"] < 0.25  # one training step; 0.5 s gaps counted before


@pytest.mark.parametrize("name", ["1f1b", "zbh1", "zbh2"])
def test_the_steady_bubble_of_a_simulated_timeline_is_the_simulators_steady_step(name):
    # Five steps back to back at p=4, m=8 without the barrier, recorded as the recorder would.
    costs, m, n = {"F": 1.0, "B": 1.5, "I": 1.0, "W": 0.5}, 8, 5
    order = schedule_order(name, 4, m, 1)
    actions: dict[int, list[Action]] = {}
    for a in simulate(repeat_steps(order, n), costs, num_stages=4):
        step = a.op.microbatch // m + 1
        actions.setdefault(a.rank, []).append(Action(step, a.op, round(a.start * 1e3), round(a.end * 1e3)))
    spans = {r: [StepSpan(k, min(a.start_ns for a in acts if a.step == k), max(a.end_ns for a in acts if a.step == k))
                 for k in range(1, n + 1)] for r, acts in actions.items()}
    period, per_rank, _ = steady_bubble(actions, spans)
    step, bubbles = steady_step(order, costs, num_stages=4)
    assert period == pytest.approx(step * 1e3) and per_rank == pytest.approx(list(bubbles.values()))
    assert step == {"1f1b": 27.5, "zbh1": 24.5, "zbh2": 23.0}[name]  # m(F+B) + 3(F+B), ...; floor 20


def test_tp_collectives_are_read_from_the_trace_paired_by_thread_and_put_on_the_recorders_clock(tmp_path):
    from runner.outputs.collectives import Collective, tp_collectives

    # The recorder's clock (ns) runs 5_000_000 ns ahead of the trace's (us * 1000).
    actions = [Action(1, Op(0, "F", 0), 5_010_000, 5_020_000), Action(1, Op(0, "B", 0), 5_030_000, 5_050_000)]
    steps = [StepSpan(1, 5_000_000, 5_060_000)]

    def x(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}

    events = [x("compute:0F0", 10, 10), x("compute:0B0", 30, 20),
              x("_c10d_functional::all_reduce", 12, 1), x("_c10d_functional::_wrap_tensor_autograd", 13, 1),
              x("_c10d_functional::wait_tensor", 15, 2),  # issued at 12, done at 17, 2 of it waited
              x("_c10d_functional::all_gather_into_tensor", 31, 1, tid=2),  # the backward's thread
              x("_c10d_functional::all_reduce", 32, 1),
              x("_c10d_functional::wait_tensor", 34, 1),  # pairs with thread 1's issue at 32
              x("_c10d_functional::wait_tensor", 40, 3, tid=2),
              x("_c10d_functional::all_reduce", 70, 1), x("_c10d_functional::wait_tensor", 71, 1),  # after the step
              x("c10d::allreduce_", 20, 1)]  # not a functional collective: not tp's
    got = tp_collectives({"traceEvents": events}, actions, steps)
    assert got == [Collective("all_reduce", 5_012_000, 5_017_000, 2_000),
                   Collective("all_reduce", 5_032_000, 5_035_000, 1_000),
                   Collective("all_gather_into_tensor", 5_031_000, 5_043_000, 3_000)]
    # A CUDA trace also holds each range on the device's stream, later: the host's are placed.
    on_gpu = [{**x("compute:0F0", 11, 12, tid=7), "cat": "gpu_user_annotation"},
              {**x("compute:0B0", 33, 25, tid=7), "cat": "gpu_user_annotation"}]
    assert tp_collectives({"traceEvents": events + on_gpu}, actions, steps) == got
    # A trace that did not record the same actions cannot be placed: nothing rather than a guess.
    assert tp_collectives({"traceEvents": events}, actions[:1], steps) == []
    slices = measured_slices({0: actions}, {0: steps}, {0: got})
    lane = [(s["name"], s["ts"], s["dur"], s["args"]["waited_us"]) for s in slices if s["tid"] == 2]
    assert len(lane) == 3 and lane[0] == ("tp:all_reduce", 12.0, 5.0, 2.0)  # microseconds from the first step
    write_chrome_trace(tmp_path / "timeline.json", slices, ranks=[0, 1])
    meta = [e for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"] if e["ph"] == "M"]
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name" and e["tid"] == 2} == \
        {(0, "tp collectives")}  # rank 1 ran no tp collective: no empty lane
    # On CUDA (the actions the device's: call_ns kept) the lane and each slice say they are the host's calls.
    from runner.outputs.timeline import HOST_CALLS

    on_cuda = [Action(a.step, a.op, a.start_ns + 3_000, a.end_ns + 3_000, (a.start_ns, a.end_ns)) for a in actions]
    slices = measured_slices({0: on_cuda}, {0: steps}, {0: got})
    assert {s["args"].get("clock") for s in slices if s["tid"] == 2} == {HOST_CALLS}
    assert all("clock" not in s["args"] for s in measured_slices({0: actions}, {0: steps}, {0: got}))  # CPU
    write_chrome_trace(tmp_path / "timeline.json", slices, ranks=[0, 1])
    meta = [e for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in meta if e["name"] == "thread_name" and e["tid"] == 2] == [
        "tp collectives (host calls: issue to wait, not the device's)"]


def test_a_recorder_that_waits_for_the_device_times_an_action_by_its_work_not_its_launch():
    # A fake device on a fake clock (ns): a call returns at once and its kernels run later, as CUDA's
    # do; ``synchronize`` waits for what is queued. The rehearsal sets it (a GPU's per-action times).
    clock = {"now": 0, "queued": 0}

    def synchronize():
        clock["now"] += clock["queued"]
        clock["queued"] = 0

    def timed(sync, *, active=True):
        recorder = Recorder()
        recorder._now = lambda: clock["now"]  # type: ignore[method-assign]
        recorder.active, recorder.synchronize = active, sync
        clock["queued"] = 7  # work queued before the action: not its own
        with recorder.pipeline_step(1), recorder.action(0, "F", 0):
            clock["now"] += 1  # the launch
            clock["queued"] += 100  # its kernels
        return [a.end_ns - a.start_ns for a in recorder.actions]

    assert timed(None) == [1]  # the host's clock alone: the launch
    assert timed(synchronize) == [101]
    calls = []
    assert timed(lambda: calls.append(1), active=False) == [] and calls == []  # outside the window: no wait


WORK_NS = {"F": 400_000, "B": 900_000}  # the stand-in device's time of each action's kernels
LAUNCH_NS = 30_000  # the host's time of each action's call (its launches)


def _step_on_stream(recorder: Recorder, stream, step: int) -> list[tuple[str, int, int]]:
    """A pp=1 step of 2 microbatches on the stand-in stream, behind the host: (action, where the
    stream starts and ends it) on the host's clock, the device's truth."""
    truth = []
    with recorder.pipeline_step(step):
        for kind, mb in (("F", 0), ("F", 1), ("B", 0), ("B", 1)):
            with recorder.action(0, kind, mb):
                began = max(stream.free_at, stream.host + LATENCY)
                stream.launch(LAUNCH_NS, WORK_NS[kind])
            truth.append((f"0{kind}{mb}", began, stream.free_at))
            stream.host_work(5_000)  # the schedule's own host work between actions
    return truth


def test_on_cuda_an_actions_time_is_its_kernels_read_after_the_steps_own_wait_and_placed_on_the_hosts_clock(
        tmp_path):
    # A stand-in CUDA stream (tests/helpers/cuda_stream.py): a call returns after 30 us, its kernels
    # run later. Each action's span is two events on the stream, read once a later wait has passed
    # them (the recorder adds none of its own) and placed on the host's clock from the event
    # recorded right after the step's wait for its loss (``anchor``: the stream drained): the
    # device's durations exactly, and its starts early by that event's launch latency, never before
    # the call that launched them. The host's clock alone read 30 us per action (the launches).
    stream = FakeStream()
    recorder = Recorder(stream.event, now=stream.now)
    recorder.active = True
    stream.launch(10_000, 5_000_000)  # the previous step's update still runs: the stream is behind
    truth = _step_on_stream(recorder, stream, 1)
    assert recorder.actions == [] and stream.waits == 0  # nothing read yet: the device has not passed them
    stream.drain()  # the step's wait for its loss
    recorder.anchor()
    assert recorder.actions == [] and stream.waits == 1  # the anchor is not reached yet: read a step later
    stream.launch(10_000, 3_000_000)  # step 1's update, after its wait
    truth += _step_on_stream(recorder, stream, 2)
    assert recorder.actions == []
    stream.drain()
    recorder.anchor()
    assert len(recorder.actions) == 4 and [s.step for s in recorder.steps] == [1] and stream.waits == 2
    # Under train.optimizer_sync=deferred nothing waits at a step's end: steps 3 and 4 are read
    # from the wait in step 4 (after its forward and backward), as one group, as exactly.
    for step in (3, 4):
        stream.launch(10_000, 3_000_000)  # the previous step's update
        truth += _step_on_stream(recorder, stream, step)
    stream.drain()
    recorder.anchor()
    assert len(recorder.actions) == 8 and stream.waits == 3
    recorder.settle()  # the window's end: the rest read, waiting for the device
    assert recorder.device is not None and recorder.device.pending == 0
    assert [(a.op.name, a.start_ns, a.end_ns) for a in recorder.actions] == [
        (name, start - LATENCY, end - LATENCY) for name, start, end in truth]
    assert all(a.call_ns is not None and a.start_ns >= a.call_ns[0] for a in recorder.actions)
    assert all(a.end_ns - a.start_ns == WORK_NS[a.op.kind] for a in recorder.actions)
    assert all(a.host_ns[1] - a.host_ns[0] < 2 * LAUNCH_NS for a in recorder.actions)  # the launches
    ends = [t[2] for t in truth]
    assert [(s.step, s.start_ns, s.end_ns) for s in recorder.steps] == [
        (k, truth[4 * k - 4][1] - LATENCY, ends[4 * k - 1] - LATENCY) for k in (1, 2, 3, 4)]
    gc.collect()
    assert stream.recorded == 4 * 10 + 3 and len(stream.alive) == 0  # every event let go once read
    # What the timeline, the bubble and the simulator's costs are made of: the device's times.
    assert mean_costs({0: recorder.actions}) == {(0, "F"): 4e-4, (0, "B"): 9e-4}
    write_chrome_trace(tmp_path / "timeline.json", measured_slices({0: recorder.actions}, {0: recorder.steps}),
                       ranks=[0])
    slices = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert sorted({round(e["dur"], 6) for e in slices if e.get("tid") == 0 and e["ph"] == "X"}) == [400.0, 900.0]
    assert [round(e["dur"], 6) for e in slices if e.get("tid") == 1 and e["ph"] == "X"] == [2600.0] * 4


def test_an_anchor_on_a_stream_still_busy_keeps_the_durations_and_no_start_before_its_launch():
    # Where the stream was not drained at the anchor (work queued behind the wait), the starts
    # come out early, by at most what was queued, never before the call that launched them; the
    # durations are the device's all the same. The docstring of runner.pipeline.device_spans says so.
    stream = FakeStream()
    recorder = Recorder(stream.event, now=stream.now)
    recorder.active = True
    stream.launch(10_000, 5_000_000)
    truth = _step_on_stream(recorder, stream, 1)
    queued = stream.free_at - stream.host
    recorder.anchor()  # no wait before it: 6.8 ms still queued
    recorder.settle()
    placed = {a.op.name: a for a in recorder.actions}
    for name, start, end in truth:
        a = placed[name]
        assert a.end_ns - a.start_ns == end - start and a.call_ns is not None
        assert a.call_ns[0] <= a.start_ns <= start and start - a.start_ns <= queued


@pytest.mark.timeout(30)
def test_on_cuda_an_action_that_raises_leaves_no_span_and_holds_no_event():
    stream = FakeStream()
    recorder = Recorder(stream.event, now=stream.now)
    recorder.active, recorder.step = True, 1
    with pytest.raises(RuntimeError, match="in the forward"):
        with recorder.action(0, "F", 0):
            raise RuntimeError("in the forward")
    with recorder.action(0, "F", 1):
        stream.launch(10_000, 1_000_000)
    assert recorder.device is not None and recorder.device.pending == 1  # the failed one's event let go
    recorder.settle()
    assert [a.op.microbatch for a in recorder.actions] == [1]  # its launch and 1 ms of kernels
    assert 1_000_000 <= recorder.actions[0].end_ns - recorder.actions[0].start_ns <= 1_010_000


def test_on_cpu_the_recorder_makes_no_events_and_reads_the_hosts_clock(monkeypatch):
    from runner.outputs.config import ProfileConfig
    from runner.outputs.profile import RunProfiler
    from runner.ranks.dist import DistEnv

    def no_event(*args, **kwargs):
        raise AssertionError("a CUDA event made on CPU")

    monkeypatch.setattr(torch.cuda, "Event", no_event)
    profiler = RunProfiler(ProfileConfig(enabled=False), steps=3, env=DistEnv(0, 1, torch.device("cpu")),
                           run_dir=Path("."))
    recorder = profiler.recorder
    assert recorder.device is None
    recorder.active = True
    with recorder.pipeline_step(1), recorder.action(0, "F", 0):
        pass
    recorder.anchor()
    recorder.settle()
    assert len(recorder.actions) == 1 and recorder.actions[0].call_ns is None and len(recorder.steps) == 1


class _Kernels(Hook):
    """The stand-in stream's work in a real (CPU) run: each forward's kernels as it returns, its
    backward's as the gradient reaches the model's output, each update's, and 1 ms before each
    step's forward and backward (the batch's copy, say); ``windows``: where the
    stream ran each forward's and backward's (host's clock)."""

    def __init__(self, stream: FakeStream):
        self.stream = stream
        self.windows: set[tuple[int, int]] = set()
        self.hooked = False

    def begin_step(self, ctx, state) -> None:
        if not self.hooked:
            self.hooked = True
            ctx.modules[0].register_forward_hook(self._forward)
            ctx.optimizer.register_step_post_hook(lambda *_: self.stream.launch(10_000, 3_000_000))
        # Work queued before the step's forward (as a batch's copy): post_validate's wait drained the
        # stream after the update; an action on an idle stream would also hold its own launch.
        self.stream.launch(5_000, 1_000_000)

    def _launch(self, kind: str) -> None:
        began = max(self.stream.free_at, self.stream.host + LATENCY)
        self.stream.launch(LAUNCH_NS, WORK_NS[kind])
        self.windows.add((began, self.stream.free_at))

    def _forward(self, module, args, out) -> None:
        self._launch("F")
        out.register_hook(lambda grad: self._launch("B"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", ["barrier", "post_validate", "deferred"])
def test_a_cuda_runs_actions_and_bubble_are_the_devices_read_with_no_wait_of_their_own(sync, tmp_path, monkeypatch):
    # A real pp=1 run on CPU, its recorder on the stand-in stream (kernels queued by hooks on the
    # model and the optimizer), the step's loss read after the stream drains (as CUDA's .tolist()
    # does): the recorded window's actions are where the stream ran each forward and backward, so
    # the summary's per-action costs and pipeline step are the device's (not the launches', nor
    # the CPU's). The only waits are the steps' own, under deferred too (the loss read in the next
    # step), until the window is settled at the run's end.
    import runner.train
    from runner.outputs.profile import RunProfiler
    from runner.ranks.dist import DistEnv
    from runner.train import Trainer
    from runner.validate import validate

    from helpers.config import TINY, compose

    stream = FakeStream()
    stream.launch(0, 5_000_000)  # a device behind its host from the start
    waits_at_settle: list[int] = []
    recorders: list[Recorder] = []

    def profiler(*args, **kwargs):
        made = RunProfiler(*args, **kwargs)
        made.recorder = Recorder(stream.event, now=stream.now)
        recorders.append(made.recorder)
        settle = made.recorder.settle
        made.recorder.settle = lambda: waits_at_settle.append(stream.waits) or settle()  # type: ignore[method-assign]
        return made

    reduce = runner.train.start_reduce
    drains = []  # the spans not read yet (their events held) at each of the steps' own waits

    def start_reduce(*args, **kwargs):
        wait = reduce(*args, **kwargs)
        device = recorders[0].device
        assert device is not None
        return lambda: drains.append(device.pending) or stream.drain() or wait()

    monkeypatch.setattr(runner.train, "RunProfiler", profiler)
    monkeypatch.setattr(runner.train, "start_reduce", start_reduce)
    kernels = _Kernels(stream)
    cfg = compose(*TINY, "parallel.pp=1", "parallel.microbatches=2", f"train.optimizer_sync={sync}",
                  "train.grad_clip=0")
    trainer = Trainer(validate(cfg, tmp_path), cfg, DistEnv(0, 1, torch.device("cpu")), hooks=[kernels])
    summary = trainer.run().summary
    assert summary is not None
    recorder = trainer.profiler.recorder
    assert waits_at_settle[0] == len(drains) == 5  # nothing waited for the device but the steps' reads
    assert recorder.device is not None and recorder.device.pending == 0
    assert max(drains) == 10  # two steps' spans (4 actions and the pipeline step each) at most
    assert sorted((a.step, a.op.name) for a in recorder.actions) == sorted(
        (step, f"0{kind}{mb}") for step in (3, 4, 5) for kind in "FB" for mb in (0, 1))
    assert {(a.start_ns + LATENCY, a.end_ns + LATENCY) for a in recorder.actions} <= kernels.windows
    bubble = summary["bubble"]
    assert bubble["mean_costs_s"] == pytest.approx({"0B": 9e-4, "0F": 4e-4}, rel=1e-12)
    assert bubble["pipeline_step_s"] == pytest.approx(2.6e-3, abs=1e-12) and bubble["per_rank"] == [0.0]


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_on_cuda_a_recorded_forward_is_its_kernels_placed_before_the_wait_that_passed_it():
    # A real GPU: a "forward" of 20 matmuls, its synchronized time measured first; recorded behind
    # a 2e8-cycle sleep kernel (the stream busy: its launch returns long before it runs), its span
    # is its kernels' (close to the synchronized time; its call's host time is the launches), read
    # only after the step's own wait, and placed before that wait returned.
    import time
    from functools import partial

    device = torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=device)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(20):
            y = (y @ x) / 64.0
        return y

    forward()
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    forward()
    torch.cuda.synchronize(device)
    synced_s = time.perf_counter() - began
    recorder = Recorder(partial(torch.cuda.Event, enable_timing=True))
    recorder.active = True
    torch.cuda._sleep(200_000_000)  # about 0.1 s at an H100's clock
    with recorder.pipeline_step(1), recorder.action(0, "F", 0):
        y = forward()
    assert recorder.actions == [] and recorder.device is not None and recorder.device.pending == 2
    y.sum().item()  # the step's own wait for its loss
    waited_ns = time.perf_counter_ns()
    recorder.anchor()
    recorder.settle()
    (a,) = recorder.actions
    assert a.call_ns is not None
    device_s, host_s = (a.end_ns - a.start_ns) / 1e9, (a.call_ns[1] - a.call_ns[0]) / 1e9
    assert device_s == pytest.approx(synced_s, rel=0.25) and host_s < 0.5 * device_s, (device_s, synced_s, host_s)
    assert a.call_ns[0] <= a.start_ns and waited_ns - 2_000_000 <= a.end_ns <= waited_ns, (a, waited_ns)
