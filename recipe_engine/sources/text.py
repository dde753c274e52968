"""Text sources for calibration and evaluation, tokenization, and seeded window sampling.

Sources (``dataset`` field):

* ``wikipedia-sample`` / ``c4-sample`` / ``code-sample``: the ``wiki.utf8`` / ``c4.utf8`` / ``code.utf8`` files
  shipped in the PyPI package ``exllamav2==0.3.2`` (located with ``importlib.util.find_spec``, never imported),
  ``<doc ...>`` tags stripped (a file without tags: its blank-line paragraphs, or its lines). Split ``train``
  is the first 90 % of documents, ``test``/``validation`` the last 10 %, ``all`` every document (a file
  without tags: its text as it is).
* ``wikitext2``: WikiText-2 raw. Local files are used when ``$RECIPE_DATA_DIR`` is set and holds
  ``wikitext-2-raw/wiki.{test,valid}.raw``; otherwise HF ``datasets`` (``wikitext``, ``wikitext-2-raw-v1``).
  The report records which was read.
* ``c4``: HF ``allenai/c4`` validation shard 0 (online only).
* a local ``.txt`` file, a ``.jsonl``/``.json`` file (field ``text_field``), or a ``save_to_disk`` directory.
* any other string: an HF ``datasets`` name, loaded with ``load_dataset(name, split=split)``.

Rows are joined with ``"\\n\\n"`` (the WikiText-2 perplexity convention).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceError
from ..suggest import did_you_mean
from .hub import hub_unreachable, names_a_local_path, offline_mode, valid_hub_id

EXLLAMA_INSTALL = "pip install --no-deps exllamav2==0.3.2"
SAMPLE_FILES = {"wikipedia-sample": "wiki.utf8", "c4-sample": "c4.utf8", "code-sample": "code.utf8"}
SAMPLE_SPLITS = ("train", "validation", "test", "all")
WIKITEXT_SPLITS = {"test": "wiki.test.raw", "validation": "wiki.valid.raw", "valid": "wiki.valid.raw",
                   "train": "wiki.train.raw"}
_DOC_TAG = re.compile(r"</?doc[^>]*>")


@dataclass(frozen=True)
class TextSource:
    name: str      # what the user asked for
    origin: str    # the file or dataset actually read
    text: str


#: Environment variable naming the local data directory (WikiText-2 raw, zero-shot task files).
DATA_DIR_VARIABLE = "RECIPE_DATA_DIR"


def data_dir() -> Path | None:
    """``$RECIPE_DATA_DIR`` (the shared data directory: ``wikitext-2-raw/``, ``arc/``, ...), or None when
    unset; set to something that is not a directory is an error (one line)."""
    env = os.environ.get(DATA_DIR_VARIABLE)
    if not env:
        return None
    path = Path(env).expanduser()
    if not path.is_dir():
        raise SourceError(f"${DATA_DIR_VARIABLE}={env} is not a directory")
    return path


def local_wikitext(split: str) -> Path | None:
    """The WikiText-2 raw file of ``split`` under the data directory, if there is one."""
    root = data_dir()
    path = None if root is None else root / "wikitext-2-raw" / WIKITEXT_SPLITS.get(split, "")
    return path if path is not None and path.is_file() else None


def exllama_sample(filename: str) -> Path:
    spec = importlib.util.find_spec("exllamav2")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"builtin text samples need the PyPI package: {EXLLAMA_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / "conversion" / "standard_cal_data" / filename
    if not path.is_file():
        raise SourceError(f"{path} missing; reinstall with {EXLLAMA_INSTALL}")
    return path


def split_documents(raw: str) -> list[str]:
    """Documents of a sample file: ``<doc ...>``-wrapped documents (tags stripped); in a file without tags,
    blank-line-separated paragraphs, or lines where it has no blank lines (``c4.utf8``: one line a document)."""
    if _DOC_TAG.search(raw):
        docs = [d.strip() for d in re.split(r"<doc[^>]*>", raw)]
        return [_DOC_TAG.sub("", d).strip() for d in docs if _DOC_TAG.sub("", d).strip()]
    parts = re.split(r"\n[ \t]*\n", raw) if re.search(r"\n[ \t]*\n", raw) else raw.splitlines()
    return [part.strip("\n") for part in parts if part.strip()]


def wikitext_rows(raw: str) -> list[str]:
    """Emulate HF ``wikitext-2-raw-v1`` rows from a raw file: each line with its newline is a row,
    a blank line (``" \\n"``) is ``""``."""
    return ["" if line.strip() == "" else line for line in raw.splitlines(keepends=True)]


BUILTIN_TEXT = (*SAMPLE_FILES, "wikitext2", "c4")


#: How the builtin hub sources are read: ``load_dataset``'s path and keyword arguments.
HUB_BUILTINS = {"wikitext2": ("wikitext", {"name": "wikitext-2-raw-v1"}),
                "c4": ("allenai/c4", {"data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"}})}


def _hf_rows(source: str, dataset: str, split: str, field: str, **load_kwargs) -> list[str]:
    """Rows of ``field`` of HF dataset ``dataset`` (``datasets.load_dataset(dataset, split=split,
    **load_kwargs)``), read for the recipe's source name ``source``; any failure is one line."""
    require_hub(source, split=split)
    try:
        # deferred: datasets takes about a second to import; only hub and on-disk datasets need it
        import datasets

        table = datasets.load_dataset(dataset, split=split, **load_kwargs)
    except Exception as exc:  # datasets raises many unrelated types; each becomes one located line
        raise SourceError(f"cannot load dataset '{dataset}' split '{split}'{_read_for(source, dataset)}: "
                          f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                          f"{'' if source in BUILTIN_TEXT else did_you_mean(source, BUILTIN_TEXT)}") from None
    return _column(table, field, dataset)


