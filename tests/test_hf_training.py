"""Hugging Face models trained pipelined match transformers' own unsplit training, on every
schedule and layout; checkpoints resume across layouts and export back to Hugging Face format.

A tiny Llama (pretrained weights in its directory, untied) and a tiny GPT-2 (config only: the
runner's initialisation; embedding and head tied, so pipelined they are copies on two stages),
and a nested user model split by ``parallel.stage_modules``. One 2-rank spawn and one 4-rank spawn
run every case; the references (transformers' model trained the same way) run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from _hf import hf_training, write_model
from _ranks import spawn, train_cases
from conftest import compose
from test_parity import CLIP, SCHEDULES, _assert_matches

PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
PP4 = ["parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16"]
NESTED = ["model=mlp", "model._target_=_models.nested", "model.dim=16", "model.n_layers=4", "data.vocab_size=48",
          "parallel.stage_modules=[[embed,layers.0,layers.1],[layers.2,layers.3,norm,head]]"]


def _base(path: Path) -> list[str]:
    return ["device=cpu", "model=hf", f"model.path={path}", "data.vocab_size=64", "train.seq_len=16", "train.steps=5",
            "profile.enabled=false", *CLIP]


def _resolved(*overrides: str) -> dict:
    return OmegaConf.to_container(compose(*overrides), resolve=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"llama": write_model(root / "llama", "llama", weights=True),
            "gpt2": write_model(root / "gpt2", "gpt2", weights=False)}


@pytest.fixture(scope="module")
def pp2(models, tmp_path_factory) -> tuple[Path, dict]:
    """The 2-rank spawn: every schedule for both models, verify against transformers' forward, a
    GPT-2 with its dropout on, nested models, and a GPT-2 run that saves a checkpoint."""
    out = tmp_path_factory.mktemp("pp2")
    cases = {f"{m}-{s}": _resolved(*_base(models[m]), *PP2, f"schedule={s}", "verify=true")
             for m in models for s in SCHEDULES}
    cases["llama-ac"] = _resolved(*_base(models["llama"]), *PP2, "schedule=1f1b", "train.activation_checkpointing=full")
    cases["gpt2-dropout"] = _resolved(*_base(models["gpt2"]), *PP2, "verify=true",
                                      "+model.config_overrides.resid_pdrop=0.1")
    cases["nested"] = _resolved("device=cpu", "train.seq_len=16", "train.steps=5", "profile.enabled=false", *CLIP,
                                *PP2, *NESTED, "verify=true")
    cases["nested-residual"] = _resolved("device=cpu", "train.seq_len=16", "train.steps=5", "profile.enabled=false",
                                         *PP2, *NESTED, "+model.residual=true", "verify=true")
    cases["gpt2-save"] = _resolved(*_base(models["gpt2"]), *PP2, "train.steps=6", "checkpoint.every=3")
    spawn(2, train_cases, str(out), cases)
    return out, {name: torch.load(out / f"{name}.pt", weights_only=False) for name in cases}


@pytest.mark.timeout(400)
def test_every_schedule_at_pp2_matches_transformers_own_training(models, pp2, tmp_path):
    out, results = pp2
    for model in models:
        ref = hf_training(compose(*_base(models[model]), *PP2), steps=5)
        for schedule in SCHEDULES:
            case = f"{model}-{schedule}"
            _assert_matches(results[case], ref, case)
            report = results[case]["summary"]["verify"]
            assert report["passed"] and report["max_abs_diff"] < 4e-5, case
        if model == "llama":  # activation checkpointing recomputes the decoder layers, the same numbers
            _assert_matches(results["llama-ac"], ref, "llama-ac")
        # Pretrained weights: the first step's loss is transformers' own loss on that batch.
        if model == "llama":
            assert results["llama-1f1b"]["losses"][0] == pytest.approx(ref["hf_loss"], rel=1e-6)
    # GPT-2's embedding and head are one tensor unsplit; pipelined, the copies got equal gradients.
    assert "lm_head.weight" not in results["gpt2-1f1b"]["grads"]
    assert results["gpt2-1f1b"]["summary"]["stages"]["1"][-1] == "lm_head"
    error = results["gpt2-dropout"]["error"]
    assert error.startswith("VerifyError") and "dropout in training" in error and "resid_dropout (p=0.1)" in error
    assert "error" not in results["nested"], results["nested"].get("traceback")
    assert results["nested"]["summary"]["verify"]["passed"]
    assert results["nested"]["summary"]["stages"]["1"] == ["layers.2", "layers.3", "norm", "head"]
    # The model's own forward adds residuals its listed units do not: verify says they differ.
    assert results["nested-residual"]["error"].startswith("VerifyError")


@pytest.mark.timeout(120)
def test_a_trained_model_exports_to_hugging_face_format_and_loads_with_from_pretrained(pp2, tmp_path):
    from transformers import AutoModelForCausalLM

    from runner.export import _model_tensors, export

    out, results = pp2
    run = out / "gpt2-save"
    exported = export(run, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight is model.transformer.wte.weight  # stored once, tied again on load
    # The checkpoint's own tensors (what the pipeline trained) give the same logits.
    tensors = _model_tensors(run / "checkpoints" / "step-6")
    assert "lm_head.weight" not in tensors
    ids = torch.randint(64, (2, 16))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        fresh = AutoModelForCausalLM.from_config(model.config)
        fresh.load_state_dict(tensors, strict=False)
        fresh.tie_weights()
        torch.testing.assert_close(got, fresh(input_ids=ids).logits, rtol=0, atol=0)
        initial = AutoModelForCausalLM.from_config(model.config)
    assert not torch.allclose(got, initial(input_ids=ids).logits, atol=1e-3)  # it is the trained model
    assert results["gpt2-save"]["losses"][-1] < results["gpt2-save"]["losses"][0]


@pytest.mark.timeout(480)
def test_pp4_and_fsdp_layouts_match_and_resume_across_layouts(models, pp2, tmp_path):
    out, saved_results = pp2
    saved = out / "gpt2-save" / "checkpoints" / "step-3"
    fsdp = ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp", "parallel.microbatches=4",
            "train.batch_size=8"]
    cases = {}
    for model, schedules in {"llama": ["gpipe", "interleaved_1f1b", "zbv"], "gpt2": ["1f1b", "dualpipev"]}.items():
        for s in schedules:
            cases[f"{model}-pp4-{s}"] = _resolved(*_base(models[model]), *PP4, f"schedule={s}")
        for s in ("1f1b", "zbv"):  # zbv: both ends of GPT-2 on one rank, as copies under FSDP
            cases[f"{model}-fsdp-{s}"] = _resolved(*_base(models[model]), *fsdp, f"schedule={s}")
    resume = [*_base(models["gpt2"]), "train.steps=6", f"checkpoint.resume={saved}"]
    cases["resume-pp4-interleaved"] = _resolved(*resume, *PP4[:1], *PP2[1:], "schedule=interleaved_1f1b")
    cases["resume-fsdp-zbv"] = _resolved(*resume, *fsdp, "schedule=zbv")
    spawn(4, train_cases, str(tmp_path), cases)
    results = {name: torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in cases}

    refs = {(m, layout): hf_training(compose(*_base(models[m]), *batch), steps=5)
            for m in models for layout, batch in (("pp4", PP4), ("pp2", PP2))}
    for case, got in results.items():
        if case.startswith("resume"):
            continue
        model, layout = case.split("-")[:2]
        _assert_matches(got, refs[(model, "pp4" if layout == "pp4" else "pp2")], case)
    full = saved_results["gpt2-save"]["losses"]
    for case in ("resume-pp4-interleaved", "resume-fsdp-zbv"):
        got = results[case]
        assert "error" not in got, got.get("traceback")
        assert got["summary"]["first_step"] == 4  # step 4 first: after checkpoint step-3
        assert got["losses"] == pytest.approx(full[3:], rel=1e-4, abs=0), case


@pytest.mark.timeout(200)
def test_the_command_line_trains_a_pretrained_model_on_a_local_dataset_and_exports_it(tmp_path):
    """What the README's "Hugging Face models" section tells a user to type, without code."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from _hf import write_tokenizer
    from conftest import ROOT

    model_dir = write_model(tmp_path / "model", "llama", weights=True)
    write_tokenizer(model_dir)  # a model directory with its tokenizer, as on the Hub
    words = "the pipeline stage runs every microbatch forward and backward while another rank waits".split()
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps({"text": " ".join(words[i % 5:] + words[:i % 5])})
                                                     for i in range(200)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)]),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "runner", "model=hf", f"model.path={model_dir}", "data=hf",
         f"data.path={tmp_path / 'corpus.jsonl'}", f"data.tokenizer={model_dir}", "train.seq_len=16",
         "train.batch_size=8", "train.steps=4", "eval.every=2", "checkpoint.every=4", "verify=true",
         "profile.enabled=false", f"hydra.run.dir={run}"], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verify"]["passed"] and summary["val_loss"] > 0
    assert summary["stages"]["0"][0] == "model.embed_tokens" and summary["stages"]["1"][-1] == "lm_head"
    # Each rank read its own stages' weights: together the file once (the untied head is its own).
    size = sum(AutoModelForCausalLM.from_pretrained(model_dir).state_dict()[k].numel() * 4
               for k in AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    read = summary["weights_read_bytes"]
    assert len(read) == 2 and sum(read) == size and min(read) > 0.2 * size
    assert list((tmp_path / "cache" / "runner" / "tokens").glob("*.uint16"))  # tokenized once, cached
    exported = subprocess.run([sys.executable, "-m", "runner.export", str(run), str(tmp_path / "out")], env=env,
                              capture_output=True, text=True, timeout=60)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == 19
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    before = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(model.lm_head.weight, before.lm_head.weight)  # trained
