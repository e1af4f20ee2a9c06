"""``model=hf`` weights: trained in fp32 whatever dtype the directory stores, checked against the
model config.json describes before any rank starts, and never a directory's own code run.

In-process (the checks are the launcher's, and a pp=1 run trains here); one multiprocess test
feeds ``y`` to the command line's stdin."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.errors import ConfigError, VerifyError
from runner.models.hf import resolve_verify
from runner.models.split import build_meta_model, materialize
from runner.ranks.dist import DistEnv
from runner.train import Trainer
from runner.validate import validate

from helpers.cli import run_cli
from helpers.config import compose
from helpers.hf import write_model, write_tokenizer

CPU = torch.device("cpu")
BASE = ["device=cpu", "model=hf", "data.vocab_size=64", "train.seq_len=16", "train.batch_size=8",
        "parallel.pp=1", "parallel.microbatches=2", "profile.enabled=false"]


def _cfg(path, *extra):
    return compose(*BASE, f"model.path={path}", *extra)


# -- fp32 weights from a bf16 checkpoint -----------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A bf16-stored Llama (bf16 safetensors, config.json dtype bfloat16) trained 5 steps at lr
    1e-5, here, with a checkpoint at the end."""
    root = tmp_path_factory.mktemp("bf16")
    path = write_model(root / "model", "llama", weights=True, dtype=torch.bfloat16)
    cfg = _cfg(path, "train.lr=1e-5", "train.warmup_steps=0", "train.steps=5", "checkpoint.every=5")
    (root / "run").mkdir()
    trainer = Trainer(validate(cfg, root / "run"), cfg, DistEnv(0, 1, CPU))
    trainer.run()
    return path, root / "run", trainer


