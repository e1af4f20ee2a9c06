"""The token cache: text documents tokenized once into a flat file of ids, beside a manifest.

The file is named by a key of the sources (each file's path, device, inode, size, modification and
change times: ``cp -p``, ``rsync -t`` and ``tar`` keep a modification time but cannot keep a change
time; or, with ``by_content``, a SHA-256 of each file's bytes), the tokenizer (a digest of its whole
pipeline) and the chunk size. The manifest (``<file>.json``) holds the file's size and SHA-256, the
tokenizer's digest and the smallest and largest id; a cache file that does not match it is rebuilt,
with a warning naming it. Its size is checked on every use; its digest once per run: the launcher
verifies before any rank starts and leaves what it verified (the file's identity) in the
environment, which the ranks inherit, so a rank hashes only what changed since.

Documents are tokenized in pieces of at most ``chunk_chars`` characters (the tokenizer's memory
grows with the piece, not with the longest line): a piece ends just before a space that a
non-space follows, where byte-level, whitespace and Metaspace pre-tokenizers split anyway, so the
ids are the whole document's. A tokenizer for which that does not hold (a probe text says so), and
a run of more than ``chunk_chars`` characters without such a space (cut where it reaches that
length), are warned about with the number of cuts affected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from runner.data.files import default_cache_dir, file_identity
from runner.errors import ConfigError

__all__ = ["tokenize_to_cache", "chunks", "source_key", "tokenizer_digest", "CHUNK_CHARS"]

log = logging.getLogger("runner.token_cache")  # named as before runner/ became packages (runner.log)

CHUNK_CHARS = 1 << 20  # about 120 bytes of tokenizer memory per character: ~130 MB per piece
_FORMAT = 1  # of the manifest and of the key: a change re-tokenizes
_BATCH = 256  # pieces per tokenizer call (and at most CHUNK_CHARS characters)
_MEMO_ENV = "RUNNER_TOKEN_CACHE_VERIFIED"  # what this run verified, for the ranks it starts
_STALE_S = 24 * 3600  # a partial file of another host (or an older runner) is left this long
_PARTIAL = re.compile(r"~(?P<host>[^~]+)~(?P<pid>\d+)~[0-9a-f]+\.partial$")
# Spaces before words, several spaces, newlines, tabs, digits, punctuation, contractions, accents,
# CJK and an emoji: tokenized whole and cut before each space, the ids must be the same.
_PROBE = ("The  pipeline\n stage   runs\n\nevery it's 12 345.6 café  naïve\tand  backward ( x ) "
          "— 東京 の 駅 🙂 end.  \n  Next line:  a-b,  c;d  ")
_LISTED_DOCUMENTS = 100_000  # documents whose token counts a manifest lists (data=text: one per file)
_WEIGHTS = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt"}


def tokenize_to_cache(pieces: Iterable[tuple[str, bool]], *, files: Sequence[Path], tokenizer, tokenizer_dir: str,
                      cache_dir: str | None, extra: str = "", by_content: bool = False,
                      chunk_chars: int = CHUNK_CHARS) -> tuple[np.ndarray, int]:
    """Token ids of the documents in ``pieces`` (text, and whether a document ends with it; the
    tokenizer's EOS follows each document), as a memory map of the cache file for ``files`` and
    ``tokenizer`` (loaded from ``tokenizer_dir``): verified against its manifest, or (re)built.
    Returns the ids and the vocabulary size."""
    vocab = len(tokenizer)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    tok = tokenizer_digest(tokenizer, tokenizer_dir)
    key = source_key(files, tokenizer=tok, extra=f"{extra}|{chunk_chars}", by_content=by_content)
    target = cache / f"{key}.{dtype.name}"
    expected = {"format": _FORMAT, "key": key, "tokenizer": tok, "dtype": dtype.name}
    problem = _problem(target, expected, vocab)
    if problem:
        if problem != "absent":
            log.warning("token cache %s %s: rebuilding it", target, problem)
        _prepare(cache)
        log.info("tokenizing %s%s into %s", ", ".join(str(f) for f in files[:3]), " …" if len(files) > 3 else "",
                 target)
        manifest = _build(pieces, tokenizer, target, dtype, chunk_chars, tokenizer_dir)
        _write_manifest(target, {**expected, **manifest, "sources": [str(f) for f in files[:100]],
                                 "num_sources": len(files)})
        _remember(file_identity(target), manifest["sha256"])
        log.info("%d tokens", manifest["tokens"])
    _log_tokens_by_type(files, target)
    if target.stat().st_size == 0:  # no documents (a memory map cannot be empty)
        return np.zeros(0, dtype), vocab
    return np.memmap(target, dtype=dtype, mode="r"), vocab


def source_key(files: Sequence[Path], *, tokenizer: str, extra: str, by_content: bool) -> str:
    """The cache key of ``files`` (in order) for a tokenizer digest: by their identity (path,
    device, inode, size, times), or by their bytes (then a run hashes each file once: ranks
    find the key their launcher computed in the environment)."""
    h = hashlib.sha256(f"{_FORMAT}|{extra}|{tokenizer}|{'content' if by_content else 'stat'}".encode())
    identities = "\n".join(file_identity(f) for f in files)
    if by_content:
        name = f"content:{identities}"
        content = _recall(name) or hashlib.sha256("\n".join(_file_sha256(f) for f in files).encode()).hexdigest()
        _remember(name, content)
        h.update(content.encode())
    else:
        h.update(identities.encode())
    return h.hexdigest()[:32]


def tokenizer_digest(tokenizer, directory: str) -> str:
    """What decides the ids: the tokenizer's whole pipeline (a fast tokenizer's serialisation),
    or the tokenizer files of a slow one (never the weights of a model directory)."""
    h = hashlib.sha256(f"{type(tokenizer).__name__}|{tokenizer.eos_token_id}".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        for f in sorted(Path(directory).expanduser().iterdir()):
            if f.is_file() and f.suffix not in _WEIGHTS:
                h.update(f"{f.name}|{_file_sha256(f)}".encode())
    return h.hexdigest()


def chunks(blocks: Iterable[tuple[str, bool]], cap: int) -> Iterator[tuple[str, bool, str]]:
    """The documents in ``blocks`` (text, document ends) as pieces of at most ``cap`` characters:
    (text, document ends, how the piece ended: "" at a document's end, "space" just before a space
    that a non-space follows, "forced" where a run without one reached ``cap``)."""
    rest = ""
    for block, ends in blocks:
        rest += block
        while len(rest) > cap + (not ends):  # within a document, what follows a space at ``cap`` is known
            cut = _cut(rest, cap)
            yield rest[:cut or cap], False, "space" if cut else "forced"
            rest = rest[cut or cap:]
        if ends:
            yield rest, True, ""
            rest = ""
    if rest:
        yield rest, False, ""


def _cut(text: str, cap: int) -> int:
    """The last position ``0 < p <= cap`` where ``text[p]`` is a space and ``text[p + 1]`` is not
    whitespace; 0 if there is none."""
    p = text.rfind(" ", 1, min(cap, len(text) - 2) + 1)
    while p > 0:
        if not text[p + 1].isspace():
            return p
        p = text.rfind(" ", 1, p)
    return 0


def _batched(pieces: Iterable[tuple[str, bool, str]], chars: int) -> Iterator[list[tuple[str, bool, str]]]:
    """Groups of at most ``_BATCH`` pieces and ``chars`` characters (or one piece)."""
    group: list[tuple[str, bool, str]] = []
    size = 0
    for piece in pieces:
        if group and (size + len(piece[0]) > chars or len(group) == _BATCH):
            yield group
            group, size = [], 0
        group.append(piece)
        size += len(piece[0])
    if group:
        yield group


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _chunk_safe(tokenizer) -> bool:
    """Whether cutting before a space keeps this tokenizer's ids (the probe text, cut at each)."""
    whole = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    cuts = [p for p in range(1, len(_PROBE) - 1) if _PROBE[p] == " " and not _PROBE[p + 1].isspace()]
    return all(sum(tokenizer([_PROBE[:p], _PROBE[p:]], add_special_tokens=False)["input_ids"], []) == whole
               for p in cuts)


