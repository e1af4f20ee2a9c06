"""``train.optimizer_sync=post_validate``: each rank steps AdamW before the step's global norm is
known, and the step is validated afterwards (undone from a snapshot and redone clipped where the
norm needed clipping, undone and refused where a value is not finite). The bar: the barrier's
numbers, bit for bit (losses, norms, final weights and AdamW moments), with clipping binding on some
steps and not on others, and today's error at the same step for a non-finite gradient.

One 2-rank spawn runs every pp=2 case, and deferred against the barrier on a pretrained Hugging Face
Llama (bf16 on disk, embedding and head tied) under ZBV, also held to transformers' own training;
pp=4 and dp=2 (DDP, FSDP) are in the slow tier, as is the job ending in bounded time when a rank
dies while its peers wait in the overlapped reduction."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner._torch.dcp import read_model_tensors
from runner.errors import ConfigError, NonFiniteLossError
from runner.hooks import Hook
from runner.optim import UpdateSnapshot, clip_coefficient, clip_grads
from runner.pipeline.recorder import Recorder
from runner.ranks.dist import DistEnv
from runner.train import Trainer
from runner.validate import _check_optimizer_sync, validate

from helpers.cli import start_cli
from helpers.config import TINY, compose, resolved
from helpers.cuda_stream import FakeStream
from helpers.hf import hf_training, write_model
from helpers.parity import assert_matches
from helpers.plan import round_schedule_csv
from helpers.ranks import final_weights, run_cases

PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
PP4 = ["parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16"]
SCHEDULES = ["1f1b", "zbh1", "zbh2"]
# The tiny model's global norms over 20 steps: 0.74-0.93 with 8 samples a step, 0.67-0.75 with 16.
# These clips bind on some steps, not all.
CLIP = {8: 0.81, 16: 0.71}
MODES = ["barrier", "post_validate", "deferred"]
SPECULATIVE = MODES[1:]  # the modes that update before the norm is known
STEPS = 20
NANGRAD = "nangrad:1:2"  # a finite loss and a NaN gradient on rank 1 at step 2
NANGRAD_STEPS = 3  # step 2 is not the last: deferred validates it during step 3
# A pretrained Hugging Face Llama stored in bf16 (trained in fp32) with its embedding and head tied,
# under ZBV at pp=2: both ends on rank 0, one parameter of its first and its last stage.
HF_STEPS = 6
HF_CLIP = 1.25  # the norms: 1.1-1.5; it binds on steps 3, 4 and 6


def _hf(path: Path, mode: str) -> list[str]:
    return ["device=cpu", "model=hf", f"model.path={path}", "model.pretrained=true", "data.vocab_size=64",
            "train.seq_len=16", f"train.steps={HF_STEPS}", "profile.enabled=false", "schedule=zbv", *PP2,
            f"train.grad_clip={HF_CLIP}", f"train.optimizer_sync={mode}"]


def _cases(layout: list[str], schedules: list[str], *, clip: float,
           extra: dict[str, list[str]] | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """Each schedule (and each ``extra`` layout) 20 steps in both modes, and 2 steps with a NaN
    gradient at step 2; returns the cases and their faults."""
    layouts = {name: [f"schedule={name}", *layout] for name in schedules} | (extra or {})
    cases, faults = {}, {}
    for name, overrides in layouts.items():
        for mode in MODES:
            common = [*TINY, *overrides, f"train.grad_clip={clip}", f"train.optimizer_sync={mode}"]
            cases[f"{name}-{mode}"] = resolved(*common, f"train.steps={STEPS}")
            cases[f"{name}-nangrad-{mode}"] = resolved(*common, f"train.steps={NANGRAD_STEPS}")
            faults[f"{name}-nangrad-{mode}"] = NANGRAD
    return cases, faults


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(out: Path, records: dict[str, dict], name: str, clip: float, *,
                     speculative: list[str] = SPECULATIVE, steps: int = STEPS) -> None:
    """``name``'s ``speculative`` runs (post_validate, deferred) are the barrier's, bit for bit;
    clipping bound on some steps and not on others, and each rolled back exactly the clipped ones;
    deferred ran again each step that followed a rolled-back step it had not validated at its own
    end (all but the last)."""
    barrier = records[f"{name}-barrier"]
    modes = ["barrier", *speculative]
    for mode in modes:
        assert "error" not in records[f"{name}-{mode}"], records[f"{name}-{mode}"].get("traceback")
    want = _metrics(out / f"{name}-barrier")
    clipped = [clip_coefficient(clip, m["grad_norm"]) < 1 for m in want]
    assert 0 < sum(clipped) < steps, f"{name}: the clip must bind on some steps and not on others ({clipped})"
    final = {mode: torch.load(out / f"{name}-{mode}" / "weights.pt", weights_only=True) for mode in modes}
    for mode in speculative:
        post = records[f"{name}-{mode}"]
        assert len(post["losses"]) == steps and post["losses"] == barrier["losses"], (name, mode)
        got = _metrics(out / f"{name}-{mode}")
        assert [(m["step"], m["loss"], m["grad_norm"], m["lr"]) for m in got] == \
            [(m["step"], m["loss"], m["grad_norm"], m["lr"]) for m in want], (name, mode)
        report = post["summary"]["post_validate"]
        assert set(report["rollbacks"]) == {sum(clipped)}, report  # every rank undid and redid exactly those
        reruns = sum(clipped[:-1]) if mode == "deferred" else 0  # the last step is validated at its end
        assert set(report["reruns"]) == {reruns}, (mode, report)
        for nbytes, params in zip(report["snapshot_bytes"], report["params"]):
            assert 12 * params <= nbytes <= 12 * params + 4 * 200, report  # 3 fp32 copies, and each tensor's AdamW step
        for kind, tensors in final["barrier"].items():
            assert tensors.keys() == final[mode][kind].keys() and tensors, (name, mode, kind)
            for key, value in tensors.items():
                assert torch.equal(final[mode][kind][key], value), (name, mode, kind, key)
    assert "post_validate" not in barrier["summary"]
    # With the barrier no rank begins a step before every rank has ended the one before.
    assert barrier["summary"]["bubble"]["steady"]["overlapped_steps"] == 0
    assert 0 <= records[f"{name}-deferred"]["summary"]["bubble"]["steady"]["overlapped_steps"] <= 2


def _assert_same_refusal(records: dict[str, dict], name: str) -> None:
    errors = [records[f"{name}-nangrad-{mode}"].get("error", "") for mode in MODES]
    assert errors[0].startswith("NonFiniteLossError: non-finite gradient norm at step 2 (loss "), errors[0]
    assert "grad_norm nan" in errors[0] and errors[1:] == [errors[0]] * len(SPECULATIVE), errors


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("post-validate") / "pp2"
    out.mkdir(parents=True)
    # A synthesized CSV schedule too: a round schedule, what the search without the barrier builds.
    csv = ["schedule=csv", f"schedule.csv={out / 'rounds.csv'}", *PP2]
    round_schedule_csv(out / "rounds.csv")
    cases, faults = _cases(PP2, SCHEDULES, clip=CLIP[8], extra={"rounds": csv})
    llama = write_model(out / "llama", "llama", weights=True, dtype=torch.bfloat16, tie_word_embeddings=True)
    cases |= {f"hf-{mode}": resolved(*_hf(llama, mode)) for mode in ("barrier", "deferred")}
    return out, run_cases(out, 2, cases, more_hooks=final_weights, faults=faults)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [*SCHEDULES, "rounds"])
def test_post_validation_trains_bit_identically_to_the_barrier_at_pp2(pp2, name):
    _assert_same_run(*pp2, name, CLIP[8])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [*SCHEDULES, "rounds"])
def test_a_non_finite_gradient_stops_both_modes_at_the_same_step_with_the_same_error(pp2, name):
    _assert_same_refusal(pp2[1], name)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_deferred_trains_a_bf16_hugging_face_llama_with_tied_ends_bit_identically_to_the_barrier(pp2):
    out, records = pp2
    stored = load_file(out / "llama" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16} and "lm_head.weight" not in stored  # tied
    _assert_same_run(out, records, "hf", HF_CLIP, speculative=["deferred"], steps=HF_STEPS)
    weights = torch.load(out / "hf-deferred" / "weights.pt", weights_only=True)["weights"]
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights  # the tied weight once
    assert {w.dtype for w in weights.values()} == {torch.float32}
    # The barrier's run is transformers' own unsplit training from the same bf16 weights.
    reference = hf_training(compose(*_hf(out / "llama", "barrier")), steps=HF_STEPS)
    assert_matches(records["hf-barrier"], reference, "hf-barrier", steps=HF_STEPS)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_post_validation_at_pp4_and_with_ddp_and_fsdp_at_dp2(tmp_path):
    dp2 = [*PP2, "parallel.dp=2", "train.batch_size=16", "schedule=1f1b"]
    cases, faults = _cases(PP4, SCHEDULES, clip=CLIP[16],
                           extra={mode: [*dp2, f"parallel.dp_mode={mode}"] for mode in ("ddp", "fsdp")})
    records = run_cases(tmp_path, 4, cases, more_hooks=final_weights, faults=faults)
    for name in [*SCHEDULES, "ddp", "fsdp"]:
        _assert_same_run(tmp_path, records, name, CLIP[16])
        _assert_same_refusal(records, name)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_weight_tied_across_the_first_and_last_rank_trains_bit_identically_in_every_mode(tmp_path):
    # The tied gradients' sum between ranks 0 and 1 blocks after every backward, a rerun's too. Tied,
    # the norms are 1.16 falling to 0.35 over 20 steps: a clip of 0.5 binds on steps 1-6, 8-10 and
    # 14, not on the other 10.
    tied = ["parallel.pp=2", "parallel.microbatches=8", "train.batch_size=16", "schedule=1f1b",
            "model.tie_embeddings=true"]
    cases, faults = _cases([], [], clip=0.5, extra={"tied": tied})
    records = run_cases(tmp_path, 2, cases, more_hooks=final_weights, faults=faults)
    _assert_same_run(tmp_path, records, "tied", 0.5)
    _assert_same_refusal(records, "tied")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,fault,lines,symptom", [
    # 1F1B at pp=2: rank 1 (the last stage) finishes its backward first, steps AdamW and waits in the
    # reduction for rank 0, which is killed once its own backward is done.
    ("post_validate", "kill-after-backward:0:3", [1, 2], "SIGKILL"),
    # deferred: rank 1 runs into step 4 and waits for rank 0's activations; step 2 was to be validated
    # (and its line written) during step 3, after the backward rank 0 did not survive.
    ("deferred", "kill-after-backward:0:3", [1], "SIGKILL"),
    # deferred: rank 1 raises as step 3 begins, with step 2's update applied and not yet validated.
    ("deferred", "raise:1:3", [1], "injected fault on rank 1 at step 3"),
], ids=["post_validate-kill", "deferred-kill", "deferred-raise"])
def test_a_rank_dying_while_its_peer_waits_in_the_overlapped_reduction_ends_the_job_in_bounded_time(
        tmp_path, mode, fault, lines, symptom):
    run_dir = tmp_path / "run"
    proc = start_cli(*TINY, *PP2, "train.steps=50", f"train.optimizer_sync={mode}", "launch.timeout_s=10",
                     "launch.grace_s=5", f"hydra.run.dir={run_dir}", env={"RUNNER_FAULT": fault})
    began = time.monotonic()
    _, err = proc.communicate(timeout=100)
    assert time.monotonic() - began < 60  # startup, two steps, then launch.timeout_s + launch.grace_s at most
    failing = fault.split(":")[1]
    assert proc.returncode == 3 and f"rank {failing}" in err and symptom in err, err
    if fault.startswith("raise"):
        assert "Traceback" in err  # the root cause, with its traceback
    assert [m["step"] for m in _metrics(run_dir)] == lines


# -- in-process ------------------------------------------------------------------------------------
def _adamw() -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    return params, torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    torch.manual_seed(seed)
    for p in params:
        p.grad = torch.randn_like(p)


def _state(params, optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in params for t in (p.detach(), *optimizer.state[p].values())]


def test_a_snapshot_undoes_an_adamw_step_bit_for_bit_and_the_redo_is_the_step_itself():
    params, optimizer = _adamw()
    twin_params, twin = _adamw()
    snapshot = UpdateSnapshot(optimizer)
    for step in range(3):  # the first (no AdamW state yet) and later steps
        _set_grads(params, step)
        _set_grads(twin_params, step)
        snapshot.take()
        before = [p.detach().clone() for p in params]
        optimizer.step()
        assert not torch.equal(params[0], before[0])
        snapshot.restore()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        if step == 0:
            assert not optimizer.state  # no state before the first step: none after its undoing
        for ps in (params, twin_params):
            clip_grads(ps, 0.5, torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps])).item())
        optimizer.step()
        twin.step()
        assert all(torch.equal(a, b) for a, b in zip(_state(params, optimizer), _state(twin_params, twin))), step
    numel = sum(p.numel() for p in params)
    assert snapshot.numel() == numel == 22 and snapshot.nbytes() == 12 * numel + 4 * len(params)


@pytest.mark.parametrize("norm", [0.1, 0.5 - 2e-6, 0.5 - 1e-6, 0.5, 0.5 + 1e-7, 0.7, math.inf])
def test_the_clip_coefficient_is_the_factor_clip_grads_applies_and_1_exactly_where_it_changes_nothing(norm):
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = torch.randn(1000)
    original = p.grad.clone()
    clip_grads([p], 0.5, norm)
    coefficient = clip_coefficient(0.5, norm)
    assert torch.equal(p.grad, original * torch.tensor(coefficient, dtype=torch.float32))
    assert (coefficient == 1.0) == torch.equal(p.grad, original)
    assert clip_coefficient(0.0, norm) == 1.0  # grad_clip=0: off


def test_a_non_finite_step_leaves_the_weights_and_adamw_state_as_the_barrier_leaves_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_FAULT", "nangrad:0:2")
    kept = {}
    for mode in MODES:
        cfg = compose(*TINY, "parallel.pp=1", f"train.steps={NANGRAD_STEPS}", f"train.optimizer_sync={mode}")
        (tmp_path / mode).mkdir()
        trainer = Trainer(validate(cfg, tmp_path / mode), cfg, DistEnv(0, 1, torch.device("cpu")))
        with pytest.raises(NonFiniteLossError, match="non-finite gradient norm at step 2") as info:
            trainer.run()
        kept[mode] = (str(info.value), _state(trainer.params, trainer.optimizer))
        assert [m["step"] for m in _metrics(tmp_path / mode)] == [1], mode  # step 2 never written
    for mode in SPECULATIVE:
        assert kept[mode][0] == kept["barrier"][0]
        assert all(torch.equal(a, b) for a, b in zip(kept[mode][1], kept["barrier"][1])), mode
        assert all(torch.isfinite(t).all() for t in kept[mode][1])


class _Points(Hook):
    """The hook points in the order the trainer calls them, as (point, step)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def begin_step(self, ctx, state) -> None:
        self.seen.append(("begin", state.step))

    def after_reduce(self, ctx, state) -> None:
        self.seen.append(("reduce", state.step))

    def after_step(self, ctx, state) -> None:
        self.seen.append(("step", state.step))


