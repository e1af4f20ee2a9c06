"""Hugging Face causal LMs (``model=hf``): a local directory with ``config.json`` and optionally
``*.safetensors`` weights and tokenizer files.

The stage modules hold transformers' own modules (embedding, decoder layers, norm, head) under
their own names, so nothing of transformers is copied. What the base model computes beside the
hidden states (position ids, rotary position embeddings, the causal or sliding-window mask for
each layer) each stage recomputes from the batch's keyword inputs (``attention_mask``,
``position_ids``) with transformers' own functions, per family. Families are a tested list, each
held to the model's own forward; another family runs only with ``model.allow_unlisted=true``,
where ``verify`` decides (on by default: ``resolve_verify``).

Pretrained weights: checked against the model from the safetensors headers when the model is built
(``runner.models.hf_weights``: before launch, as validate builds the meta model); each rank then reads only
its own stages' tensors (``safe_open``, lazily), cast to the fp32 the model is built in whatever the
directory stores (its dtype is recorded for export). No directory's code runs
(``runner.models.hf_dirs``). Random initialisation (``model.pretrained=false``) runs the family's
``_init_weights`` per module, children before parents as transformers does, each module under a
seed of its own (the runner's layout-independent initialisation).

Uses transformers' weight-renaming helpers (``conversion_mapping``, ``core_model_loading``), which
are not public API: tested with the transformers range pinned in pyproject.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from runner.errors import ConfigError
from runner.models.hf_dirs import TOKENIZER_FILES as _TOKENIZER
from runner.models.hf_dirs import remote_code_problem, remote_override_problem
from runner.models.hf_weights import Stored, Weights, header_dtype, read_weights
from runner.models.units import ModelSpec, Unit, tied_groups

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["FAMILIES", "causal_lm", "HFSpec", "TOKENIZER_FILES", "copy_model_files", "resolve_verify"]

log = logging.getLogger("runner.hf")  # named as before runner/ became packages (runner.log)


def _full(config, i: int) -> str:
    return "full_attention"


def _sliding_if_configured(config, i: int) -> str:
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _by_layer_type(config, i: int) -> str:
    return config.layer_types[i]


@dataclass(frozen=True)
class Family:
    """What one family's base model computes around its layers (names relative to the base model)."""

    embed: tuple[str, ...] = ("embed_tokens",)  # modules of the first unit
    layers: str = "layers"  # the container of decoder layers
    norm: str = "norm"
    rotary: str | None = "rotary_emb"  # computes (cos, sin) from the positions
    positions: str | None = None  # a learned position embedding added to the tokens' (GPT-2's wpe)
    dropout: str | None = None  # dropout after the embedding (GPT-2's drop)
    mask: Callable[[Any, int], str] = _full  # the mask layer i takes: full_attention | sliding_attention


# model_type -> family; each is checked against the model's own forward in tests/test_hf.py.
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(mask=_sliding_if_configured),
    "qwen2": Family(mask=_by_layer_type),
    "qwen3": Family(mask=_by_layer_type),
    "gpt2": Family(embed=("wte", "wpe", "drop"), layers="h", norm="ln_f", rotary=None, positions="wpe",
                   dropout="drop"),
}
# A model directory's files besides config and weights: its tokenizer's and its generation config.
TOKENIZER_FILES = (*_TOKENIZER, "generation_config.json")


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ConfigError("model=hf needs transformers and safetensors (not installed). "
                          "Fix: pip install -e '.[hf]' (or 'runner[hf]').") from e
    return transformers


def _not_a_model_dir(path: str, directory: Path) -> str:
    """Why ``model.path`` is no model directory: not there (a Hub name, maybe), a file, or no config.json."""
    fix = ("Fix: a local directory written by save_pretrained (config.json, and optionally *.safetensors and "
           "tokenizer files)")
    if directory.is_dir():
        return f"model.path={path!r} holds no config.json. {fix}."
    if directory.exists():
        return f"model.path={path!r} is a file, not a directory. {fix}: model.path={str(directory.parent)!r}?"
    where = "no such directory" + ("" if directory.is_absolute() else f" ({directory.resolve()})")
    if not path.startswith(("/", "~", ".")) and path.count("/") == 1:  # organisation/name, as the Hub names models
        return (f"model.path={path!r}: {where}; the runner reads local directories only and downloads nothing. {fix}: "
                f"download it first (`hf download {path} --local-dir <dir>`), then model.path=<dir>.")
    return f"model.path={path!r}: {where}. {fix}."


