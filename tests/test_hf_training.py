"""Hugging Face models trained pipelined match transformers' own unsplit training, on every
schedule and layout; checkpoints resume across layouts and export back to Hugging Face format.

A tiny Llama (pretrained weights in its directory, untied) and a tiny GPT-2 (config only: the
runner's initialisation; embedding and head tied, so pipelined they are copies on two stages),
and a nested user model split by ``parallel.stage_modules``. One 2-rank spawn and one 4-rank spawn
(module-scoped fixtures) run every case, each asserted in its own test; the references
(transformers' model trained the same way) run once each, in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.cli import run_cli
from helpers.config import compose, resolved
from helpers.hf import hf_training, write_model, write_tokenizer
from helpers.parity import CLIP, SCHEDULES, assert_matches
from helpers.ranks import run_cases

pytestmark = pytest.mark.multiprocess

MODELS = ["llama", "gpt2"]
PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
PP4 = ["parallel.pp=4", "parallel.microbatches=8", "train.batch_size=16"]
FSDP = ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp", "parallel.microbatches=4", "train.batch_size=8"]
NESTED = ["model=mlp", "model._target_=helpers.models.nested", "model.dim=16", "model.n_layers=4",
          "data.vocab_size=48", "parallel.stage_modules=[[embed,layers.0,layers.1],[layers.2,layers.3,norm,head]]"]
# The 4-rank layouts of each model: pp=4 with these schedules, and pp=2 x dp=2 FSDP with 1F1B and
# ZBV (zbv: both ends of GPT-2 on one rank, as copies under FSDP).
PP4_SCHEDULES = {"llama": ["gpipe", "interleaved_1f1b", "zbv"], "gpt2": ["1f1b", "dualpipev"]}
LAYOUT_CASES = [f"{model}-{layout}-{s}" for model in MODELS
                for layout, schedules in (("pp4", PP4_SCHEDULES[model]), ("fsdp", ["1f1b", "zbv"]))
                for s in schedules]
RESUMES = ["resume-pp4-interleaved", "resume-fsdp-zbv"]


def _base(path: Path) -> list[str]:
    # A directory of config.json only (GPT-2 here) is the runner's random initialisation: said explicitly.
    pretrained = (path / "model.safetensors").is_file()
    return ["device=cpu", "model=hf", f"model.path={path}", f"model.pretrained={str(pretrained).lower()}",
            "data.vocab_size=64", "train.seq_len=16", "train.steps=5", "profile.enabled=false", *CLIP]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"llama": write_model(root / "llama", "llama", weights=True),
            "gpt2": write_model(root / "gpt2", "gpt2", weights=False)}


@pytest.fixture(scope="module")
def references(models):
    """``references(model, batch)``: transformers' own training of ``model`` with the ``PP2`` or
    ``PP4`` batch, computed once."""
    found: dict[tuple[str, str], dict] = {}

    def get(model: str, batch: list[str]) -> dict:
        key = (model, batch[0])
        if key not in found:
            found[key] = hf_training(compose(*_base(models[model]), *batch), steps=5)
        return found[key]

    return get


@pytest.fixture(scope="module")
def pp2(models, tmp_path_factory) -> tuple[Path, dict]:
    """The 2-rank spawn: every schedule for both models, verify against transformers' forward, a
    GPT-2 with its dropout on, nested models, and a GPT-2 run that saves a checkpoint."""
    out = tmp_path_factory.mktemp("pp2")
    cases = {f"{m}-{s}": resolved(*_base(models[m]), *PP2, f"schedule={s}", "verify=true")
             for m in models for s in SCHEDULES}
    cases["llama-ac"] = resolved(*_base(models["llama"]), *PP2, "schedule=1f1b", "train.activation_checkpointing=full")
    cases["gpt2-dropout"] = resolved(*_base(models["gpt2"]), *PP2, "verify=true",
                                     "+model.config_overrides.resid_pdrop=0.1")
    cases["nested"] = resolved("device=cpu", "train.seq_len=16", "train.steps=5", "profile.enabled=false", *CLIP,
                               *PP2, *NESTED, "verify=true")
    cases["nested-residual"] = resolved("device=cpu", "train.seq_len=16", "train.steps=5", "profile.enabled=false",
                                        *PP2, *NESTED, "+model.residual=true", "verify=true")
    cases["gpt2-save"] = resolved(*_base(models["gpt2"]), *PP2, "train.steps=6", "checkpoint.every=3")
    return out, run_cases(out, 2, cases)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", MODELS)  # ids: <model>-<schedule>, the case's name
def test_every_schedule_at_pp2_matches_transformers_own_training(pp2, references, model, schedule):
    case = f"{model}-{schedule}"
    got = pp2[1][case]
    assert_matches(got, references(model, PP2), case)
    report = got["summary"]["verify"]
    assert report["passed"] and report["max_abs_diff"] < 4e-5, case
    # It followed 2 updates (GPT-2: its head and embedding, copies on two stages, each by its name).
    assert ["weights" in step for step in report["steps"]] == [True, True, False], case


@pytest.mark.timeout(400)
def test_activation_checkpointing_recomputes_the_decoder_layers_to_the_same_numbers(pp2, references):
    assert_matches(pp2[1]["llama-ac"], references("llama", PP2), "llama-ac")


@pytest.mark.timeout(400)
def test_pretrained_weights_give_transformers_own_loss_at_the_first_step(pp2, references):
    assert pp2[1]["llama-1f1b"]["losses"][0] == pytest.approx(references("llama", PP2)["hf_loss"], rel=1e-6)


@pytest.mark.timeout(400)
def test_gpt2s_tied_embedding_and_head_are_copies_on_two_stages(pp2):
    # One tensor unsplit; pipelined, the copies got equal gradients (compared with the reference above).
    results = pp2[1]
    assert "lm_head.weight" not in results["gpt2-1f1b"]["grads"]
    assert results["gpt2-1f1b"]["summary"]["stages"]["1"][-1] == "lm_head"


@pytest.mark.timeout(400)
def test_verify_names_the_dropout_left_on_in_training(pp2):
    error = pp2[1]["gpt2-dropout"]["error"]
    assert error.startswith("VerifyError") and "dropout in training" in error and "resid_dropout (p=0.1)" in error
    assert "float64 rerun not run: the model applies dropout in training" in error  # other masks: no measure


@pytest.mark.timeout(400)
def test_a_nested_model_splits_by_stage_modules_and_passes_verify(pp2):
    nested = pp2[1]["nested"]
    assert "error" not in nested, nested.get("traceback")
    assert nested["summary"]["verify"]["passed"]
    assert nested["summary"]["stages"]["1"] == ["layers.2", "layers.3", "norm", "head"]


@pytest.mark.timeout(400)
def test_verify_fails_a_forward_that_adds_residuals_its_listed_units_do_not(pp2):
    error = pp2[1]["nested-residual"]["error"]
    assert error.startswith("VerifyError")
    # The float64 rerun ran, and tells a defect: 0.0328 off float64 where the reference's rounding is 3e-9.
    assert "embed.weight: max abs diff " in error and "the unsplit model's own fp32 rounding: " in error
    assert error.rstrip().endswith("float64 rerun: no difference was within rounding")


@pytest.mark.timeout(120)
def test_a_trained_model_exports_to_hugging_face_format_and_loads_with_from_pretrained(pp2, tmp_path):
    from transformers import AutoModelForCausalLM

    from runner._torch.dcp import read_model_tensors
    from runner.export import export

    out, results = pp2
    run = out / "gpt2-save"
    exported = export(run, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight is model.transformer.wte.weight  # stored once, tied again on load
    # The checkpoint's own tensors (what the pipeline trained) give the same logits.
    tensors = read_model_tensors(run / "checkpoints" / "step-6")
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


@pytest.fixture(scope="module")
def layouts_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def layouts(models, pp2, layouts_dir) -> dict[str, dict]:
    """The 4-rank spawn: ``LAYOUT_CASES``, and resumes of the pp=2 run's step-3 under two layouts.
    GPT-2 under FSDP with ZBV (its tied ends as copies on one rank) saves its last step, to export."""
    saved = pp2[0] / "gpt2-save" / "checkpoints" / "step-3"
    cases = {}
    for model in MODELS:
        for s in PP4_SCHEDULES[model]:
            cases[f"{model}-pp4-{s}"] = resolved(*_base(models[model]), *PP4, f"schedule={s}")
        for s in ("1f1b", "zbv"):
            save = ["checkpoint.every=5"] if (model, s) == ("gpt2", "zbv") else []
            cases[f"{model}-fsdp-{s}"] = resolved(*_base(models[model]), *FSDP, f"schedule={s}", *save)
    assert list(cases) == LAYOUT_CASES
    resume = [*_base(models["gpt2"]), "train.steps=6", f"checkpoint.resume={saved}"]
    cases["resume-pp4-interleaved"] = resolved(*resume, *PP4[:1], *PP2[1:], "schedule=interleaved_1f1b")
    cases["resume-fsdp-zbv"] = resolved(*resume, *FSDP, "schedule=zbv")
    return run_cases(layouts_dir, 4, cases)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_pp4_and_fsdp_layouts_match_transformers_own_training(layouts, references, case):
    model, layout = case.split("-")[:2]
    assert_matches(layouts[case], references(model, PP4 if layout == "pp4" else PP2), case)


@pytest.mark.timeout(480)
def test_an_fsdp_trained_tied_model_exports_what_transformers_own_training_reaches(layouts, layouts_dir, references,
                                                                                  tmp_path):
    # pp=2 x dp=2 FSDP, ZBV: GPT-2's tied embedding and head are copies on one rank, each sharded.
    from transformers import AutoModelForCausalLM

    from runner.export import export

    assert "error" not in layouts["gpt2-fsdp-zbv"], layouts["gpt2-fsdp-zbv"].get("traceback")
    exported = export(layouts_dir / "gpt2-fsdp-zbv", tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=False, local_files_only=True)
    assert model.lm_head.weight is model.transformer.wte.weight and model.dtype == torch.float32
    reference = AutoModelForCausalLM.from_config(model.config)  # transformers' own 5 steps, the same batches
    reference.load_state_dict(references("gpt2", PP2)["state"])
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # 1e-7 seen: rounding; a step's update is 1e-3


@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", RESUMES)
def test_a_checkpoint_resumes_across_layouts(layouts, pp2, case):
    full = pp2[1]["gpt2-save"]["losses"]
    got = layouts[case]
    assert "error" not in got, got.get("traceback")
    assert got["summary"]["first_step"] == 4  # step 4 first: after checkpoint step-3
    assert got["losses"] == pytest.approx(full[3:], rel=1e-4, abs=0), case


@pytest.mark.timeout(200)
def test_the_command_line_trains_a_pretrained_model_on_a_local_dataset_and_exports_it(tmp_path):
    """What the README's "Hugging Face models" section tells a user to type, without code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = write_model(tmp_path / "model", "llama", weights=True)
    write_tokenizer(model_dir)  # a model directory with its tokenizer, as on the Hub
    words = "the pipeline stage runs every microbatch forward and backward while another rank waits".split()
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps({"text": " ".join(words[i % 5:] + words[:i % 5])})
                                                     for i in range(200)))
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = tmp_path / "run"
    done = run_cli("model=hf", f"model.path={model_dir}", "data=hf", f"data.path={tmp_path / 'corpus.jsonl'}",
                   f"data.tokenizer={model_dir}", "train.seq_len=16", "train.batch_size=8", "train.steps=4",
                   "eval.every=2", "checkpoint.every=4", "verify=true", "profile.enabled=false",
                   f"hydra.run.dir={run}", cwd=tmp_path, env=env, timeout=150, check=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verify"]["passed"] and summary["val_loss"] > 0
    assert summary["stages"]["0"][0] == "model.embed_tokens" and summary["stages"]["1"][-1] == "lm_head"
    # Each rank read its own stages' weights: together the file once (the untied head is its own).
    size = sum(AutoModelForCausalLM.from_pretrained(model_dir).state_dict()[k].numel() * 4
               for k in AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    read = summary["weights_read_bytes"]
    assert len(read) == 2 and sum(read) == size and min(read) > 0.2 * size
    assert list((tmp_path / "cache" / "runner" / "tokens").glob("*.uint16"))  # tokenized once, cached
    exported = run_cli(str(run), str(tmp_path / "out"), module="runner.export", cwd=tmp_path, env=env, timeout=60,
                       check=True)
    for output in (done.stdout + done.stderr, exported.stdout + exported.stderr):  # quiet: no library's bars
        for noise in ("Generating train split", "examples/s]", "it/s]", "Writing model shards", "UserWarning"):
            assert noise not in output, (noise, output)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == 19
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    before = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(model.lm_head.weight, before.lm_head.weight)  # trained
