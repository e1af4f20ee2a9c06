"""The token cache: text is tokenized in pieces of bounded size whose ids are exactly the whole
document's, into a file keyed by what can change the ids (an edit that keeps size and modification
time included), verified against its manifest on every use and rebuilt when it does not match; no
partial file survives, and a cache that cannot be written is one clear error."""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pytest

from runner.data import token_cache
from runner.data.files import text_files
from runner.data.token_cache import chunks, tokenize_to_cache, tokenizer_digest
from runner.data.tokens import load_tokenizer, text_documents
from runner.errors import ConfigError

from helpers.hf import write_trained_tokenizer

# Long lines, runs of spaces, blank lines, tabs, leading spaces, digits, punctuation, accents, CJK.
DOCUMENTS = [
    "the pipeline  stage runs every microbatch forward and backward while another rank waits " * 12,
    "  it's 12 3.5\n\n the\ta  naïve café   runs\n  東京 (x) a-b don't " * 9 + "end",
    "rank waits",
]


@pytest.fixture(autouse=True)
def fresh_run(monkeypatch):
    """Each test starts as a new run: nothing verified yet, in this process or its environment."""
    monkeypatch.setattr(token_cache, "_memo", {})
    monkeypatch.setenv(token_cache._MEMO_ENV, "{}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {kind: str(write_trained_tokenizer(tmp_path_factory.mktemp(kind), kind))
            for kind in ("bpe", "byte_level", "metaspace", "prepend")}