def causal_lm(*, path: str, pretrained: bool = True, allow_unlisted: bool = False,
              config_overrides: Mapping[str, Any] | None = None, attn_implementation: str | None = None) -> nn.Module:
    """The model factory of ``model=hf``: the causal LM of ``path`` (built on the current device:
    meta when the runner builds it), carrying its pipeline units as ``runner_spec``. Its weights
    are fp32 whatever dtype the directory stores or its config.json names (``source_dtype``)."""
    transformers = _import_transformers()
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError(_not_a_model_dir(path, directory))
    overrides = dict(config_overrides or {})
    problem = remote_override_problem(overrides, attn_implementation) or remote_code_problem(directory, "model.path")
    if problem:  # before transformers reads an auto_map
        raise ConfigError(problem)
    stored = read_weights(directory) if pretrained else None
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False,
                                                         **overrides)
        source_dtype = _source_dtype(directory, config, stored)  # from_config(dtype=...) overwrites config.dtype
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False,
                                                              **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"model.path={path!r}: transformers cannot build a causal LM from its config.json: {e}\n"
                          "Fix: a directory of a causal language model (AutoModelForCausalLM).") from e
    family = FAMILIES.get(config.model_type)
    if family is None:
        if not allow_unlisted:
            raise ConfigError(
                f"model.path={path!r} is a {config.model_type!r} model, which is not in the tested list "
                f"({', '.join(FAMILIES)}): what its base model computes beside the layers (masks, position "
                "embeddings, scalings) may differ. Fix: a listed family, or model.allow_unlisted=true to run it "
                "as a Llama-like decoder, checked against the model's own forward on the first step (verify).")
        family = _unlisted_family(model)
    model.runner_spec = HFSpec(model, family, directory, stored=stored, source_dtype=source_dtype)
    return model


def _source_dtype(directory: Path, config: Any, stored: Mapping[str, Stored] | None) -> torch.dtype | None:
    """The dtype the model is stored in: config.json's, else the weights' (what an export writes
    back). A disagreement between the two is logged."""
    named = config.dtype if isinstance(config.dtype, torch.dtype) else None
    found = header_dtype(stored.values()) if stored else None
    if named is not None and found is not None and named != found:
        log.warning("model.path=%s: config.json names dtype %s but the weights are stored in %s; the runner trains "
                    "fp32 weights either way and records %s as the model's dtype", directory,
                    str(named).removeprefix("torch."), str(found).removeprefix("torch."),
                    str(named).removeprefix("torch."))
    return named or found


def _unlisted_family(model: PreTrainedModel) -> Family:
    """A Llama-like reading of a family that declares a pipeline plan (embed_tokens, layers, norm):
    masks by each layer's ``attention_type``."""
    base: Any = model.base_model  # the family's own class: its config and layers are read by name
    plan = getattr(base.config, "base_model_pp_plan", None) or {}
    if list(plan)[:3] != ["embed_tokens", "layers", "norm"] or not hasattr(model, "lm_head"):
        raise ConfigError(f"model.allow_unlisted=true: a {model.config.model_type!r} model declares no "
                          "embed_tokens/layers/norm pipeline plan the runner can follow. Fix: a listed family.")
    rotary = "rotary_emb" if hasattr(base, "rotary_emb") else None
    return Family(rotary=rotary, mask=lambda config, i: getattr(base.layers[i], "attention_type", "full_attention"))


