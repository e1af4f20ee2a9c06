"""``python -m runner.export <checkpoint or run directory> <output directory>``: a trained
``model=hf`` model in Hugging Face format, for ``AutoModelForCausalLM.from_pretrained``.

Writes config.json (with the run's ``model.config_overrides``), the weights as safetensors in the
source model's dtype unless ``--dtype`` says otherwise (sharded above ``--max-shard-size``, a tied
head stored once, as transformers stores it), the tokenizer the run trained with and the model's
generation config. Checkpoints are keyed by the model's own parameter names, so the tensors go in
as they are, from any layout. Everything is written into a fresh directory beside the target,
renamed into place once complete: a failed or killed export leaves the target as it was.

Exit codes as ``python -m runner``'s: 2 nothing could be exported as asked (nothing written),
3 the export failed, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import torch

from runner.checkpoint.files import TOKENIZER_DIR, find_checkpoint, read_train_state
from runner.checkpoint.model import hf_model
from runner.config import parse_bytes
from runner.errors import ConfigError, RunnerError, exit_code, interrupted_exit_code
from runner.ranks.console import quiet_libraries
from runner.rundir import LOCK_FILE

__all__ = ["DTYPES", "export", "checkpoint_of", "source_dtype", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # as config.json spells them


class _Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the export is, so that its temporary directory is removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def checkpoint_of(source: Path) -> Path:
    """The checkpoint ``source`` names: itself, or a run directory's newest complete one."""
    return find_checkpoint(str(source), source, label=f"python -m runner.export {source}")


def source_dtype(checkpoint: Path) -> str:
    """The dtype the checkpoint's ``hf/config.json`` records for the source model (fp32 where it
    names none: the runner trains in fp32)."""
    try:
        config = json.loads((checkpoint / "hf" / "config.json").read_text())
    except (OSError, ValueError):
        return "fp32"
    return _CONFIG_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), "fp32")


# What a run directory holds from its start: any directory holding one of these is a run's.
_RUN_FILES = ("resolved_config.yaml", LOCK_FILE, ".hydra")


def _protected(checkpoint: Path) -> list[tuple[Path, str]]:
    """What an export must never write over, into or around: the checkpoint's run directory (the
    checkpoint itself, outside one), the run's model.path (recorded by the checkpoint, else in the
    run's resolved_config.yaml) and the tokenizer the run trained with."""
    import yaml

    state = read_train_state(checkpoint)
    in_run = checkpoint.parent.name == "checkpoints"
    found = [(checkpoint.parent.parent, "the run directory of the checkpoint being exported") if in_run else
             (checkpoint, "the checkpoint being exported")]
    model_path = state.get("model_path")
    resolved = checkpoint.parent.parent / "resolved_config.yaml"
    if model_path is None and resolved.is_file():
        try:
            model_path = ((yaml.safe_load(resolved.read_text()) or {}).get("model") or {}).get("path")
        except (OSError, yaml.YAMLError, AttributeError):
            model_path = None
    if model_path:
        found.append((Path(model_path).expanduser().resolve(), "the run's own model.path"))
    if isinstance(state.get("tokenizer"), dict) and state["tokenizer"].get("path"):
        found.append((Path(state["tokenizer"]["path"]), "the tokenizer the run trained with (data.tokenizer)"))
    return found


def _run_dir_around(out: Path) -> Path | None:
    """A run directory (any run's) that ``out`` is, is inside, or holds."""
    for path in (out, *out.parents):
        if any((path / name).exists() for name in _RUN_FILES):
            return path
    for root, dirs, files in os.walk(out) if out.is_dir() else ():  # (symlinks not followed, as rmtree)
        if set(_RUN_FILES) & {*dirs, *files}:
            return Path(root)
    return None


def _relation(out: Path, path: Path) -> str | None:
    if out == path:
        return "is"
    return "is inside" if path in out.parents else "holds" if out in path.parents else None


def _check_target(out: Path, checkpoint: Path, *, overwrite: bool) -> None:
    """Before anything is read or written: ``out`` may be replaced."""
    protected = _protected(checkpoint)
    if (run := _run_dir_around(out)) is not None:
        protected.append((run, "a run directory"))
    for path, what in protected:
        if relation := _relation(out, path):
            raise ConfigError(f"output directory {out} {relation} {what} ({path}): an export never writes there, "
                              "even with --overwrite. Fix: an output directory outside it.")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output directory {out} is an existing file. Fix: another output directory.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"output directory {out} is not empty. Fix: another output directory, or --overwrite "
                          "to replace it (the old one is removed once the new one is in place).")
    parent = next(p for p in out.parents if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"output directory {out}: {parent} is not writable. Fix: another output directory.")


