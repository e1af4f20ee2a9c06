"""One tiny Llama trained 2 steps by the runner, in this process, with a checkpoint at step 2:
what ``test_export`` exports and ``test_generate`` samples from (``conftest.trained_llama``, one
run per session)."""

from __future__ import annotations

from pathlib import Path

import torch

from runner.ranks.dist import DistEnv
from runner.train import train
from runner.validate import validate

from helpers.config import compose
from helpers.hf import family_configs, write_tokenizer

ENV = DistEnv(0, 1, torch.device("cpu"))
WORDS = "the pipeline stage runs every microbatch forward and backward while another rank waits".split()


def other_tokenizer(directory: Path) -> Path:
    """A tokenizer of the same size as ``write_tokenizer``'s whose ids stand for other words."""
    write_tokenizer(directory)
    file = directory / "tokenizer.json"
    file.write_text(file.read_text().replace('"pipeline"', '"pipework"'))
    return directory


def run_config(root: Path, tokenizer: Path, *overrides: str):
    return compose("device=cpu", "model=hf", f"model.path={root / 'model'}", "data=text",
                   f"data.path={root / 'corpus.txt'}", f"data.tokenizer={tokenizer}",
                   f"data.cache_dir={root / 'cache'}",
                   "train.seq_len=16", "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4",
                   "profile.enabled=false", *overrides)


def train_tiny_llama(root: Path) -> Path:
    """``root``: model/ (a tiny Llama with a tied head saved in bf16, with tokenizer A), tokenizer-b/ (B: the same
    size, other words), run/ (2 steps trained with B, checkpoint step-2)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_configs()["llama"]
    config.tie_word_embeddings = True  # the head stored once in the checkpoint, tied again where it is loaded
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root / "model")
    write_tokenizer(root / "model")
    other_tokenizer(root / "tokenizer-b")
    (root / "corpus.txt").write_text(" ".join(WORDS * 40))
    cfg = run_config(root, root / "tokenizer-b", "train.steps=2", "checkpoint.every=2")
    (root / "run").mkdir()
    train(validate(cfg, root / "run"), cfg, ENV)
    return root
