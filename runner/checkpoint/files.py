"""What a checkpoint directory holds, read without torch: which checkpoint ``checkpoint.resume``
names (``latest``: the newest complete one of the runs under ``checkpoint.latest_root``), whether it
is complete, the manifests (size and sha256 of every file a rank wrote) that show damage, and the
lock that marks a run directory as in progress. Saving and loading: ``runner.checkpoint.checkpointer``."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import CheckpointError, ConfigError
from runner.models.hf_dirs import TOKENIZER_FILES  # a checkpoint's tokenizer/ holds them
from runner.rundir import LOCK_FILE, run_in_progress

__all__ = ["read_train_state", "run_config",
           "checkpoint_step", "complete_steps", "find_checkpoint", "write_manifest", "files_of", "manifest_problems",
           "CUDA_RNG_PREFIX", "TOKENIZER_DIR", "TOKENIZER_FILES"]

log = logging.getLogger("runner.checkpoint")  # its lines are the checkpoints' (as before the split)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MANIFEST = "manifest-rank{}.json"
CUDA_RNG_PREFIX = "cuda-rng-rank"  # cuda-rng-rank<R>.pt: a GPU rank's device generator (rng-rank<R>.pt: its CPU's)
TOKENIZER_DIR = "tokenizer"  # in a checkpoint: the files of the tokenizer the run trained with
# Where checkpoint.resume=latest looks under its root: the root itself, and run directories one,
# two (Hydra's outputs/<date>/<time>) and three (multirun/<date>/<time>/<job>) levels down.
_LATEST_PATTERNS = ("checkpoints", "*/checkpoints", "*/*/checkpoints", "*/*/*/checkpoints")


# -- what a checkpoint directory holds ---------------------------------------------------------

def read_train_state(path: Path) -> dict:
    """``train_state.json``, or a ``CheckpointError`` naming the file and what is wrong with it.
    Its ``world_size`` is bounded by what is on disk (each rank wrote at least its manifest and
    RNG state) before anything (manifest names, hashing work) is sized by it."""
    file = path / "train_state.json"
    try:
        state = json.loads(file.read_text())
        if not (isinstance(state, dict) and isinstance(state.get("step"), int)
                and isinstance(state.get("world_size"), int) and isinstance(state.get("lr_scheduler"), dict)):
            raise ValueError("expected an object with an integer step and world_size and lr_scheduler")
        if state["step"] < 0 or state["world_size"] < 1:
            raise ValueError(f"step {state['step']} and world_size {state['world_size']}: expected step >= 0 "
                             "and world_size >= 1")
        on_disk = sum(1 for _ in path.glob("rng-rank*.pt"))
        if state["world_size"] > on_disk:
            raise ValueError(f"world_size {state['world_size']}, but the directory holds the RNG state of only "
                             f"{on_disk} ranks (rng-rank<R>.pt)")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable or corrupt ({e}).") from None
    return state


def checkpoint_step(path: Path) -> int:
    """Optimizer steps done when the checkpoint was saved."""
    return read_train_state(path)["step"]


def _incomplete(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None."""
    if not (path / ".metadata").is_file():
        return "it has no .metadata (its save did not finish, or the file was removed)"
    try:
        world_size = read_train_state(path)["world_size"]
    except CheckpointError as e:
        return str(e)
    missing = [_MANIFEST.format(r) for r in range(world_size) if not (path / _MANIFEST.format(r)).is_file()]
    if missing:
        return f"it has no {', '.join(missing)} (its save did not finish, or they were removed)"
    return None


def complete_steps(directory: Path, *, log_skipped: bool = True) -> list[Path]:
    """The complete ``step-N`` checkpoints in ``directory``, oldest first; the others are logged."""
    found = []
    for p in directory.glob("step-*"):
        if not _STEP_DIR.match(p.name):
            continue
        reason = _incomplete(p)
        if reason is None:
            found.append(p)
        elif log_skipped:
            log.warning("skipping checkpoint %s: %s", p, reason)
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _latest(root: Path, run_dir: Path) -> Path:
    """The newest complete checkpoint of the runs under ``root`` that are not in progress."""
    candidates = []
    for checkpoints in sorted({d for pattern in _LATEST_PATTERNS for d in root.glob(pattern) if d.is_dir()}):
        run = checkpoints.parent
        if run.resolve() != run_dir.resolve() and run_in_progress(run):
            log.warning("checkpoint.resume=latest: skipping the checkpoints of %s: that run is still in "
                        "progress (it holds %s), and its checkpoint.keep may delete them", run, LOCK_FILE)
            continue
        candidates += complete_steps(checkpoints)
    if not candidates:
        raise ConfigError(f"checkpoint.resume=latest: no complete checkpoint in the runs under {root} "
                          "(checkpoint.latest_root). Fix: checkpoint.resume=<a checkpoint or run directory>, "
                          "or checkpoint.latest_root=<the directory your runs are in>.")
    return max(candidates, key=lambda p: (p / "train_state.json").stat().st_mtime)


