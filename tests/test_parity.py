"""The bar above all: pipelined training computes what the unsplit model computes.

One spawn per pipeline width runs every schedule (and CSV schedules) on the same process group;
the unsplit pp=1 reference is computed once, in this process, by the same training loop."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from runner.dist import DistEnv
from runner.plan.synthesize import Problem, synthesize
from runner.schedule import placement, schedule_order
from runner.timeline import write_schedule_csv
from runner.train import train
from runner.validate import validate

from _ranks import FirstGrads, spawn, train_cases
from conftest import EXAMPLES, TINY, compose
from test_synthesize import _costs

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
# Clipping must bind, or a per-rank clip would pass: gradient norms here are ~1.
CLIP = ["train.grad_clip=0.05"]
LOSS_RTOL = 1e-4
GRAD_RTOL, GRAD_ATOL = 1e-5, 4e-5


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


def _reference(tmp_path: Path, *overrides: str) -> dict:
    cfg = compose(*TINY, *CLIP, "parallel.pp=1", *overrides)
    run_dir = tmp_path / "reference"
    run_dir.mkdir()
    grads = FirstGrads()
    result = train(validate(cfg, run_dir), cfg, DistEnv(0, 1, torch.device("cpu")), hooks=[grads])
    return {"losses": result.losses, "grads": grads.grads, "clipped": grads.clipped,
            "summary": result.summary}


def _run_cases(tmp_path: Path, world: int, cases: dict[str, list[str]]) -> dict[str, dict]:
    resolved = {name: OmegaConf.to_container(compose(*TINY, *CLIP, *ov), resolve=True)
                for name, ov in cases.items()}
    spawn(world, train_cases, str(tmp_path), resolved)
    return {name: torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in cases}


def _assert_matches(got: dict, ref: dict, case: str) -> None:
    assert "error" not in got, f"{case}: {got.get('traceback')}"
    assert len(got["losses"]) == len(ref["losses"]) == 5
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{case} losses: {m}")
    for kind in ("grads", "clipped"):  # after the first backward, and after the global clip
        assert got[kind].keys() == ref[kind].keys(), case
        for name, ref_grad in ref[kind].items():
            assert ref_grad is not None and got[kind][name] is not None, f"{case}: {name} has no grad"
            torch.testing.assert_close(got[kind][name], ref_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       msg=lambda m, kind=kind, name=name: f"{case} {kind} {name}: {m}")


def _ran(tmp_path: Path, case: str) -> list[str]:
    """The per-rank order a pp=2 case recorded (its schedule.csv rows)."""
    return (tmp_path / "pp2" / case / "schedule.csv").read_text().split()


def _add_long_runs(cases: dict, *overrides: str) -> None:
    """Every schedule for 20 steps on the same ranks (the test's timeout is the watchdog)."""
    for name in SCHEDULES:
        cases[f"20-steps-{name}"] = [f"schedule={name}", *overrides, "train.steps=20"]


def _assert_long_runs_completed(results: dict) -> None:
    for name in SCHEDULES:
        got = results.pop(f"20-steps-{name}")
        assert "error" not in got, got.get("traceback")
        assert len(got["losses"]) == 20 and all(math.isfinite(x) for x in got["losses"]), name


def _assert_reference_is_meaningful(ref: dict) -> None:
    metrics = [float(line.split('"grad_norm": ')[1].split(",")[0])
               for line in (Path(ref["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert min(metrics) > 0.05 * 4, "clipping must bind in every step for the test to mean anything"
    assert ref["losses"][-1] < ref["losses"][0] - 0.01, "the reference must learn"


@pytest.mark.timeout(240)
def test_every_schedule_at_pp2_matches_the_unsplit_model(tmp_path):
    cases = {name: [f"schedule={name}", "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
             for name in SCHEDULES}
    # CSV files with loop, V and one-stage-per-rank placements, with F/B and with F/I/W actions.
    for csv in ("interleaved_1f1b_pp2_m4.csv", "zero_bubble_pp2_m4.csv", "zbv_pp2_m4.csv", "gpipe_pp2_m4.csv"):
        cases[f"csv-{csv}"] = ["schedule=csv", f"schedule.csv={EXAMPLES / csv}", "parallel.pp=2",
                               "parallel.microbatches=4", "train.batch_size=8"]
    for name, text in TORCH_FILES.items():
        path = tmp_path / f"{name}.csv"
        path.write_text(text)
        cases[f"torch-{name}"] = ["schedule=csv", f"schedule.csv={path}", "parallel.pp=2", "parallel.microbatches=4",
                                  "train.batch_size=8"]
    cases["explicit-split"] = ["schedule=1f1b", "parallel.pp=2", "parallel.microbatches=4",
                               "train.batch_size=8", "parallel.split_points=[block1]"]
    # Orders the planner's search writes (plan.synthesize=true): B, I and put-off W mixed on one
    # stage, in a loop and in a V.
    for name, spr, v_shape, skew in (("synthesized-loop", 1, False, 1.0), ("synthesized-v", 2, True, 3.0)):
        found = synthesize(Problem(4, placement("zbv" if v_shape else "1f1b", 2, 2 * spr), _costs(2 * spr, skew),
                                   comm_s=0.1), seeds={}, budget=100, seed=0)
        assert {op.kind for ops in found.order.values() for op in ops} == set("FBIW"), name
        write_schedule_csv(tmp_path / f"{name}.csv", found.order)
        cases[name] = ["schedule=csv", f"schedule.csv={tmp_path / f'{name}.csv'}", "parallel.pp=2",
                       "parallel.microbatches=4", "train.batch_size=8"]
    cases = {name: [*ov, "verify=true"] for name, ov in cases.items()}
    # A model that is random in training mode cannot match: verify must fail the run on every rank.
    cases["verify-catches-dropout"] = ["model=mlp", "model._target_=_models.dropout_mlp", "verify=true",
                                       "parallel.microbatches=4", "train.batch_size=8"]
    # Every run writes the order that ran as schedule.csv; feeding it back must reproduce the run.
    for name in SCHEDULES:
        cases[f"replay-{name}"] = ["schedule=csv", f"schedule.csv={tmp_path / 'pp2' / name / 'schedule.csv'}",
                                   "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
    _add_long_runs(cases, "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8")
    results = _run_cases(tmp_path / "pp2", 2, cases)
    _assert_long_runs_completed(results)
    assert results.pop("verify-catches-dropout")["error"].startswith("VerifyError: verify=true")
    for name in SCHEDULES:
        replay = results[f"replay-{name}"]
        assert "error" not in replay, replay.get("traceback")
        assert replay["losses"] == pytest.approx(results[name]["losses"], rel=1e-6, abs=0), name
        assert replay["summary"]["num_stages"] == results[name]["summary"]["num_stages"]
    ref = _reference(tmp_path, "parallel.microbatches=4", "train.batch_size=8")
    ref["run_dir"] = tmp_path / "reference"
    _assert_reference_is_meaningful(ref)
    for case, got in results.items():
        _assert_matches(got, ref, case)
        if not case.startswith("replay-"):
            report = got["summary"]["verify"]
            assert report["passed"] and report["max_abs_diff"] < GRAD_ATOL, case
        bubble = got["summary"]["bubble"]
        assert all(0 <= b < 1 for b in bubble["per_rank"]) and 0 <= bubble["theoretical"] < 1, case
    # Uneven layouts were exercised: 9 children over 2 and 4 stages, and a 2/7 explicit split.
    assert results["1f1b"]["summary"]["stages"] == {"0": ["embed", "block0", "block1", "block2"],
                                                    "1": ["block3", "block4", "block5", "norm", "head"]}
    assert results["explicit-split"]["summary"]["stages"]["0"] == ["embed", "block0"]
    assert results["zbv"]["summary"]["num_stages"] == 4
    assert results["csv-gpipe_pp2_m4.csv"]["summary"]["num_stages"] == 2
    assert results["synthesized-v"]["summary"]["num_stages"] == 4
    # torch's file shapes ran the orders they hold: the DualPipeV file is DualPipeV's order, the
    # others the zero-bubble order with stage 2's backward in one piece.
    assert _ran(tmp_path, "torch-overlap") == _ran(tmp_path, "dualpipev")
    zero_bubble = (EXAMPLES / "zero_bubble_pp2_m4.csv").read_text().split()
    assert _ran(tmp_path, "torch-compute-pre26") == zero_bubble
    assert _ran(tmp_path, "torch-comms-pre26")[1] == zero_bubble[1]
    # The planner's reading of torch's declared orders is what actually ran, for every schedule.
    for name in SCHEDULES:
        spr = results[name]["summary"]["num_stages"] // 2
        assert [",".join(op.name for op in ops) for ops in schedule_order(name, 2, 4, spr).values()] == _ran(
            tmp_path, name), name


@pytest.mark.timeout(300)
def test_every_schedule_at_pp4_matches_the_unsplit_model(tmp_path):
    cases = {name: [f"schedule={name}", "parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16"]
             for name in SCHEDULES}
    _add_long_runs(cases, "parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16")
    results = _run_cases(tmp_path / "pp4", 4, cases)
    _assert_long_runs_completed(results)
    ref = _reference(tmp_path, "parallel.microbatches=8", "train.batch_size=16")
    for case, got in results.items():
        _assert_matches(got, ref, case)
    assert results["interleaved_zb"]["summary"]["num_stages"] == 8
