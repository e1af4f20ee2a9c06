"""``python -m runner.generate <run dir or checkpoint> prompt="..."`` (or ``runner-generate``):
text from a trained run, without exporting it first.

Loads the newest complete checkpoint of a run directory (or the checkpoint named) in this one
process, without a process group (DCP's ``no_dist``), and continues the prompt with the tokenizer
the run trained with (the checkpoint's ``tokenizer/``; a byte-level run's bytes). Greedy by default
(``temperature=0``); ``temperature>0`` samples, from the ``top_k`` likeliest tokens where
``top_k>0``, with a generator seeded by ``seed``: the same settings give the same text. It stops
after ``max_new_tokens`` tokens or at the tokenizer's end-of-sequence token. Works for
``model=hf`` (its own key-value cache, as transformers' ``generate``) and the built-in models.

Settings are ``key=value`` words after the source; a run without a tokenizer (synthetic data,
pre-tokenized ids) takes ``prompt_ids="1 2 3"`` and prints ids. Exit codes as ``python -m
runner``'s: 2 bad input (nothing loaded), 3 the checkpoint could not be used, 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import operator
import signal
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import nn

from runner.checkpoint.files import TOKENIZER_DIR, TOKENIZER_FILES, find_checkpoint, read_train_state
from runner.checkpoint.model import checkpoint_model, max_positions, run_config
from runner.errors import ConfigError, RunnerError, exit_code, interrupted_exit_code, shown
from runner.rundir import LOCK_FILE

__all__ = ["Settings", "Generation", "generate", "main"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PROG = "python -m runner.generate"


def _setting(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings:
    """What ``key=value`` words set (each key's meaning: its help, as ``--help`` prints it)."""

    prompt: str | None = _setting(None, "the text to continue (required, or prompt_ids)")
    prompt_ids: tuple[int, ...] | None = _setting(None, 'token ids instead, for a run without a tokenizer: "1 5 9"')
    max_new_tokens: int = _setting(64, "the token budget: at most this many tokens after the prompt")
    temperature: float = _setting(0.0, "0: greedy (the likeliest token each step); > 0: sample from "
                                       "softmax(logits / temperature)")
    top_k: int = _setting(0, "sample from the k likeliest tokens only; 0: from all")
    seed: int = _setting(0, "the sampling generator's seed: the same settings and seed, the same text")
    stop_at_eos: bool = _setting(True, "stop at the tokenizer's end-of-sequence token (true or false)")
    device: str = _setting("cpu", "cpu, cuda, cuda:1, ...")
    dtype: str = _setting("fp32", "the weights' and the computation's: fp32, bf16 or fp16")

    def __post_init__(self) -> None:
        # From Python the ids may come as any sequence of integers, or as the command line's text.
        ids = self.prompt_ids
        if isinstance(ids, str):
            object.__setattr__(self, "prompt_ids", _value("prompt_ids", ids))
        elif ids is not None:
            try:
                object.__setattr__(self, "prompt_ids", tuple(operator.index(i) for i in ids))
            except TypeError:
                raise ConfigError(f"prompt_ids={ids!r} is not a sequence of token ids. Fix: e.g. "
                                  'prompt_ids=(1, 5, 9) or prompt_ids="1 5 9".') from None

    def check(self) -> None:
        """Every value a user can get wrong, before anything is loaded."""
        if self.prompt is None and self.prompt_ids is None:
            raise ConfigError(f'no prompt. Fix: {_PROG} <run dir> prompt="Once upon a time".')
        if self.prompt is not None and self.prompt_ids is not None:
            raise ConfigError("prompt and prompt_ids are both given. Fix: one of them.")
        if self.prompt is not None and not self.prompt.strip():
            raise ConfigError(f'prompt={self.prompt!r} is empty. Fix: prompt="some text" to continue.')
        if self.prompt_ids is not None and (not self.prompt_ids or min(self.prompt_ids) < 0):
            raise ConfigError(f"prompt_ids={list(self.prompt_ids)} must be one or more token ids >= 0. "
                              'Fix: e.g. prompt_ids="1 5 9".')
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1. Fix: e.g. max_new_tokens=64.")
        if not self.temperature >= 0:  # (NaN too)
            raise ConfigError(f"temperature={self.temperature} must be >= 0. Fix: temperature=0 for greedy decoding, "
                              "or e.g. temperature=0.8 to sample.")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0. Fix: top_k=0 (all tokens) or e.g. top_k=50.")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {sorted(_DTYPES)}. Fix: one of them.")
        _device(self.device)


@dataclass
class Generation:
    """What ``generate`` returns: the ids (prompt, then the new ones) and, with a tokenizer, the text."""

    checkpoint: Path
    step: int  # optimizer steps the checkpoint's weights had trained
    prompt_ids: list[int]
    new_ids: list[int]
    text: str | None = None  # the prompt and its continuation, decoded (special tokens left out)
    stopped_at_eos: bool = field(default=False)


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device={name!r} is not a device. Fix: device=cpu or device=cuda.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}: no CUDA device is available here. Fix: device=cpu.")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r}: only cpu and cuda are supported. Fix: device=cpu or device=cuda.")
    return device


