"""Sequence and loss parallelism inside each stage's tensor-parallel group: pp=2 x tp=2 (and the
unsplit pp=1 step at tp=4) computes what the unsplit model computes, losses and every gradient,
for the built-in transformer and tiny Hugging Face Llama and Qwen3 models.

One 4-rank spawn (a module-scoped fixture) runs the CI cases, a representative set of schedules
(one per stage placement: 1F1B, interleaved zero bubble with split backward, ZBV's V with split
backward); the full matrix (every schedule x sp, lp, both x both model kinds) is the ``slow`` tier's
own spawn. The references are computed once each, in this process. The checks before launch and
the layout sequence parallelism derives from a model's plan are in-process tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.errors import ConfigError
from runner.models.split import build_meta_model
from runner.parallel.tp import TPPlan, _torch_styles, check_tp, model_plan
from runner.validate import check_config

from helpers.config import EXAMPLES, TINY, compose, resolved
from helpers.hf import hf_training, write_model
from helpers.messages import stage_shapes
from helpers.parity import CLIP, SCHEDULES, assert_matches, reference
from helpers.ranks import run_cases

BATCH = ["parallel.microbatches=4", "train.batch_size=8"]
PP2TP2 = ["parallel.pp=2", "parallel.tp=2", *BATCH]
OPTIONS = {"sp": ["parallel.sequence_parallel=true"], "lp": ["parallel.loss_parallel=true"],
           "splp": ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]}
EVAL = ["eval.every=5"]  # forward-only evaluation after the last step: schedule.eval inside loss_parallel
# CI: each option on each placement at least once, for both model kinds; (model, option, schedule).
CI = [("transformer", "sp", "1f1b"), ("transformer", "lp", "interleaved_zb"), ("transformer", "splp", "zbv"),
      ("llama", "splp", "1f1b"), ("llama", "sp", "zbv"), ("qwen3", "sp", "zbv")]
# Schedule files with F/I/W actions (a loop placement and a V), run by torch's CSV runtime.
CSV = {f"csv-{name}": ["schedule=csv", f"schedule.csv={EXAMPLES / f'{name}_pp2_m4.csv'}"]
       for name in ("zero_bubble", "zbv")}
SLOW = [(m, o, s) for m in ("transformer", "llama") for o in OPTIONS for s in (*SCHEDULES, *CSV)]
HF = ("llama", "qwen3")
# The built-in transformer's spawned cases (and their reference) with 2 blocks, not TINY's 6: held
# here is each option on each placement, not depth; 5 units still put a tp-sharded module in every
# stage (test_tp.py's test_tp_stages_keep_a_sharded_module), and the messages asserted below are the same.
SHALLOW = ["model.n_layers=2"]


def _name(model: str, option: str, schedule: str) -> str:
    return f"{model}-{option}-{schedule}"


def _hf_base(path: Path) -> list[str]:
    return ["device=cpu", "model=hf", f"model.path={path}", "model.pretrained=true", "data.vocab_size=64",
            "train.seq_len=16", "train.steps=5", "profile.enabled=false", *CLIP]


def _case(models: dict[str, Path], model: str, option: str, schedule: str) -> dict:
    chosen = CSV.get(schedule, [f"schedule={schedule}"])
    if model == "transformer":
        return resolved(*TINY, *SHALLOW, *CLIP, *PP2TP2, *EVAL, *OPTIONS[option], *chosen)
    return resolved(*_hf_base(models[model]), *PP2TP2, *OPTIONS[option], *chosen)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-sp-models")
    return {family: write_model(root / family, family, weights=True) for family in HF}


@pytest.fixture(scope="module")
def references(models, tmp_path_factory):
    """``references(model)``: the unsplit pp=1 run of the built-in transformer (the runner's loop,
    with its evaluation), or transformers' own training of a Hugging Face model; once each."""
    found: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in found:
            if model == "transformer":
                tmp = tmp_path_factory.mktemp("tp-sp-reference")
                found[model] = {**reference(tmp, *SHALLOW, *BATCH, *EVAL), "run_dir": tmp / "reference"}
            else:
                found[model] = hf_training(compose(*_hf_base(models[model]), *BATCH), steps=5)
        return found[model]

    return get


def _spawn(out: Path, models: dict[str, Path], matrix: list[tuple[str, str, str]], extra: dict[str, dict]):
    cases = {_name(*key): _case(models, *key) for key in matrix}
    return run_cases(out, 4, {**cases, **extra}, stage_shapes)


@pytest.fixture(scope="module")
def ci(models, tmp_path_factory) -> tuple[Path, dict]:
    """The 4-rank spawn of the CI cases, and the unsplit step (pp=1) at tp=4 with both options."""
    out = tmp_path_factory.mktemp("tp-sp") / "ranks"
    pp1 = {"transformer-splp-pp1-tp4": resolved(*TINY, *SHALLOW, *CLIP, *BATCH, *EVAL, "parallel.pp=1", "parallel.tp=4",
                                                *OPTIONS["splp"])}
    return out, _spawn(out, models, CI, pp1)