def _build(pieces: Iterable[tuple[str, bool]], tokenizer, target: Path, dtype: np.dtype, cap: int,
           tokenizer_dir: str) -> dict:
    """Write the cache file beside ``target`` and rename it into place; a failure leaves no
    partial file behind. Returns its manifest's numbers."""
    _remove_stale_partials(target.parent)
    partial = _partial(target)
    digest, tokens, lo, hi, cuts = hashlib.sha256(), 0, 1 << 32, -1, Counter[str]()
    documents: list[int] = [0]  # tokens of each document, the last one open
    try:
        with open(partial, "wb") as out:
            for group in _batched(chunks(pieces, cap), cap):
                for ids, (_, ends, cut) in zip(_encode(tokenizer, [text for text, _, _ in group]), group):
                    array = np.asarray(ids + [tokenizer.eos_token_id] * ends, dtype=dtype)
                    out.write(array.tobytes())
                    digest.update(array.tobytes())
                    tokens, cuts[cut] = tokens + array.size, cuts[cut] + 1
                    documents[-1] += array.size
                    if ends:
                        documents.append(0)
                    if array.size:
                        lo, hi = min(int(array.min()), lo), max(int(array.max()), hi)
        os.replace(partial, target)
    except OSError as e:
        if e.filename is not None and Path(e.filename).parent != target.parent:  # a source, not the cache
            raise ConfigError(f"{e.filename}: cannot be read for tokenizing ({e.strerror or e}). Fix: a readable "
                              "data.path.") from e
        raise _cache_error(target.parent, e) from e
    finally:
        partial.unlink(missing_ok=True)
    _warn_cuts(cuts, tokenizer, tokenizer_dir, cap)
    return {"tokens": tokens, "bytes": tokens * dtype.itemsize, "sha256": digest.hexdigest(),
            "min_id": lo if tokens else None, "max_id": hi if tokens else None,
            "document_tokens": documents[:-1] if len(documents) <= _LISTED_DOCUMENTS else None}


