"""What a checkpoint records about the run that saved it, and the checks a resume makes against it
before any rank starts: the tokenizer the run trained with (its files travel in the checkpoint's
``tokenizer/``, its digest in ``train_state.json``) and the model's tensors (a checkpoint holding
tensors the configured model lacks would lose them silently: DCP loads only what the model asks
for). ``resume_point`` is what ``runner.validate`` asks. Torch and the meta model are imported
inside the checks: ``runner.validate`` imports this module before torch."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.checkpoint.files import (
    CUDA_RNG_PREFIX,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    find_checkpoint,
    read_train_state,
    run_config,
)
from runner.errors import CheckpointError, ConfigError

__all__ = ["tokenizer_files", "tokenizer_record", "copy_tokenizer", "data_position", "resume_point"]

log = logging.getLogger("runner.checkpoint")


def tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer's own files in ``directory``."""
    return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]


def tokenizer_record(tokenizer: str | None) -> dict | None:
    """``{"path", "sha256"}`` of the tokenizer directory ``data.tokenizer`` names (the digest of
    its files' names and bytes); None for a run without one (bytes, token ids, synthetic data)."""
    if not tokenizer:
        return None
    directory = Path(tokenizer).expanduser().resolve()
    digest = hashlib.sha256()
    for file in tokenizer_files(directory):
        digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return {"path": str(directory), "sha256": digest.hexdigest()}


def copy_tokenizer(record: dict | None, checkpoint: Path) -> None:
    """The tokenizer's files into ``checkpoint/tokenizer/`` (what ``runner.export`` ships)."""
    if record is None:
        return
    target = checkpoint / TOKENIZER_DIR
    target.mkdir(exist_ok=True)
    for file in tokenizer_files(Path(record["path"])):
        shutil.copy2(file, target / file.name)


def _described(record: dict | None) -> str:
    return f"{record['path']} (sha256 {record['sha256'][:12]})" if record else "no tokenizer (bytes or token ids)"


def _check_tokenizer(cfg: DictConfig, path: Path, state: dict) -> None:
    if "tokenizer" not in state:  # saved before checkpoints recorded it
        log.warning("checkpoint.resume: %s does not record the tokenizer it was trained with; not checked", path)
        return
    saved, mine = state["tokenizer"], tokenizer_record(cfg.data.get("tokenizer"))
    if (saved or {}).get("sha256") == (mine or {}).get("sha256"):
        return
    problem = (f"checkpoint.resume: {path} was trained with tokenizer {_described(saved)}, this run's data.tokenizer "
               f"is {_described(mine)}: the same token ids would stand for other text")
    if cfg.checkpoint.allow_tokenizer_change:
        log.warning("%s (checkpoint.allow_tokenizer_change=true: continuing)", problem)
        return
    restore = f"data.tokenizer={saved['path']} (its files are also in {path / TOKENIZER_DIR})" if saved else \
        "the data the checkpoint was trained on"
    raise ConfigError(f"{problem}. Fix: {restore}, or checkpoint.allow_tokenizer_change=true to continue with "
                      "this tokenizer on purpose.")


# What makes a step a position in the data: batch(step) reads samples (step - 1) * batch_size on,
# as windows of seq_len + 1 tokens in an order (and, for synthetic data, a rule) drawn from the seed
# and, for a token stream, from the number of windows its training split holds (``train_windows``:
# the data's length and data.val_fraction decide it).
_DATA_POSITION = ("train.batch_size", "train.seq_len", "train.seed")
_WINDOWS = "train_windows"


def data_position(cfg: DictConfig, train_windows: int | None = None) -> dict[str, Any]:
    """The keys that give a step its samples, as ``train_state.json`` records them; ``train_windows``
    (``runner.data.datasets.train_windows``) where the data is a token stream."""
    position: dict[str, Any] = {key: cfg.train[key.split(".")[1]] for key in _DATA_POSITION}
    if train_windows is not None:
        position[_WINDOWS] = train_windows
    return position