def _read_for(source: str, dataset: str) -> str:
    return "" if source == dataset else f" (read for '{source}')"


def require_hub(name: str, timeout_s: float = 3.0, *, split: str | None = None) -> None:
    """Fail in seconds, not after ``datasets``' retries, when the HF hub cannot be reached; the message says
    why source ``name`` (its ``split``, when given) is read from the hub.

    In HF offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) nothing is probed: ``datasets``
    reads its cache without retrying.
    """
    if offline_mode("HF_DATASETS_OFFLINE"):
        return
    problem = hub_unreachable(timeout_s)
    if problem:
        raise SourceError(f"{_hub_source_phrase(name, split)}, and {problem}")


def _hub_source_phrase(name: str, split: str | None = None) -> str:
    """What a hub source is, for a message: a builtin read from the hub, or a name that is nothing local."""
    if name == "wikitext2" and split is not None:
        return (f"dataset 'wikitext2' split '{split}': {_missing_wikitext(split)}, so it is read from the HF hub "
                f"(wikitext, wikitext-2-raw-v1)")
    if name == "wikitext2":
        return (f"dataset 'wikitext2' is read from the HF hub (wikitext, wikitext-2-raw-v1) when "
                f"${DATA_DIR_VARIABLE} has no wikitext-2-raw/ files")
    if name == "c4":
        return "dataset 'c4' is read from the HF hub (allenai/c4)"
    return f"dataset '{name}' is not a builtin ({', '.join(BUILTIN_TEXT)}) or a local path"


def _missing_wikitext(split: str) -> str:
    """Why WikiText-2's ``split`` is not read locally: no data directory, or which files it has instead."""
    root = data_dir()
    if root is None:
        return f"${DATA_DIR_VARIABLE} is not set"
    folder = root / "wikitext-2-raw"
    have = [s for s in ("train", "validation", "test") if local_wikitext(s) is not None]
    if not have:
        return f"not in ${DATA_DIR_VARIABLE} (no {folder}/wiki.*.raw)"
    return (f"not in ${DATA_DIR_VARIABLE} ({folder} has {', '.join(have)} only, no "
            f"{WIKITEXT_SPLITS.get(split, split)})")


