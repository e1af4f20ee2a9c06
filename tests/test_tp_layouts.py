"""Tensor parallelism composed with what the runner already does, held to the unsplit model: data
parallelism over tp shards (FSDP2 on the 2-D (dp, tp) mesh, and torch's replicate), weights tied
across stages (vocabulary-sharded in each tp group, an uneven vocabulary, both ends on one rank
under a V schedule), and checkpoints that resume at another tp, pp and dp with the same continuing
losses and export the same weights as a run without tp.

In CI, one 4-rank spawn runs the built-in transformer's and a tiny Llama's cases, and one 8-rank
spawn pp=2 x tp=2 x dp=2 with FSDP; the slow tier adds a second 4-rank spawn (ddp, a V schedule,
a tied checkpoint resumed at pp=1). Module-scoped fixtures; each case is asserted in its own test.
The unsplit references run in this process, once each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner._torch.dcp import read_model_tensors
from runner.export import export
from runner.ranks.dist import DistEnv
from runner.train import Trainer, train
from runner.validate import validate

from helpers.config import TINY, compose, resolved
from helpers.hf import write_model
from helpers.parity import CLIP, assert_matches, reference
from helpers.ranks import run_cases

ENV = DistEnv(0, 1, torch.device("cpu"))
BATCH = ["parallel.microbatches=4", "train.batch_size=8"]
TIED = ["model.tie_embeddings=true"]
TP2 = ["parallel.tp=2"]
# Continuing losses after a resume: the same step's loss of the uninterrupted run, to fp32 sums'
# reordering (another layout adds in another order).
RESUME_RTOL = 1e-5
# The built-in transformer's cases (and their references) with 2 blocks, not TINY's 6: held here is
# tp composed with dp, tied weights and resumes, not depth; 5 units still give each of the 2 (or a
# V's 4) stages a tp-sharded module.
SHALLOW = ["model.n_layers=2"]


def _builtin(*overrides: str) -> dict:
    return resolved(*TINY, *SHALLOW, *CLIP, *BATCH, *overrides)


def _llama(path: Path, *overrides: str) -> list[str]:
    return ["device=cpu", "model=hf", f"model.path={path}", "data.vocab_size=64", "train.seq_len=16",
            "train.steps=6", "profile.enabled=false", *CLIP, *BATCH, *overrides]


# The 4-rank cases of the built-in transformer, and the reference each is held to: in CI, FSDP
# over tp with a tied embedding and head at pp=1 (one parameter, one fully_shard group), and tied
# copies on two pipeline ranks, each tp shard summing its rows of an uneven vocabulary with its
# peer's; in the slow tier, the ddp mode, both ends on one rank under a V schedule, and tied
# copies saved at pp=2 x tp=2 (and resumed at pp=1).
BUILTIN = {
    "fsdp-tp2-dp2-tied": (["parallel.pp=1", *TP2, "parallel.dp=2", "parallel.dp_mode=fsdp", *TIED, "verify=true"],
                          "tied"),
    "tied-pp2-tp2-vocab47": (["parallel.pp=2", *TP2, *TIED, "data.vocab_size=47"], "tied-47"),
}
SLOW = {
    "ddp-tp2-dp2": (["parallel.pp=1", *TP2, "parallel.dp=2", "parallel.dp_mode=ddp"], "untied"),
    "tied-zbv-vocab47": (["parallel.pp=2", *TP2, *TIED, "schedule=zbv", "data.vocab_size=47"], "tied-47"),
    "tied-pp2-tp2": (["parallel.pp=2", *TP2, *TIED, "checkpoint.every=3"], "tied"),
}
REFERENCES = {"untied": [], "tied": TIED, "tied-47": [*TIED, "data.vocab_size=47"]}
# The tiny Llama saved at pp=2 x tp=2, resumed at tp=1 (pp=2 x dp=2) and at pp=1 (tp=2 x dp=2).
LLAMA_RESUMES = {
    "llama-resume-pp2-tp1": ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp"],
    "llama-resume-pp1-tp2": ["parallel.pp=1", *TP2, "parallel.dp=2", "parallel.dp_mode=ddp", "verify=true"],
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "llama", "llama", weights=True)


class _References(dict):
    """The unsplit run of each ``REFERENCES`` entry, computed when a test first asks for it."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str) -> dict:
        self[name] = reference(self.tmp_path_factory.mktemp(name), *SHALLOW, *BATCH, *REFERENCES[name])
        return self[name]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    return _References(tmp_path_factory)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory, llama) -> tuple[Path, dict[str, dict]]:
    """The 4-rank spawn of the CI tier; returns the cases' directory (``<case>/`` each run's) and
    their records."""
    out = tmp_path_factory.mktemp("tp4") / "spawn"
    cases = {name: _builtin(*overrides) for name, (overrides, _) in BUILTIN.items()}
    cases["llama-save-pp2-tp2"] = resolved(*_llama(llama, "parallel.pp=2", *TP2, "checkpoint.every=3"))
    saved = out / "llama-save-pp2-tp2" / "checkpoints" / "step-3"
    for name, overrides in LLAMA_RESUMES.items():
        cases[name] = resolved(*_llama(llama, *overrides, f"checkpoint.resume={saved}"))
    return out, run_cases(out, 4, cases)