def _log_tokens_by_type(files: Sequence[Path], target: Path) -> None:
    """Tokens per file type where each file is one document (``data=text``): what the corpus the
    model sees is made of (a directory's skipped files are logged by ``runner.data.files``)."""
    try:
        counts = json.loads(target.with_name(target.name + ".json").read_text()).get("document_tokens")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(counts, list) or len(counts) != len(files) or len(files) < 2:
        return
    by_type: Counter[str] = Counter()
    for file, count in zip(files, counts):
        by_type[file.suffix.lower() or "(no suffix)"] += count
    log.info("tokens per file type: %s", ", ".join(f"{suffix} {count}" for suffix, count in by_type.most_common()))


def _warn_cuts(cuts: Counter, tokenizer, tokenizer_dir: str, cap: int) -> None:
    if cuts["forced"]:
        log.warning("%d runs of more than %d characters without a space followed by a word were cut where they "
                    "reached that length (to bound the tokenizer's memory): the ids at those cuts may differ from "
                    "tokenizing the whole text", cuts["forced"], cap)
    if cuts["space"] and not _chunk_safe(tokenizer):
        log.warning("data.tokenizer=%r does not give the same ids for a text cut before a space as for the whole "
                    "text (e.g. a tokenizer that prepends '▁' to every text): %d cuts of documents longer than %d "
                    "characters may each differ from the whole document's ids. Fix, for exact ids: documents "
                    "shorter than that (one per file or record)", tokenizer_dir, cuts["space"], cap)