def require_hub_dataset(name: str) -> None:
    """The hub knows dataset ``name`` (one metadata request, no download); skipped in offline mode."""
    if offline_mode():
        return
    # deferred: the hub client (~0.2 s) is needed only for hub sources
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise SourceError(f"dataset '{name}' is not a builtin ({', '.join(BUILTIN_TEXT)}), a local path, or a "
                          f"dataset on the HF hub{did_you_mean(name, BUILTIN_TEXT)}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise SourceError(f"dataset '{name}': the HF hub did not answer: "
                          f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from None


def source_kind(name: str, split: str = "train") -> str:
    """Classify a text source without reading it (what ``apply`` and ``validate`` both check offline):
    ``sample`` (a builtin sample file), ``local`` (a file or directory here, WikiText-2 under
    ``$RECIPE_DATA_DIR`` included) or ``hub`` (read from the HF hub: ``wikitext2`` without local files,
    ``c4``, or an HF datasets id).

    Refused here, in one line: a builtin's unknown split; a path-like name (``./x``, ``/x``, ``~/x``,
    ``x.txt``/``.jsonl``/``.json``, or under a directory that exists here) that does not exist; a name that
    is not a valid hub id; and a bare name (no ``owner/``) that is a near miss of a builtin name
    (``wikipedia-sampel``: did you mean ``wikipedia-sample``?): such a name is taken for a misspelt
    builtin, online or offline alike. A hub dataset of such a name is read by its full id (``owner/name``).
    """
    if name in SAMPLE_FILES:
        if split not in SAMPLE_SPLITS:
            raise SourceError(f"{name} has splits {', '.join(SAMPLE_SPLITS)} (got '{split}')")
        return "sample"
    if name == "wikitext2":
        if split not in WIKITEXT_SPLITS:
            raise SourceError(f"wikitext2 has splits train, validation, test (got '{split}')")
        return "hub" if local_wikitext(split) is None else "local"
    if name == "c4":
        return "hub"
    path = Path(name).expanduser()
    if path.exists():
        return "local"
    if names_a_local_path(name) or path.suffix in (".txt", ".jsonl", ".json"):
        raise SourceError(f"data not found: {name}")
    hint = did_you_mean(name, BUILTIN_TEXT)
    if hint and "/" not in name:
        raise SourceError(f"dataset '{name}' is not a builtin ({', '.join(BUILTIN_TEXT)}) or a local "
                          f"path{hint} (an HF hub dataset of this name: write its full id, owner/name)")
    if not valid_hub_id(name):
        raise SourceError(f"data not found: '{name}' is not a builtin ({', '.join(BUILTIN_TEXT)}), a local "
                          f"path or a valid HF hub dataset id{hint}")
    return "hub"


def is_hub_source(name: str, split: str = "train") -> bool:
    """Would :func:`load_text` read ``name`` from the HF hub (rather than a file on this machine)?"""
    return source_kind(name, split) == "hub"


def check_text(name: str, split: str, text_field: str, tokens: int) -> str | None:
    """``recipe validate``'s data check, :func:`source_kind`'s checks first (as ``apply``'s
    :func:`load_text`): a local source is read and must hold at least ``tokens`` bytes of text (a token
    covers at least one byte, so fewer bytes can never give enough tokens); a hub source must be reachable
    and, for an HF datasets id, known to the hub. The exact token count is checked after tokenization
    (``sample_windows``). Returns None when fully checked, else one line on what could not be checked
    (a hub source in HF offline mode: the hub is not asked)."""
    if source_kind(name, split) == "hub":
        require_hub(name, split=split)
        if offline_mode():
            return f"dataset '{name}' (HF hub) not checked: HF offline mode is set"
        if name not in BUILTIN_TEXT:
            require_hub_dataset(name)
        return None
    check_length(load_text(name, split, text_field), tokens)
    return None


def _column(table, field: str, name: str) -> list[str]:
    if field not in table.column_names:
        raise SourceError(f"dataset {name} has no field '{field}' (fields: {', '.join(table.column_names)})")
    return list(table[field])


def load_text(name: str, split: str, text_field: str = "text") -> TextSource:
    """Resolve a text source to one string (rows joined by blank lines). ``text_field``: the field of
    json/jsonl/dataset records (evaluation sources are read with ``text``; calibration states its own)."""
    kind = source_kind(name, split)
    if name in SAMPLE_FILES:
        path = exllama_sample(SAMPLE_FILES[name])
        raw = _read(path)
        docs = split_documents(raw)
        cut = int(len(docs) * 0.9)
        chosen = {"train": docs[:cut], "all": docs}.get(split, docs[cut:])
        text = raw.strip() if split == "all" and not _DOC_TAG.search(raw) else "\n\n".join(chosen)
        return TextSource(name, f"{path} [{split}: {len(chosen)} documents]", text)
    if name == "wikitext2":
        local = local_wikitext(split)
        if local is not None:
            return TextSource(name, str(local), "\n\n".join(wikitext_rows(_read(local))))
        hf_split = "validation" if split == "valid" else split
        dataset, load_kwargs = HUB_BUILTINS[name]
        rows = _hf_rows(name, dataset, hf_split, "text", **load_kwargs)
        return TextSource(name, f"hf:wikitext/wikitext-2-raw-v1[{hf_split}]", "\n\n".join(rows))
    if name == "c4":
        dataset, load_kwargs = HUB_BUILTINS[name]
        rows = _hf_rows(name, dataset, "validation", "text", **load_kwargs)
        return TextSource(name, "hf:allenai/c4[validation shard 0]", "\n\n".join(rows))
    path = Path(name).expanduser()
    if kind == "local" and path.is_dir():
        return TextSource(name, str(path), "\n\n".join(_disk_rows(path, split, text_field)))
    if kind == "local":
        return TextSource(name, str(path), "\n\n".join(_file_rows(path, text_field)))
    rows = _hf_rows(name, name, split, text_field)
    return TextSource(name, f"hf:{name}[{split}]", "\n\n".join(rows))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start})") from None
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from None