def _unlisted_type(model_cfg: Any) -> str | None:
    """The model_type of a ``model=hf`` directory outside the tested list (None: listed, or not model=hf)."""
    if model_cfg.get("_target_") != "runner.models.hf.causal_lm" or not model_cfg.get("allow_unlisted"):
        return None
    try:  # the factory has read it already (validate builds the meta model first)
        model_type = json.loads((Path(model_cfg.path).expanduser() / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return None if model_type in FAMILIES else str(model_type)


def resolve_verify(cfg: Any) -> bool:
    """The run's ``verify``: as given, or (null) on for a ``model=hf`` family outside the tested
    list, whose Llama-like reading nothing else checks; said in the log either way. (Here, not in
    runner.verify: validate calls it, and the import chain stays short.)"""
    family = _unlisted_type(cfg.model)
    if family is not None:
        if cfg.verify is False:
            log.warning("model.path=%s is a %r model, outside the tested list, and verify=false: nothing checks that "
                        "the runner computes what the model does.", cfg.model.path, family)
        else:
            log.warning("model.path=%s is a %r model, outside the tested list (model.allow_unlisted=true): verify "
                        "compares the first step with the model's own forward (verify=false turns it off).",
                        cfg.model.path, family)
    return bool(cfg.verify) if cfg.verify is not None else family is not None


@dataclass
class _Context:
    """What the base model computes once per forward and its layers take."""

    hidden: torch.Tensor  # the masks take their shape, dtype and device from the hidden states
    attention_mask: torch.Tensor | None  # the batch's (batch, seq) padding mask
    position_ids: torch.Tensor
    position_embeddings: Any = None
    masks: dict[str, Any] = field(default_factory=dict)  # per mask kind, made when a layer first needs it


class HFSpec(ModelSpec):
    """A Hugging Face causal LM's units: the embedding, each decoder layer, the final norm, the head."""

    def __init__(self, model: PreTrainedModel, family: Family, path: Path, *, stored: Mapping[str, Stored] | None,
                 source_dtype: torch.dtype | None = None):
        from transformers import PreTrainedModel

        self.family = model.config.model_type
        self.unlisted = model.config.model_type not in FAMILIES  # verify runs unless turned off
        self.config = model.config
        self.path = path
        self.source_dtype = source_dtype  # the directory's; the model's weights are fp32
        self._family = family
        self._model = model
        base = model.base_model_prefix
        self._base = base
        layers = model.get_submodule(f"{base}.{family.layers}")
        assert isinstance(layers, nn.ModuleList), type(layers)  # transformers keeps decoder layers in a ModuleList
        self._layer_names = [f"{base}.{family.layers}.{i}" for i in range(len(layers))]
        embed = Unit(f"{base}.{family.embed[0]}", tuple(f"{base}.{n}" for n in family.embed))
        self.units = (embed, *(Unit(n, (n,)) for n in self._layer_names),
                      Unit(f"{base}.{family.norm}", (f"{base}.{family.norm}",)), Unit("lm_head", ("lm_head",)))
        self.shared = (f"{base}.{family.rotary}",) if family.rotary else ()
        self._kind = {embed.name: "embed", **{n: "layer" for n in self._layer_names},
                      self.units[-2].name: "norm", "lm_head": "head"}
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
        # Each module is initialised by the _init_weights of its closest PreTrainedModel.
        self._init_owners = sorted(((name, m) for name, m in model.named_modules() if isinstance(m, PreTrainedModel)),
                                   key=lambda item: -len(item[0]))
        self._tied = tied_groups(model)
        # Checked against the model here, so that validate's meta model refuses bad weights before launch.
        self._weights = None if stored is None else Weights(path, stored, model, self._tied)
        self.bytes_read = 0
        self._counted: set[tuple[str, str, Any]] = set()  # (file, key, part) read here: a tied copy counts once

    # -- running a stage ------------------------------------------------------------------------
    def blocks(self) -> list[str]:
        return list(self._layer_names)

    def keyword_inputs(self) -> set[str]:
        return {"attention_mask", "position_ids"}

    def run(self, stage: nn.Module, units: Sequence[str], x: torch.Tensor, kwargs: dict[str, Any], *,
            seq_shards: int = 1) -> torch.Tensor:
        ctx = None
        for name in units:
            kind = self._kind[name]
            if kind == "embed":
                x = self._embed(stage, x, kwargs)
            elif kind == "layer":
                ctx = ctx or self._context(stage, x, kwargs, seq_shards)
                x = self._layer(stage.get_submodule(name), self._layer_index[name], x, ctx)
            else:  # the final norm, the head
                x = stage.get_submodule(name)(x)
        return x

    def _positions(self, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        # As the base model: the batch's position_ids, else 0..seq-1 (also with left padding).
        given = kwargs.get("position_ids")
        return given if given is not None else torch.arange(x.shape[1], device=x.device).unsqueeze(0)

    def _embed(self, stage: nn.Module, ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        f, base = self._family, self._base
        h = stage.get_submodule(f"{base}.{f.embed[0]}")(ids)
        if f.positions:
            h = h + stage.get_submodule(f"{base}.{f.positions}")(self._positions(ids, kwargs)).to(h.device)
        if f.dropout:
            h = stage.get_submodule(f"{base}.{f.dropout}")(h)
        return h

    def _context(self, stage: nn.Module, h: torch.Tensor, kwargs: dict[str, Any], seq_shards: int = 1) -> _Context:
        if seq_shards > 1:  # sequence parallelism: h is this rank's slice; positions and masks are the whole sequence's
            h = h[:, :1].expand(h.shape[0], h.shape[1] * seq_shards, *h.shape[2:])  # its shape, no copy
        ctx = _Context(h, kwargs.get("attention_mask"), self._positions(h, kwargs))
        if self._family.rotary:
            ctx.position_embeddings = stage.get_submodule(f"{self._base}.{self._family.rotary}")(h, ctx.position_ids)
        return ctx

    def _mask(self, ctx: _Context, kind: str):
        if kind not in ctx.masks:
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            if ctx.hidden.device.type == "meta":  # shape checks and torch's shape inference: no values
                ctx.masks[kind] = None
            else:
                make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                ctx.masks[kind] = make(config=self.config, inputs_embeds=ctx.hidden, attention_mask=ctx.attention_mask,
                                       cache=None, position_ids=ctx.position_ids)
        return ctx.masks[kind]

    def _layer(self, layer: nn.Module, index: int, h: torch.Tensor, ctx: _Context) -> torch.Tensor:
        kwargs = {"attention_mask": self._mask(ctx, self._family.mask(self.config, index)),
                  "position_ids": ctx.position_ids, "use_cache": False}
        if ctx.position_embeddings is not None:
            kwargs["position_embeddings"] = ctx.position_embeddings
        return layer(h, **kwargs)

    def reference_forward(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """transformers' own forward of the whole, unmodified model."""
        return lambda x, **kwargs: model(input_ids=x, use_cache=False, **kwargs).logits

    # -- initialisation and weights -------------------------------------------------------------
    def cannot_init(self, model: nn.Module) -> list[str]:
        return []  # transformers' _init_weights covers its own modules

    def init_order(self, names: Iterable[str]) -> list[str]:
        return list(reversed(list(names)))  # children before parents, as transformers' smart_apply

    def needs_init(self, module: nn.Module) -> bool:
        return True  # a parent's _init_weights may set its children's weights (GPT-2's c_proj)

    def init_module(self, name: str, module: nn.Module) -> None:
        owner = next(m for prefix, m in self._init_owners if not prefix or name == prefix or
                     name.startswith(f"{prefix}."))
        owner._init_weights(module)

    @property
    def pretrained(self) -> bool:
        return self._weights is not None

    def load_pretrained(self, stage: nn.Module) -> set[str] | None:
        """Each tensor of the stage from its file; a DTensor's local shard (tp's, FSDP's) reads its
        own part alone (``get_slice``), never the whole tensor. ``bytes_read`` counts
        what this process read, a tied copy once."""
        if self._weights is None:
            return None
        from safetensors import safe_open

        wanted = _persistent_state(stage)
        by_source: dict[Stored, list[torch.Tensor]] = {}
        for name, target in wanted.items():
            source = self._weights.source(name)
            assert source is not None  # Weights checked every name of the model
            targets = by_source.setdefault(source, [])
            if all(t is not target for t in targets):  # a weight tied within the stage: one tensor
                targets.append(target)
        with torch.no_grad():
            for file in sorted({s.file for s in by_source}):
                with safe_open(self.path / file, framework="pt") as f:
                    for source in (s for s in by_source if s.file == file):
                        for target in by_source[source]:
                            self._read_into(f, file, source, target)
        return set(wanted)

    def _read_into(self, f: Any, file: str, source: Stored, target: torch.Tensor) -> None:
        """``target``'s part of ``source`` (all of it, or a tp or FSDP shard's: its region of
        the whole, ``local_region``), cast to the model's fp32."""
        from runner._torch.dist import local_region

        local = target.to_local() if hasattr(target, "to_local") else target  # a DTensor: its shard
        region = local_region(target)
        part = tuple((r.start, r.stop) for r in region)
        tensor = f.get_tensor(source.key) if local is target else f.get_slice(source.key)[region]
        local.copy_(tensor)
        _check_finite(local, source, self.path)
        if (file, source.key, part) not in self._counted:
            self._counted.add((file, source.key, part))
            self.bytes_read += tensor.numel() * tensor.element_size()

    def save_metadata(self, directory: Path) -> None:
        """What an exported model needs besides its tensors: config and tokenizer files."""
        directory.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.config)
        config.dtype = self.source_dtype or torch.float32  # the directory's, not the fp32 trained in
        config.save_pretrained(directory)
        copy_model_files(self.path, directory)


def _check_finite(tensor: torch.Tensor, source: Stored, path: Path) -> None:
    """Pretrained values that are NaN or inf are named here, not found as a non-finite loss later.
    The sum is finite unless one is not (or it overflows): only then are they counted."""
    if not tensor.is_floating_point() or torch.isfinite(tensor.sum()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise ConfigError(f"model.path={str(path)!r}: {source.key} in {source.file} holds non-finite values ({bad} of "
                          f"{tensor.numel()} are NaN or inf): the weights are damaged. Fix: weights with finite "
                          "values (copy them again).")


def copy_model_files(source: Path, target: Path) -> None:
    """The tokenizer and generation-config files of a model directory, where it has them."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (target / name).exists():
            shutil.copy2(source / name, target / name)


def _persistent_state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by full name (what a checkpoint file holds)."""
    out: dict[str, torch.Tensor] = dict(stage.named_parameters(remove_duplicate=False))
    for module_name, module in stage.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{buf_name}" if module_name else buf_name] = buf
    return out
