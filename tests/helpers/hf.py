"""Tiny Hugging Face models, tokenizers and corpora written into a test's directory (nothing is
downloaded), and Hugging Face's own unsplit training as the reference."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig

VOCAB = 64
LAYERS = 6  # 9 units: enough for 8 stages


def family_configs(layers: int = LAYERS) -> dict:
    """Each family's tiny config, with ``layers`` decoder layers."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    return {
        "llama": LlamaConfig(**common),
        # Sliding windows shorter than the sequence: the masks differ from plain causal ones.
        "mistral": MistralConfig(**common, sliding_window=5),
        "qwen2": Qwen2Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=2),
        "qwen3": Qwen3Config(**common, head_dim=8),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, bos_token_id=1,
                           eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }


def write_model(directory: Path, family: str, *, weights: bool, seed: int = 0, layers: int = LAYERS,
                dtype: torch.dtype | None = None, max_shard_size: str | None = None, **config_changes) -> Path:
    """``save_pretrained`` of a tiny model of ``family``: with random weights, or its config only.
    ``layers``: its decoder layers; ``dtype``: stored in it, and named in config.json (as real bf16 checkpoints are);
    ``max_shard_size``: several safetensors files and their index, as large checkpoints come."""
    from transformers import AutoModelForCausalLM

    config = family_configs(layers)[family]
    for key, value in config_changes.items():
        setattr(config, key, value)
    if weights:
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if dtype is not None:
                model.to(dtype)
                model.config.dtype = dtype
            model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    else:
        config.save_pretrained(directory)
    return directory


def write_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer over a small vocabulary, with <pad>, <s>, </s> and <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a pipeline stage runs every microbatch forward and backward while another rank waits".split()
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words, "."])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


TOKENIZER_KINDS = ("bpe", "byte_level", "metaspace", "prepend")


def write_trained_tokenizer(directory: Path, kind: str) -> Path:
    """A small tokenizer of ``kind`` trained on a fixed corpus: ``bpe`` (BPE over whitespace-split
    words), ``byte_level`` (GPT-2's byte-level BPE), ``metaspace`` (a SentencePiece-style Unigram
    with the Metaspace pre-tokenizer) or ``prepend`` (Llama-2's legacy normalizer, which prepends
    '▁' to every text it is given)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = ("the a pipeline stage runs every microbatch forward and backward while another rank waits 12 3.5 "
             "it's don't café naïve 東京 (x) a-b").split()
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(24)) for i in range(120)]
    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "metaspace":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=specials, unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        if kind == "bpe":
            tok.pre_tokenizer = pre_tokenizers.Whitespace()
        else:
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


def hf_training(cfg: DictConfig, steps: int) -> dict:
    """transformers' own model (the class itself, with the run's initial weights) trained as the
    runner trains: the same batches, microbatches, AdamW groups, LR schedule and global clip."""
    from runner.data.datasets import build_dataset, get_batch
    from runner.losses import build_loss
    from runner.optim import build_optimizer
    from runner.pipeline.step import UnsplitStep
    from runner.verify.hook import collect_grads, reference_model

    model, forward = reference_model(cfg)
    t = cfg.train
    step = UnsplitStep(model, cfg.parallel.microbatches, build_loss(cfg.loss), forward=forward)
    optimizer, scheduler = build_optimizer([model], t)
    data = build_dataset(cfg.data, seed=t.seed)
    out = {"losses": []}
    for i in range(steps):
        inputs, targets, kwargs = get_batch(data, i + 1, t.batch_size, t.seq_len)  # steps from 1
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(step(inputs, targets, **kwargs).item())
        if i == 0:
            out["grads"] = collect_grads([model])
            with torch.no_grad():  # transformers' own loss, with the runner's targets
                out["hf_loss"] = model(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False,
                                       **kwargs).loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        if i == 0:
            out["clipped"] = collect_grads([model])
        optimizer.step()
        scheduler.step()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the trained weights
    return out