def _file_rows(path: Path, field: str) -> list[str]:
    if path.suffix not in (".jsonl", ".json"):
        return [_read(path)]
    text, line = _read(path), 0
    try:
        if path.suffix == ".jsonl":
            records = []
            for line, row in enumerate(text.splitlines(), 1):
                if row.strip():
                    records.append(json.loads(row))
        else:
            records = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {line}" if path.suffix == ".jsonl" else f"line {exc.lineno}"
        raise SourceError(f"{path}: invalid JSON at {where}: {exc.msg}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SourceError(f"{path}: expected a list of JSON objects (one per line in .jsonl), each with "
                          f"field '{field}'")
    missing = [i for i, r in enumerate(records) if field not in r]
    if missing:
        raise SourceError(f"{path}: record {missing[0]} has no field '{field}'")
    return [str(r[field]) for r in records]


def _disk_rows(path: Path, split: str, field: str) -> list[str]:
    # deferred: datasets takes about a second to import; only hub and on-disk datasets need it
    import datasets

    try:
        table = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise SourceError(f"cannot read save_to_disk directory {path}: {exc}") from None
    if isinstance(table, datasets.DatasetDict):
        if split not in table:
            raise SourceError(f"{path} has splits {', '.join(table)} (asked for '{split}')")
        table = table[split]
    return _column(table, field, str(path))


def check_length(text: "TextSource", tokens: int) -> None:
    size = len(text.text.encode("utf-8"))
    if size < tokens:
        raise SourceError(f"calibration data {text.origin} has {size} bytes of text; samples × seq_len = "
                          f"{tokens} tokens need at least {tokens} bytes (a token covers at least one byte)")
