"""Model sources: HF hub ids, local HF dirs, model files of a source format (``formats.source_formats``: each
converted once into a cached HF checkpoint), and the builtin aliases those formats ship.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.reader import CheckpointReader, check_checkpoint, check_safetensors, has_weights
from ..errors import SourceError, reading
from ..formats import SourceFormat, packed_reader, source_formats
from ..records.extras import EXTRAS_JSON, restore_extras
from ..suggest import did_you_mean
from ..system.host_memory import trim_heap
from .hub import hub_unreachable, names_a_local_path, offline_mode, valid_hub_id

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    spec: str          # what the user wrote
    kind: str          # builtin | local | hub | a source format's name
    location: str      # directory (or hub id) that from_pretrained reads


def builtin_names() -> list[str]:
    """Every builtin alias, of every source format."""
    return [alias for fmt in source_formats().values() for alias in fmt.builtins]


def builtin_format(alias: str) -> SourceFormat:
    """The source format whose builtin ``alias`` is."""
    return next(fmt for fmt in source_formats().values() if alias in fmt.builtins)


def source_format(source: ModelSource) -> SourceFormat | None:
    """The source format a builtin alias's or a model file's weights are converted from; None for a directory
    or a hub id."""
    if source.kind == "builtin":
        return builtin_format(source.spec)
    return source_formats().get(source.kind)


def _files() -> str:
    """The model files a spec may name, for a message: ``.name`` (or ``.a/.b``) of the source formats."""
    return "/".join(fmt.suffix for fmt in source_formats().values())


def resolve_model(spec: str, convert: bool = True) -> ModelSource:
    """Classify a model spec without loading weights. A model file (and a builtin alias's) is converted here,
    once (cached); with ``convert=False`` its location is the file itself."""
    if not spec.strip():
        raise SourceError(f"empty model name {spec!r}; give a directory, a {_files()} file, a builtin alias "
                          f"({', '.join(builtin_names())}) or a hub id")
    if spec in builtin_names():
        fmt = builtin_format(spec)
        file = fmt.builtin_file(spec)
        return ModelSource(spec, "builtin", str(fmt.convert(file) if convert else file))
    path = Path(spec).expanduser()
    fmt = next((f for f in source_formats().values() if path.suffix == f.suffix), None)
    if fmt is not None:
        if not path.is_file():
            raise SourceError(f"model file not found: {spec}")
        return ModelSource(spec, fmt.name, str(fmt.convert(path) if convert else path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"model directory {spec} has no config.json")
        check_safetensors(path)
        return ModelSource(spec, "local", str(path))
    builtins = f"builtins: {', '.join(builtin_names())}"
    hint = did_you_mean(spec, builtin_names())
    if hint and "/" not in spec:  # a misspelt alias, not a hub id (hub model ids are owner/name)
        raise SourceError(f"model '{spec}' is not a builtin alias, a local directory or a {_files()} file{hint}")
    if path.exists():
        raise SourceError(f"model {spec} is a file, not a model directory (config.json and weights), a {_files()} "
                          f"file or a builtin alias ({builtins})")
    if names_a_local_path(spec) or spec.count("/") > 1 or not valid_hub_id(spec):
        raise SourceError(f"model not found: {spec} (not a directory, {_files()} file or builtin alias; {builtins})")
    problem = hub_unreachable() or (offline_mode("HF_HUB_OFFLINE") and "HF offline mode is set")
    if problem and not _hub_cached(spec):
        raise SourceError(f"model '{spec}' is not a local directory, {_files()} file or builtin alias ({builtins}; "
                          f"no directory {path.absolute()}), and as an HF hub id: not in the local HF cache, "
                          f"and {problem}")
    return ModelSource(spec, "hub", spec)


def _hub_cached(repo: str) -> bool:
    """The HF cache already holds ``repo``'s config (transformers can read it without the network)."""
    # deferred: the hub client (~0.2 s) is needed only for hub sources
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def load_config(spec: str):
    """Config only (no weights), for validation; a model file's config comes from its metadata."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoConfig

    source = resolve_model(spec, convert=False)
    if source_format(source) is not None:
        return source_format(source).config(Path(source.location))
    with reading(_config_of(spec, source)):  # not JSON, an unknown model_type, sizes transformers rejects
        config = AutoConfig.from_pretrained(source.location)
    if source.kind == "local" and has_weights(Path(source.location)):  # a config alone validates a recipe
        check_checkpoint(Path(source.location), config, spec)
    return config


def _config_of(spec: str, source: "ModelSource") -> str:
    where = Path(source.location) / "config.json" if source.kind == "local" else source.location
    return f"the config of model '{spec}' ({where})"


def require_weights(spec: str) -> None:
    """A local model directory that holds only a config (enough to validate a recipe) cannot be run: one line."""
    source = resolve_model(spec, convert=False)
    if source.kind == "local" and not has_weights(Path(source.location)):
        raise SourceError(f"model directory {spec} has no model.safetensors or model.safetensors.index.json "
                          f"(safetensors weights are required)")


def load_model(spec: str, dtype: str = "float32", skeleton: bool = False):
    """Load (model, tokenizer, source) on CPU in ``dtype``; restores saved LinearPatch-style extras.

    The model stays on CPU: the session moves one layer at a time to the accelerator. With ``skeleton``
    every parameter stays on the meta device, to be streamed from the source (``recipe_engine.execution.streaming``).
    """
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(spec)
    if skeleton and source.kind == "hub":
        source = ModelSource(spec, "hub", _hub_snapshot(spec))
    with reading(_config_of(spec, source)):  # checked before any weight is read (``load_config``)
        AutoConfig.from_pretrained(source.location)
    try:
        with reading(f"the tokenizer of model '{spec}' ({source.location})"):
            tokenizer = AutoTokenizer.from_pretrained(source.location)
        if skeleton:
            if (Path(source.location) / EXTRAS_JSON).is_file():
                raise SourceError(f"model '{spec}' carries non-stock extras ({EXTRAS_JSON}); they are "
                                  f"restored on a model in memory only: set stream: off")

            skeleton = skeleton_model(source.location, DTYPES[dtype])
            check_checkpoint(Path(source.location), skeleton.config, spec)  # the stream reads these files
            return skeleton, tokenizer, source
        if is_packed(source.location):
            return packed_model(source.location, DTYPES[dtype], spec), tokenizer, source
        with _quiet_load_report(), reading(f"model '{spec}' ({source.location})"):
            model, info = AutoModelForCausalLM.from_pretrained(source.location, dtype=DTYPES[dtype],
                                                               output_loading_info=True, ignore_mismatched_sizes=True)
    except OSError as exc:
        raise SourceError(f"cannot load model '{spec}': {str(exc).splitlines()[0]}") from None
    problems = [f"{label} {len(names)} tensor(s): {', '.join(map(str, names[:3]))}"
                for label, names in (("missing", sorted(info.get("missing_keys") or [])),
                                     ("unexpected", sorted(info.get("unexpected_keys") or [])),
                                     ("mis-shaped", [n for n, *_ in info.get("mismatched_keys") or []]))
                if names]
    if problems:  # transformers would have initialized the missing ones at random
        raise SourceError(f"model '{spec}': the weights in {source.location} do not match its config.json: "
                          f"{'; '.join(problems)}")
    model.eval()
    restore_extras(model, source.location)
    return model, tokenizer, source


def _quantization_config(location: str) -> dict | None:
    """The ``quantization_config`` of a local checkpoint's ``config.json`` (None: none, or no such file)."""
    config = Path(location) / "config.json"
    return json.loads(config.read_text()).get("quantization_config") if config.is_file() else None


def is_packed(location: str) -> bool:
    """A local checkpoint whose ``config.json`` has a ``quantization_config`` (packed weights)."""
    return bool(_quantization_config(location))


def packed_description(location: str) -> str | None:
    """How a local checkpoint's weights are packed (``compressed-tensors, 4-bit, groups of 64``), else None."""
    qconfig = _quantization_config(location)
    return packed_reader(qconfig).describe(qconfig) if qconfig else None


def local_packed_description(spec: str) -> str | None:
    """``packed_description`` of a local model directory named by ``spec`` (None for any other source: a hub
    model is not fetched to say it)."""
    path = Path(spec).expanduser()
    return packed_description(str(path)) if path.is_dir() else None


def packed_model(location: str, dtype: torch.dtype, spec: str) -> nn.Module:
    """A packed checkpoint (``recipe_engine.formats``) as a plain model in ``dtype``: every packed linear
    dequantized by ``CheckpointReader`` (``s (q - z)``, the values the quantizing step left), no
    ``quantization_config`` left on the config, so the model is what the engine and a later recipe work on."""
    model = skeleton_model(location, dtype)
    check_checkpoint(Path(location), model.config, spec)
    reader = CheckpointReader(location, model)  # with the model: packed experts under the Hub's names fused
    wanted = [name for name in model.state_dict() if name in reader]
    # a decoder layer at a time (the rest in one part): a linear's dequantizing copies are freed before the
    # next layer's are made, and the freed heap goes back after, so the peak is the model and one layer's
    by_layer = itertools.groupby(wanted, key=lambda name: re.match(r"(.*\.layers\.\d+\.)?", name).group(0))
    for _, names in by_layer:
        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                 for name, tensor in reader.read(list(names)).items()}
        model.load_state_dict(state, strict=False, assign=True)
    trim_heap()
    model.tie_weights()
    empty = [name for name, t in model.state_dict(keep_vars=True).items() if t.device.type == "meta"]
    if empty:
        raise SourceError(f"model '{spec}': {len(empty)} tensor(s) missing from {location}: {', '.join(empty[:3])}")
    restore_extras(model, location)
    return model.eval()