def _problem(target: Path, expected: dict, vocab: int) -> str | None:
    """Why the cache file cannot be used ("absent" when there is none yet), or None."""
    manifest_file = target.with_name(target.name + ".json")
    if not target.is_file():
        return "absent"
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as e:
        return f"has no readable manifest ({manifest_file.name}: {type(e).__name__})"
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in expected.items()):
        return f"does not match its manifest {manifest_file.name} (another key, tokenizer or format)"
    size = target.stat().st_size
    if size != manifest.get("bytes"):
        return f"is {size} bytes, its manifest {manifest_file.name} says {manifest.get('bytes')} (truncated or altered)"
    if manifest.get("max_id") is not None and not 0 <= manifest["min_id"] <= manifest["max_id"] < vocab:
        return f"holds ids {manifest['min_id']}..{manifest['max_id']}, outside the tokenizer's vocabulary ({vocab})"
    identity = file_identity(target)
    if not isinstance(manifest.get("sha256"), str):
        return f"has no sha256 in its manifest {manifest_file.name}"
    if _recall(identity) != manifest["sha256"]:  # not verified by this run yet (or changed since)
        try:
            digest = _file_sha256(target)
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if digest != manifest["sha256"]:
            return f"does not match the sha256 in its manifest {manifest_file.name} (its ids were altered)"
        _remember(identity, manifest["sha256"])
    return None


def _write_manifest(target: Path, manifest: dict) -> None:
    file = target.with_name(target.name + ".json")
    partial = _partial(file)
    try:
        partial.write_text(json.dumps(manifest, indent=1))
        os.replace(partial, file)
    except OSError as e:
        raise _cache_error(target.parent, e) from e
    finally:
        partial.unlink(missing_ok=True)


def _partial(file: Path) -> Path:
    """Where ``file`` is written before it is renamed into place: hidden, named by host and process
    (so that a later build knows whether its writer is gone)."""
    return file.with_name(f".{file.name}~{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:8]}.partial")


def _prepare(cache: Path) -> None:
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_error(cache, e) from e
    if not os.access(cache, os.W_OK | os.X_OK):
        raise _cache_error(cache, PermissionError(13, "Permission denied (not writable)", str(cache)))


def _cache_error(cache: Path, e: OSError) -> ConfigError:
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(cache) else ""
    return ConfigError(f"The token cache directory {str(cache)!r} (data.cache_dir) cannot be written: "
                       f"{e.strerror or e}{where}. Fix: data.cache_dir=<a writable directory with room for the "
                       "tokenized corpus>, or free space there.")


def _remove_stale_partials(cache: Path) -> None:
    """Partial files of killed runs: this host's whose process is gone, and any older than a day."""
    host = socket.gethostname()
    for file in cache.glob(".*.partial"):
        m = _PARTIAL.search(file.name)
        try:
            stale = (m is not None and m["host"] == host and not _alive(int(m["pid"]))) or (
                time.time() - file.stat().st_mtime > _STALE_S)
            if stale:
                file.unlink()
                log.info("removed %s, left by a run that was killed while tokenizing", file)
        except OSError:  # removed meanwhile, or not ours to remove
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _file_sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# What this run verified: in this process, and in the environment for the ranks it starts.
_memo: dict[str, str] = {}


def _recall(name: str) -> str | None:
    name = hashlib.sha256(name.encode()).hexdigest()[:32]
    return _memo.get(name) or _inherited().get(name)


def _remember(name: str, value: str) -> None:
    name = hashlib.sha256(name.encode()).hexdigest()[:32]
    _memo[name] = value
    env = _inherited()
    env[name] = value
    os.environ[_MEMO_ENV] = json.dumps(dict(list(env.items())[-32:]))  # digests only: it stays small


def _inherited() -> dict[str, str]:
    try:
        env = json.loads(os.environ.get(_MEMO_ENV, "{}"))
    except ValueError:
        return {}
    return env if isinstance(env, dict) else {}
