"""The training options composed with a single-stage (1F1B) and a multi-stage, V-shaped (ZBV)
schedule, each against the unsplit model: activation checkpointing, keyword inputs, a user loss,
evaluation, bf16, weight decay groups and the LR schedule, and torch.compile (with 1F1B and
Interleaved1F1B).

One 2-rank spawn runs every case; each pp=1 reference runs once, in this process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runner.models import transformer
from runner.verify import TOLERANCES

from test_parity import _assert_matches, _reference, _run_cases

SCHEDULES = ["1f1b", "zbv"]
PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
OPTIONS = {
    "ac-full": ["train.activation_checkpointing=full"],
    "ac-every2": ["train.activation_checkpointing=every_n", "train.ac_every=2"],
    "padding": ["data.padding=true"],
    "user-loss": ["loss._target_=_models.z_loss_cross_entropy"],
    "eval": ["eval.every=2", "eval.steps=2"],
    "bf16": ["train.precision=bf16", "verify=true"],  # verify at bf16 tolerances
    # Decay on every parameter, strong, and a constant LR after warmup (the defaults: cosine, no decay
    # on biases, norms and embeddings).
    "optim": ["train.lr_schedule=constant", "train.no_decay=[]", "train.weight_decay=0.5"],
}
# What each case is compared with: the pp=1 run with the options that change the numbers.
REFERENCE_OF = {"ac-full": "base", "ac-every2": "base", "padding": "padding", "user-loss": "user-loss",
                "eval": "eval", "bf16": "bf16", "optim": "optim"}
COMPILED = ["model=mlp", "train.compile=true", "verify=true", "eval.every=2"]


def _assert_close_at_bf16(got: dict, ref: dict, case: str) -> None:
    rtol, atol = TOLERANCES["bf16"]
    assert "error" not in got, f"{case}: {got.get('traceback')}"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0)
    for name, ref_grad in ref["grads"].items():
        grad = got["grads"][name]
        assert grad.dtype == torch.float32, f"{case} {name}: gradients (and so parameters) must stay fp32"
        torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{case} {n}: {m}")


def _val_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}


@pytest.mark.timeout(300)
def test_training_options_match_the_unsplit_model_on_single_and_multi_stage_schedules(tmp_path):
    cases = {f"{option}-{name}": [f"schedule={name}", *PP2, *overrides]
             for option, overrides in OPTIONS.items() for name in SCHEDULES}
    for name in ("1f1b", "interleaved_1f1b"):
        cases[f"compile-{name}"] = [f"schedule={name}", *PP2, *COMPILED]
    results = _run_cases(tmp_path / "pp2", 2, cases)

    batch = ["parallel.microbatches=4", "train.batch_size=8"]
    refs = {}
    for option in ("base", "padding", "user-loss", "eval", "bf16", "optim"):
        (tmp_path / option).mkdir()
        refs[option] = _reference(tmp_path / option, *batch, *OPTIONS.get(option, []))
    for option in OPTIONS:
        ref = refs[REFERENCE_OF[option]]
        for name in SCHEDULES:
            case = f"{option}-{name}"
            if option == "bf16":
                _assert_close_at_bf16(results[case], ref, case)
                report = results[case]["summary"]["verify"]
                assert report["passed"] and report["rtol"] == TOLERANCES["bf16"][0], case
            else:
                _assert_matches(results[case], ref, case)

    # The options change what is computed (so matching the reference means something).
    base = refs["base"]["losses"]
    for option in ("padding", "user-loss", "bf16", "optim"):
        assert refs[option]["losses"] != base, option
    assert refs["user-loss"]["losses"][0] > base[0] + 0.1  # the z-loss term is added
    # Evaluation: after steps 2 and 4 and after the last (5), on held-out data, in metrics and summary
    # (steps are numbered from 1 everywhere).
    for name in SCHEDULES:
        got = _val_losses(tmp_path / "pp2" / f"eval-{name}")
        want = _val_losses(tmp_path / "eval" / "reference")
        assert list(got) == list(want) == [2, 4, 5]
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-4)
        summary = results[f"eval-{name}"]["summary"]
        assert summary["val_loss"] == pytest.approx(want[5], rel=1e-4)
        assert [v["step"] for v in summary["val_losses"]] == [2, 4, 5]
    val = list(want.values())
    assert val[-1] < val[0] and all(v != loss for v, loss in zip(val, refs["eval"]["losses"]))
    # Evaluation does not change training, and leaves no actions in the recorded schedule.
    assert refs["eval"]["losses"] == base
    for name in ("1f1b", "zbv"):
        assert (tmp_path / "pp2" / f"eval-{name}" / "schedule.csv").read_text() == \
            (tmp_path / "pp2" / f"padding-{name}" / "schedule.csv").read_text()
    # Compiled stages: verify compared the first step with the eager unsplit model.
    for name in ("1f1b", "interleaved_1f1b"):
        got = results[f"compile-{name}"]
        assert "error" not in got, got.get("traceback")
        assert got["summary"]["verify"]["passed"] and got["summary"]["verify"]["max_abs_diff"] < 4e-5
        assert got["losses"][-1] < got["losses"][0] and math.isfinite(got["summary"]["val_loss"])


def test_the_attention_mask_reaches_every_block_and_changes_only_what_it_should():
    from runner.split import StageModule
    from runner.units import SequentialSpec

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
