"""The bar above all: pipelined training computes what the unsplit model computes.

One spawn per pipeline width runs every schedule (and CSV schedules) on the same process group (a
module-scoped fixture); each case is its own test, so one failing case does not hide the others.
The unsplit pp=1 reference is computed once, in this process, by the same training loop."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from runner.config import TrainConfig
from runner.optim import lr_factor
from runner.outputs.timeline import write_schedule_csv
from runner.pipeline.ops import Op
from runner.pipeline.schedule import placement, schedule_order
from runner.plan.synthesize import Problem, synthesize

from helpers.config import EXAMPLES, TINY, resolved
from helpers.parity import CLIP, GRAD_ATOL, assert_matches, first_steps, reference
from helpers.parity import SCHEDULES as TORCH_SCHEDULES
from helpers.plan import round_schedule_csv, synthetic_costs
from helpers.ranks import run_cases

# Every schedule by name: torch's, and the Zero Bubble paper's ZB-H1 and ZB-H2 that the runner
# generates (runner.pipeline.zb_orders; held here, not in helpers.parity's list, which the HF tests also run).
SCHEDULES = [*TORCH_SCHEDULES, "zbh1", "zbh2"]
PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
PP4 = ["parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16"]

# Schedule files in the three shapes torch writes or ships (pp=2, m=4), held to the unsplit model
# like every other schedule.
TORCH_FILES = {
    # DualPipeV's order as torch's schedule visualizer exports it: OVERLAP_F_B cells.
    "overlap": ("0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,(3F3;0B1)OVERLAP_F_B,"
                "3B3,0I2,0W2,0I3,0W3\n"
                "1F0,2F0,1F1,2F1,1F2,2B0,(2F2;1B0)OVERLAP_F_B,(1F3;2B1)OVERLAP_F_B,(2F3;1B1)OVERLAP_F_B,2B2,1B2,"
                "2I3,1I3,2W3,1W3\n"),
    # Compute+comms in torch < 2.6 notation (B = input backward, BW = full backward), the shape of
    # torch's zb1p_2rank_2stagep_comms.csv. Run as written (torch's compute_comms path) its
    # gradients come out m times too large: no reduce step divides them.
    "comms-pre26": ("0F0,0SEND_F0,2RECV_F0,0F1,0SEND_F1,2RECV_F1,2F0,2SEND_F0,2F1,2SEND_F1,2RECV_B0,2BW0,2SEND_B0,"
                    "0F2,0SEND_F2,2RECV_B1,2BW1,2SEND_B1,0F3,0SEND_F3,2RECV_F2,0RECV_B0,0B0,0W0,2RECV_F3,2F2,"
                    "2SEND_F2,0RECV_B1,0B1,0W1,2F3,2SEND_F3,2RECV_B2,2BW2,2SEND_B2,2RECV_B3,2BW3,2SEND_B3,0RECV_B2,"
                    "0B2,0W2,0RECV_B3,0B3,0W3\n"
                    "1RECV_F0,1F0,1SEND_F0,1RECV_F1,1F1,1SEND_F1,3RECV_F0,3F0,3RECV_F1,3B0,3SEND_B0,1RECV_B0,3F1,"
                    "1RECV_F2,3B1,3SEND_B1,1RECV_B1,3W0,1RECV_F3,1F2,1SEND_F2,1B0,1SEND_B0,3W1,1F3,1SEND_F3,"
                    "3RECV_F2,1B1,1SEND_B1,1W0,3F2,3RECV_F3,3B2,3SEND_B2,1RECV_B2,1W1,3F3,3B3,3SEND_B3,1RECV_B3,"
                    "3W2,1B2,1SEND_B2,3W3,1B3,1SEND_B3,1W2,1W3\n"),
    # Compute-only in torch < 2.6 notation with idle (empty) cells: torch's zb1p_2rank_2stagep_compute.csv.
    "compute-pre26": ("0F0,0F1,2F0,2F1,2B0,2W0,0F2,2B1,2W1,0F3,0B0,0W0,2F2,0B1,0W1,2F3,2B2,2W2,2B3,2W3,0B2,0W2,0B3,"
                      "0W3\n"
                      ",1F0,1F1,3F0,3B0,3F1,3B1,3W0,1F2,1B0,3W1,1F3,1B1,1W0,3F2,3B2,1W1,3F3,3B3,3W2,1B2,3W3,1B3,1W2,"
                      "1W3\n"),
}
# An order that runs microbatches out of order, its last stage's forwards too (1F1 before 1F0), with
# the Ws put off: torch pairs a last stage's backward of microbatch i with the i-th loss computed, so
# before runner._torch.pp kept each loss under its microbatch this trained on swapped losses (the
# grad norms off by up to 100% in a probe) without a word.
OUT_OF_ORDER = ("0F1,0F0,0F3,0F2,0I1,0I0,0I3,0I2,0W2,0W0,0W3,0W1\n"
                "1F1,1F0,1I1,1I0,1F3,1F2,1I3,1I2,1W0,1W1,1W2,1W3\n")
# CSV files with loop, V and one-stage-per-rank placements, with F/B and with F/I/W actions.
CSV_FILES = ["interleaved_1f1b_pp2_m4.csv", "zero_bubble_pp2_m4.csv", "zbv_pp2_m4.csv", "gpipe_pp2_m4.csv"]
# Orders the planner's search writes (plan.synthesize=true): B, I and put-off W mixed on one stage,
# in a loop and in a V. (name, stages per rank, V-shaped, how much heavier the last stage is)
SYNTHESIZED = [("synthesized-loop", 1, False, 1.0), ("synthesized-v", 2, True, 3.0)]
# The pp=2 cases held to the unsplit model; each run's recorded order replayed from its
# schedule.csv (replay-*) must reproduce the run.
DOUBLE_STEP = "double-step-on-rank-1-at-step-2"
DOUBLE_ON_REPLICA_0 = "replica-0-steps-twice-at-step-2"
PP2_CASES = [*SCHEDULES, *(f"csv-{csv}" for csv in CSV_FILES), *(f"torch-{name}" for name in TORCH_FILES),
             "explicit-split", *(name for name, *_ in SYNTHESIZED), "rounds", "out-of-order",
             *(f"replay-{name}" for name in SCHEDULES)]


# Each schedule's case runs 20 steps on the same ranks (the test's timeout is the watchdog): its
# first 5 steps are held to the 5-step unsplit reference (``first_steps``: the learning rates of
# updates 1-4 do not depend on the run's length, test_the_first_five_losses_do_not_depend_on_the_runs_length),
# all 20 must be finite. One run per schedule, where a 5-step and a 20-step run each paid a setup.
LONG = ["train.steps=20"]


def test_the_first_five_losses_do_not_depend_on_the_runs_length():
    """Losses 1-5 follow updates 1-4: with the default warmup (3 steps) their learning rates are
    the same in a 5-step and a 20-step run, so a 20-step run's first 5 losses are a 5-step run's."""
    t = TrainConfig()
    rates = {steps: [lr_factor(s, steps=steps, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio,
                               schedule=t.lr_schedule) for s in range(4)] for steps in (5, 20)}
    assert rates[5] == rates[20], rates
    assert lr_factor(4, steps=5, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio) != lr_factor(
        4, steps=20, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)  # update 5 differs: loss 6 on


def _assert_long_run_completed(got: dict, name: str) -> None:
    assert "error" not in got, got.get("traceback")
    assert len(got["losses"]) == 20 and all(math.isfinite(x) for x in got["losses"]), name


def _ran(out: Path, case: str) -> list[str]:
    """The per-rank order a pp=2 case recorded (its schedule.csv rows)."""
    return (out / "pp2" / case / "schedule.csv").read_text().split()


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The 2-rank spawn: every pp=2 case (each schedule's for 20 steps), a model verify must fail. Returns
    the directory (each case's run directory is ``pp2/<case>``) and each case's record."""
    out = tmp_path_factory.mktemp("parity")
    cases = {name: [f"schedule={name}", *PP2, *LONG] for name in SCHEDULES}
    for csv in CSV_FILES:
        cases[f"csv-{csv}"] = ["schedule=csv", f"schedule.csv={EXAMPLES / csv}", *PP2]
    for name, text in TORCH_FILES.items():
        path = out / f"{name}.csv"
        path.write_text(text)
        cases[f"torch-{name}"] = ["schedule=csv", f"schedule.csv={path}", *PP2]
    cases["explicit-split"] = ["schedule=1f1b", *PP2, "parallel.split_points=[block1]"]
    for name, spr, v_shape, skew in SYNTHESIZED:
        found = synthesize(Problem(4, placement("zbv" if v_shape else "1f1b", 2, 2 * spr),
                                   synthetic_costs(2 * spr, skew), comm_s=0.1), seeds={}, budget=100, seed=0)
        assert {op.kind for ops in found.order.values() for op in ops} == set("FBIW"), name
        write_schedule_csv(out / f"{name}.csv", found.order)
        cases[name] = ["schedule=csv", f"schedule.csv={out / f'{name}.csv'}", *PP2]
    # A round schedule, what the search without the barrier starts from: stage 0 splits its backward
    # too (I then W), rank 1 puts all its Ws off to the end.
    rounds = round_schedule_csv(out / "rounds.csv")
    assert Op(0, "I", 0) in rounds[0] and rounds[1][-4:] == [Op(1, "W", i) for i in range(4)]
    cases["rounds"] = ["schedule=csv", f"schedule.csv={out / 'rounds.csv'}", *PP2]
    (out / "out-of-order.csv").write_text(OUT_OF_ORDER)
    cases["out-of-order"] = ["schedule=csv", f"schedule.csv={out / 'out-of-order.csv'}", *PP2]
    cases = {name: [*ov, "verify=true"] for name, ov in cases.items()}
    # A model that is random in training mode cannot match: verify must fail the run on every rank.
    cases["verify-catches-dropout"] = ["model=mlp", "model._target_=helpers.models.dropout_mlp", "verify=true",
                                       "parallel.microbatches=4", "train.batch_size=8"]
    # A defect only an update shows: rank 1 applies step 2's update twice. Verify follows the first
    # 2 updates and fails the run; following 1 (step 1's gradients and update, step 2's loss) misses it.
    cases[DOUBLE_STEP] = ["schedule=1f1b", *PP2, "verify=true"]
    cases[f"{DOUBLE_STEP}-verify-1-step"] = [*cases[DOUBLE_STEP], "verify_steps=1"]
    # The same defect on the first of 2 replicas (plain dp): verify holds every replica's copy, not one.
    cases[DOUBLE_ON_REPLICA_0] = ["parallel.pp=1", "parallel.dp=2", "parallel.dp_mode=ddp", *PP2[1:], "verify=true",
                                  "train.steps=3", "model.n_layers=2"]
    # Every run writes the order that ran as schedule.csv; feeding it back must reproduce the run.
    for name in SCHEDULES:
        cases[f"replay-{name}"] = ["schedule=csv", f"schedule.csv={out / 'pp2' / name / 'schedule.csv'}", *PP2]
    return out, run_cases(out / "pp2", 2, {name: resolved(*TINY, *CLIP, *ov) for name, ov in cases.items()},
                          faults={**{name: "double-step:1:2" for name in cases if name.startswith(DOUBLE_STEP)},
                                  DOUBLE_ON_REPLICA_0: "double-step:0:2"})