def _in_process_run(tmp_path: Path, mode: str, *overrides: str) -> tuple[Trainer, _Points]:
    cfg = compose(*TINY, "parallel.pp=1", "train.batch_size=8", f"train.grad_clip={CLIP[8]}",
                  f"train.optimizer_sync={mode}", *overrides)
    points = _Points()
    (tmp_path / mode).mkdir()
    trainer = Trainer(validate(cfg, tmp_path / mode), cfg, DistEnv(0, 1, torch.device("cpu")), hooks=[points])
    trainer.run()
    return trainer, points


@pytest.mark.timeout(120)
def test_deferred_validates_each_step_during_the_next_and_commits_what_the_barrier_commits(tmp_path):
    # 8 steps, evaluated at 3 and 6, saved at 4 and 8: those and the last are validated at their own end.
    common = ["train.steps=8", "eval.every=3", "eval.steps=1", "checkpoint.every=4"]
    barrier, _ = _in_process_run(tmp_path, "barrier", *common)
    deferred, points = _in_process_run(tmp_path, "deferred", *common)
    want, got = _metrics(tmp_path / "barrier"), _metrics(tmp_path / "deferred")
    assert [{k: m[k] for k in ("step", "loss", "lr", "grad_norm", "val_loss") if k in m} for m in got] == \
        [{k: m[k] for k in ("step", "loss", "lr", "grad_norm", "val_loss") if k in m} for m in want]
    assert [m["step"] for m in got if "val_loss" in m] == [3, 6, 8]
    clipped = [clip_coefficient(CLIP[8], m["grad_norm"]) < 1 for m in want]
    assert 0 < sum(clipped) < 8, clipped
    deferred_steps = [1, 2, 5, 7]  # neither evaluated, saved nor the last
    report = deferred.post_validate.report()
    assert report["rollbacks"] == sum(clipped) and report["reruns"] == sum(clipped[s - 1] for s in deferred_steps)
    # A deferred step's update is validated after the next step began; the others' before.
    for step in range(1, 8):
        begin_next, validated = points.seen.index(("begin", step + 1)), points.seen.index(("reduce", step))
        assert (begin_next < validated) == (step in deferred_steps), (step, points.seen)
    for step in deferred_steps:  # the next step ran again where a deferred step was redone (clipped)
        assert points.seen.count(("begin", step + 1)) == 1 + clipped[step - 1], (step, points.seen)
    assert report["reruns"] >= 1, clipped
    for step in (4, 8):
        a, b = (read_model_tensors(tmp_path / mode / "checkpoints" / f"step-{step}")
                for mode in ("barrier", "deferred"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    assert all(torch.equal(a, b) for a, b in zip(_state(barrier.params, barrier.optimizer),
                                                 _state(deferred.params, deferred.optimizer)))


# On a GPU dropout draws from the device's generator, which a rerun must restore too (the CPU case
# keeps the GPU one from rotting between GPU runs).
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.timeout(120)
def test_a_rerun_step_draws_the_same_dropout_masks_as_the_barriers_one_pass(tmp_path, device):
    # Dropout draws from the generator the trainer seeds from train.seed. On CPU, norms 0.5638,
    # 0.5648, 0.5761, 0.5689, 0.5429, 0.5657: the clip binds at steps 2, 3, 4 and 6 (the last,
    # validated at its own end), so steps 3, 4 and 5 run again, from the random state they began
    # with (3 reruns). On CUDA (other masks, other norms) a clip that binds at every step: each of
    # steps 2 to 6 runs again, after the deferred step before it (5 reruns).
    clip = 0.5645 if device == "cpu" else 0.01
    kept = {}
    for mode in ("barrier", "deferred"):
        cfg = compose(*TINY, "model=mlp", "model._target_=helpers.models.dropout_mlp", "parallel.pp=1",
                      "train.steps=6", f"train.grad_clip={clip}", f"train.optimizer_sync={mode}", f"device={device}")
        (tmp_path / mode).mkdir()
        on = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        trainer = Trainer(validate(cfg, tmp_path / mode), cfg, DistEnv(0, 1, on))
        kept[mode] = (trainer.run(), _state(trainer.params, trainer.optimizer))
    reruns = kept["deferred"][0].summary["post_validate"]["reruns"]
    assert reruns == ([3] if device == "cpu" else [5]), reruns  # (one rank's count)
    assert kept["deferred"][0].losses == kept["barrier"][0].losses
    assert all(torch.equal(a, b) for a, b in zip(kept["deferred"][1], kept["barrier"][1]))


@pytest.mark.parametrize("on_cuda", [False, True])
def test_a_discarded_pass_leaves_no_actions_or_span_in_the_recorder(on_cuda):
    # On CUDA (a stand-in stream) the thrown-away pass is still unread when it is discarded: the
    # wait that found its redo due anchored it, the device had not been seen to pass it.
    stream = FakeStream()
    recorder = Recorder(stream.event, now=stream.now) if on_cuda else Recorder()
    recorder.active = True
    for i, step in enumerate((1, 2, 2)):
        with recorder.pipeline_step(step):
            with recorder.action(0, "F", 0):
                stream.launch(1_000, 50_000)
        if i == 1:
            stream.drain()
            recorder.anchor()
            assert [s.step for s in recorder.steps] == ([] if on_cuda else [1, 2])
            assert len(recorder.actions) == (0 if on_cuda else 2)
            recorder.discard(2)  # the first pass of step 2 was thrown away
    recorder.settle()
    assert [s.step for s in recorder.steps] == [1, 2] and [a.step for a in recorder.actions] == [1, 2]


def test_verify_of_a_resumed_run_under_post_validation_is_refused_with_the_fix():
    cfg = compose(*TINY, *PP2, "train.optimizer_sync=post_validate", "checkpoint.resume=latest")
    with pytest.raises(ConfigError, match=r"train.optimizer_sync=post_validate with verify=true .*"
                                          r"Fix: train.optimizer_sync=barrier"):
        _check_optimizer_sync(cfg, verify=True, resume=Path(os.devnull))
    _check_optimizer_sync(cfg, verify=False, resume=Path(os.devnull))  # either alone is fine
    _check_optimizer_sync(cfg, verify=True, resume=None)


@pytest.mark.parametrize("mode", SPECULATIVE)
def test_verify_holds_a_post_validated_run_to_the_unsplit_model_when_the_clip_binds(tmp_path, mode):
    # deferred: steps 1-2 verified (validated at their end), 3-4 deferred, 5 the last.
    cfg = compose(*TINY, "parallel.pp=1", "train.steps=5", "train.grad_clip=0.05", "verify=true", "verify_steps=1",
                  f"train.optimizer_sync={mode}")
    result = Trainer(validate(cfg, tmp_path), cfg, DistEnv(0, 1, torch.device("cpu"))).run()
    assert result.summary is not None
    report = result.summary["post_validate"]
    assert report["rollbacks"] == [5] and report["reruns"] == [2 if mode == "deferred" else 0]  # the clip always binds
    report = result.summary["verify"]
    assert report["passed"] and [s["step"] for s in report["steps"]] == [1, 2]
    assert all(s["weights"]["passed"] for s in report["steps"] if "weights" in s)