# -- the tokenizer the run trained with --------------------------------------------------------

@dataclass(frozen=True)
class _Codec:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None


def _bytes_codec() -> _Codec:
    return _Codec(lambda text: list(text.encode()), lambda ids: bytes(i for i in ids if i < 256).decode(
        errors="replace"), None)


def _tokenizer_codec(tokenizer: Any) -> _Codec:
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return _Codec(tokenizer.encode, decode, tokenizer.eos_token_id)


def _codec(checkpoint: Path) -> _Codec | None:
    """The checkpoint's tokenizer (``tokenizer/``; checkpoints that predate it: the model
    directory's, in ``hf/``), bytes for a byte-level text run, else None (token ids only)."""
    from runner.data.tokens import load_tokenizer

    for directory in (checkpoint / TOKENIZER_DIR, checkpoint / "hf"):
        if any((directory / name).is_file() for name in TOKENIZER_FILES):
            return _tokenizer_codec(load_tokenizer(str(directory)))
    config = run_config(checkpoint)
    data = config.get("data") if config is not None else None
    if data is not None and str(data.get("_target_")).endswith(".TextData") and not data.get("tokenizer"):
        return _bytes_codec()
    return None


def _prompt_ids(settings: Settings, codec: _Codec | None, checkpoint: Path) -> list[int]:
    if settings.prompt_ids is not None:
        return list(settings.prompt_ids)
    assert settings.prompt is not None
    if codec is None:
        raise ConfigError(f"prompt={shown(settings.prompt)}: {checkpoint} records no tokenizer (its run trained on "
                          'token ids or synthetic data), so text cannot be encoded. Fix: prompt_ids="1 2 3".')
    ids = codec.encode(settings.prompt)
    if not ids:
        raise ConfigError(f"prompt={shown(settings.prompt)} encodes to no tokens. Fix: a longer prompt.")
    return ids


# -- decoding ----------------------------------------------------------------------------------

def _check_budget(model: nn.Module, ids: list[int], settings: Settings) -> None:
    """The prompt's ids in the vocabulary, and the prompt and the budget within the positions."""
    inputs = getattr(model, "get_input_embeddings", None)  # a Hugging Face model's; else a built-in one's
    embedding = inputs() if callable(inputs) else model.get_submodule("embed.tok")
    vocab = cast(nn.Embedding, embedding).num_embeddings
    if max(ids) >= vocab:
        raise ConfigError(f"prompt_ids: id {max(ids)} is outside the model's vocabulary of {vocab}. "
                          f"Fix: ids below {vocab}.")
    limit = max_positions(model)
    if limit is None or len(ids) + settings.max_new_tokens <= limit:
        return
    if len(ids) >= limit:
        key = "prompt" if settings.prompt is not None else "prompt_ids"
        raise ConfigError(f"{key}={shown(settings.prompt or list(ids))} is {len(ids)} tokens, the model takes at most "
                          f"{limit} positions. Fix: a prompt of at most {limit - 1} tokens.")
    raise ConfigError(f"max_new_tokens={settings.max_new_tokens}: with the prompt's {len(ids)} tokens that is "
                      f"{len(ids) + settings.max_new_tokens} positions, the model takes at most {limit}. "
                      f"Fix: max_new_tokens={limit - len(ids)} or less.")