@pytest.fixture(scope="module")
def pp2_reference(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("parity-reference-pp2")
    return {**reference(tmp, *PP2[1:]), "run_dir": tmp / "reference"}


def test_the_pp2_reference_learns_and_clipping_binds_in_every_step(pp2_reference):
    metrics = [float(line.split('"grad_norm": ')[1].split(",")[0])
               for line in (pp2_reference["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert min(metrics) > 0.05 * 4, "clipping must bind in every step for the test to mean anything"
    assert pp2_reference["losses"][-1] < pp2_reference["losses"][0] - 0.01, "the reference must learn"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", PP2_CASES)
def test_every_pp2_case_matches_the_unsplit_model(pp2, pp2_reference, case):
    got = pp2[1][case]
    assert_matches(first_steps(got, 5) if case in SCHEDULES else got, pp2_reference, case)
    if not case.startswith("replay-"):
        report = got["summary"]["verify"]
        assert report["passed"] and report["max_abs_diff"] < GRAD_ATOL, case
        # It followed the optimizer: the weights after steps 1 and 2, the loss and norm of steps 2 and 3.
        assert [sorted(s) for s in report["steps"]] == [["step", "weights"], ["loss_and_grad_norm", "step", "weights"],
                                                        ["loss_and_grad_norm", "step"]], case
    bubble = got["summary"]["bubble"]
    assert all(0 <= b < 1 for b in bubble["per_rank"]) and 0 <= bubble["theoretical"] < 1, case


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SCHEDULES)
def test_a_runs_recorded_order_fed_back_as_a_csv_reproduces_it(pp2, name):
    results = pp2[1]
    replay = results[f"replay-{name}"]
    assert "error" not in replay, replay.get("traceback")
    assert replay["losses"] == pytest.approx(first_steps(results[name], 5)["losses"], rel=1e-6, abs=0), name
    assert replay["summary"]["num_stages"] == results[name]["summary"]["num_stages"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_runs_20_steps_at_pp2(pp2, name):
    _assert_long_run_completed(pp2[1][name], name)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_verify_fails_a_model_that_is_random_in_training_mode(pp2):
    assert pp2[1]["verify-catches-dropout"]["error"].startswith("VerifyError: verify=true")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_verify_catches_an_update_applied_twice_that_the_first_step_does_not_show(pp2):
    caught, missed = pp2[1][DOUBLE_STEP], pp2[1][f"{DOUBLE_STEP}-verify-1-step"]
    error = caught.get("error", "")
    assert error.startswith("VerifyError: verify=true: the weights after step 2's update differ"), caught
    assert "block3.attn.qkv.weight: " in error and "block0." not in error and "more" in error  # rank 1 only
    assert "error" not in missed and missed["summary"]["verify"]["passed"]  # step 1 and the first update agree
    # On replica 0 of 2: its copies are held to the reference too, not only the last replica's.
    replica = pp2[1][DOUBLE_ON_REPLICA_0].get("error", "")
    assert replica.startswith("VerifyError: verify=true: the weights after step 2's update differ"), replica
    problems = replica.splitlines()[1:]
    assert problems[0].partition("%")[2] == (" of the weights differ by more than 0.5 lr (lr 0.002; at most 1% may), "
                                             "most of them in:")
    assert all(line.startswith("  rank 0's copies: ") for line in problems), replica  # replica 1's are right
    assert float(problems[0].partition(": ")[2].partition("%")[0]) > 50, replica  # nearly every element, by about 1 lr


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_uneven_layouts_split_as_planned(pp2):
    # 9 children over 2 and 4 stages, and a 2/7 explicit split.
    results = pp2[1]
    assert results["1f1b"]["summary"]["stages"] == {"0": ["embed", "block0", "block1", "block2"],
                                                    "1": ["block3", "block4", "block5", "norm", "head"]}
    assert results["explicit-split"]["summary"]["stages"]["0"] == ["embed", "block0"]
    assert results["zbv"]["summary"]["num_stages"] == 4
    assert results["csv-gpipe_pp2_m4.csv"]["summary"]["num_stages"] == 2
    assert results["synthesized-v"]["summary"]["num_stages"] == 4


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_torchs_schedule_file_shapes_run_the_orders_they_hold(pp2):
    # The DualPipeV file is DualPipeV's order, the others the zero-bubble order with stage 2's
    # backward in one piece.
    out = pp2[0]
    assert _ran(out, "torch-overlap") == _ran(out, "dualpipev")
    zero_bubble = (EXAMPLES / "zero_bubble_pp2_m4.csv").read_text().split()
    assert _ran(out, "torch-compute-pre26") == zero_bubble
    assert _ran(out, "torch-comms-pre26")[1] == zero_bubble[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_planners_reading_of_torchs_declared_order_is_what_ran(pp2, name):
    out, results = pp2
    spr = results[name]["summary"]["num_stages"] // 2
    assert [",".join(op.name for op in ops) for ops in schedule_order(name, 2, 4, spr).values()] == _ran(
        out, name), name


@pytest.fixture(scope="module")
def pp4_dir(tmp_path_factory) -> Path:
    """Where the 4-rank cases run (each case's run directory is ``<it>/<case>``)."""
    return tmp_path_factory.mktemp("parity") / "pp4"


@pytest.fixture(scope="module")
def pp4(pp4_dir) -> dict[str, dict]:
    """The 4-rank spawn: every schedule, each for 20 steps."""
    cases = {name: [f"schedule={name}", *PP4, *LONG] for name in SCHEDULES}
    return run_cases(pp4_dir, 4, {name: resolved(*TINY, *CLIP, *ov) for name, ov in cases.items()})


@pytest.fixture(scope="module")
def pp4_reference(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("parity-reference-pp4"), *PP4[1:])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_at_pp4_matches_the_unsplit_model(pp4, pp4_reference, name):
    assert_matches(first_steps(pp4[name], 5), pp4_reference, name)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_runs_20_steps_at_pp4(pp4, name):
    _assert_long_run_completed(pp4[name], name)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_interleaved_zero_bubble_at_pp4_runs_two_stages_per_rank(pp4):
    assert pp4["interleaved_zb"]["summary"]["num_stages"] == 8


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zbh1", "zbh2"])
def test_the_zero_bubble_paper_schedules_at_pp4_run_their_order_one_stage_per_rank(pp4, pp4_dir, name):
    assert pp4[name]["summary"]["num_stages"] == 4
    ran = (pp4_dir / name / "schedule.csv").read_text().split()
    assert ran == [",".join(op.name for op in ops) for ops in schedule_order(name, 4, 8, 1).values()]