def _val_loss(run_dir: Path) -> float:
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return float(last["val_loss"])


def _assert_case(out: Path, results: dict, references, model: str, case: str) -> None:
    ref = references(model)
    assert_matches(results[case], ref, case)
    if model == "transformer":  # the evaluation after the last step, forward only
        assert _val_loss(out / case) == pytest.approx(_val_loss(ref["run_dir"]), rel=1e-5), case


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model,option,schedule", CI, ids=[_name(*c) for c in CI])
def test_sequence_and_loss_parallel_stages_match_the_unsplit_model(ci, references, model, option, schedule):
    _assert_case(*ci, references, model, _name(model, option, schedule))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_unsplit_step_at_tp4_with_both_options_matches_the_unsplit_model(ci, references):
    _assert_case(*ci, references, "transformer", "transformer-splp-pp1-tp4")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_stages_send_slices_of_the_sequence_and_the_loss_takes_vocabulary_shards(ci):
    # Rank 0 (tp rank 0 of the first pipeline rank): its stages' first forward, microbatches of 2 x 16 tokens.
    shapes = {case: record["summary"]["stage_shapes"] for case, record in ci[1].items()}
    half = {"input": [2, 16], "output": "Tensor", "output_local": [2, 8, 32]}  # sequence parallel: 8 of 16 tokens
    assert shapes["transformer-sp-1f1b"] == {"embed": half}
    assert shapes["llama-splp-1f1b"] == {"model.embed_tokens": half}
    # Without sequence parallelism the message is whole; with loss parallelism (ZBV: the last
    # stage on rank 0 too) the logits leave the head as a DTensor, half of the 48 tokens each.
    assert shapes["transformer-lp-interleaved_zb"]["embed"]["output_local"] == [2, 16, 32]
    (last,) = set(shapes["transformer-splp-zbv"]) - {"embed"}
    assert shapes["transformer-splp-zbv"][last] == {"input": [2, 8, 32], "output": "DTensor",
                                                    "output_local": [2, 16, 24]}
    assert shapes["llama-sp-zbv"]["model.embed_tokens"] == half
    assert shapes["llama-sp-zbv"]["model.layers.5"]["output"] == "Tensor"  # logits gathered: lm_head's stage
    assert shapes["transformer-splp-pp1-tp4"] == {"embed": {"input": [2, 16], "output": "DTensor",
                                                            "output_local": [2, 16, 12]}}


