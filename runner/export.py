"""``python -m runner.export <checkpoint or run directory> <output directory>``: a trained
``model=hf`` model in Hugging Face format, for ``AutoModelForCausalLM.from_pretrained``.

Writes config.json (with the run's ``model.config_overrides``), the weights as safetensors
(sharded above ``--max-shard-size``, a tied head stored once, as transformers stores it), and the
tokenizer and generation-config files the model directory had. Checkpoints are keyed by the
model's own parameter names, so the tensors go in as they are, from any layout.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from runner._torch_dcp import SafePlanner, SafeReader, UnsafeCheckpointError
from runner.checkpoint import verify_checkpoint
from runner.checkpoint_files import find_checkpoint, read_train_state
from runner.dist import DistEnv
from runner.errors import CheckpointError, ConfigError, RunnerError, exit_code
from runner.remote_code import remote_code_problem
from runner.units import tied_groups

__all__ = ["export", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint (not the optimizer's), read in this process: its
    files checked against their manifests, and nothing unpickled but checkpoint data."""
    verify_checkpoint(checkpoint, read_train_state(checkpoint)["world_size"], DistEnv(0, 1, torch.device("cpu")))
    reader = SafeReader(str(checkpoint))
    try:
        metadata = reader.read_metadata()
    except UnsafeCheckpointError as e:
        raise CheckpointError(f"checkpoint {checkpoint} was refused: {e}.") from None
    model = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=str(checkpoint), storage_reader=reader, planner=SafePlanner())
    return model


def export(source: Path, out: Path, *, dtype: str | None = None, max_shard_size: str = "5GB") -> Path:
    """Write the model of ``source`` (a checkpoint, or a run directory's newest) into ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from runner.hf import copy_model_files

    checkpoint = find_checkpoint(str(source), source)
    hf = checkpoint / "hf"
    if not (hf / "config.json").is_file():
        raise ConfigError(f"{checkpoint} holds no Hugging Face config (hf/config.json): only model=hf runs export "
                          "to Hugging Face format. Fix: export a checkpoint of a model=hf run.")
    if problem := remote_code_problem(hf, f"checkpoint {checkpoint}"):  # before transformers reads an auto_map
        raise ConfigError(problem)
    config = AutoConfig.from_pretrained(hf, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    tied = {n for names in tied_groups(model) for n in names[1:]}  # stored once, under the first name
    tensors = _model_tensors(checkpoint)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = [n for n in missing if n not in tied and n in params]
    if missing or unexpected:
        raise RunnerError(f"{checkpoint} does not hold this model's weights: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}.")
    model.tie_weights()
    for module in model.modules():  # buffers no checkpoint holds (rotary frequencies): computed
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                model._init_weights(module)
    if dtype:
        model.to(DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    copy_model_files(hf, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a checkpoint (…/checkpoints/step-N) or a run directory")
    parser.add_argument("out", type=Path, help="the output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: as trained, fp32)")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    args = parser.parse_args(argv)
    try:
        out = export(args.source.expanduser().resolve(), args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(exit_code(e))
    print(f"exported to {out}: AutoModelForCausalLM.from_pretrained({str(out)!r})")


if __name__ == "__main__":
    main()