def whole(tokenizer_dir: str, documents: list[str]) -> list[int]:
    tok = load_tokenizer(tokenizer_dir)
    return [t for d in documents for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def corpus(tmp_path, documents=DOCUMENTS):
    directory = tmp_path / "corpus"
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(documents):
        (directory / f"doc{i}.txt").write_text(text)
    return directory


def cached(path, tokenizer_dir, cache, *, chunk_chars=token_cache.CHUNK_CHARS, by_content=False, block=64):
    files, pieces = text_documents(text_files(str(path)), chunk_chars=block)
    tokens, _ = tokenize_to_cache(pieces, files=files, tokenizer=load_tokenizer(tokenizer_dir),
                                  tokenizer_dir=tokenizer_dir, cache_dir=str(cache),
                                  extra="text", by_content=by_content, chunk_chars=chunk_chars)
    return tokens


def spy_encode(monkeypatch) -> list[list[str]]:
    """What the tokenizer is given, call by call."""
    calls: list[list[str]] = []
    encode = token_cache._encode
    monkeypatch.setattr(token_cache, "_encode", lambda tok, texts: calls.append(texts) or encode(tok, texts))
    return calls


@pytest.mark.parametrize("kind", ["bpe", "byte_level", "metaspace"])
def test_pieces_cut_before_a_space_give_exactly_the_whole_documents_ids(tmp_path, tokenizers, kind, monkeypatch):
    for cap in (13, 50, 97):  # cuts at other places
        tokens = cached(corpus(tmp_path), tokenizers[kind], tmp_path / f"cache{cap}", chunk_chars=cap, block=7)
        assert tokens.tolist() == whole(tokenizers[kind], DOCUMENTS), cap
        assert "forced" not in [cut for _, _, cut in chunks(((d, True) for d in DOCUMENTS), cap)]
    calls = spy_encode(monkeypatch)
    tokens = cached(corpus(tmp_path), tokenizers[kind], tmp_path / "cache", chunk_chars=29, block=11)
    assert tokens.tolist() == whole(tokenizers[kind], DOCUMENTS)
    pieces = [t for call in calls for t in call]
    assert len(pieces) > 60 and max(len(t) for t in pieces) <= 29  # many pieces, none over the cap
    assert all(sum(len(t) for t in call) <= 29 for call in calls)  # nor any one call of the tokenizer
    assert "".join(pieces) == "".join(DOCUMENTS)
    pieces = list(chunks(((d, True) for d in DOCUMENTS), 29))
    assert [t for t, _, _ in pieces] == [t for call in calls for t in call]
    after_cut = [following for (_, _, cut), (following, _, _) in zip(pieces, pieces[1:]) if cut]
    assert len(after_cut) > 50 and all(t[0] == " " and not t[1].isspace() for t in after_cut)  # " word"
    assert token_cache._chunk_safe(load_tokenizer(tokenizers[kind]))


def test_pieces_keep_every_character_stay_under_the_cap_and_are_forced_only_without_a_space_before_a_word():
    import random

    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(["a", "bc", " ", "  ", "\n", "\t", "é"]) for _ in range(rng.randrange(0, 80)))
        cap, cuts = rng.randrange(2, 12), sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        blocks = [(text[a:b], False) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [("", True)]
        pieces = list(chunks(blocks, cap))
        assert "".join(t for t, _, _ in pieces) == text and pieces[-1][1:] == (True, "")
        assert all(len(t) <= cap for t, _, _ in pieces), (text, cap)
        start = 0
        for (piece, _, cut), (following, _, _) in zip(pieces, pieces[1:]):
            start += len(piece)
            if cut == "space":
                assert following[0] == " " and not following[1].isspace()
            else:  # forced: no space before a word anywhere in the window it was cut from
                window = text[start - len(piece):start + 1]
                assert cut == "forced" and not re.search(r"(?<=.) (?=\S)", window), (text, cap, piece)


def test_a_tokenizer_that_prepends_to_every_text_is_found_out_and_its_cuts_are_warned_about(tmp_path, tokenizers,
                                                                                            caplog):
    tok = load_tokenizer(tokenizers["prepend"])
    assert not token_cache._chunk_safe(tok)  # '▁' + ' the' != the whole text's ids
    short = ["the pipeline runs", "a stage waits"]
    with caplog.at_level(logging.WARNING, logger="runner.token_cache"):
        tokens = cached(corpus(tmp_path, short), tokenizers["prepend"], tmp_path / "cache")
    assert tokens.tolist() == whole(tokenizers["prepend"], short) and not caplog.records  # no cut: exact
    with caplog.at_level(logging.WARNING, logger="runner.token_cache"):
        cached(corpus(tmp_path / "long", DOCUMENTS[:1]), tokenizers["prepend"], tmp_path / "cache", chunk_chars=100)
    [record] = caplog.records
    cuts = [cut for _, _, cut in chunks([(DOCUMENTS[0], True)], 100)]
    assert f"data.tokenizer={tokenizers['prepend']!r} does not give the same ids" in record.getMessage()
    assert f"{cuts.count('space')} cuts of documents longer than 100 characters" in record.getMessage()
    assert cuts.count("space") == len(DOCUMENTS[0]) // 100 and "forced" not in cuts


def test_a_long_line_is_tokenized_in_bounded_pieces_and_a_run_without_spaces_is_cut_with_a_warning(
        tmp_path, tokenizers, monkeypatch, caplog):
    line = "the pipeline stage runs every microbatch " * 900  # a 36 KB line: 37 pieces of at most 1000
    calls = spy_encode(monkeypatch)
    tokens = cached(corpus(tmp_path, [line]), tokenizers["byte_level"], tmp_path / "cache", chunk_chars=1000,
                    block=4096)
    assert tokens.tolist() == whole(tokenizers["byte_level"], [line])
    assert max(len(t) for call in calls for t in call) <= 1000 and len(sum(calls, [])) == 37
    calls.clear()
    spaceless = "a" * 2500 + " the end"
    with caplog.at_level(logging.WARNING, logger="runner.token_cache"):
        cached(corpus(tmp_path / "x", [spaceless]), tokenizers["byte_level"], tmp_path / "cache", chunk_chars=1000)
    assert [len(t) for call in calls for t in call] == [1000, 1000, 508]
    assert "2 runs of more than 1000 characters without a space" in caplog.records[0].getMessage()
    pieces = list(chunks([("x  y" + " " * 8, False), ("z", True)], 5))  # spaces before spaces: no cut there
    assert pieces == [("x ", False, "space"), (" y   ", False, "forced"), ("    ", False, "space"),
                      (" z", True, "")]


def test_an_edit_that_keeps_size_and_modification_time_is_tokenized_again(tmp_path, tokenizers):
    text = corpus(tmp_path, ["the pipeline runs forward"]) / "doc0.txt"
    cache = tmp_path / "cache"
    assert cached(text, tokenizers["bpe"], cache).tolist() == whole(tokenizers["bpe"], ["the pipeline runs forward"])
    stat = text.stat()
    text.write_text("the pipeline runs backward"[:len("the pipeline runs forward")])  # cp -p / rsync -t / tar
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert text.stat().st_size == stat.st_size and text.stat().st_mtime_ns == stat.st_mtime_ns
    assert cached(text, tokenizers["bpe"], cache).tolist() == whole(tokenizers["bpe"], [text.read_text()])
    assert len(list(cache.glob("*.uint16"))) == 2


def test_by_content_a_copy_reuses_the_cache_and_any_edit_rebuilds_it(tmp_path, tokenizers):
    from runner.data.datasets import build_dataset

    from helpers.config import compose

    text = corpus(tmp_path, ["the pipeline runs forward"]) / "doc0.txt"
    cache = tmp_path / "cache"

    def build(path):
        cfg = compose("data=text", f"data.path={path}", f"data.tokenizer={tokenizers['bpe']}",
                      f"data.cache_dir={cache}", "data.cache_by_content=true")
        return build_dataset(cfg.data, seed=0).tokens.tolist()

    first = build(text)
    copy = tmp_path / "elsewhere.txt"
    copy.write_text(text.read_text())
    assert build(copy) == first and len(list(cache.glob("*.uint16"))) == 1  # the same bytes: the same file
    stat = text.stat()
    text.write_text("the pipeline runs backward"[:stat.st_size])
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert build(text) == whole(tokenizers["bpe"], [text.read_text()]) != first


def test_a_truncated_or_altered_cache_file_is_rebuilt_with_a_warning_naming_it(tmp_path, tokenizers, caplog,
                                                                              monkeypatch):
    path, cache, tok = corpus(tmp_path), tmp_path / "cache", tokenizers["metaspace"]
    expected = whole(tok, DOCUMENTS)
    assert cached(path, tok, cache).tolist() == expected
    [file] = cache.glob("*.uint16")
    manifest = json.loads((cache / f"{file.name}.json").read_text())
    assert manifest["bytes"] == file.stat().st_size == 2 * len(expected) and manifest["tokens"] == len(expected)
    assert (manifest["min_id"], manifest["max_id"]) == (min(expected), max(expected))
    assert manifest["tokenizer"] == tokenizer_digest(load_tokenizer(tok), tok)
    vocab = len(load_tokenizer(tok))
    damages = {  # what was done to the file -> what the warning says
        "truncated to an even size": (lambda b: b[:-6], "is %d bytes, its manifest" % (file.stat().st_size - 6)),
        "in-vocabulary garbage": (lambda b: np.full(len(b) // 2, 5, np.uint16).tobytes(), "does not match the sha256"),
        "out-of-vocabulary garbage": (lambda b: np.full(len(b) // 2, vocab + 9, np.uint16).tobytes(),
                                      "does not match the sha256"),
    }
    for damage, says in damages.values():
        file.write_bytes(damage(file.read_bytes()))
        monkeypatch.setattr(token_cache, "_memo", {})  # a later run
        monkeypatch.setenv(token_cache._MEMO_ENV, "{}")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="runner.token_cache"):
            assert cached(path, tok, cache).tolist() == expected
        assert f"token cache {file} {says}" in caplog.text and "rebuilding it" in caplog.text
    (cache / f"{file.name}.json").unlink()  # a file without its manifest (a run killed between the two)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runner.token_cache"):
        assert cached(path, tok, cache).tolist() == expected
    assert "has no readable manifest" in caplog.text


def test_the_digest_is_checked_once_per_run_and_ranks_inherit_the_verification(tmp_path, tokenizers, monkeypatch):
    path, cache, tok = corpus(tmp_path), tmp_path / "cache", tokenizers["bpe"]
    cached(path, tok, cache)  # built: what it wrote counts as verified
    hashed = []
    digest = token_cache._file_sha256
    monkeypatch.setattr(token_cache, "_file_sha256", lambda f: hashed.append(f.name) or digest(f))
    cached(path, tok, cache)
    assert hashed == []
    monkeypatch.setattr(token_cache, "_memo", {})  # the launcher of a later run: hashes the whole file once
    monkeypatch.setenv(token_cache._MEMO_ENV, "{}")
    cached(path, tok, cache)
    cached(path, tok, cache)
    [file] = cache.glob("*.uint16")
    assert hashed == [file.name]
    monkeypatch.setattr(token_cache, "_memo", {})  # a rank it starts: the environment says verified
    cached(path, tok, cache)
    assert hashed == [file.name]
    os.utime(file)  # touched since: its identity changed, so the rank hashes it again
    cached(path, tok, cache)
    assert hashed == [file.name, file.name]


def test_no_partial_file_survives_a_failure_and_those_of_killed_runs_are_removed(tmp_path, tokenizers):
    cache = tmp_path / "cache"

    def failing():
        yield "the pipeline runs", False
        raise RuntimeError("the source went away")

    with pytest.raises(RuntimeError, match="went away"):
        tokenize_to_cache(failing(), files=[corpus(tmp_path)], tokenizer=load_tokenizer(tokenizers["bpe"]),
                          tokenizer_dir=tokenizers["bpe"], cache_dir=str(cache))
    assert list(cache.iterdir()) == []
    dead = os.fork()  # a process that has ended: its id names no process now
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    host = token_cache.socket.gethostname()
    killed = cache / f".x.uint16~{host}~{dead}~abcd1234.partial"  # a run killed while tokenizing
    running = cache / f".y.uint16~{host}~{os.getpid()}~abcd1234.partial"  # one still tokenizing
    old = cache / ".z.uint16.1234abcd.partial"  # an older runner's, two days old
    for file in (killed, running, old):
        file.write_bytes(b"")
    os.utime(old, (0, 0))
    cached(corpus(tmp_path), tokenizers["bpe"], cache)
    assert sorted(f.name for f in cache.glob(".*")) == [running.name]


def test_a_cache_directory_that_cannot_be_written_is_one_error_naming_it_and_the_key(tmp_path, tokenizers):
    from runner.data.datasets import build_dataset

    from helpers.config import compose

    (tmp_path / "file").write_text("")
    cfg = compose("data=text", f"data.path={corpus(tmp_path)}", f"data.tokenizer={tokenizers['bpe']}",
                  f"data.cache_dir={tmp_path / 'file' / 'cache'}")
    with pytest.raises(ConfigError) as e:  # as the launcher builds the dataset: our error, not a wrapped one
        build_dataset(cfg.data, seed=0)
    assert str(e.value).startswith(f"The token cache directory {str(tmp_path / 'file' / 'cache')!r} "
                                   "(data.cache_dir) cannot be written: Not a directory")
    assert "Fix: data.cache_dir=<a writable directory" in str(e.value) and "\n" not in str(e.value)
    def disk_full(tokenizer, texts):
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as m:  # the disk fills while the cache is written
        m.setattr(token_cache, "_encode", disk_full)
        with pytest.raises(ConfigError, match=r"'.*cache' \(data.cache_dir\) cannot be written: No space left"):
            cached(corpus(tmp_path), tokenizers["bpe"], tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing partial left
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=r"'.*read-only' \(data.cache_dir\) cannot be written: Permission denied"):
        cached(corpus(tmp_path), tokenizers["bpe"], read_only)


def test_the_tokenizer_digest_is_its_pipeline_not_the_weights_beside_it(tmp_path, tokenizers):
    import shutil

    directory = shutil.copytree(tokenizers["bpe"], tmp_path / "model")
    (directory / "model.safetensors").write_bytes(b"weights")
    digest = tokenizer_digest(load_tokenizer(str(directory)), str(directory))
    (directory / "model.safetensors").write_bytes(b"other weights")
    assert tokenizer_digest(load_tokenizer(str(directory)), str(directory)) == digest  # stable, weights unread
    assert tokenizer_digest(load_tokenizer(tokenizers["byte_level"]), tokenizers["byte_level"]) != digest


def test_an_edit_of_a_dataset_file_that_keeps_size_and_modification_time_is_read_again(tmp_path, tokenizers):
    from runner.data.datasets import HFData

    records = tmp_path / "a.jsonl"
    records.write_text(json.dumps({"text": "the pipeline runs forward"}) + "\n")
    read = lambda: HFData(path=str(records), tokenizer=tokenizers["bpe"], seed=0,  # noqa: E731
                          cache_dir=str(tmp_path / "cache")).tokens.tolist()
    before = read()
    stat = records.stat()
    records.write_text(json.dumps({"text": "the pipeline runs backward"[:len("the pipeline runs forward")]}) + "\n")
    os.utime(records, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # Not datasets' Arrow copy of the old text (which it keys by path and modification time).
    assert read() == whole(tokenizers["bpe"], ["the pipeline runs backwar"]) != before
