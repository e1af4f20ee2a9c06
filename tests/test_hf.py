"""Hugging Face causal LMs and nested models: split by module name, stage by stage computing what
the model's own forward computes, from pretrained or freshly initialised weights.

In-process checks here; the multi-process training parity (every schedule, FSDP, resume across
layouts, export) is in test_hf_training.py."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.errors import ConfigError
from runner.models.split import MetaModel, build_meta_model, materialize, plan_split
from runner.models.units import SequentialSpec, tied_groups
from runner.optim import param_groups
from runner.verify.compare import ROUNDING_FACTOR, compare
from runner.verify.hook import reference_model

from helpers.config import compose
from helpers.hf import family_configs, write_model

CPU = torch.device("cpu")


def _hf_cfg(path, **extra):
    return OmegaConf.create({"_target_": "runner.models.hf.causal_lm", "path": str(path), "pretrained": True,
                             "allow_unlisted": False, "config_overrides": {}, "attn_implementation": None, **extra})


def _stages(cfg, num_stages):
    meta = build_meta_model(cfg)
    split = plan_split(meta, num_stages)
    # Each stage from a model built on its own, as on its own rank.
    return split, [materialize(build_meta_model(cfg), units, seed=0, device=CPU) for units in split]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_every_listed_family_computes_what_transformers_computes(tmp_path, family):
    from transformers import AutoModelForCausalLM

    path = write_model(tmp_path / family, family, weights=True)
    split, stages = _stages(_hf_cfg(path), 3)
    ref = AutoModelForCausalLM.from_pretrained(path).train()
    ids = torch.randint(64, (2, 12))
    mask = torch.arange(12) >= torch.tensor([[4], [0]])  # left padding: the masks must carry it
    for kwargs in ({}, {"attention_mask": mask}):
        x = ids
        for stage in stages:
            x = stage(x, **kwargs)
        want = ref(input_ids=ids, use_cache=False, **kwargs).logits
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)
        # Gradients too: every parameter, through the stage boundaries.
        x.float().logsumexp(-1).mean().backward()
        want.float().logsumexp(-1).mean().backward()
        got = {n: p.grad for s in stages for n, p in s.named_parameters()}
        for first, *copies in tied_groups(ref):  # a tied head's copy on the last stage: summed, as training does
            got[first] = got[first] + sum(got[c] for c in copies)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for module in (*stages, ref):
            module.zero_grad()
    assert split[0][0].endswith(("embed_tokens", "wte")) and split[-1][-1] == "lm_head"
    assert any(".layers." in u or ".h." in u for u in split[1])  # split inside the layer container


def test_each_rank_reads_only_its_own_stages_weights(tmp_path):
    path = write_model(tmp_path / "llama", "llama", weights=True)
    split, stages = _stages(_hf_cfg(path), 2)
    for stage in stages:
        own = sum(p.numel() * p.element_size() for p in stage.parameters())
        assert stage.spec.bytes_read == own  # nothing but the stage's tensors
    total = sum(s.spec.bytes_read for s in stages)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert total == sum(f.get_tensor(k).numel() * 4 for k in f.keys())


def test_random_init_follows_transformers_init_children_before_parents(tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=64, n_embd=256, n_layer=8, n_head=4, n_positions=64).save_pretrained(tmp_path / "g")
    cfg = _hf_cfg(tmp_path / "g", pretrained=False)
    split, stages = _stages(cfg, 2)
    first, last = stages
    # GPT-2 scales its residual projections by 1/sqrt(2 x layers) after the generic init: the
    # parent's init must run after its children's.
    std = first.get_parameter("transformer.h.0.attn.c_proj.weight").std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert first.get_parameter("transformer.h.0.attn.c_attn.weight").std().item() == pytest.approx(0.02, rel=0.05)
    # The tied head on the last stage holds the embedding's values; layouts agree with the unsplit model.
    whole = materialize(build_meta_model(cfg), build_meta_model(cfg).unit_names, seed=0, device=CPU)
    assert whole.get_parameter("lm_head.weight") is whole.get_parameter("transformer.wte.weight")
    assert torch.equal(last.get_parameter("lm_head.weight"), first.get_parameter("transformer.wte.weight"))
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, whole.get_parameter(name)), name


def test_an_unlisted_family_is_refused_or_run_with_opt_in_where_verify_decides(tmp_path):
    from transformers import Gemma2Config

    # Weights large enough for the logits to reach Gemma2's soft cap (30).
    Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=3,
                 initializer_range=1.0).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(ConfigError, match="'gemma2' model, which is not in the tested list.*llama.*allow_unlisted"):
        build_meta_model(_hf_cfg(tmp_path / "gemma2", pretrained=False))
    cfg = compose("model=hf", f"model.path={tmp_path / 'gemma2'}", "model.allow_unlisted=true", "parallel.pp=1",
                  "model.pretrained=false",
                  "data.vocab_size=64", "train.seq_len=8")
    meta = build_meta_model(cfg.model)
    assert meta.unit_names[:2] == ["model.embed_tokens", "model.layers.0"]
    # Gemma2 scales its embeddings and soft-caps its logits: the Llama-like reading computes
    # something else, and the comparison with the model's own forward says so.
    units = materialize(meta, meta.unit_names, seed=0, device=CPU)
    model, forward = reference_model(cfg)
    ids = torch.randint(64, (2, 8))
    ours, theirs = units(ids), forward(ids)
    report = compare({"logits": ours.detach()}, {"logits": theirs.detach()}, 0.0, 0.0)
    assert not report["passed"] and report["max_abs_diff"] > 1.0


def test_a_nested_model_splits_by_stage_modules_and_is_checked_against_its_own_forward():
    cfg = OmegaConf.create({"_target_": "helpers.models.nested", "vocab_size": 48, "residual": True})
    with pytest.raises(ConfigError, match="not an nn.Sequential.*parallel.stage_modules="):
        build_meta_model(cfg)
    listed = [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "head"]]
    meta = build_meta_model(cfg, listed)
    assert plan_split(meta, 2, stage_modules=listed) == (("embed", "layers.0", "layers.1"),
                                                        ("layers.2", "layers.3", "norm", "head"))
    assert plan_split(meta, 2, stage_modules=[["embed", "layers"], ["norm", "head"]])[0][-1] == "layers.3"
    # Full names in every stage, and the stages chained are the listed units in order.
    stages = [materialize(build_meta_model(cfg, listed), s, seed=0, device=CPU) for s in listed]
    assert "layers.2.1.weight" in dict(stages[1].named_parameters())
    # The model's own forward adds residuals the units do not: verify's reference tells them apart.
    full = OmegaConf.create({"model": cfg, "parallel": {"stage_modules": listed}, "train": {"seed": 0,
                                                                                             "precision": "fp32"}})
    model, forward = reference_model(full)
    ids = torch.randint(48, (2, 5))
    chained = stages[1](stages[0](ids))
    assert not torch.allclose(chained, forward(ids))
    for bad, message in [([["embed", "layers.0"], ["layers.1", "layers.2", "layers.3", "head"]], "leaves .*norm"),
                         ([["layers.0", "embed"], ["layers.1", "layers.2", "layers.3", "norm", "head"]], "out of model "
                                                                                                           "order"),
                         ([["embed", "layers"], ["layers.3", "norm", "head"]], "more than once"),
                         ([["embed", "nope"], ["norm", "head"]], "'nope', which is not a module")]:
        with pytest.raises(ConfigError, match=message):
            build_meta_model(cfg, bad)


def test_a_nested_sequential_is_split_inside_its_container():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))),
                              nn.Linear(4, 10))
    meta = MetaModel(model, SequentialSpec(model), [])
    assert meta.unit_names == ["0", "1.0", "1.1", "1.2", "2"]
    assert plan_split(meta, 2, ["1.1"]) == (("0", "1.0"), ("1.1", "1.2", "2"))
    assert plan_split(meta, 2, stage_modules=[["0", "1"], ["2"]]) == (("0", "1.0", "1.1", "1.2"), ("2",))


def test_weight_decay_spares_every_1d_parameter_and_embeddings_by_shape_and_role(tmp_path):
    cfg = _hf_cfg(write_model(tmp_path / "llama", "llama", weights=False), pretrained=False)
    meta = build_meta_model(cfg)
    module = materialize(meta, meta.unit_names, seed=0, device=CPU)
    decayed, exempt = ({n for n, p in module.named_parameters() if id(p) in {id(q) for q in g["params"]}}
                       for g in param_groups([module], 0.1, ["bias", "norm", "embedding"]))
    # transformers' LlamaRMSNorm is no torch norm class: its weights are 1-D gains all the same.
    assert "model.norm.weight" in exempt and "model.layers.0.input_layernorm.weight" in exempt
    assert "model.embed_tokens.weight" in exempt
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert all(p.dim() == 1 for n, p in module.named_parameters() if n in exempt and "embed" not in n)


def test_family_configs_cover_the_tested_list():
    from runner.models.hf import FAMILIES

    assert set(family_configs()) == set(FAMILIES)


def test_the_float64_rerun_tells_a_padded_qwen2s_rounding_from_one_microbatch_scaled_by_1_001(tmp_path):
    """The false alarm's computation in-process (test_tp_weights runs it at pp=2 x tp=2): a zero
    pad embedding amplified by RMSNorm gives the value biases gradients of ~4000 from larger terms."""
    from runner.data.datasets import build_dataset, get_batch
    from runner.losses import counted_targets, cross_entropy
    from runner.pipeline.step import UnsplitStep
    from runner.verify.exact import _Float64, float64_step
    from runner.verify.hook import collect_grads

    with _Float64():  # the model's own casts (RMSNorm's, the loss's) stay float64
        assert {torch.ones(2).float().dtype, torch.zeros(2, dtype=torch.float32).dtype,
                torch.ones(2).to(torch.bfloat16).dtype} == {torch.float64}
    path = write_model(tmp_path / "qwen2", "qwen2", weights=True, seed=1)
    cfg = compose("model=hf", f"model.path={path}", "model.pretrained=true", "data.vocab_size=64", "train.seq_len=16",
                  "data.padding=true", "parallel.microbatches=4", "train.batch_size=8")
    model, forward = reference_model(cfg)
    inputs, targets, kwargs = batch = get_batch(build_dataset(cfg.data, seed=0), 1, 8, 16)

    def step(microbatches: int, scaled: int = -1) -> tuple[float, dict]:
        calls = []

        def loss_fn(logits, y):  # microbatch ``scaled``'s loss x 1.001: a defect 1e-3 of one of them
            calls.append(len(calls))
            return cross_entropy(logits, y) * (1.001 if calls[-1] == scaled else 1.0)

        model.zero_grad(set_to_none=True)
        loss = UnsplitStep(model, microbatches, loss_fn, forward=forward)(inputs, targets,
                                                                          counted=counted_targets(targets), **kwargs)
        return loss.item(), collect_grads([model])

    loss, ref = step(4)
    exact = float64_step(model, cfg, batch, 4)
    bias = "model.layers.0.self_attn.v_proj.bias"
    assert not isinstance(exact, str) and exact.grads[bias].dtype == torch.float64
    noise = (ref[bias].double() - exact.grads[bias]).abs().max().item()
    assert ref[bias].abs().max() > 1000 and 0 < noise < 1e-5 * ref[bias].abs().max()  # rounding, and large
    assert exact.loss == pytest.approx(loss, rel=1e-6)
    assert all(torch.equal(g, ref[n]) for n, g in collect_grads([model]).items())  # the reference's own, untouched
    other_loss, other = step(8)  # the same sums in another order: rounding
    assert compare(other, ref, other_loss, loss, exact=lambda: exact)["passed"]
    # One element of the amplified gradient off by 20 x its noise: a defect there, caught.
    perturbed = {**other, bias: other[bias].clone()}
    perturbed[bias][0] += 20 * noise
    report = compare(perturbed, ref, other_loss, loss, exact=lambda: exact)
    assert not report["passed"] and list(report["rounding"]["beyond"]) == [bias]
    # One microbatch's loss scaled by 1.001: the loss and the embedding fail, far beyond their rounding.
    scaled_loss, scaled = step(4, scaled=1)
    report = compare(scaled, ref, scaled_loss, loss, exact=lambda: exact)
    beyond = report["rounding"]["beyond"]
    assert not report["passed"] and {"(loss)", "model.embed_tokens.weight"} <= set(beyond), report["problems"]
    assert all(b["run_off"] > 10 * ROUNDING_FACTOR * b["unsplit_off"] for b in beyond.values()), beyond
