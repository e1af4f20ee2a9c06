"""The training options composed with a single-stage (1F1B) and a multi-stage, V-shaped (ZBV)
schedule, each against the unsplit model: activation checkpointing, keyword inputs, a user loss,
evaluation, bf16, weight decay groups and the LR schedule, and torch.compile (with 1F1B and
Interleaved1F1B).

One 2-rank spawn (a module-scoped fixture) runs every case, each asserted in its own test; each
pp=1 reference runs once, in this process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runner.models.builtin import transformer
from runner.verify.compare import TOLERANCES

from helpers.config import TINY, resolved
from helpers.parity import CLIP, assert_close_at_bf16, assert_matches, reference
from helpers.ranks import run_cases

SCHEDULES = ["1f1b", "zbv"]
PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
OPTIONS = {
    "ac-full": ["train.activation_checkpointing=full"],
    "ac-every2": ["train.activation_checkpointing=every_n", "train.ac_every=2"],
    "padding": ["data.padding=true"],
    "user-loss": ["loss._target_=helpers.models.z_loss_cross_entropy"],
    "eval": ["eval.every=2", "eval.steps=2"],
    "bf16": ["train.precision=bf16", "verify=true"],  # verify at bf16 tolerances
    # Decay on every parameter, strong, and a constant LR after warmup (the defaults: cosine, no decay
    # on biases, norms and embeddings); verify's reference updates with the same groups and schedule.
    "optim": ["train.lr_schedule=constant", "train.no_decay=[]", "train.weight_decay=0.5", "verify=true"],
}
# What each case is compared with: the pp=1 run with the options that change the numbers.
REFERENCE_OF = {"ac-full": "base", "ac-every2": "base", "padding": "padding", "user-loss": "user-loss",
                "eval": "eval", "bf16": "bf16", "optim": "optim"}
# The padded references take each batch whole (one microbatch): a run split into microbatches and
# replicas must give the mean over the batch's real targets, not a mean of microbatch means.
WHOLE_BATCH = ["parallel.microbatches=1"]
PADDED_EVAL = ["data.padding=true", "eval.every=5", "eval.steps=1"]
COMPILED = ["model=mlp", "train.compile=true", "verify=true", "eval.every=2"]
COMPILED_SCHEDULES = ["1f1b", "interleaved_1f1b"]
DROPOUT = ["model=mlp", "model._target_=helpers.models.recorded_dropout_mlp", "model.n_layers=4"]
DROPOUT_RUNS = ("dropout-first", "dropout-again")


def _val_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The 2-rank spawn: every option with each schedule, and the compiled stages. Returns the
    directory of the cases' run directories and each case's record."""
    cases = {f"{option}-{name}": [f"schedule={name}", *PP2, *overrides]
             for option, overrides in OPTIONS.items() for name in SCHEDULES}
    for name in COMPILED_SCHEDULES:
        cases[f"compile-{name}"] = [f"schedule={name}", *PP2, *COMPILED]
    # Padding over 2 replicas of 4 one-sample microbatches, and its evaluation (held to the whole batch's).
    cases["padding-dp2"] = ["parallel.pp=1", "parallel.dp=2", "parallel.dp_mode=ddp", *PP2[1:], *PADDED_EVAL]
    out = tmp_path_factory.mktemp("features") / "pp2"
    # The same model with dropout after every block, twice, in the same ranks (which trained the
    # cases above first): each run seeds its dropout from train.seed, each pipeline rank its own.
    for run in (*DROPOUT_RUNS, "dropout-evaluated"):
        (out / f"masks-{run}").mkdir(parents=True)
        cases[run] = ["schedule=1f1b", *PP2, *DROPOUT, f"+model.masks={out / f'masks-{run}'}"]
    cases["dropout-evaluated"] += ["eval.every=2", "eval.steps=1"]
    return out, run_cases(out, 2, {name: resolved(*TINY, *CLIP, *ov) for name, ov in cases.items()})


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The pp=1 references, each in ``<directory>/<option>/reference``."""
    tmp = tmp_path_factory.mktemp("features-references")
    batch = ["parallel.microbatches=4", "train.batch_size=8"]
    found = {}
    for option in ("base", "padding", "user-loss", "eval", "bf16", "optim"):
        (tmp / option).mkdir()
        # The padded one also evaluates (which changes no training): the replicas' case does.
        found[option] = reference(tmp / option, *batch, *OPTIONS.get(option, []),
                                  *(WHOLE_BATCH + PADDED_EVAL if option == "padding" else []))
    return tmp, found


def test_the_options_change_what_is_computed_and_evaluation_changes_no_training(refs):
    # So matching the reference means something.
    tmp, refs = refs
    base = refs["base"]["losses"]
    for option in ("padding", "user-loss", "bf16", "optim"):
        assert refs[option]["losses"] != base, option
    assert refs["user-loss"]["losses"][0] > base[0] + 0.1  # the z-loss term is added
    val = list(_val_losses(tmp / "eval" / "reference").values())
    assert val[-1] < val[0] and all(v != loss for v, loss in zip(val, refs["eval"]["losses"]))
    assert refs["eval"]["losses"] == base


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("option", OPTIONS)  # ids: <option>-<schedule>, the case's name
def test_every_option_matches_the_unsplit_model(pp2, refs, option, name):
    case = f"{option}-{name}"
    got, ref = pp2[1][case], refs[1][REFERENCE_OF[option]]
    if option == "bf16":
        assert_close_at_bf16(got, ref, case)
        report = got["summary"]["verify"]
        assert report["passed"] and report["rtol"] == TOLERANCES["bf16"][0], case
    else:
        assert_matches(got, ref, case)
    if option in ("bf16", "optim"):  # verify followed the first 2 updates
        assert [sorted(s).count("weights") for s in got["summary"]["verify"]["steps"]] == [1, 1, 0], case


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_padded_batches_over_replicas_and_microbatches_train_and_evaluate_as_the_whole_batch(pp2, refs):
    # 8 one-sample microbatch means over 2 replicas, each weighted by its real targets: the whole
    # padded batch's loss, gradients and held-out loss (a mean of means differs by ~1e-2 here).
    got, ref = pp2[1]["padding-dp2"], refs[1]["padding"]
    assert_matches(got, ref, "padding-dp2")
    assert got["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SCHEDULES)
def test_evaluation_runs_on_held_out_data_and_leaves_no_actions_in_the_recorded_schedule(pp2, refs, name):
    # After steps 2 and 4 and after the last (5), in metrics and summary (steps are numbered from 1
    # everywhere).
    out, results = pp2
    got = _val_losses(out / f"eval-{name}")
    want = _val_losses(refs[0] / "eval" / "reference")
    assert list(got) == list(want) == [2, 4, 5]
    assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-4)
    summary = results[f"eval-{name}"]["summary"]
    assert summary["val_loss"] == pytest.approx(want[5], rel=1e-4)
    assert [v["step"] for v in summary["val_losses"]] == [2, 4, 5]
    assert (out / f"eval-{name}" / "schedule.csv").read_text() == (out / f"padding-{name}" / "schedule.csv").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", COMPILED_SCHEDULES)
def test_compiled_stages_match_the_eager_unsplit_model(pp2, name):
    # verify compared the first step with the eager unsplit model.
    got = pp2[1][f"compile-{name}"]
    assert "error" not in got, got.get("traceback")
    assert got["summary"]["verify"]["passed"] and got["summary"]["verify"]["max_abs_diff"] < 4e-5
    assert got["losses"][-1] < got["losses"][0] and math.isfinite(got["summary"]["val_loss"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dropout_draws_from_the_seed_each_pipeline_rank_its_own_masks_and_never_in_evaluation(pp2):
    # Nothing seeded dropout: each rank drew from whatever its process held, so the same config in
    # the same ranks trained apart (a second runner.run in one process too), and both pipeline ranks
    # held one state, so block1 (rank 1) dropped the very elements block0 (rank 0) dropped.
    out, results = pp2
    first, again = (results[run] for run in DROPOUT_RUNS)
    assert "error" not in first, first.get("traceback")
    assert again["losses"] == first["losses"] and len(first["losses"]) == 5
    masks = {run: {f.stem: torch.load(f) for f in sorted((out / f"masks-{run}").glob("*.pt"))} for run in DROPOUT_RUNS}
    assert list(masks[DROPOUT_RUNS[0]]) == ["block0", "block1", "block2", "block3"]
    for name, mask in masks[DROPOUT_RUNS[0]].items():
        assert torch.equal(masks[DROPOUT_RUNS[1]][name], mask), name
    drawn = list(masks[DROPOUT_RUNS[0]].values())
    same = [(a, b) for a in range(4) for b in range(a) if torch.equal(drawn[a], drawn[b])]
    assert same == [], f"blocks {same} dropped the same elements"
    # Evaluation runs without dropout (it ran with it: 4.0826 after one, not 4.0688), so it draws
    # nothing and the training after it is the same.
    evaluated = results["dropout-evaluated"]
    assert evaluated["losses"] == first["losses"]
    assert [v["step"] for v in evaluated["summary"]["val_losses"]] == [2, 4, 5]


def test_the_attention_mask_reaches_every_block_and_changes_only_what_it_should():
    from runner.models.split import StageModule
    from runner.models.units import SequentialSpec

    torch.manual_seed(0)
    whole = transformer(vocab_size=16, max_seq_len=8, dim=16, n_layers=2, n_heads=2, ffn_mult=2)
    spec = SequentialSpec(whole)
    model = StageModule(spec, spec.unit_names, dict(whole.named_children()))
    tokens = torch.randint(16, (2, 8))
    full = torch.ones(2, 8, dtype=torch.bool)
    left_pad = torch.arange(8) >= torch.tensor([[3], [0]])
    plain, unmasked, masked = model(tokens), model(tokens, attention_mask=full), model(tokens, attention_mask=left_pad)
    torch.testing.assert_close(unmasked, plain)  # an all-true mask is plain causal attention
    torch.testing.assert_close(masked[1], plain[1])  # an unpadded row is unchanged
    assert not torch.allclose(masked[0, 3:], plain[0, 3:])  # real tokens no longer see the pad
    assert torch.isfinite(masked).all()  # padded queries attend to themselves: no empty softmax
