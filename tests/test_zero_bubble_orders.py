"""The Zero Bubble paper's handcrafted schedules, ZB-H1 and ZB-H2 (``schedule=zbh1``, ``schedule=zbh2``):
their orders held to torch's validator and to torch's own ZB-H1, their memory and their simulated steps
held to the paper's formulas (the layouts they refuse before launch are in test_validate's table of bad
input). In-process, in seconds."""

from __future__ import annotations

import pytest

from runner._torch import pp as _torch_pp
from runner.pipeline.ops import Op
from runner.pipeline.registry import SCHEDULES, theoretical_bubble
from runner.pipeline.schedule import placement, schedule_order
from runner.pipeline.simulate import (
    bubble_fractions,
    compute_floor,
    peak_in_flight,
    repeat_steps,
    simulate,
    steady_step,
)
from runner.pipeline.zb_orders import zbh1_order, zbh2_order
from runner.plan.planner import _candidates
from runner.validate import validate

from helpers.config import TINY, compose

PP2 = [*TINY, "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
# A weight gradient about half the input gradient, as the paper profiles its models (its Table 9).
PAPER_LIKE = {"F": 1.0, "I": 1.0, "W": 0.5}
EQUAL = {"F": 1.0, "I": 1.0, "W": 1.0}


def _torch_zb_order(pp: int, m: int) -> dict[int, list[Op]] | None:
    """torch's ScheduleInterleavedZeroBubble at one stage per rank; None where torch refuses m."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    try:
        schedule = ScheduleInterleavedZeroBubble(_torch_pp.stand_in_stages(pp, pp, 1), m)
    except ValueError:  # m not a multiple of max(1, m // pp)
        return None
    return {r: [Op(a.stage_index, a.computation_type.value, a.microbatch_index)
                for a in schedule.pipeline_order[r] if a is not None] for r in range(pp)}


def _step(order: dict[int, list[Op]], costs: dict[str, float], comm_s: float = 0.0) -> float:
    return max(a.end for a in simulate(order, costs, num_stages=len(order), comm_s=comm_s))


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_zbh1_is_torchs_interleaved_zero_bubble_order_at_one_stage_per_rank(pp):
    compared = 0
    for m in range(pp, 4 * pp + 1):
        theirs = _torch_zb_order(pp, m)
        if theirs is not None:
            assert zbh1_order(pp, m) == theirs, (pp, m)
            compared += 1
    assert compared >= pp + 1  # every multiple of pp, and more


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
def test_both_orders_pass_torchs_validator_and_dry_run_for_every_microbatch_count(pp):
    for m in range(1, 4 * pp + 2):  # below the full shapes too: the synthesizer may seed from those
        for order in (zbh1_order(pp, m), zbh2_order(pp, m)):
            assert _torch_pp.check_actions(_torch_pp.to_actions(order), pp, m) == {r: r for r in range(pp)}
            assert sorted(op.kind for op in order[0]) == sorted("FIW" * m)


def test_orders_below_one_rank_or_microbatch_are_refused():
    with pytest.raises(ValueError, match="microbatches=0"):
        zbh2_order(2, 0)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 24), (8, 15)])
def test_zbh1_holds_1f1bs_memory_and_zbh2_at_most_2p_minus_1(pp, m):
    # A microbatch is held from its F to its W (the I frees only part of it).
    assert peak_in_flight(zbh1_order(pp, m)) == dict.fromkeys(range(pp), pp)
    assert peak_in_flight(zbh2_order(pp, m)) == dict.fromkeys(range(pp), 2 * pp - 1)
    assert max(peak_in_flight(schedule_order("1f1b", pp, m, 1)).values()) == pp


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 24)])
def test_simulated_steps_are_the_papers_zbh1_and_zbh2_fills_its_bubble(pp, m):
    f, b, w = PAPER_LIKE.values()
    zbh1, zbh2 = _step(zbh1_order(pp, m), PAPER_LIKE), _step(zbh2_order(pp, m), PAPER_LIKE)
    assert zbh1 == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b - w))  # the paper's ZB-H1 bubble
    assert zbh2 == pytest.approx(m * (f + b + w) + (pp - 1) * f)  # the least a step can take: the F ramp
    one_f_one_b = _step(schedule_order("1f1b", pp, m, 1), {"F": f, "B": b + w})
    assert one_f_one_b == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b + w))
    bubbles = [sum(bubble_fractions(simulate(o, PAPER_LIKE, num_stages=pp)).values()) / pp
               for o in (zbh2_order(pp, m), zbh1_order(pp, m))]
    assert 0 < bubbles[0] < bubbles[1]  # ZB-H2 keeps a bubble within the step, below ZB-H1's
    # With equal F, I and W both reach the least step; with messages ZB-H2 stays within them of it.
    assert _step(zbh1_order(pp, m), EQUAL) == _step(zbh2_order(pp, m), EQUAL) == 3 * m + pp - 1
    assert _step(zbh2_order(pp, m), PAPER_LIKE, comm_s=0.1) <= zbh2 + 2 * (pp - 1) * 0.1 + 1e-9
    assert _step(zbh2_order(pp, m), PAPER_LIKE, comm_s=0.1) < _step(zbh1_order(pp, m), PAPER_LIKE, comm_s=0.1)


def test_the_registry_runs_them_one_stage_per_rank_with_split_backward_and_no_closed_form():
    for name, generate in (("zbh1", zbh1_order), ("zbh2", zbh2_order)):
        kind = SCHEDULES[name]
        assert kind.splits_backward and not kind.v_shape and kind.torch_class is None and kind.order == f"{name}_order"
        assert schedule_order(name, 4, 8, 1) == generate(4, 8)
        assert placement(name, 4, 4) == {r: r for r in range(4)}
        assert theoretical_bubble(name, pp=4, microbatches=8, stages_per_rank=1) is None  # simulated
        with pytest.raises(ValueError, match="one stage per rank"):
            schedule_order(name, 2, 4, 2)


@pytest.mark.parametrize("name", ["zbh1", "zbh2"])
def test_zbh_schedules_validate_to_one_stage_per_rank(name):
    layout = validate(compose(*PP2, f"schedule={name}")).layout
    assert (layout.num_stages, layout.stage_to_rank, layout.csv) == (2, {0: 0, 1: 1}, None)
    pp4 = validate(compose(*TINY, "parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16",
                           f"schedule={name}", "parallel.stages_per_rank=1")).layout
    assert pp4.stage_to_rank == {r: r for r in range(4)}


def test_zbh1_runs_at_microbatch_counts_torchs_class_refuses():
    assert _torch_zb_order(2, 5) is None  # torch: m a multiple of max(1, m // pp)
    layout = validate(compose(*TINY, "parallel.pp=2", "parallel.microbatches=5", "train.batch_size=10",
                              "schedule=zbh1")).layout
    assert layout.microbatches == 5 and schedule_order("zbh1", 2, 5, 1) == zbh1_order(2, 5)



def test_the_planner_lists_them_as_one_stage_per_rank_candidates():
    found = _candidates(compose(*TINY, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[2,4]"))
    assert {("zbh1", 2, 1), ("zbh1", 4, 1), ("zbh2", 2, 1), ("zbh2", 4, 1)} <= set(found)


def test_without_the_barrier_zbh2s_steady_step_is_the_papers_floor_hand_computed_at_pp2_m3():
    # F = I = W = 1, ZB-H2 at p=2, m=3. Rank 0: F0 F1 F2, then I0 W0 I1 W1 I2 W2 (each I waits for
    # rank 1's I of its microbatch); rank 1: F0 I0 F1 I1 F2 I2 W0 W1 W2. Step 1 ends at 10 (rank 1's
    # last W), = m(F+I+W) + (p-1)F, the step with the barrier. Without it rank 0 starts step 2's
    # forwards at 9, when its own W2 ends: rank 1's F3 at [10, 11] ... its W5 ends at 19, and every
    # step after is 9 = m(F+I+W) apart, the floor: no bubble in the steady state.
    order = zbh2_order(2, 3)
    assert _step(order, EQUAL) == 10
    actions = simulate(repeat_steps(order, 3), EQUAL, num_stages=2)
    ends = [max(a.end for a in actions if a.op.microbatch // 3 == k) for k in range(3)]
    assert ends == [10, 19, 28]
    first_of_step_2 = {a.rank: a.start for a in actions if a.op.microbatch == 3 and a.op.kind == "F"}
    assert first_of_step_2 == {0: 9, 1: 10}
    step, bubbles = steady_step(order, EQUAL, num_stages=2, steps=3)
    assert step == compute_floor(order, EQUAL) == 9 and bubbles == {0: 0.0, 1: 0.0}


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 24)])
def test_without_the_barrier_steps_overlap_never_slower_and_never_below_the_compute_floor(pp, m):
    f, b, w = EQUAL.values()
    zbh2 = zbh2_order(pp, m)
    assert steady_step(zbh2, EQUAL, num_stages=pp)[0] == compute_floor(zbh2, EQUAL) == m * (f + b + w)
    # 1F1B's and ZB-H1's bubble is within every step: removing the barrier leaves their step as it is.
    one_f_one_b = schedule_order("1f1b", pp, m, 1)
    assert steady_step(one_f_one_b, {"F": 1.0, "B": 2.0}, num_stages=pp)[0] == _step(one_f_one_b, {"F": 1.0, "B": 2.0})
    for order in (zbh1_order(pp, m), zbh2):
        for costs in (EQUAL, PAPER_LIKE):
            for comm_s in (0.0, 0.1):
                step, _ = steady_step(order, costs, num_stages=pp, comm_s=comm_s)
                assert compute_floor(order, costs) - 1e-9 <= step <= _step(order, costs, comm_s) + 1e-9
    with pytest.raises(ValueError, match="steps=1"):
        steady_step(zbh2, EQUAL, num_stages=pp, steps=1)