@pytest.fixture(scope="module")
def tp4_slow(tmp_path_factory) -> dict[str, dict]:
    """The slow tier's 4-rank spawn: ``SLOW``, and the tied pp=2 x tp=2 run's step-3 resumed at
    pp=1 (embedding and head one parameter) x tp=2 x dp=2 with FSDP."""
    out = tmp_path_factory.mktemp("tp4-slow") / "spawn"
    cases = {name: _builtin(*overrides) for name, (overrides, _) in SLOW.items()}
    tied_saved = out / "tied-pp2-tp2" / "checkpoints" / "step-3"
    cases["tied-resume-pp1-tp2-dp2"] = _builtin("parallel.pp=1", *TP2, "parallel.dp=2", "parallel.dp_mode=fsdp",
                                                *TIED, f"checkpoint.resume={tied_saved}")
    return run_cases(out, 4, cases)


@pytest.fixture(scope="module")
def tp8(tmp_path_factory) -> dict[str, dict]:
    """The 8-rank spawn: pp=2 x tp=2 x dp=2 with FSDP2 on each stage's (dp, tp) mesh, the tied
    embedding and head vocabulary-sharded over an uneven vocabulary."""
    cases = {"fsdp-pp2-tp2-dp2": _builtin("parallel.pp=2", *TP2, "parallel.dp=2", "parallel.dp_mode=fsdp",
                                          *TIED, "data.vocab_size=47")}
    return run_cases(tmp_path_factory.mktemp("tp8") / "spawn", 8, cases)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(BUILTIN))
def test_dp_over_tp_and_tied_weights_under_tp_match_the_unsplit_model(tp4, references, case):
    """Losses and every first-step gradient, before and after a binding global clip: the norm
    counts each piece of a 2-D (dp, tp) DTensor once (FSDP's ``_StridedShard`` included)."""
    assert_matches(tp4[1][case], references[BUILTIN[case][1]], case)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["fsdp-tp2-dp2-tied", "llama-resume-pp1-tp2"])
def test_verify_passes_with_tp_over_dp_and_after_a_resume(tp4, case):
    """``verify=true`` gathers the 2-D DTensors whole and compares them with the unsplit model (for
    the resume, loaded with the pp=2 x tp=2 checkpoint's weights), and follows 2 updates (for the
    resume, from the AdamW moments its ranks hold as sharded DTensors)."""
    report = tp4[1][case]["summary"]["verify"]
    assert report["passed"] and report["max_abs_diff"] < 4e-5, report
    assert ["weights" in step for step in report["steps"]] == [True, True, False], report["steps"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(SLOW))
