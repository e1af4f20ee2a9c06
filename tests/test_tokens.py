"""Tokenized data: local text through a tokenizer, local json/jsonl/parquet files through
`datasets`, and pre-tokenized binaries. Every batch is a pure function of (seed, split, step), so a
resumed run reads the batches it would have; documents are packed with EOS between them; nothing
reads the whole corpus into memory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runner.data.datasets import HFData, TextData, TokensData
from runner.data.tokens import text_documents, window_index
from runner.errors import ConfigError

from helpers.config import compose
from helpers.hf import write_tokenizer

SENTENCES = ["the pipeline stage runs every microbatch forward", "another rank waits while a stage runs backward",
             "every microbatch runs forward and backward"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_windows_visit_every_window_once_per_epoch_and_depend_only_on_seed_split_and_index():
    for windows in (1, 2, 7, 12, 97):
        for epoch in range(2):
            seen = [window_index(epoch * windows + i, windows, 0, "train") for i in range(windows)]
            assert sorted(seen) == list(range(windows))
    assert [window_index(i, 97, 0, "train") for i in range(5)] != [window_index(i, 97, 1, "train") for i in range(5)]
    assert [window_index(i, 97, 0, "train") for i in range(97)] != [window_index(i, 97, 0, "train")
                                                                   for i in range(97, 194)]  # a new order per epoch


def test_text_is_tokenized_once_with_eos_between_documents_and_batches_are_step_addressable(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # three documents, each a file
        (corpus / f"doc{i}.txt").write_text("\n".join(SENTENCES[i:] + SENTENCES[:i]) * 20)
    cache = tmp_path / "cache"
    data = TextData(path=str(corpus), vocab_size=None, seed=0, val_fraction=0.2, tokenizer=str(tokenizer),
                    cache_dir=str(cache))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    whole = [t for i in range(3) for t in tok((corpus / f"doc{i}.txt").read_text(), add_special_tokens=False)
             ["input_ids"] + [tok.eos_token_id]]
    assert data.tokens.tolist() == whole  # chunked tokenization = the documents', EOS after each
    assert data.vocab_size == len(tok)
    [cached] = list(cache.glob("*.uint16"))
    stamp = cached.stat().st_mtime_ns
    again = TextData(path=str(corpus), vocab_size=None, seed=0, val_fraction=0.2, tokenizer=str(tokenizer),
                     cache_dir=str(cache))
    assert cached.stat().st_mtime_ns == stamp  # reused, not rewritten
    assert sorted(cache.glob("*")) == [cached, cached.with_name(f"{cached.name}.json")]  # and its manifest
    for step in (1, 5, 123):  # a fresh reader (a resumed run) draws the same batch at the same step
        for split in ("train", "val"):
            x1, y1 = data.batch(step, 4, 8, split=split)
            x2, y2 = again.batch(step, 4, 8, split=split)
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = data.batch(1, 4, 8)
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.long
    n = len(data.tokens)
    assert data.splits == {"train": (0, n - int(n * 0.2)), "val": (n - int(n * 0.2), n)}  # the tail held out
    assert data.batch(1, 4, 8)[0].tolist() != data.batch(2, 4, 8)[0].tolist()


def test_text_files_are_read_in_blocks_never_whole(tmp_path):
    file = tmp_path / "a.txt"
    file.write_text("alpha beta\ngamma delta\n\n epsilon\nzeta" * 50)
    _, pieces = text_documents(str(file), chunk_chars=16)
    pieces = list(pieces)
    assert "".join(text for text, _ in pieces) == file.read_text() and max(len(t) for t, _ in pieces) == 16
    assert [ends for _, ends in pieces].count(True) == 1 and pieces[-1][1]  # one document: one EOS
    # Where pieces are cut for the tokenizer: tests/test_token_cache.py.


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_local_dataset_files_are_documents_of_their_text_field(tmp_path, tokenizer, suffix):
    records = [{"id": i, "body": SENTENCES[i % 3] * (1 + i % 4)} for i in range(40)]
    path = tmp_path / f"corpus.{suffix}"
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    with pytest.raises(ConfigError, match="data.field='text' is not a column.*body"):
        HFData(path=str(path), tokenizer=str(tokenizer), seed=0, cache_dir=str(tmp_path / "cache"))
    data = HFData(path=str(path), tokenizer=str(tokenizer), seed=0, field="body", val_fraction=0.1,
                  cache_dir=str(tmp_path / "cache"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    assert data.tokens.tolist() == [t for r in records for t in tok(r["body"], add_special_tokens=False)["input_ids"]
                                    + [tok.eos_token_id]]
    assert torch.equal(data.batch(7, 4, 8)[0], HFData(path=str(path), tokenizer=str(tokenizer), seed=0, field="body",
                                                     val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
                       .batch(7, 4, 8)[0])


def test_pre_tokenized_binaries_are_memory_mapped_and_checked(tmp_path):
    ids = np.arange(1000, dtype=np.uint32)  # token i at position i: windows show where they were read
    ids.tofile(tmp_path / "train.bin")
    data = TokensData(path=str(tmp_path / "train.bin"), seed=3, dtype="uint32", vocab_size=1000, val_fraction=0.2)
    assert isinstance(data.tokens, np.memmap) and len(data.tokens) == 1000
    x, y = data.batch(2, 8, 16)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(x[:, 1:] - x[:, :-1], torch.ones(8, 15, dtype=torch.long))
    assert (x % 17 == 0)[:, 0].all() and y.max() < 800  # whole windows of 17, from the training part
    val = data.batch(1, 8, 16, split="val")[0]
    assert val.min() >= 800  # the held-out tail
    np.save(tmp_path / "train.npy", ids.astype(np.uint16))
    assert torch.equal(TokensData(path=str(tmp_path / "train.npy"), seed=3, val_fraction=0.2).batch(2, 8, 16)[0], x)
    with pytest.raises(ConfigError, match=r"token id \d+ \(train batch of step 1\), outside 0..99 "
                                          r"\(data.vocab_size=100"):
        TokensData(path=str(tmp_path / "train.bin"), seed=0, dtype="uint32", vocab_size=100).batch(1, 64, 8)
    with pytest.raises(ConfigError, match="not a whole number of uint32"):
        (tmp_path / "odd.bin").write_bytes(b"abc")
        TokensData(path=str(tmp_path / "odd.bin"), seed=0, dtype="uint32")
    with pytest.raises(ConfigError, match="data.dtype='int8'"):
        TokensData(path=str(tmp_path / "train.bin"), seed=0, dtype="int8")


def test_data_configs_compose_and_the_vocabulary_comes_from_the_tokenizer(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text(" ".join(SENTENCES))
    cfg = compose("data=text", f"data.path={tmp_path / 'a.txt'}", f"data.tokenizer={tokenizer}")
    assert cfg.data.vocab_size == cfg.model.vocab_size == 19  # the built-in model's embedding follows
    assert compose("data=text", f"data.path={tmp_path / 'a.txt'}").data.vocab_size == 256
    cfg = compose("data=hf", "data.path=x.jsonl", f"data.tokenizer={tokenizer}")
    assert cfg.data.vocab_size == 19 and cfg.data.field == "text"
    assert compose("data=tokens", "data.path=x.bin").data.dtype == "uint16"
