"""The evaluation tasks: every task the engine knows, with its kind, found through this one registry.

A task is of one kind (:class:`TaskKind`): ``multiple choice`` (lm-eval zero-shot: the offline configs in
``tasks/*.yaml``, or with ``task_data: hub`` any task of lm-eval's stock index) or ``generation``
(``generation_tasks.py``: greedy completions scored by what they do). A kind says how its tasks run (``run``: all of
the recipe's tasks of that kind together, into one section of the result, :class:`~recipe_engine.records.evaluation.
Evaluation`), whether they run on a model streamed from disk (``streams``) and its pre-flight (``check``: the rows
are installed, the code-execution opt-in). Perplexity is not a task (``evaluate.perplexity``).

The built-in kinds and tasks register when their modules are imported (``zeroshot``: the kind and the offline
configs; ``generation_tasks``: HumanEval, GSM8K; ``generation``: the kind), which the registry does on its first
question; every module in ``tasks/`` is imported too, so a new task is one module there (a ``GenerationTask``
subclass under ``@generation_task``). A name no module registered is lm-eval's: multiple choice, which its pre-flight
accepts (``task_data: hub``) or refuses with a did-you-mean.
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod

from ..errors import RecipeError

MULTIPLE_CHOICE, GENERATION = "multiple choice", "generation"
#: The kinds, in the order they run and are listed (whatever order their modules were imported in).
KINDS = (MULTIPLE_CHOICE, GENERATION)
#: The modules that register the built-in kinds and tasks, in the order their names are listed.
BUILTIN = ("zeroshot", "generation_tasks", "generation")
#: Every module of this package is imported: one module per added task.
TASK_PACKAGE = f"{__package__}.tasks"


class TaskKind(ABC):
    """How the tasks of one kind run and are checked before a model loads."""

    name: str  # multiple choice, generation
    section: str  # the field of ``Evaluation`` its result fills
    streams: bool  # runs on a model streamed from disk (one unit resident at a time)

    @abstractmethod
    def check(self, names: list[str], config, option: str | None) -> None:
        """Pre-flight of ``names`` under the ``evaluate:`` block ``config``: one line on the first problem;
        ``option``: the command's own opt-in flag for model-written code (None: the recipe's field)."""

    @abstractmethod
    def run(self, model, tokenizer, names: list[str], config, device, progress=None):
        """The section's result for ``names`` on ``model`` (already on ``device``)."""


_KINDS: dict[str, TaskKind] = {}
_TASKS: dict[str, str] = {}  # task name -> its kind's name
_LOADED: list[bool] = []


def register_kind(kind: TaskKind) -> TaskKind:
    if kind.name in _KINDS or kind.name not in KINDS:
        raise RecipeError(f"evaluation task kind '{kind.name}' is registered twice or not one of {', '.join(KINDS)}")
    _KINDS[kind.name] = kind
    return kind


def register_task(name: str, kind: str) -> None:
    """``name`` is a task of ``kind``; a name registered twice raises."""
    if name in _TASKS:
        raise RecipeError(f"evaluation task '{name}' is registered twice ({_TASKS[name]}, {kind})")
    _TASKS[name] = kind


def _load() -> None:
    if _LOADED:
        return
    _LOADED.append(True)
    for module in BUILTIN:
        importlib.import_module(f"{__package__}.{module}")
    package = importlib.import_module(TASK_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{TASK_PACKAGE}.{info.name}")


def names(kind: str | None = None) -> tuple[str, ...]:
    """Every registered task name (of ``kind``): by kind (``KINDS``), each kind's in the order registered."""
    _load()
    return tuple(name for of in KINDS for name, its in _TASKS.items() if its == of and kind in (None, of))


def kind_of(name: str) -> TaskKind:
    """The kind of task ``name``: its registered kind, else multiple choice (a name of lm-eval's index)."""
    _load()
    return _KINDS[_TASKS.get(name, MULTIPLE_CHOICE)]


def by_kind(tasks: list[str]) -> list[tuple[TaskKind, list[str]]]:
    """``tasks`` grouped by kind (in the order of ``KINDS``), each group in the order given."""
    groups: dict[str, list[str]] = {}
    for task in tasks:
        groups.setdefault(kind_of(task).name, []).append(task)
    return [(_KINDS[name], groups[name]) for name in KINDS if name in groups]


def check_tasks(config, option: str | None = None) -> None:
    """Pre-flight of the ``evaluate:`` block's tasks, each kind's own checks in turn (``TaskKind.check``)."""
    for kind, tasks in by_kind(list(config.tasks)):
        kind.check(tasks, config, option)