def _stepper(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``step(new_ids) -> logits of the last position``, fed the prompt once and then each new
    token: a Hugging Face model keeps its key-value cache (as ``generate`` does); a built-in one
    runs the whole sequence again each time."""
    if hasattr(model, "config"):
        takes = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in takes else "past_key_values"  # transformers 5.24's name; the older one
        last_only = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
        cache: dict[str, Any] = {}

        def cached(new: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=new, use_cache=True, **cache, **last_only)
            cache[name] = out[name]
            return out.logits[0, -1]

        return cached
    seen: list[torch.Tensor] = []

    def whole(new: torch.Tensor) -> torch.Tensor:
        seen.append(new)
        return model(torch.cat(seen, dim=1))[0, -1]

    return whole


def _pick(logits: torch.Tensor, settings: Settings, generator: torch.Generator) -> int:
    """The next token: the likeliest, or drawn from ``softmax(logits / temperature)`` (top-k)."""
    if settings.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / settings.temperature
    if 0 < settings.top_k < logits.numel():
        kth = torch.topk(logits, settings.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.inference_mode()
def _decode(model: nn.Module, ids: list[int], settings: Settings, eos_id: int | None,
            device: torch.device) -> tuple[list[int], bool]:
    step = _stepper(model)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    new: list[int] = []
    feed = torch.tensor([ids], device=device)
    while len(new) < settings.max_new_tokens:
        token = _pick(step(feed), settings, generator)
        new.append(token)
        if settings.stop_at_eos and token == eos_id:
            return new, True
        feed = torch.tensor([[token]], device=device)
    return new, False


def generate(source: str | Path, settings: Settings | None = None, **values: Any) -> Generation:
    """Continue the prompt with the weights of ``source`` (a run directory's newest complete
    checkpoint, or the checkpoint named): ``generate(run_dir, prompt="...", max_new_tokens=20)``,
    or a ``Settings``. Raises ``ConfigError`` for bad input."""
    if settings is not None and values:
        raise TypeError("generate() takes a Settings or keyword settings, not both")
    settings = settings or Settings(**values)
    source = Path(source).expanduser().resolve()
    if "=" in source.name and not source.exists():  # a setting where the source belongs
        raise ConfigError(f"{_PROG} {source.name}: the first argument is the run directory or checkpoint, not a "
                          f"setting. Fix: {_PROG} <run dir> {source.name}.")
    settings.check()
    checkpoint = _checkpoint_of(source)
    codec = _codec(checkpoint)
    ids = _prompt_ids(settings, codec, checkpoint)
    model = checkpoint_model(checkpoint).eval()
    _check_budget(model, ids, settings)
    device = _device(settings.device)
    model.to(device=device, dtype=_DTYPES[settings.dtype])
    new, at_eos = _decode(model, ids, settings, codec.eos_id if codec else None, device)
    text = codec.decode(ids + new) if codec is not None and settings.prompt is not None else None
    return Generation(checkpoint, read_train_state(checkpoint)["step"], ids, new, text, at_eos)


def _checkpoint_of(source: Path) -> Path:
    label = f"{_PROG} {source}"
    if source.is_dir() and not (source / "checkpoints").is_dir() and \
            any((source / name).exists() for name in ("resolved_config.yaml", ".hydra", LOCK_FILE)):
        raise ConfigError(f"{label}: the run saved no checkpoint (it has no checkpoints/). Fix: a run trained with "
                          "checkpoint.every=K, which saves every K steps.")
    return find_checkpoint(str(source), source, label=label)


# -- the command line --------------------------------------------------------------------------

_KEYS = {f.name: f for f in fields(Settings)}


# How a word's text becomes a setting's value, and what it must look like: by the field's type.
_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "tuple[int, ...] | None": (lambda t: tuple(int(i) for i in t.replace(",", " ").split()), "token ids"),
    "int": (int, "an integer"),
    "float": (float, "a number"),
    "bool": (lambda t: {"true": True, "false": False}[t.lower()], "true or false"),
}


def _value(key: str, text: str) -> Any:
    parse, what = _PARSERS.get(str(_KEYS[key].type), (str, "text"))
    try:
        return parse(text)
    except (ValueError, KeyError):
        raise ConfigError(f"{key}={text!r} is not {what}. Fix: e.g. {key}={_example(key)}.") from None


def _example(key: str) -> str:
    return {"prompt_ids": '"1 5 9"', "stop_at_eos": "false"}.get(key, str(_KEYS[key].default))


def parse_settings(words: list[str]) -> Settings:
    """``key=value`` words as ``Settings``; an unknown key is named with the nearest ones."""
    values: dict[str, Any] = {}
    for word in words:
        key, eq, text = word.partition("=")
        if not eq or key not in _KEYS:
            near = difflib.get_close_matches(key, list(_KEYS), n=2) if eq else []
            hint = f"Did you mean {' or '.join(near)}? " if near else ""
            raise ConfigError(f"{word!r} is not a setting: {hint}Fix: key=value with a key of "
                              f"{', '.join(_KEYS)} (see {_PROG} --help).")
        values[key] = _value(key, text)
    return Settings(**values)


def _help() -> str:
    defaults = {name: "" if f.default is None else f" (default {str(f.default).lower()})" for name, f in _KEYS.items()}
    lines = [f"  {name:<15} {f.metadata['help']}{defaults[name]}" for name, f in _KEYS.items()]
    return "settings (key=value):\n" + "\n".join(lines) + "\n\n" + __doc__.split("\n\n")[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0], epilog=_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a run directory (its newest complete checkpoint) or a checkpoint")
    parser.add_argument("settings", nargs="*", metavar="key=value", help='prompt="..." and the settings below')
    args = parser.parse_args(argv)
    try:
        result = generate(args.source, parse_settings(args.settings))
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(exit_code(e))
    except KeyboardInterrupt:
        print("generate stopped", file=sys.stderr)
        sys.exit(interrupted_exit_code(signal.SIGINT))
    print(result.text if result.text is not None else " ".join(map(str, result.prompt_ids + result.new_ids)))
    end = "the end-of-sequence token" if result.stopped_at_eos else "the token budget (max_new_tokens)"
    print(f"{len(result.new_ids)} tokens from {result.checkpoint} (step {result.step}), stopped at {end}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