def test_ddp_over_tp_and_tied_weights_in_a_v_match_the_unsplit_model(tp4_slow, references, case):
    assert_matches(tp4_slow[case], references[SLOW[case][1]], case)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_tied_tp_checkpoint_resumes_at_pp1_with_the_same_continuing_losses(tp4_slow, references):
    """Saved at pp=2 x tp=2 (the head's copy stored under the embedding's name), resumed at pp=1
    where both are one parameter: steps 4 and 5 are the uninterrupted runs' (optimizer state too:
    AdamW's moments decide step 5)."""
    got, saved = tp4_slow["tied-resume-pp1-tp2-dp2"], tp4_slow["tied-pp2-tp2"]
    assert "error" not in got, got.get("traceback")
    assert len(got["losses"]) == 2
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(saved["losses"][3:]), rtol=RESUME_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(references["tied"]["losses"][3:]),
                               rtol=1e-4, atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(LLAMA_RESUMES))
def test_a_pp2_tp2_checkpoint_resumes_at_another_tp_and_pp_with_the_same_continuing_losses(tp4, case):
    got, saved = tp4[1][case], tp4[1]["llama-save-pp2-tp2"]
    assert "error" not in saved, saved.get("traceback")
    assert "error" not in got, got.get("traceback")
    assert len(saved["losses"]) == 6 and len(got["losses"]) == 3
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(saved["losses"][3:]), rtol=RESUME_RTOL, atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_export_of_a_tp_checkpoint_equals_the_export_of_its_weights_saved_without_tp(tp4, llama, tmp_path):
    """The pp=2 x tp=2 checkpoint loaded by an unsplit run (tp=1) and saved again: the two
    checkpoints' model tensors are equal, and their exports are byte for byte the same files."""
    saved = tp4[0] / "llama-save-pp2-tp2" / "checkpoints" / "step-3"
    cfg = compose(*_llama(llama, "parallel.pp=1", f"checkpoint.resume={saved}"))
    (tmp_path / "run").mkdir()
    trainer = Trainer(validate(cfg, tmp_path / "run"), cfg, ENV)
    trainer.setup()  # loads the checkpoint into the whole model
    trainer.checkpointer.save(3)
    if trainer.metrics is not None:
        trainer.metrics.close()
    again = tmp_path / "run" / "checkpoints" / "step-3"
    tp_tensors, whole = read_model_tensors(saved), read_model_tensors(again)
    assert tp_tensors.keys() == whole.keys() and len(whole) > 10
    for name, tensor in whole.items():
        assert torch.equal(tp_tensors[name], tensor), name
    export(saved, tmp_path / "from-tp")
    export(again, tmp_path / "from-tp1")
    files = sorted(p.name for p in (tmp_path / "from-tp").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "from-tp1").glob("*.safetensors")) and files
    for name in files:
        assert (tmp_path / "from-tp" / name).read_bytes() == (tmp_path / "from-tp1" / name).read_bytes(), name


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_pp2_tp2_dp2_with_fsdp_matches_the_unsplit_model(tp8, references):
    """The one 8-rank case (about 20 s on 2 idle cores): pp x tp x dp with FSDP over the 2-D mesh."""
    assert_matches(tp8["fsdp-pp2-tp2-dp2"], references["tied-47"], "fsdp-pp2-tp2-dp2")


def test_a_weight_held_under_two_names_is_checkpointed_once_under_its_first(tmp_path):
    """At pp=1 the tied head is the embedding's parameter: stored as ``embed.tok.weight`` only, as
    a pipelined run stores it, so checkpoints of either load into the other (before, pp=1 wrote
    ``head.weight`` too and could not load a pipelined run's checkpoint)."""
    cfg = compose(*TINY, *TIED, "parallel.pp=1", "train.steps=1", "checkpoint.every=1")
    train(validate(cfg, tmp_path), cfg, ENV)
    tensors = read_model_tensors(tmp_path / "checkpoints" / "step-1")
    assert "embed.tok.weight" in tensors and "head.weight" not in tensors