@pytest.fixture(scope="module")
def full(models, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tp-sp-full") / "ranks"
    return out, _spawn(out, models, SLOW, {})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model,option,schedule", SLOW, ids=[_name(*c) for c in SLOW])
def test_every_schedule_with_each_option_matches_the_unsplit_model(full, references, model, option, schedule):
    _assert_case(*full, references, model, _name(model, option, schedule))


# -- in-process: the layout sequence parallelism derives, the context of a sequence shard, checks ------


def _meta(*overrides: str):
    cfg = compose(*TINY, *overrides)
    return cfg, build_meta_model(cfg.model)


def _hf_meta(directory: Path, family: str):
    path = write_model(directory / family, family, weights=False)
    return build_meta_model(compose("model=hf", f"model.path={path}", "model.pretrained=false").model)


def _styles(meta) -> dict[str, str]:
    """Each styled module's torch style under both options, with the layouts a style sets."""
    styles = _torch_styles(meta.module, meta.spec, TPPlan(model_plan(meta.module), True, True))
    out = {}
    for name, style in styles.items():
        layouts = {k: str(getattr(style, k)) for k in ("input_layouts", "output_layouts", "desired_output_layouts")
                   if hasattr(style, k)}
        out[name] = type(style).__name__ + (str(layouts) if layouts else "")
    return out


def test_sequence_parallelism_is_derived_from_the_built_in_transformers_plan():
    _, meta = _meta()
    styles = _styles(meta)
    assert styles["block0.attn_norm"] == styles["block0.ffn_norm"] == styles["norm"] == "SequenceParallel"
    assert styles["block0.attn"] == styles["block0.ffn"] == "_GatherSequence"  # the colwise layers' parents
    assert styles["block0.attn.qkv"] == styles["block0.ffn.up"] == ("ColwiseParallel{'input_layouts': "
                                                                   "'(Replicate(),)', 'output_layouts': "
                                                                   "'(Shard(dim=-1),)'}")  # plain tp's
    assert styles["block0.attn.proj"] == "RowwiseParallel{'input_layouts': '(Shard(dim=-1),)', " \
                                         "'output_layouts': '(Shard(dim=1),)'}"
    # The embedding unit adds the position table to the tokens' sum: the unit's output is scattered.
    assert styles["embed"] == ("PrepareModuleOutput{'output_layouts': '(Replicate(),)', "
                               "'desired_output_layouts': '(Shard(dim=1),)'}")
    assert styles["embed.tok"].startswith("RowwiseParallel{'input_layouts': '(Replicate(),)', 'output_layouts': "
                                          "'(Replicate(),)'")
    # The head gathers the sequence and (loss parallel) leaves the logits sharded on the vocabulary.
    assert styles["head"] == "ColwiseParallel{'input_layouts': '(Shard(dim=1),)', 'output_layouts': " \
                             "'(Shard(dim=-1),)'}"
    assert "embed.pos" not in styles and "block0" not in styles


def test_sequence_parallelism_is_derived_from_transformers_plan_and_leaves_qwen3s_head_norms(tmp_path):
    meta = _hf_meta(tmp_path, "qwen3")
    styles = _styles(meta)
    layer = "model.layers.0"
    assert styles[f"{layer}.input_layernorm"] == styles[f"{layer}.post_attention_layernorm"] == "SequenceParallel"
    assert styles["model.norm"] == "SequenceParallel"
    assert styles[f"{layer}.self_attn"] == styles[f"{layer}.mlp"] == "_GatherSequence"
    # q_norm/k_norm act on each shard's heads inside attention: replicated, their gradient summed.
    assert f"{layer}.self_attn.q_norm" not in styles and f"{layer}.self_attn.k_norm" not in styles
    assert styles["model.embed_tokens"] == ("RowwiseParallel{'input_layouts': '(Replicate(),)', "
                                            "'output_layouts': '(Shard(dim=1),)'}")  # reduce-scattered
    assert styles["lm_head"] == "ColwiseParallel{'input_layouts': '(Shard(dim=1),)', 'output_layouts': " \
                                "'(Shard(dim=-1),)'}"


def test_a_sequence_shards_context_has_the_whole_sequences_positions_and_masks(tmp_path):
    meta = _hf_meta(tmp_path, "llama")
    spec, rotary = meta.spec, meta.module.model.rotary_emb.to_empty(device="cpu")
    rotary.inv_freq = rotary.original_inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    stage = nn.Module()
    stage.model = nn.Module()
    stage.model.rotary_emb = rotary
    whole = torch.randn(2, 16, 32)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, :3] = 0
    ref = spec._context(stage, whole, {"attention_mask": padding})
    shard = spec._context(stage, whole[:, 8:], {"attention_mask": padding}, seq_shards=2)
    assert shard.position_ids.tolist() == ref.position_ids.tolist() == [list(range(16))]
    for got, want in zip(shard.position_embeddings, ref.position_embeddings):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    mask, ref_mask = spec._mask(shard, "full_attention"), spec._mask(ref, "full_attention")
    assert mask.shape == ref_mask.shape == (2, 1, 16, 16) and torch.equal(mask, ref_mask)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=15"],
     "parallel.sequence_parallel=true shards the sequence over parallel.tp=2, but train.seq_len=15 does not divide. "
     "Fix: train.seq_len a multiple of 2."),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true shards over the tensor-parallel group, "
     "but parallel.tp=1. Fix: parallel.tp=2 or more, or parallel.sequence_parallel=false."),
    (["parallel.loss_parallel=true"], "parallel.loss_parallel=true shards over the tensor-parallel group, but "
     "parallel.tp=1. Fix: parallel.tp=2 or more, or parallel.loss_parallel=false."),
    (["parallel.tp=2", "parallel.loss_parallel=true", "+loss.label_smoothing=0.1"],
     "parallel.loss_parallel=true computes torch's vocabulary-parallel cross-entropy, not "
     "loss._target_=runner.losses.cross_entropy with label_smoothing=0.1. Fix: parallel.loss_parallel=false"),
    (["parallel.tp=2", "parallel.loss_parallel=true", "loss._target_=helpers.models.z_loss_cross_entropy"],
     "not loss._target_=helpers.models.z_loss_cross_entropy with label_smoothing=0.0. Fix: "),
])
def test_sequence_and_loss_parallelism_are_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError) as info:  # by the checks the command line runs before importing torch
        check_config(compose(*TINY, "parallel.pp=2", *overrides))
    assert message in str(info.value)


def _check(meta, *options: str) -> None:
    cfg = compose(*TINY, "parallel.tp=2", *(f"parallel.{o}=true" for o in options))
    check_tp(meta, cfg.parallel)


def test_a_plan_that_leaves_a_weight_on_the_sharded_sequence_is_refused_with_sequence_parallelism():
    _, meta = _meta()
    del meta.module.tp_plan["block*.attn.qkv"]  # attention no longer gathers its input: qkv would see a slice
    _check(meta)  # plain tp: the layers are whole (qkv replicated)
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true with parallel.tp=2: "
                                          r"block0.attn.qkv.weight, block0.attn.qkv.bias, block1.attn.qkv.weight ... "
                                          r"would see only this rank's slice of the sequence.*"
                                          r"Fix: parallel.sequence_parallel=false"):
        _check(meta, "sequence_parallel")


@pytest.mark.parametrize("option", ["sequence_parallel", "loss_parallel"])
def test_a_plan_without_a_gathering_head_is_refused_with_either_option(option):
    _, meta = _meta()
    del meta.module.tp_plan["head"]
    _check(meta)
    with pytest.raises(ConfigError, match=rf"parallel.{option}=true with parallel.tp=2: the model's last unit "
                                          r"\(head\) is not one module its tp_plan shards as colwise_gather_output"):
        _check(meta, option)