def _check_data_position(cfg: DictConfig, path: Path, state: dict, train_windows: int | None) -> None:
    """A resume reads on from the checkpoint's step: with another batch size, sequence length or
    seed, or a token stream of another number of training windows (more or less data, another
    data.val_fraction: each epoch's order is drawn for that number), that step is not where the
    saving run's data stopped (samples the epoch has not shown are skipped, others read again)."""
    saved = state.get("data_position")  # None: saved before checkpoints recorded it
    if not saved:
        return
    mine = data_position(cfg, train_windows)
    changed = [key for key in (*_DATA_POSITION, _WINDOWS) if key in saved and key in mine and saved[key] != mine[key]]
    if "train.seq_len" in changed and _WINDOWS in changed:  # windows of another length: another number of them
        changed.remove(_WINDOWS)
    if not changed:
        return
    keys = [k for k in changed if k != _WINDOWS]
    parts = [f"with {', '.join(f'{k}={saved[k]}' for k in keys)}; this run has "
             f"{', '.join(f'{k}={mine[k]}' for k in keys)}"] if keys else []
    if _WINDOWS in changed:
        parts.append(f"from data of {saved[_WINDOWS]} training windows of train.seq_len + 1 tokens; this run's data "
                     f"holds {mine[_WINDOWS]} (data.path={cfg.data.get('path')!r} changed, or data.val_fraction: each "
                     "epoch's order is drawn for the number of windows)")
    problem = (f"checkpoint.resume: {path} was saved at step {state['step']} {' and '.join(parts)}, so its step "
               f"{state['step'] + 1} would not read the samples after the ones trained (every batch is a function "
               f"of the step, the batch size, the sequence length, the seed and the data): some would be skipped or "
               f"read twice")
    if cfg.checkpoint.allow_data_change:
        log.warning("%s (checkpoint.allow_data_change=true: continuing)", problem)
        return
    restore = " ".join([*(f"{k}={saved[k]}" for k in keys),
                        *(["the data and data.val_fraction the checkpoint was trained on"] if _WINDOWS in changed
                          else [])])
    raise ConfigError(f"{problem}. Fix: {restore}, or checkpoint.allow_data_change=true to continue with "
                      "the new values on purpose.")


def _by_module(names: list[str], model: dict) -> dict[str, int]:
    """``names`` counted by the outermost module the model lacks (``block5``, ``model.layers.3``)."""
    prefixes = {".".join(n.split(".")[:i]) for n in model for i in range(1, n.count(".") + 2)}
    counts: dict[str, int] = {}
    for name in sorted(names):
        parts = name.split(".")
        module = next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in prefixes),
                      name)
        counts[module] = counts.get(module, 0) + 1
    return counts


def _read_pickles(path: Path, world_size: int) -> Any:
    """The checkpoint's ``.metadata``, after reading it and every rank's RNG state through the safe
    readers: a crafted pickle in any of them is refused here, before a rank starts."""
    from runner._torch.dcp import SafeReader, UnsafeCheckpointError, read_rng_state, refusal

    try:
        metadata = SafeReader(str(path)).read_metadata()
        for rank in range(world_size):
            for name in (f"rng-rank{rank}.pt", f"{CUDA_RNG_PREFIX}{rank}.pt"):
                if (path / name).is_file():
                    read_rng_state(path / name)
    except UnsafeCheckpointError as e:
        raise CheckpointError(refusal(path, e)) from None
    return metadata


