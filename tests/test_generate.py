"""``python -m runner.generate``: text from a run's newest checkpoint, in one process, without
exporting it first. Greedy decoding of a Hugging Face run equals transformers' own ``generate`` on
the exported model token for token (fp32); a built-in model's equals an argmax loop over the
unsplit model loaded from the same checkpoint, its tied head tied again; sampling is reproducible
by seed and keeps to the top k; bad input exits 2 naming the key, the value and the fix.
In-process: the session's tiny Llama run (``conftest.trained_llama``, also test_export's) and one
tiny built-in run trained here."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate

from runner._torch.dcp import read_model_tensors
from runner.checkpoint.model import checkpoint_model
from runner.errors import ConfigError
from runner.export import export
from runner.generate import generate, main
from runner.train import train
from runner.validate import validate

from helpers.config import compose
from helpers.trained import ENV, WORDS

pytestmark = pytest.mark.timeout(120)

BUILTIN = ["device=cpu", "model=transformer", "model.dim=32", "model.n_layers=2", "model.tie_embeddings=true",
           "data=text", "data.vocab_size=256", "train.seq_len=16", "parallel.pp=1", "parallel.microbatches=2",
           "train.batch_size=4", "train.steps=2", "checkpoint.every=2", "profile.enabled=false"]


@pytest.fixture(scope="module")
def trained(trained_llama) -> Path:
    return trained_llama


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory) -> tuple[Path, object]:
    """(run directory, its config): a built-in transformer with a tied head, trained 2 steps on bytes."""
    root = tmp_path_factory.mktemp("generate-builtin")
    (root / "corpus.txt").write_text(" ".join(WORDS * 40))
    cfg = compose(*BUILTIN, f"data.path={root / 'corpus.txt'}")
    (root / "run").mkdir()
    train(validate(cfg, root / "run"), cfg, ENV)
    return root / "run", cfg


def _main(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv])
    return exit_info.value.code  # type: ignore[return-value]


def test_greedy_decoding_of_a_hf_run_equals_transformers_generate_on_its_export(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export(trained / "run", tmp_path / "exported", dtype="fp32")
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = "the pipework stage runs"  # "pipework": a word of the tokenizer the run trained with only
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = reference.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)[0].tolist()

    result = generate(trained / "run", prompt=prompt, max_new_tokens=20)
    assert result.checkpoint == trained / "run" / "checkpoints" / "step-2" and result.step == 2
    assert result.prompt_ids == ids[0].tolist() and 3 not in result.prompt_ids  # no <unk>: tokenizer B's ids
    assert result.prompt_ids + result.new_ids == expected
    assert len(result.new_ids) == 20 or result.stopped_at_eos
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert result.text.startswith(prompt)
    assert not dist.is_initialized()  # one process, no process group
    assert "lm_head.weight" not in read_model_tensors(result.checkpoint)  # stored once, under the first name
    loaded = checkpoint_model(result.checkpoint)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again
    assert reference.lm_head.weight is reference.model.embed_tokens.weight

    main([str(trained / "run" / "checkpoints" / "step-2"), f"prompt={prompt}", "max_new_tokens=20"])
    printed = capsys.readouterr()
    assert printed.out == result.text + "\n"
    assert f"{len(result.new_ids)} tokens from {result.checkpoint} (step 2)" in printed.err


def test_sampling_is_reproducible_by_seed_and_keeps_to_the_top_k(trained):
    run = trained / "run"
    sample = dict(prompt="the stage", max_new_tokens=24, temperature=1.5, top_k=5, stop_at_eos=False)
    first = generate(run, seed=1, **sample)
    assert generate(run, seed=1, **sample).new_ids == first.new_ids
    assert generate(run, seed=2, **sample).new_ids != first.new_ids
    greedy = generate(run, prompt="the stage", max_new_tokens=24, stop_at_eos=False).new_ids
    assert first.new_ids != greedy
    assert generate(run, **{**sample, "top_k": 1}, seed=3).new_ids == greedy  # the likeliest only: greedy
    model = checkpoint_model(run / "checkpoints" / "step-2").eval()
    sequence = first.prompt_ids + first.new_ids
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0]
    for position, token in enumerate(first.new_ids, start=len(first.prompt_ids) - 1):
        assert token in torch.topk(logits[position], 5).indices.tolist()


def test_a_builtin_models_greedy_output_equals_an_argmax_loop_over_the_unsplit_model(builtin_run):
    run, cfg = builtin_run
    checkpoint = run / "checkpoints" / "step-2"
    reference = instantiate(cfg.model)  # the unsplit model, loaded from the same checkpoint by hand
    missing, unexpected = reference.load_state_dict(read_model_tensors(checkpoint), strict=False)
    assert missing == ["head.weight"] and unexpected == []  # stored once, as embed.tok.weight
    assert reference.head.weight is reference.embed.tok.weight
    ids = list(b"the pipeline ")
    with torch.no_grad():
        for _ in range(3):  # up to the model's 16 positions (train.seq_len)
            ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))

    result = generate(run, prompt="the pipeline ", max_new_tokens=3)
    assert result.prompt_ids == list(b"the pipeline ") and result.prompt_ids + result.new_ids == ids
    assert result.text == bytes(ids).decode(errors="replace")
    loaded = checkpoint_model(checkpoint)
    assert loaded.head.weight is loaded.embed.tok.weight  # tied again
    assert torch.equal(loaded.head.weight, reference.head.weight)
    by_ids = generate(run, prompt_ids=tuple(b"the pipeline "), max_new_tokens=3)
    assert by_ids.new_ids == result.new_ids and by_ids.text is None
    # From Python the ids may also be a list or the command line's text (a bare TypeError before).
    as_text = generate(run, prompt_ids=" ".join(map(str, b"the pipeline ")), max_new_tokens=3)
    as_list = generate(run, prompt_ids=list(b"the pipeline "), max_new_tokens=3)
    assert as_text.new_ids == as_list.new_ids == result.new_ids
    with pytest.raises(ConfigError, match="prompt_ids=.* is not a sequence of token ids"):
        generate(run, prompt_ids=[1.5, 2], max_new_tokens=3)


def test_a_user_model_factory_is_not_imported(builtin_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(builtin_run[0], run)
    config = run / "resolved_config.yaml"
    config.write_text(config.read_text().replace("runner.models.builtin.transformer", "mypkg.models.build"))
    assert _main(str(run), "prompt=the") == 2
    err = capsys.readouterr().err
    assert "model._target_='mypkg.models.build' is not a built-in model" in err and "Fix: " in err
    assert "mypkg" not in sys.modules


def _run_without_checkpoints(tmp_path: Path) -> Path:
    (tmp_path / "no-checkpoints").mkdir()
    (tmp_path / "no-checkpoints" / "resolved_config.yaml").write_text("model: {}\n")
    return tmp_path / "no-checkpoints"


# (the source: a path in the trained run's directory ("run": itself), else a path made here; the settings;
# what the error says)
BAD = {
    "no such directory": (lambda t: t / "missing", ["prompt=the"], "no such directory. Fix: a checkpoint"),
    "a checkpoint no longer kept": ("run/checkpoints/step-1", ["prompt=the"], "checkpoints/step-1: no such "
                                    "directory. Its run keeps step-2 (checkpoint.keep, 2 by default, keeps the newest"),
    "not a run": (lambda t: t, ["prompt=the"], "is not a complete checkpoint: it has no .metadata"),
    "no checkpoint": (_run_without_checkpoints, ["prompt=the"], "the run saved no checkpoint (it has no "
                      "checkpoints/). Fix: a run trained with checkpoint.every=K"),
    "no source": (lambda t: "prompt=the stage", [], "python -m runner.generate prompt=the stage: the first "
                  "argument is the run directory or checkpoint, not a setting. Fix: python -m runner.generate "
                  "<run dir> prompt=the stage."),
    "empty prompt": ("run", ["prompt="], "prompt='' is empty. Fix: prompt="),
    "no prompt": ("run", [], 'no prompt. Fix: python -m runner.generate <run dir> prompt="'),
    "negative temperature": ("run", ["prompt=the", "temperature=-0.5"], "temperature=-0.5 must be >= 0. Fix: "),
    "temperature not a number": ("run", ["prompt=the", "temperature=hot"], "temperature='hot' is not a number. "
                                 "Fix: e.g. temperature=0.0"),
    "misspelt key": ("run", ["prompt=the", "tempreature=1"], "'tempreature=1' is not a setting: Did you mean "
                     "temperature? Fix: key=value"),
    "budget beyond the positions": ("run", ["prompt=the stage", "max_new_tokens=63"], "max_new_tokens=63: with the "
                                    "prompt's 2 tokens that is 65 positions, the model takes at most 64. Fix: "
                                    "max_new_tokens=62 or less."),
    "negative top_k": ("run", ["prompt=the", "top_k=-1"], "top_k=-1 must be >= 0. Fix: "),
    "prompt beyond the positions": ("run", ["prompt=" + "the " * 70], "is 70 tokens, the model takes at most 64 "
                                    "positions. Fix: a prompt of at most 63 tokens."),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_naming_the_key_the_value_and_the_fix(case, trained, tmp_path, capsys):
    source, settings, message = BAD[case]
    path = trained / source if isinstance(source, str) else source(tmp_path)
    assert _main(str(path), *settings) == 2
    printed = capsys.readouterr()
    assert message in printed.err and "Traceback" not in printed.err and printed.out == "", printed.err