def test_a_bf16_checkpoint_trains_fp32_weights_and_moments_and_nearly_all_move(bf16_run):
    path, _, trainer = bf16_run
    stored = load_file(path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    params = dict(trainer.modules[0].named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * len(params) and {m.dtype for m in moments} == {torch.float32}
    moved = sum(int((params[k].detach() != v.float()).sum()) for k, v in stored.items())
    total = sum(v.numel() for v in stored.values())
    # bf16 weights updated in bf16 at this lr barely move (an update below half a bf16 step is lost).
    assert moved / total > 0.95, moved / total


def test_the_checkpoint_records_the_source_dtype_not_the_fp32_trained_in(bf16_run):
    _, run, _ = bf16_run
    config = json.loads((run / "checkpoints" / "step-5" / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_a_config_dtype_that_disagrees_with_the_stored_tensors_is_logged(tmp_path, caplog):
    path = write_model(tmp_path / "m", "llama", weights=True)  # float32 tensors
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    with caplog.at_level(logging.WARNING, logger="runner.hf"):
        meta = build_meta_model(_cfg(path).model)
    assert "names dtype bfloat16 but the weights are stored in float32" in caplog.text
    assert meta.spec.source_dtype == torch.bfloat16 and next(meta.module.parameters()).dtype == torch.float32


def test_without_a_dtype_in_config_json_the_stored_dtype_is_recorded(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=True, dtype=torch.bfloat16)
    config = json.loads((path / "config.json").read_text())
    del config["dtype"]
    (path / "config.json").write_text(json.dumps(config))
    meta = build_meta_model(_cfg(path).model)
    assert meta.spec.source_dtype == torch.bfloat16
    meta.spec.save_metadata(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_sharded_bf16_checkpoint_is_read_per_stage_into_fp32_exactly(tmp_path):
    """As real checkpoints come: bf16, several files and an index; each stage reads its own tensors
    (not every file's), each equal to transformers' own load cast to fp32."""
    from transformers import AutoModelForCausalLM

    path = write_model(tmp_path / "m", "llama", weights=True, dtype=torch.bfloat16, max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    meta = build_meta_model(_cfg(path).model)
    names = meta.unit_names
    first = materialize(meta, names[:2], seed=0, device=CPU)
    read_by_first = meta.spec.bytes_read
    last = materialize(meta, names[2:], seed=0, device=CPU)
    read = {}
    for stage in (first, last):
        for name, param in stage.named_parameters():
            assert param.dtype == torch.float32 and torch.equal(param, reference[name]), name
            read[name] = param
    assert set(read) == {n for n, _ in AutoModelForCausalLM.from_pretrained(path).named_parameters()}
    on_disk = sum(t.numel() * t.element_size() for f in path.glob("*.safetensors") for t in load_file(f).values())
    assert 0 < read_by_first < on_disk / 2  # the embedding and one layer, not the files' whole
    assert meta.spec.bytes_read == on_disk  # both stages together: every tensor once, in its stored bf16


def test_a_tied_embedding_on_one_rank_is_read_and_counted_once(tmp_path):
    path = write_model(tmp_path / "gpt2", "gpt2", weights=True)
    meta = build_meta_model(_cfg(path).model)
    whole = materialize(meta, meta.unit_names, seed=0, device=CPU)
    assert whole.get_parameter("lm_head.weight") is whole.get_parameter("transformer.wte.weight")
    on_disk = sum(t.numel() * t.element_size() for t in load_file(path / "model.safetensors").values()
                  if t.is_floating_point())
    assert meta.spec.bytes_read == on_disk


# -- no code from a directory runs -----------------------------------------------------------------

def _remote_code_dir(directory, marker, *, tokenizer: bool = False):
    """A directory whose auto_map points at a module that writes ``marker`` when imported."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    if tokenizer:
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    else:
        (directory / "config.json").write_text(json.dumps(
            {"model_type": "evil", "architectures": ["EvilModel"],
             "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    return directory


def test_an_auto_map_in_a_model_or_tokenizer_directory_is_refused_naming_file_and_entry(tmp_path):
    from runner.data.tokens import load_tokenizer

    marker = tmp_path / "marker"
    model = _remote_code_dir(tmp_path / "model", marker)
    with pytest.raises(ConfigError, match=r"model.path: .*config.json has an auto_map \(.*evil.EvilModel"):
        build_meta_model(_cfg(model).model)
    tok = _remote_code_dir(write_tokenizer(tmp_path / "tok"), marker, tokenizer=True)
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*tokenizer_config.json has an auto_map.*EvilTokenizer"):
        load_tokenizer(str(tok))
    # A listed model whose directory carries a tokenizer with code: refused as the model too.
    listed = _remote_code_dir(write_model(tmp_path / "llama", "llama", weights=True), marker, tokenizer=True)
    with pytest.raises(ConfigError, match="tokenizer_config.json has an auto_map"):
        build_meta_model(_cfg(listed).model)
    assert not marker.exists()


def test_config_overrides_cannot_turn_remote_code_or_hub_kernels_on(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=False)
    for override, message in [("+model.config_overrides.trust_remote_code=true", "trust_remote_code=True"),
                              ("+model.config_overrides.attn_implementation=kernels-community/flash-attn",
                               "names a kernel repository on the Hub"),
                              ("model.attn_implementation=org/repo", "model.attn_implementation='org/repo'")]:
        with pytest.raises(ConfigError, match=message):
            build_meta_model(_cfg(path, "model.pretrained=false", override).model)


def _checkpoint_with_code(run, tmp_path, marker):
    """A copy of ``run`` whose checkpoint's hf/config.json has an auto_map to a marker-writing module."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    hf = copy / "checkpoints" / "step-5" / "hf"
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}))
    (hf / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return copy


def test_a_checkpoint_whose_hf_config_has_an_auto_map_is_not_exported(bf16_run, tmp_path):
    from runner.export import export

    marker = tmp_path / "marker"
    copy = _checkpoint_with_code(bf16_run[1], tmp_path, marker)
    with pytest.raises(ConfigError, match=r"checkpoint .*step-5: .*hf/config.json has an auto_map"):
        export(copy, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_yes_on_stdin_runs_no_code_from_a_model_directory_or_a_checkpoint(bf16_run, tmp_path):
    """transformers asks "Do you wish to run the custom code? [y/N]" on stdin; the runner never lets it."""
    marker = tmp_path / "marker"
    model = _remote_code_dir(tmp_path / "model", marker)
    checkpoint = _checkpoint_with_code(bf16_run[1], tmp_path, marker)
    for module, args in (("runner", [*BASE, f"model.path={model}", f"hydra.run.dir={tmp_path / 'new'}"]),
                         ("runner.export", [str(checkpoint), str(tmp_path / "out")])):
        done = run_cli(*args, module=module, cwd=tmp_path, input="y\n" * 8, timeout=150)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "has an auto_map" in done.stderr + done.stdout and "[y/N]" not in done.stdout + done.stderr
    assert not marker.exists()


# -- weights that must agree with config.json, checked before launch -------------------------------

def test_weights_the_config_does_not_use_are_refused_before_launch_naming_them(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))  # the weights hold 6
    with pytest.raises(ConfigError, match=r"tensor\(s\) of the weights are not used .*model.layers.4.*"
                                          r"num_hidden_layers") as e:
        validate(_cfg(path))
    assert "model.layers.4.input_layernorm.weight (model.safetensors)" in str(e.value)


def test_tensors_transformers_ignores_on_load_are_accepted(tmp_path):
    # GPT-2 checkpoints hold attn.bias (a causal-mask buffer); older Llama ones each layer's inv_freq.
    for family, key, shape in [("gpt2", "transformer.h.0.attn.bias", (1, 1, 64, 64)),
                               ("llama", "model.layers.0.self_attn.rotary_emb.inv_freq", (4,))]:
        path = write_model(tmp_path / family, family, weights=True)
        tensors = load_file(path / "model.safetensors")
        save_file({**tensors, key: torch.ones(shape)}, path / "model.safetensors", metadata={"format": "pt"})
        meta = build_meta_model(_cfg(path).model)
        materialize(meta, meta.unit_names, seed=0, device=CPU)


def test_shape_and_missing_tensor_errors_come_from_the_headers_before_launch(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=True)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "model.norm.weight": torch.ones(16)}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"model.norm.weight in model.safetensors has shape \(16,\), but the "
                                          r"model's model.norm.weight is \(32,\)"):
        validate(_cfg(path))
    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"hold no tensor for 1 of the model's: model.layers.2.self_attn.q_proj"):
        validate(_cfg(path))


def test_a_model_path_that_is_no_model_directory_says_what_it_is_and_the_fix(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m", "llama", weights=True)
    monkeypatch.chdir(tmp_path)
    cases = {str(tmp_path / "missing"): f"model.path='{tmp_path / 'missing'}': no such directory. Fix: a local "
                                         "directory written by save_pretrained",
             "meta-llama/Llama-3.2-1B": f"no such directory ({tmp_path}/meta-llama/Llama-3.2-1B); the runner reads "
                                        "local directories only and downloads nothing. Fix: a local directory "
                                        "written by save_pretrained (config.json, and optionally *.safetensors and "
                                        "tokenizer files): download it first (`hf download meta-llama/Llama-3.2-1B "
                                        "--local-dir <dir>`), then model.path=<dir>.",
             str(model / "model.safetensors"): f"is a file, not a directory. Fix: a local directory written by "
                                               f"save_pretrained (config.json, and optionally *.safetensors and "
                                               f"tokenizer files): model.path='{model}'?",
             str(tmp_path): "holds no config.json. Fix: a local directory written by save_pretrained"}
    for path, message in cases.items():
        with pytest.raises(ConfigError) as info:
            validate(_cfg(path))
        assert message in str(info.value), (path, str(info.value))


def test_damaged_weight_files_and_indexes_are_named(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=True)
    whole = (path / "model.safetensors").read_bytes()
    cases = [(whole[: len(whole) // 2], None, r"model.safetensors is not a whole safetensors file"),
             (b"<html>not found</html>", None, r"model.safetensors is not a whole safetensors file"),
             (whole, {"metadata": {}}, r"model.safetensors.index.json has no weight_map"),
             (whole, {"weight_map": {"lm_head.weight": "model-00002.safetensors"}},
              r"names weight files that are not in the directory: \['model-00002.safetensors'\]")]
    for content, index, message in cases:
        (path / "model.safetensors").write_bytes(content)
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        if index is not None:
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ConfigError, match=message):
            validate(_cfg(path))


def test_index_entries_outside_the_model_directory_are_refused_before_launch(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=True)
    keys = list(load_file(path / "model.safetensors"))
    outside = shutil.copy(path / "model.safetensors", tmp_path / "outside.safetensors")  # a whole, readable file
    for entry in ["../outside.safetensors", str(outside)]:
        weight_map = {**{k: "model.safetensors" for k in keys}, "model.norm.weight": entry}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ConfigError, match=r"model.safetensors.index.json maps tensors to files outside the "
                                              rf"model directory: 'model.norm.weight' -> '{re.escape(entry)}'.*Fix: "):
            validate(_cfg(path))


def test_integer_weights_for_float_parameters_are_refused_before_launch_integer_buffers_are_not(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from runner.models.hf_weights import Weights, read_weights

    path = write_model(tmp_path / "m", "llama", weights=True)
    tensors = load_file(path / "model.safetensors")
    for name in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        tensors[name] = tensors[name].to(torch.int32)  # e.g. quantized values whose scales are elsewhere
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"2 float parameter\(s\) are stored as integers: model.layers.1.mlp.up_proj"
                                          r"\.weight \(I32 in model.safetensors\), model.norm.weight \(I32 .*Fix: "):
        validate(_cfg(path))
    # A persistent integer buffer (position ids) is read as the integers it is.
    save_file({**load_file(write_model(tmp_path / "b", "llama", weights=True) / "model.safetensors"),
               "model.position_ids": torch.arange(64)}, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "b"))
    model.model.register_buffer("position_ids", torch.empty(64, dtype=torch.int64, device="meta"))
    assert Weights(tmp_path / "b", read_weights(tmp_path / "b"), model, []).source("model.position_ids").dtype == "I64"


def test_non_finite_pretrained_weights_are_named_by_tensor(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=True)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, :2] = 3e38  # finite, though their sum overflows: accepted
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    meta = build_meta_model(_cfg(path).model)
    materialize(meta, meta.unit_names, seed=0, device=CPU)
    tensors["model.layers.3.mlp.up_proj.weight"][0, :3] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    meta = build_meta_model(_cfg(path).model)
    with pytest.raises(ConfigError, match=r"model.layers.3.mlp.up_proj.weight in model.safetensors holds non-finite "
                                          r"values \(3 of 2048"):
        materialize(meta, meta.unit_names, seed=0, device=CPU)


