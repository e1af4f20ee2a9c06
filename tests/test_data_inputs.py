"""What users hand the data group, checked before any rank starts: which files of a directory or
glob are text, token files and their ids against the model's vocabulary, ``data=hf``'s records,
the missing tokenizer; that building an HF dataset leaves the launcher able to fork its ranks; and
that ``batch(step)`` numbers steps from 1 as the logs do."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from runner.data import token_files
from runner.data.datasets import HFData, TextData, TokensData, check_eval_windows, check_vocab
from runner.data.files import text_files
from runner.data.tokens import load_tokenizer, window_index
from runner.errors import ConfigError
from runner.ranks.processes import spawn_reason, start_method
from runner.validate import check_config, validate

from helpers import datasets
from helpers.config import TINY, compose
from helpers.hf import VOCAB, write_model, write_tokenizer

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 40  # what a docs folder's images start with
TEXT = "the pipeline stage runs every microbatch forward\nanother rank waits while a stage runs backward\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def docs(tmp_path):
    """A docs folder: prose, a README, images, a binary and a file in Latin-1, a hidden .git."""
    root = tmp_path / "docs"
    (root / "guide").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "index.md").write_text(TEXT)
    (root / "guide" / "usage.rst").write_text(TEXT * 2)
    (root / "README").write_text(TEXT)
    (root / "notes.dat").write_text(TEXT)  # text, with a suffix a directory does not take
    (root / "latin.txt").write_bytes(TEXT.encode() + b"caf\xe9\n")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    for i in range(3):
        (root / f"figure{i}.png").write_bytes(PNG)
    return root


def test_a_directory_takes_its_text_files_only_and_logs_what_it_skipped(docs, tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="runner.data_files"):
        files = text_files(str(docs))
    assert files == [docs / "README", docs / "guide" / "usage.rst", docs / "index.md"]
    taken, skipped = (r.getMessage() for r in caplog.records)
    assert taken == f"data.path={docs}: 3 text files: 1 .rst (0.2 KB), 1 (no suffix) (0.1 KB), 1 .md (0.1 KB)"
    assert skipped.startswith(f"data.path={docs}: skipped 5 files that are not text: 3 .png (30.8 KB), "
                              "1 .txt (0.1 KB), 1 .dat (0.1 KB) (e.g. ")
    assert "figure0.png: not a text suffix (.png)" in skipped
    for built in ("tokenized", "from the cache"):  # the tokens per type are logged on every run
        with caplog.at_level(logging.INFO, logger="runner.token_cache"):
            caplog.clear()
            data = TextData(path=str(docs), vocab_size=None, seed=0, tokenizer=str(tokenizer),
                            cache_dir=str(docs.parent / "c"))
        words = len(TEXT.split())
        assert len(data.tokens) == 4 * words + 3, built  # the three documents and an EOS after each: no image bytes
        per_file = [len(load_tokenizer(str(tokenizer))(f.read_text())["input_ids"]) + 1 for f in files]
        assert f"tokens per file type: .rst {per_file[1]}, (no suffix) {per_file[0]}, .md {per_file[2]}" \
            in caplog.text, built
    # A glob takes what it matches that is text, whatever the suffix; the images still fail the check.
    assert text_files(str(docs / "*")) == [docs / "README", docs / "guide" / "usage.rst", docs / "index.md",
                                           docs / "notes.dat"]
    with pytest.raises(ConfigError, match=r"latin.txt' is not UTF-8 text: byte 0xe9 at offset 99"):
        text_files(str(docs / "latin.txt"))
    with pytest.raises(ConfigError, match=r"none of its 3 files is text \(3 .png \(30.8 KB\); e.g. .*figure0.png: "
                                          r"a NUL byte at offset 8\)"):
        text_files(str(docs / "*.png"))


def test_absolute_globs_and_home_paths_work_for_every_data_form(docs, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert text_files(str(docs / "**" / "*.rst")) == [docs / "guide" / "usage.rst"]  # absolute, recursive
    assert text_files("~/docs/*.md") == [docs / "index.md"]
    records = tmp_path / "records"
    records.mkdir()
    for i in range(2):
        (records / f"part{i}.jsonl").write_text("\n".join(json.dumps({"text": TEXT}) for _ in range(3 + i)))
    shutil.copytree(tokenizer, tmp_path / "tok")
    data = HFData(path="~/records/*.jsonl", tokenizer="~/tok", seed=0, cache_dir="~/cache")
    assert len(data.tokens) == 7 * (len(TEXT.split()) + 1) and (tmp_path / "cache" / "datasets").is_dir()
    assert TextData(path="~/docs/*.md", vocab_size=256, seed=0).tokens.tobytes() == TEXT.encode()  # bytes of one
    with pytest.raises(ConfigError, match=r"names 2 files \(glob\); text without data.tokenizer is the bytes of one"):
        TextData(path=str(docs / "[Ri]*"), vocab_size=256, seed=0)
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "shard0.bin")
    assert TokensData(path="~/shard*.bin", seed=0, val_fraction=0.5).tokens.tolist() == list(range(10))
    assert TokensData(path=str(tmp_path / "shard?.bin"), seed=0, val_fraction=0.5).tokens.tolist() == list(range(10))


def test_token_files_must_hold_integers_and_shards_read_as_one_stream(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.float32))
    with pytest.raises(ConfigError, match=r"ids.npy holds float32 values; token ids are integers .*Fix: save the "
                                          r"ids as integers"):
        TokensData(path=str(tmp_path / "ids.npy"), seed=0)
    shards = tmp_path / "shards"
    shards.mkdir()
    np.arange(0, 50, dtype=np.uint16).tofile(shards / "a.bin")
    np.arange(50, 53, dtype=np.uint16).tofile(shards / "b.bin")  # shorter than a window
    np.arange(53, 120, dtype=np.uint16).tofile(shards / "c.bin")
    data = TokensData(path=str(shards), seed=1, val_fraction=0.25)
    assert len(data.tokens) == 120 and data.tokens[45:60].tolist() == list(range(45, 60))  # across two edges
    x, y = data.batch(1, 8, 9)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(8, 8, dtype=torch.long))  # windows of consecutive ids
    starts = set(x[:, 0].tolist())  # 8 of the training part's 9 windows (90 tokens), one across b.bin
    assert len(starts) == 8 and starts < set(range(0, 90, 10))
    (shards / "README.md").write_text("token shards")
    with pytest.raises(ConfigError, match=r"names files of several kinds \(.bin, .md\).*Fix: a glob of the token "
                                          r"files, e.g. data.path='.*shards/\*.bin'"):
        TokensData(path=str(shards), seed=0)


def test_token_ids_are_checked_against_the_vocabulary_once_per_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids = np.arange(1000, dtype=np.int64) % 50
    ids[990] = 64  # in the held-out tail: training would have run before it failed
    np.save(tmp_path / "ids.npy", ids)
    data = TokensData(path=str(tmp_path / "ids.npy"), seed=0)
    check_vocab(data, None, 65)
    with pytest.raises(ConfigError) as e:
        check_vocab(data, None, 64)
    assert str(e.value) == (
        f"data.path='{tmp_path}/ids.npy': {tmp_path}/ids.npy holds token id 64 at position 990 (a token index, "
        "from 0), outside the model's vocabulary (64: ids 0..63); the model's embedding would fail on it. Fix: token "
        "ids from the model's tokenizer, the data.dtype the file was written with, or a model whose vocabulary holds "
        "them.")
    with pytest.raises(ConfigError, match=r"token id 64 at position 990 .*outside data.vocab_size \(60: ids 0..59\)"):
        check_vocab(data, 60, 65)
    [record] = (tmp_path / "cache" / "runner" / "tokens" / "id-ranges").iterdir()
    assert json.loads(record.read_text())["range"] == {"low": 0, "low_at": 0, "high": 64, "high_at": 990,
                                                         "odd_high": 49}

    def no_scan(tokens):
        raise AssertionError("scanned again")

    monkeypatch.setattr(token_files, "_scan", no_scan)
    check_vocab(data, None, 65)  # the same file: its range comes from the record
    # Edited in place, size and modification time kept (cp -p, rsync -t): a negative id now.
    stat = (tmp_path / "ids.npy").stat()
    ids[990], ids[17] = 3, -2
    np.save(tmp_path / "ids.npy", ids)
    os.utime(tmp_path / "ids.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (tmp_path / "ids.npy").stat().st_size == stat.st_size
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"holds token id -2 at position 17 "):
        check_vocab(TokensData(path=str(tmp_path / "ids.npy"), seed=0), None, 65)


def test_uint32_ids_read_as_uint16_are_refused_before_launch_not_trained_on_as_halves(tmp_path, monkeypatch):
    # GPT-2 ids saved as int32 (np.int32(ids).tofile) and read with the default data.dtype=uint16:
    # each id became two, its low half and a 0, every one inside the vocabulary: the run trained on
    # [0, 777, 0, 8671, ...] without a word.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids = np.random.default_rng(0).integers(0, 50257, 4000)
    ids.astype(np.int32).tofile(tmp_path / "wide.bin")
    wide = TokensData(path=str(tmp_path / "wide.bin"), seed=0)
    assert wide.tokens[:4].tolist() == [ids[0] & 0xFFFF, 0, ids[1] & 0xFFFF, 0]
    refusal = (r"data.dtype=uint16: data.path='.*wide.bin': .*wide.bin read as uint16 holds ids of at most 0 at "
               r"every odd position \(1, 3, 5, ...\) and up to 50\d\d\d at the others: the pattern of uint32 \(or "
               r"int32\) ids read as uint16, .* Fix: data.dtype=uint32")
    with pytest.raises(ConfigError, match=refusal):
        check_vocab(wide, None, 50304)
    [record] = (tmp_path / "cache" / "runner" / "tokens" / "id-ranges").iterdir()
    older = json.loads(record.read_text())  # a record of a runner before odd_high: scanned again, not trusted
    del older["range"]["odd_high"]
    record.write_text(json.dumps(older))
    with pytest.raises(ConfigError, match=refusal):
        check_vocab(wide, None, 50304)
    check_vocab(TokensData(path=str(tmp_path / "wide.bin"), seed=0, dtype="uint32"), None, 50304)
    ids.astype(np.uint16).tofile(tmp_path / "narrow.bin")  # the same ids as uint16: read as they are
    check_vocab(TokensData(path=str(tmp_path / "narrow.bin"), seed=0), None, 50304)
    np.save(tmp_path / "halves.npy", np.asarray(wide.tokens))  # the way out the fix names: a .npy's dtype is known
    check_vocab(TokensData(path=str(tmp_path / "halves.npy"), seed=0), None, 50304)
    cfg = compose(*TINY, "parallel.pp=1", "train.batch_size=4", "parallel.microbatches=2", "data=tokens",
                  f"data.path={tmp_path}/wide.bin", "data.vocab_size=50304")
    with pytest.raises(ConfigError, match=refusal):
        validate(cfg)


def test_an_evaluation_reading_a_validation_window_twice_is_refused_before_launch(tmp_path):
    # 2000 tokens, the last 200 held out: 11 windows of 17. 3 x 4 samples would read the second
    # epoch's permutation too: one window twice (its loss counted double), the rest once.
    ((np.arange(2000) * 7) % 48).astype(np.uint16).tofile(tmp_path / "ids.bin")
    data = TokensData(path=str(tmp_path / "ids.bin"), seed=0, val_fraction=0.1)
    assert data.num_windows("val", 16) == 11 and len({window_index(n, 11, 0, "val") for n in range(12)}) == 11
    common = [*TINY, "model=mlp", "parallel.pp=1", "data=tokens", f"data.path={tmp_path}/ids.bin",
              "data.val_fraction=0.1", "train.batch_size=4", "parallel.microbatches=2", "eval.every=2"]
    with pytest.raises(ConfigError, match=r"eval.steps=3 x train.batch_size=4 = 12 held-out samples, but "
                                          r"data.path='.*ids.bin''s validation split holds 11 windows of "
                                          r"train.seq_len \+ 1 = 17 tokens: an evaluation would read 1 of them once "
                                          r"more than the others.*Fix: eval.steps=2 \(8 samples\) or eval.steps=11 "
                                          r"\(44 samples\)"):
        validate(compose(*common, "eval.steps=3"), tmp_path / "over")
    check_eval_windows(data, eval_steps=2, batch_size=4, seq_len=16)  # 8 of the 11 windows, each once
    check_eval_windows(data, eval_steps=1, batch_size=11, seq_len=16)  # each window once
    check_eval_windows(data, eval_steps=11, batch_size=2, seq_len=16)  # each window twice
    with pytest.raises(ConfigError, match=r"= 12 held-out samples.*read 1 of them once more.*Fix: eval.steps=11 "
                                          r"\(132 samples\) \(at most one pass"):
        check_eval_windows(data, eval_steps=1, batch_size=12, seq_len=16)


def test_validate_checks_a_token_file_against_a_hf_models_vocabulary_before_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = write_model(tmp_path / "llama", "llama", weights=False)
    ids = (np.arange(4000) % VOCAB).astype(np.uint16)
    ids[3990] = VOCAB  # the held-out tail
    ids.tofile(tmp_path / "train.bin")
    cfg = compose("device=cpu", "model=hf", f"model.path={model}", "model.pretrained=false", "data=tokens",
                  f"data.path={tmp_path}/train.bin", "train.seq_len=16", "parallel.pp=2", "parallel.microbatches=2",
                  "train.batch_size=4")
    with pytest.raises(ConfigError, match=rf"train.bin holds token id {VOCAB} at position 3990 .*outside the model's "
                                          rf"vocabulary \({VOCAB}: ids 0..{VOCAB - 1}\)"):
        validate(cfg)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_launch_with_data_vocab_size_null(
        tmp_path, tokenizer):
    # data.vocab_size=null (the tokenizer's, as the fix for a too small one advises) left the check
    # of the data's vocabulary against the model's without a number: the run launched and its first
    # step failed with "IndexError: index out of range in self" (on a GPU, a device-side assert).
    (tmp_path / "corpus.txt").write_text(TEXT * 50)
    assert len(load_tokenizer(str(tokenizer))) == 19
    text = [*TINY, "parallel.pp=1", "train.batch_size=4", "parallel.microbatches=2", "data=text",
            f"data.path={tmp_path}/corpus.txt", f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp_path}/cache"]
    with pytest.raises(ConfigError, match=r"data.vocab_size=null takes the data's vocabulary, data.tokenizer's \(19\), "
                                          r"which is larger than the model's vocabulary \(16\): token ids would fall "
                                          r"outside its embedding. Fix: "):
        validate(compose(*text, "data.vocab_size=null", "model.vocab_size=16"))
    with pytest.raises(ConfigError, match=r"data.vocab_size=19 is larger than the model's vocabulary \(16\)"):
        validate(compose(*text, "data.vocab_size=19", "model.vocab_size=16"))
    validate(compose(*text, "data.vocab_size=null", "model.vocab_size=19"))  # every id fits


@pytest.mark.parametrize(("content", "field", "expected"), [
    (b"", "text", r"empty.jsonl is empty: no records. Fix: "),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "text",
     r"bad.jsonl, line 2: byte 0xe9 at column 14 is not UTF-8 \(data=hf reads UTF-8\). Fix: that line"),
    (b'{"text": "ok"}\n\n{"text": "b"\n', "text",
     r"bad.jsonl, line 3: not JSON \(Expecting ',' delimiter at column 13"),
    (b'{"text": "ok"}\n[1, 2]\n', "text", r"bad.jsonl, line 2: a JSON list, where a record \(an object\) belongs"),
    (b'{"text": "ok", "n": 1}\n{"text": "b", "n": 2}\n', "n",
     r"data.field='n' of data.path=.* holds int64 values, not text \(columns: text \(string\), n \(int64\)\). "
     r"Fix: data.field=<a text column>: text."),
    (b'{"body": "ok"}\n', 3, r"data.field='3' is not a column .*\(columns: body \(string\)\)"),
])
def test_unreadable_records_are_named_by_file_and_line(tmp_path, tokenizer, content, field, expected):
    path = tmp_path / ("empty.jsonl" if not content else "bad.jsonl")
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=expected) as e:
        HFData(path=str(path), tokenizer=str(tokenizer), seed=0, field=field, cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(e.value)  # one paragraph


def test_data_hf_without_a_tokenizer_names_it_and_tokens_for_a_built_in_model_need_a_vocabulary():
    with pytest.raises(ConfigError, match=r"Required value\(s\) missing: data.tokenizer. Fix: .*data.tokenizer="):
        check_config(compose("data=hf", "data.path=x.jsonl"))
    with pytest.raises(ConfigError, match=r"model.vocab_size follows data.vocab_size, which is null.*Fix: "
                                          r"data.vocab_size=<the vocabulary size of the tokenizer"):
        check_config(compose("data=tokens", "data.path=x.bin"))
    check_config(compose("data=tokens", "data.path=x.bin", "data.vocab_size=50"))


def test_building_a_hf_dataset_leaves_the_launcher_able_to_fork(tmp_path, tokenizer):
    before = threading.enumerate()
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps({"text": TEXT}) for _ in range(20)))
    HFData(path=str(tmp_path / "corpus.jsonl"), tokenizer=str(tokenizer), seed=0, cache_dir=str(tmp_path / "c"))
    assert threading.enumerate() == before  # datasets' tqdm monitor is gone
    if before == [threading.main_thread()]:  # this process alone, as a launcher is (not after a test left a thread)
        assert spawn_reason("cpu") == "" and start_method("auto", "cpu") == "fork"


def test_a_user_dataset_is_asked_for_steps_numbered_from_1_and_a_resume_continues_them(tmp_path):
    from runner.ranks.dist import DistEnv
    from runner.train import train

    def run(run_dir, *overrides):
        cfg = compose(*TINY, "model=mlp", "data._target_=helpers.datasets.StepLog", "parallel.pp=1",
                      "parallel.microbatches=2", "train.batch_size=4", "eval.every=2", "eval.steps=2", *overrides)
        datasets.CALLS.clear()
        run_dir.mkdir(parents=True, exist_ok=True)
        plan = validate(cfg, run_dir)
        validated = list(datasets.CALLS)
        return validated, train(plan, cfg, DistEnv(0, 1, torch.device("cpu"))), list(datasets.CALLS)

    validated, full, calls = run(tmp_path / "full", "train.steps=4", "checkpoint.every=2")
    assert validated == [(1, "train"), (1, "val")]  # the first batch of each split, checked before launch
    val = [(1, "val"), (2, "val")]
    assert calls[2:] == [(1, "train"), (2, "train"), *val, (3, "train"), (4, "train"), *val]
    _, resumed, calls = run(tmp_path / "resumed", "train.steps=4",
                            f"checkpoint.resume={tmp_path}/full/checkpoints/step-2")
    assert calls[2:] == [(3, "train"), (4, "train"), *val]
    assert resumed.losses == pytest.approx(full.losses[2:], rel=1e-6, abs=0)


def test_the_launcher_says_why_it_cannot_fork():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-behind")
    thread.start()
    try:
        assert spawn_reason("cpu") == "threads run in the launcher (left-behind): a fork would copy the locks they hold"
        assert start_method("auto", "cpu") == "spawn" and start_method("fork", "cpu") == "fork"
    finally:
        stop.set()
        thread.join()
    assert spawn_reason("cuda") == "device cuda: its state does not survive a fork"
