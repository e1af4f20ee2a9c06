"""The pretrained weights of a ``model=hf`` directory, read from the safetensors headers and
checked against the model the config builds, before any rank starts (``validate`` builds the meta
model, which builds this): every tensor the model needs is there with its shape, no tensor is left
unused (but those transformers itself ignores on load), each file is a whole safetensors file.

The tensors are read later, each rank its own stages' (``HFSpec.load_pretrained``), named through
transformers' own key renames (legacy names, a base model's keys in a model with a head). Uses
transformers' weight-renaming helpers and its loading rules (``conversion_mapping``,
``core_model_loading``, ``_adjust_missing_and_unexpected_keys``), which are not public API: tested
with the transformers range pinned in pyproject.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Iterable, Mapping

import torch

from runner.errors import ConfigError, shown

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Stored", "Weights", "read_weights", "header_dtype"]

log = logging.getLogger("runner.hf_weights")  # named as before runner/ became packages (runner.log)

INDEX = "model.safetensors.index.json"
# safetensors' names of the floating dtypes a checkpoint stores its weights in.
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# safetensors' integer dtypes (I8 ... I64, U8 ... U64, BOOL), by prefix.
_INTEGER_DTYPES = ("I", "U", "BOOL")


@dataclass(frozen=True)
class Stored:
    """One tensor of the directory, as its file's header describes it."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...


def _fail(path: Path, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"model.path={str(path.parent)!r}: {path.name} {problem}. Fix: {fix}")


def _index(directory: Path) -> dict[str, str]:
    """The index's ``weight_map`` (file key -> file name), checked to name existing files."""
    path = directory / INDEX
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"cannot be read as JSON ({e})", "the index save_pretrained writes, or delete it "
                    "(a single model.safetensors needs none)") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail(path, "has no weight_map (tensor name -> file)", "the index save_pretrained writes, with its "
                    "weight_map, or delete it (a single model.safetensors needs none)")
    # Lexically, not resolved: a hub cache's snapshot holds symlinks into its blobs/, which is fine.
    outside = [f"{shown(k)} -> {shown(f)}" for k, f in weight_map.items()
               if isinstance(f, str) and (PurePath(f).is_absolute() or ".." in PurePath(f).parts)]
    if outside:
        raise _fail(path, f"maps tensors to files outside the model directory: {', '.join(outside[:5])}"
                    f"{' …' if len(outside) > 5 else ''}", "file names of the model directory itself, as "
                    "save_pretrained writes them (copy the files into the directory and name them there)")
    absent = sorted({f for f in weight_map.values() if not isinstance(f, str) or not (directory / f).is_file()},
                    key=str)
    if absent:
        raise _fail(path, f"names weight files that are not in the directory: {absent[:5]}",
                    "copy the missing files, or model.pretrained=false for random initialisation")
    return weight_map