def _ship_files(checkpoint: Path, target: Path) -> None:
    """The tokenizer the run trained with (the checkpoint's ``tokenizer/``; checkpoints that
    predate it: the model directory's, in ``hf/``) and the model's generation config."""
    from runner.models.hf import copy_model_files

    trained = checkpoint / TOKENIZER_DIR
    copy_model_files(trained if trained.is_dir() else checkpoint / "hf", target)
    generation = checkpoint / "hf" / "generation_config.json"
    if generation.is_file() and not (target / generation.name).exists():
        shutil.copy2(generation, target / generation.name)


def _modes_of_umask(directory: Path) -> None:
    """safetensors writes its shards owner-only (0600); an export is for sharing (a cluster's model
    directory, a hub upload), so its files get the modes any new file of this process gets."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _into_place(new: Path, out: Path) -> None:
    """``new`` becomes ``out``: a rename cannot replace a non-empty directory, so an old ``out``
    is renamed aside first and removed once the new one is in place."""
    if not out.exists():
        new.rename(out)
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # not stopped between the renames, nor leaving `old`
    try:
        out.rename(old)
        new.rename(out)
        shutil.rmtree(old)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def export(source: Path, out: Path, *, dtype: str | None = None, max_shard_size: str = "5GB",
           overwrite: bool = False) -> Path:
    """Write the model of ``source`` (a checkpoint, or a run directory's newest) into ``out``, in
    ``dtype`` (default: the source model's, ``source_dtype``)."""
    shard_bytes = parse_bytes("--max-shard-size", max_shard_size)
    if not shard_bytes or shard_bytes < 1:
        raise ConfigError(f"--max-shard-size={max_shard_size!r} must be positive. Fix: e.g. --max-shard-size 5GB.")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {sorted(DTYPES)}. Fix: one of them.")
    checkpoint = checkpoint_of(source.expanduser().resolve())
    out = out.expanduser().resolve()
    if not (checkpoint / "hf" / "config.json").is_file():
        raise ConfigError(f"{checkpoint} holds no Hugging Face config (hf/config.json): only model=hf runs export "
                          "to Hugging Face format. Fix: export a checkpoint of a model=hf run.")
    _check_target(out, checkpoint, overwrite=overwrite)
    model = hf_model(checkpoint)
    model.to(DTYPES[dtype or source_dtype(checkpoint)])
    out.parent.mkdir(parents=True, exist_ok=True)
    new = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        new.mkdir()
        model.save_pretrained(new, max_shard_size=shard_bytes)
        _ship_files(checkpoint, new)
        _modes_of_umask(new)
        _into_place(new, out)
    except BaseException:  # killed, interrupted or failed: the target stays as it was
        shutil.rmtree(new, ignore_errors=True)
        raise
    return out


def _stop(signum: int, frame) -> None:
    raise _Stopped(signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a checkpoint (…/checkpoints/step-N) or a run directory")
    parser.add_argument("out", type=Path, help="the output directory (new, empty, or with --overwrite)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="cast the weights (default: the source model's dtype, as its config.json records it; "
                             "fp32 where it records none)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="safetensors shard size, e.g. 5GB, 500MiB (default 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty output directory (never a run directory, nor the run's model.path "
                             "or tokenizer)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    quiet_libraries()  # transformers' "Writing model shards" bar: the line at the end says what was written
    try:
        checkpoint = checkpoint_of(args.source.expanduser().resolve())
        dtype = args.dtype or source_dtype(checkpoint)
        out = export(checkpoint, args.out, dtype=dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(exit_code(e))
    except KeyboardInterrupt as e:
        print("export stopped: nothing was written", file=sys.stderr)
        sys.exit(interrupted_exit_code(e.signum if isinstance(e, _Stopped) else signal.SIGINT))
    except Exception as e:  # noqa: BLE001  (one paragraph, not a traceback: the target is untouched)
        print(f"error: the export of {args.source} failed: {type(e).__name__}: {e}. Nothing was written to "
              f"{args.out}.", file=sys.stderr)
        sys.exit(exit_code(RunnerError()))
    why = "--dtype" if args.dtype else "the source model's dtype, from its config.json; --dtype to change"
    print(f"exported {checkpoint} to {out}, weights in {dtype} ({why}): "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r})")


if __name__ == "__main__":
    main()
