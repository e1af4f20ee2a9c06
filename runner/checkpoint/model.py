"""A checkpoint's model, whole, in one process and without a process group: what ``runner.export``
writes out and ``runner.generate`` samples from. A ``model=hf`` checkpoint carries its model's
``hf/config.json``; a built-in model (``model=transformer``, ``model=mlp``) is rebuilt from the
``model`` keys its run recorded (``resolved_config.yaml``, else Hydra's ``.hydra/config.yaml``). No
other factory is imported: a user's model code is never run from here.

Checkpoints hold a tied weight once, under its first name (``embed.tok.weight``, not
``head.weight``): every other name of it is tied again here, to the one tensor loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from runner._torch.dcp import read_model_tensors
from runner.checkpoint.checkpointer import verify_checkpoint
from runner.checkpoint.files import read_train_state, run_config
from runner.errors import ConfigError, RunnerError
from runner.models.hf_dirs import remote_code_problem
from runner.models.units import tied_groups
from runner.ranks.dist import DistEnv

__all__ = ["BUILTIN_FACTORIES", "run_config", "checkpoint_model", "hf_model", "builtin_model", "max_positions"]

# The factories a checkpoint's model may be rebuilt with here (runner.models' old paths included).
BUILTIN_FACTORIES = {f"runner.models{sub}.{name}": name for sub in ("", ".builtin") for name in ("transformer", "mlp")}
def _loaded(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of ``checkpoint``, its files checked against their manifests first."""
    verify_checkpoint(checkpoint, read_train_state(checkpoint)["world_size"], DistEnv(0, 1, torch.device("cpu")))
    return read_model_tensors(checkpoint)


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], checkpoint: Path) -> list[list[str]]:
    """``tensors`` into the meta ``model`` (its tensors become them); the tied groups, tied again
    to their first name's tensor, the one stored."""
    groups = tied_groups(model)
    copies = {n for names in groups for n in names[1:]}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = [n for n in missing if n not in copies and n in params]
    if missing or unexpected:
        raise RunnerError(f"{checkpoint} does not hold this model's weights: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}.")
    for first, *others in groups:
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    return groups


def hf_model(checkpoint: Path) -> Any:
    """The model of the checkpoint's ``hf/config.json`` with the checkpoint's tensors (a
    transformers ``PreTrainedModel``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = checkpoint / "hf"
    if problem := remote_code_problem(hf, f"checkpoint {checkpoint}"):  # before transformers reads an auto_map
        raise ConfigError(problem)
    config = AutoConfig.from_pretrained(hf, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    _assign(model, _loaded(checkpoint), checkpoint)
    model.tie_weights()
    for module in model.modules():  # buffers no checkpoint holds (rotary frequencies): computed
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                model._init_weights(module)
    return model


def _builtin_keys(checkpoint: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, dict[str, Any]]:
    """The built-in factory of the checkpoint's run and its keys; the vocabulary and the position
    table are the stored tensors' sizes."""
    config = run_config(checkpoint)
    if config is None or not isinstance(config.get("model"), DictConfig):
        raise ConfigError(f"{checkpoint} holds no hf/config.json and no run config (resolved_config.yaml or "
                          ".hydra/config.yaml in its run directory) says which model it is. Fix: the checkpoint "
                          "inside its run directory (<run>/checkpoints/step-N), or the run directory itself.")
    try:
        keys = OmegaConf.to_container(config, resolve=True).get("model")  # type: ignore[union-attr]
    except OmegaConfBaseException:  # an interpolation into what the launcher resolved: the sizes below
        keys = OmegaConf.to_container(config.model, resolve=False)
    assert isinstance(keys, dict)
    target = str(keys.pop("_target_", None))
    if target not in BUILTIN_FACTORIES:
        raise ConfigError(f"{checkpoint}: model._target_={target!r} is not a built-in model, and a user's model code "
                          "is not imported here. Fix: a checkpoint of model=transformer, model=mlp or model=hf "
                          "(or python -m runner.export for model=hf, then your own code).")
    keys["vocab_size"], _ = tensors["embed.tok.weight"].shape
    keys["max_seq_len"], _ = tensors["embed.pos.weight"].shape
    return BUILTIN_FACTORIES[target], keys


def builtin_model(checkpoint: Path) -> nn.Module:
    """The built-in model (``model=transformer`` or ``mlp``) of ``checkpoint``, with its tensors."""
    from runner.models import builtin

    tensors = _loaded(checkpoint)
    if "embed.tok.weight" not in tensors or "embed.pos.weight" not in tensors:
        raise ConfigError(f"{checkpoint} holds no hf/config.json and no built-in model's embedding "
                          "(embed.tok.weight). Fix: a checkpoint of model=transformer, model=mlp or model=hf.")
    factory, keys = _builtin_keys(checkpoint, tensors)
    try:
        with torch.device("meta"):
            model = getattr(builtin, factory)(**keys)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{checkpoint}: the run's model keys {keys} do not build model={factory}: {e}. Fix: the "
                          "run directory's resolved_config.yaml as the run wrote it.") from e
    _assign(model, tensors, checkpoint)
    return model


def checkpoint_model(checkpoint: Path) -> nn.Module:
    """The checkpoint's model: ``hf_model`` where it holds ``hf/config.json``, else ``builtin_model``."""
    return hf_model(checkpoint) if (checkpoint / "hf" / "config.json").is_file() else builtin_model(checkpoint)


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence ``model`` takes: a Hugging Face config's ``max_position_embeddings``
    (``n_positions``), a built-in model's position table; None where nothing bounds it."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(value := getattr(config, key, None), int):
            return value
    table = getattr(getattr(model, "embed", None), "pos", None)
    return table.num_embeddings if isinstance(table, nn.Embedding) else None