def test_a_directory_without_weights_is_an_incomplete_model_unless_random_init_is_asked(tmp_path):
    path = write_model(tmp_path / "m", "llama", weights=False)
    with pytest.raises(ConfigError, match=r"config.json but no weights .*Fix: .*model.pretrained=false"):
        validate(_cfg(path))
    assert validate(_cfg(path, "model.pretrained=false")).layout.stages


# -- a family outside the tested list is verified ----------------------------------------------------

@pytest.fixture
def gemma2(tmp_path):
    from transformers import Gemma2Config

    # Weights large enough for the logits to reach Gemma2's soft cap (30): the Llama-like reading differs.
    Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=3,
                 initializer_range=1.0).save_pretrained(tmp_path / "gemma2")
    return [f"model.path={tmp_path / 'gemma2'}", "model.allow_unlisted=true", "model.pretrained=false"]


def test_an_unlisted_family_is_verified_unless_verify_false_is_given(tmp_path, gemma2, caplog):
    with caplog.at_level(logging.WARNING, logger="runner.hf"):
        resolved = validate(compose(*BASE, *gemma2))
    assert resolved.verify is True and resolved.resolved_values()["verify"] is True  # resolved_config.yaml says so
    assert "a 'gemma2' model, outside the tested list" in caplog.text and "verify=false turns it off" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runner.hf"):
        assert resolve_verify(compose(*BASE, *gemma2, "verify=false")) is False
    assert "verify=false: nothing checks" in caplog.text
    listed = write_model(tmp_path / "llama", "llama", weights=False)
    assert resolve_verify(_cfg(listed, "model.pretrained=false")) is False
    assert resolve_verify(_cfg(listed, "model.pretrained=false", "verify=true")) is True
    # Trained, the Llama-like reading of Gemma2 fails its first step instead of training wrongly.
    cfg = compose(*BASE, *gemma2, "train.steps=2")
    (tmp_path / "run").mkdir()
    with pytest.raises(VerifyError, match="differs from the unsplit model"):
        Trainer(validate(cfg, tmp_path / "run"), cfg, DistEnv(0, 1, CPU)).run()