def _check_tensors(cfg: DictConfig, path: Path, metadata: Any, build_meta_model: Callable[..., Any], *,
                   legacy: bool = False) -> None:
    """The checkpoint's model tensors (its DCP ``metadata``) are the ones the configured model
    stores, with their shapes: none the model lacks, none it ties to another (a weight tied to
    the embedding is stored once, under the embedding's name), none of its own missing.
    ``legacy``: saved before checkpoints recorded their data position, when a pp=1 run still
    stored a tied copy under both names."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runner.models.units import tied_groups

    saved = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules")).module
    copies = {name: names[0] for names in tied_groups(meta) for name in names[1:]}
    model = {n: tuple(t.shape) for n, t in meta.state_dict(keep_vars=True).items() if n not in copies}
    _check_ties(path, sorted(n for n in saved if n in copies), copies, legacy)
    lacks = _by_module([n for n in saved if n not in model and n not in copies], model)
    shapes = [f"{n} {saved[n]} (the model's {model[n]})" for n in sorted(saved) if n in model and saved[n] != model[n]]
    if lacks or shapes:
        listed = ", ".join(f"{m} ({k} tensors)" if k > 1 else m for m, k in list(lacks.items())[:8])
        found = (f"{sum(lacks.values())} tensors the configured model lacks: {listed}{' …' if len(lacks) > 8 else ''}"
                 if lacks else f"tensors of other shapes: {', '.join(shapes[:4])}")
        raise ConfigError(f"checkpoint.resume: {path} holds {found}; resuming would drop or mangle trained weights "
                          "and their optimizer state. Fix: the model config the checkpoint was trained with (the same "
                          "model.n_layers, model.dim, model.path, ...), or another checkpoint.")
    missing = sorted(n for n in model if n not in saved)
    if missing:  # DCP would fail on every rank, after the launch, naming the first alone
        raise ConfigError(f"checkpoint.resume: {path} lacks {len(missing)} tensor{'s' if len(missing) > 1 else ''} the "
                          "configured model has: "
                          f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''} (a checkpoint of a model whose "
                          "head is tied to its embedding stores that weight once, under the embedding's name). Fix: "
                          "the model config the checkpoint was trained with (the same model.tie_embeddings, or "
                          "tie_word_embeddings for a Hugging Face model, model.n_layers, ...), or another checkpoint.")


def _check_ties(path: Path, held: list[str], copies: dict[str, str], legacy: bool) -> None:
    """Refuse a checkpoint holding, as weights of their own, parameters the configured model ties to
    another (``copies``: tied name -> the name stored): a checkpoint of the untied model resumed
    with tied embeddings. DCP loads the stored name alone, so the trained head was replaced by the
    embedding without a word (a probe's loss went from 3.87 to 19.97 at the resume)."""
    if not held:
        return
    pairs = ", ".join(f"{n} to {copies[n]}" for n in held[:4])
    problem = (f"checkpoint.resume: {path} holds {', '.join(held[:4])} as a weight of its own, where the configured "
               f"model ties {pairs} (model.tie_embeddings, or tie_word_embeddings for a Hugging Face model)")
    if legacy:  # saved before pp=1 runs stored a tied copy once: the same values under both names
        log.warning("%s; this checkpoint predates the runner's records of a run, so it may be a tied model's "
                    "saved under both names: resuming with the tie, the stored %s replaces it", problem,
                    copies[held[0]])
        return
    raise ConfigError(f"{problem}: resuming would replace the trained {held[0]} with {copies[held[0]]}. Fix: the "
                      "checkpoint's untied model (model.tie_embeddings=false, or "
                      "+model.config_overrides.tie_word_embeddings=false), or another checkpoint.")


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    """``node``'s values by dotted key (``model.config_overrides.rope_theta``)."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _leaves(value, f"{prefix}.{key}").items()}
    return {prefix: node}


def _warn_model_changes(cfg: DictConfig, path: Path) -> None:
    """Warn where this run's ``model`` keys differ from those the checkpoint's run recorded: the
    tensors' names and shapes are checked, not what the model computes from them (another
    ``model.n_heads`` fits the same tensors, as do most of a Hugging Face model's
    ``config_overrides``); a change can be meant (dropout for a second phase), so it is said, not refused."""
    recorded = run_config(path)
    model = recorded.get("model") if recorded is not None else None
    try:
        theirs = _leaves(OmegaConf.to_container(model, resolve=True), "model") if isinstance(model, DictConfig) else {}
        mine = _leaves(OmegaConf.to_container(cfg.model, resolve=True), "model")
    except OmegaConfBaseException:  # a recorded config this version cannot resolve: nothing to compare
        return
    # model.pretrained: a resumed run's weights are the checkpoint's whatever it says
    changed = [f"{k}={theirs.get(k)!r} there, {mine.get(k)!r} here" for k in sorted(set(theirs) | set(mine))
               if theirs and theirs.get(k) != mine.get(k) and k != "model.pretrained"]
    if changed:
        log.warning("checkpoint.resume: %s was trained with other model settings (%s): its weights go into a model "
                    "that may compute something else from them. Fix: the saving run's values, unless the change is "
                    "meant.", path, "; ".join(changed))


def _checked_checkpoint(cfg: DictConfig, run_dir: Path, latest_root: Path,
                        train_windows: int | None) -> tuple[Path, int]:
    """The checkpoint ``checkpoint.resume`` names and its step, checked against this run's config,
    its data's training windows and its model."""
    from runner.models.split import build_meta_model  # the model the checkpoint's tensors must fit

    path = find_checkpoint(cfg.checkpoint.resume, run_dir, latest_root)
    state = read_train_state(path)
    _check_tokenizer(cfg, path, state)
    _check_data_position(cfg, path, state, train_windows)
    _check_tensors(cfg, path, _read_pickles(path, state["world_size"]), build_meta_model,
                   legacy="data_position" not in state)
    _warn_model_changes(cfg, path)
    return path, state["step"]


def _launch_dir() -> Path:
    """Where the user started the runner (Hydra may have changed into the run directory)."""
    return Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()


def resume_point(cfg: DictConfig, run_dir: Path, train_windows: int | None = None) -> Path:
    """The checkpoint directory ``checkpoint.resume`` names: a checkpoint, a run directory's newest
    complete one, or (``latest``) the newest of the runs under ``checkpoint.latest_root``; refused
    before any rank starts (``ConfigError``) if it is bad, already at ``train.steps``, or its data
    position is not this run's (``train_windows``: of this run's data)."""
    try:
        latest_root = _launch_dir() / Path(cfg.checkpoint.latest_root).expanduser()
        path, step = _checked_checkpoint(cfg, run_dir, latest_root, train_windows)  # its tokenizer checked too
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {e}") from None
    if step >= cfg.train.steps:
        raise ConfigError(f"checkpoint.resume: {path} is at step {step}, already "
                          f"train.steps={cfg.train.steps}. Fix: a larger train.steps.")
    return path