def _header(file: Path) -> dict[str, Stored]:
    """The tensors a safetensors file holds, from its header (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            out = {}
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = Stored(file.name, key, tuple(s.get_shape()), s.get_dtype())
            return out
    except (SafetensorError, OSError) as e:
        raise _fail(file, f"is not a whole safetensors file ({e})", "copy the file again (a download or copy may "
                    "have been cut short), or convert the weights with save_pretrained") from None


def read_weights(directory: Path) -> dict[str, Stored]:
    """Every tensor of the directory's safetensors files (by the index when there is one), by
    file key. A directory without weights is refused: ``model.pretrained=true`` asks for them."""
    index = directory / INDEX
    if index.is_file():
        weight_map = _index(directory)
        headers: dict[str, dict[str, Stored]] = {f: _header(directory / f) for f in sorted(set(weight_map.values()))}
        listed_absent = [k for k, f in weight_map.items() if k not in headers[f]]
        if listed_absent:
            raise _fail(index, f"lists tensors their files do not hold: {listed_absent[:5]}",
                        "the index written with these files")
        return {k: headers[f][k] for k, f in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
            raise ConfigError(f"model.path={str(directory)!r} holds pickled weights (*.bin) only; the runner reads "
                              "safetensors (no code runs when they load). Fix: convert them with transformers "
                              "(from_pretrained, then save_pretrained), or model.pretrained=false.")
        raise ConfigError(f"model.path={str(directory)!r} holds config.json but no weights (*.safetensors), and "
                          "model.pretrained=true asks for them: an incomplete model (a copy cut short?). Fix: the "
                          "directory with its weights, or model.pretrained=false for random initialisation.")
    return {k: s for file in files for k, s in _header(file).items()}


def header_dtype(stored: Iterable[Stored]) -> torch.dtype | None:
    """The floating dtype most of the stored bytes are in (None: no floating tensors)."""
    counts: Counter[str] = Counter()
    for s in stored:
        if s.dtype in _FLOAT_DTYPES:
            counts[s.dtype] += _FLOAT_DTYPES[s.dtype].itemsize * torch.Size(s.shape).numel()
    return _FLOAT_DTYPES[counts.most_common(1)[0][0]] if counts else None


class Weights:
    """The stored tensors by the model's parameter and buffer names, checked against the model."""

    def __init__(self, directory: Path, stored: Mapping[str, Stored], model: PreTrainedModel,
                 tied: list[list[str]]):
        self.directory = directory
        self.stored = dict(stored)
        self.by_name = _rename(self.stored, model)
        self._tied = tied
        self._check(model)

    def source(self, name: str) -> Stored | None:
        """Where the model's ``name`` is stored; a tied parameter absent from the files reads
        the one it is tied to."""
        if name in self.by_name:
            return self.by_name[name]
        group = next((g for g in self._tied if name in g), [])
        return next((self.by_name[n] for n in group if n in self.by_name), None)

    def _check(self, model: PreTrainedModel) -> None:
        expected = model.state_dict()
        where = f"model.path={str(self.directory)!r}"
        unused = _not_ignored(model, [n for n in self.by_name if n not in expected])
        if unused:
            shown = [f"{self.by_name[n].key} ({self.by_name[n].file})" for n in sorted(unused)[:8]]
            raise ConfigError(
                f"{where}: {len(unused)} tensor(s) of the weights are not used by the model config.json describes: "
                f"{', '.join(shown)}{' …' if len(unused) > 8 else ''}. The config and the weights disagree (fewer "
                "layers, another family?), and training would drop these. Fix: the config.json written with these "
                "weights (e.g. num_hidden_layers), or weights for this config.")
        missing = [n for n in expected if self.source(n) is None]
        if missing:
            raise ConfigError(f"{where}: the weights hold no tensor for {len(missing)} of the model's: "
                              f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}. Fix: complete weights "
                              "for this config.json, or model.pretrained=false for random initialisation.")
        self._check_float(model)
        for name, target in expected.items():
            s = self.source(name)
            assert s is not None  # none is missing: checked above
            if s.shape != tuple(target.shape):
                raise ConfigError(f"{where}: {s.key} in {s.file} has shape {s.shape}, but the model's {name} is "
                                  f"{tuple(target.shape)}. Fix: the config.json written with these weights (sizes "
                                  "such as hidden_size, vocab_size, num_key_value_heads), or weights for this config.")


    def _check_float(self, model: PreTrainedModel) -> None:
        """A float parameter stored as integers is refused (a documented choice, docs/models.md):
        cast to fp32, quantized values without their scales, or a broken conversion, would train
        as if they were weights. Integer buffers (position ids) are read as the integers they are."""
        stored = {n: s for n, p in model.named_parameters(remove_duplicate=False)
                  if p.is_floating_point() and (s := self.source(n)) is not None}
        integer = sorted(n for n, s in stored.items() if s.dtype.startswith(_INTEGER_DTYPES))
        if integer:
            named = [f"{n} ({stored[n].dtype} in {stored[n].file})" for n in integer[:8]]
            raise ConfigError(
                f"model.path={str(self.directory)!r}: {len(integer)} float parameter(s) are stored as integers: "
                f"{', '.join(named)}{' …' if len(integer) > 8 else ''}. Cast to fp32 they would train as weights "
                "(quantized values without their scales, or a broken conversion?). Fix: the model's floating-point "
                "weights (save_pretrained of the unquantized model, in fp32, bf16 or fp16), or "
                "model.pretrained=false for random initialisation.")


def _not_ignored(model: PreTrainedModel, unexpected: list[str]) -> set[str]:
    """The unexpected names transformers does not ignore when it loads (its
    ``_keys_to_ignore_on_load_unexpected``, e.g. GPT-2's ``attn.bias``, and its rules for old
    checkpoints' ``rotary_emb.inv_freq`` and ``position_ids``), asked of transformers itself."""
    if not unexpected:
        return set()
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(unexpected), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    model._adjust_missing_and_unexpected_keys(info)
    return set(info.unexpected_keys)


def _rename(stored: Mapping[str, Stored], model: PreTrainedModel) -> dict[str, Stored]:
    """Model parameter name -> its stored tensor, through transformers' own renames (legacy names,
    a base-model checkpoint loaded into a model with a head, ...)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    expected = model.state_dict()
    out = {}
    for key, s in stored.items():
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if converted is not None:
            raise ConfigError(f"model.path: the weight {key!r} needs transformers' tensor conversion "
                              f"({converted}), which the runner's per-stage loading does not do. Fix: a listed family.")
        out[name] = s
    return out