def hub_file(spec: str, filename: str) -> str:
    """One small file of a hub model (from the HF cache, else downloaded once), for pre-flight checks."""
    # deferred: the hub client (~0.2 s) is needed only for hub sources
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(spec, filename)
    except Exception as exc:  # offline, unknown id, gated, no such file: one line
        raise SourceError(f"cannot read {filename} of hub model '{spec}': {(str(exc).splitlines() or [''])[0]}") \
            from None


@contextlib.contextmanager
def _quiet_load_report():
    """transformers' loading report (a table of missing keys on stderr) silenced: the caller raises one line."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _hub_snapshot(spec: str) -> str:
    """Local directory of a hub model's config, tokenizer and safetensors files (downloaded once by
    huggingface_hub), for streaming."""
    # deferred: the hub client (~0.2 s) is needed only for hub sources
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                       "*.txt"])
    except Exception as exc:  # offline, unknown id, gated: one line
        raise SourceError(f"cannot download model '{spec}': {str(exc).splitlines()[0]}") from None


def skeleton_model(location: str, dtype: torch.dtype) -> nn.Module:
    """The model of the HF checkpoint directory ``location`` with every parameter on the meta device
    (``accelerate.init_empty_weights``; buffers such as rotary frequencies are real), in eval mode, with
    the directory's generation config: what ``from_pretrained`` builds, minus the weights (and minus a
    ``quantization_config``: the engine reads packed weights dequantized)."""
    # deferred: accelerate and transformers' model classes (seconds) are needed only when weights stream
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with reading(f"{Path(location) / 'config.json'}"):
        config = AutoConfig.from_pretrained(location)
    if getattr(config, "quantization_config", None):  # packed weights are read dequantized (CheckpointReader)
        del config.quantization_config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # a tied lm_head is the embedding matrix from the start, as from_pretrained makes it
    if (Path(location) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(location)
    return model.eval()