def _kept_instead(path: Path) -> str:
    """For a ``…/checkpoints/step-N`` that is not there: the checkpoints its run still keeps."""
    if not _STEP_DIR.match(path.name) or path.parent.name != "checkpoints" or not path.parent.is_dir():
        return ""
    kept = [p.name for p in complete_steps(path.parent, log_skipped=False)]
    return (f" Its run keeps {', '.join(kept) if kept else 'no complete checkpoint'} (checkpoint.keep, 2 by "
            "default, keeps the newest; checkpoint.every=K saves every K steps).")


def find_checkpoint(resume: str, run_dir: Path, latest_root: Path | None = None, *, label: str | None = None) -> Path:
    """The checkpoint directory ``checkpoint.resume`` names (checked before any rank starts).
    ``latest`` searches the runs under ``latest_root`` only (default: ``outputs`` of the
    working directory), never the parents of a custom run directory. ``label``: what named the
    directory in the errors (``python -m runner.export``'s source), instead of ``checkpoint.resume``."""
    if resume == "latest" and label is None:
        return _latest((latest_root or Path("outputs")).expanduser().resolve(), run_dir)
    what = label or f"checkpoint.resume={resume!r}"
    path = Path(resume).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"{what}: no such directory.{_kept_instead(path)} Fix: a checkpoint directory "
                          f"(…/checkpoints/step-N), a run directory{'' if label else ', or latest'}.")
    if (path / "checkpoints").is_dir():
        steps = complete_steps(path / "checkpoints")
        if not steps:
            raise ConfigError(f"{what}: the run has no complete checkpoint (the log names each one skipped and why). "
                              "Fix: a run that saved one (checkpoint.every=K saves every K steps).")
        path = steps[-1]
    else:
        reason = _incomplete(path)
        if reason is not None:
            raise ConfigError(f"{what} is not a complete checkpoint: {reason}. Fix: a checkpoint directory "
                              "(…/checkpoints/step-N) or a run directory that has checkpoints/.")
    run = path.parent.parent
    if run.resolve() != run_dir.resolve() and run_in_progress(run):
        log.warning("%s: %s belongs to a run still in progress; its checkpoint.keep may delete it while it is "
                    "read", what, path)
    return path


# -- manifests --------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: Path, rank: int, names: list[str]) -> None:
    """Size and sha256 of the files ``rank`` wrote into the checkpoint ``directory``."""
    files = {name: {"size": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
             for name in sorted(names)}
    (directory / _MANIFEST.format(rank)).write_text(json.dumps({"rank": rank, "files": files}, indent=1))


def files_of(directory: Path, rank: int, is_main: bool) -> list[str]:
    """What ``rank`` writes into a checkpoint: its DCP shards (``__<rank>_<n>.distcp``), its RNG
    state and, on rank 0, ``.metadata``, ``train_state.json``, a Hugging Face model's ``hf/`` and the
    run's tokenizer (``tokenizer/``)."""
    names = [p.name for p in directory.glob(f"__{rank}_*.distcp")] + [f"rng-rank{rank}.pt"]
    names += [name for name in (f"{CUDA_RNG_PREFIX}{rank}.pt",) if (directory / name).is_file()]  # a GPU rank's
    if not is_main:
        return names
    extra = [str(p.relative_to(directory)) for sub in ("hf", TOKENIZER_DIR)
             for p in sorted((directory / sub).rglob("*")) if p.is_file()]
    return names + [".metadata", "train_state.json", *extra]


def manifest_problems(directory: Path, rank: int) -> list[str]:
    manifest = directory / _MANIFEST.format(rank)
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{manifest} is unreadable or corrupt ({e})"]
    problems = []
    for name, size, digest in entries:
        file = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{file} has {file.stat().st_size} bytes, its manifest {manifest.name} says {size} "
                            "(truncated or overwritten)")
        elif _sha256(file) != digest:
            problems.append(f"{file} does not match the sha256 in {manifest.name} (changed after it was saved)")
    return problems


# -- the run a checkpoint came from ------------------------------------------------------------

_RUN_CONFIGS = ("resolved_config.yaml", ".hydra/config.yaml")  # as the run ran it; as Hydra composed it


def run_config(checkpoint: Path) -> DictConfig | None:
    """The config the run of ``checkpoint`` recorded (its run directory is the checkpoint's
    grandparent: ``<run>/checkpoints/step-N``), or None where none is found."""
    if checkpoint.parent.name != "checkpoints":
        return None
    for name in _RUN_CONFIGS:
        if (file := checkpoint.parent.parent / name).is_file():
            try:
                config = OmegaConf.load(file)
            except (OSError, ValueError, OmegaConfBaseException):
                continue
            if isinstance(config, DictConfig):
                return config
    return None
