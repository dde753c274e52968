"""Evaluation results as they travel between the engine's layers: dataclasses, written to JSON by one ``to_json``
each and read back by one ``from_json`` each.

:class:`Evaluation` holds what one evaluation measured: :class:`PerplexityResult`, :class:`ZeroShotResult` (per task
a :class:`ZeroShotTask`) and :class:`GenerationResult` (per task a :class:`GenerationScore` with its problems'
:class:`Completion`), each optional; :class:`Retained` the fractions kept between two of them. ``to_json`` gives the
JSON of ``report.json``'s ``evaluation.before`` / ``after`` / ``retained`` and of ``recipe eval --json``
(docs/report.md, docs/evaluation.md), key for key and in the same order; ``from_json`` reads a record of an earlier
version too (a key it lacks is None) and checks no value (``eval_record.py`` checks a record a user hands in).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


def _object(data: Any, what: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected an object, got {type(data).__name__}")
    return data


class _Flat:
    """A record of JSON values, one field per key, written in field order."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any):
        data = _object(data, cls.__name__)
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PerplexityResult(_Flat):
    """``evaluation.perplexity``: the text read and the protocol's figures (docs/evaluation.md)."""

    dataset: str
    origin: str
    ppl: float
    nll: float
    tokens: int
    windows: int
    windows_available: int
    seq_len: int
    fingerprint: str

    @property
    def limited(self) -> bool:
        """Fewer windows than the text holds were scored (``limit``)."""
        return self.windows < self.windows_available


#: The per-metric figures lm-eval reports beside the headline, each with its stderr.
ZERO_SHOT_METRICS = ("acc", "acc_norm", "perplexity")


@dataclass(frozen=True)
class ZeroShotTask(_Flat):
    """One zero-shot task: the headline metric and value, the rows, every metric reported (with stderr)."""

    metric: str
    value: float
    samples: int
    samples_available: int
    acc: float | None = None
    acc_stderr: float | None = None
    acc_norm: float | None = None
    acc_norm_stderr: float | None = None
    perplexity: float | None = None
    perplexity_stderr: float | None = None
    fingerprint: str | None = None  # of the offline rows (task_data: local)

    def to_json(self) -> dict[str, Any]:
        """A metric lm-eval did not report is absent, with its stderr."""
        out = {"metric": self.metric, "value": self.value, "samples": self.samples,
               "samples_available": self.samples_available}
        for name in ZERO_SHOT_METRICS:
            if getattr(self, name) is not None:
                out.update({name: getattr(self, name), f"{name}_stderr": getattr(self, f"{name}_stderr")})
        return {**out, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class Completion(_Flat):
    """One generation problem: the completion and whether it passed."""

    passed: bool
    completion: str


@dataclass(frozen=True)
class GenerationScore:
    """One generation task: headline metric and value, counts, settings, timings and every problem's completion."""

    metric: str
    value: float
    passed: int
    samples: int
    samples_available: int
    max_new_tokens: int
    stop: list[str]
    fingerprint: str
    generation_s: float
    check_s: float
    sandbox: str | None
    problems: dict[str, Completion] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**out, "problems": {pid: problem.to_json() for pid, problem in self.problems.items()}}

    @classmethod
    def from_json(cls, data: Any) -> "GenerationScore":
        data = _object(data, cls.__name__)
        problems = {pid: Completion.from_json(problem) for pid, problem in (data.get("problems") or {}).items()}
        return cls(**{f.name: data.get(f.name) for f in fields(cls) if f.name != "problems"}, problems=problems)


class _Tasks:
    """A section of tasks: ``tasks`` (name -> its record, of type ``TASK``) and their ``average``."""

    TASK: ClassVar[type]
    tasks: dict
    average: float

    def value_of(self, task: str) -> float | None:
        """The headline value of ``task``, None when it was not run."""
        return self.tasks[task].value if task in self.tasks else None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**out, "tasks": {name: task.to_json() for name, task in self.tasks.items()}}

    @classmethod
    def from_json(cls, data: Any):
        data = _object(data, cls.__name__)
        tasks = {name: cls.TASK.from_json(task) for name, task in (data.get("tasks") or {}).items()}
        return cls(**{f.name: data.get(f.name) for f in fields(cls) if f.name != "tasks"}, tasks=tasks)


@dataclass(frozen=True)
class ZeroShotResult(_Tasks):
    """``evaluation.zero_shot``: lm-eval's tasks and the plain mean of their headline values."""

    TASK: ClassVar[type] = ZeroShotTask
    tasks: dict[str, ZeroShotTask]
    data: str  # local or hub
    average: float
    limit: int | None = None
    lm_eval_version: str | None = None
    device: str | None = None


@dataclass(frozen=True)
class GenerationResult(_Tasks):
    """``evaluation.generation``: the generation tasks and the mean of their pass rates (or exact matches)."""

    TASK: ClassVar[type] = GenerationScore
    tasks: dict[str, GenerationScore]
    average: float
    limit: int | None = None
    device: str | None = None
    batch_size: int | None = None


#: The sections of an evaluation, in the order written; each field of :class:`Evaluation` and :class:`Retained`.
SECTIONS: dict[str, type] = {"perplexity": PerplexityResult, "zero_shot": ZeroShotResult,
                             "generation": GenerationResult}


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation measured: each section present when the ``evaluate:`` block asked for it."""

    perplexity: PerplexityResult | None = None
    zero_shot: ZeroShotResult | None = None
    generation: GenerationResult | None = None

    def to_json(self) -> dict[str, Any]:
        """The sections measured (one not measured is absent)."""
        return {name: getattr(self, name).to_json() for name in SECTIONS if getattr(self, name) is not None}

    @classmethod
    def from_json(cls, data: Any) -> "Evaluation":
        """The sections of a record (other keys of a ``recipe eval --json`` record are left out)."""
        data = _object(data, "evaluation")
        return cls(**{name: kind.from_json(data[name]) for name, kind in SECTIONS.items()
                      if data.get(name) is not None})


@dataclass(frozen=True)
class Retained:
    """Retained fractions after / before: dense PPL / compressed PPL for perplexity, after / before for the
    zero-shot and generation averages. ``compared``: the sections both evaluations measured (a fraction is None
    when the dense average is 0: no ratio)."""

    perplexity: float | None = None
    zero_shot: float | None = None
    generation: float | None = None
    compared: tuple[str, ...] = ()

    @classmethod
    def between(cls, before: Evaluation, after: Evaluation) -> "Retained":
        kept: dict[str, float | None] = {}
        if before.perplexity is not None and after.perplexity is not None:
            kept["perplexity"] = before.perplexity.ppl / after.perplexity.ppl
        for name in ("zero_shot", "generation"):
            dense, compressed = getattr(before, name), getattr(after, name)
            if dense is not None and compressed is not None:
                kept[name] = compressed.average / dense.average if dense.average else None
        return cls(**kept, compared=tuple(kept))

    def fractions(self) -> dict[str, float]:
        """The fractions there are (compared, with a ratio), by section."""
        return {name: getattr(self, name) for name in self.compared if getattr(self, name) is not None}

    def to_json(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in self.compared}

    @classmethod
    def from_json(cls, data: Any) -> "Retained":
        data = _object(data, "retained")
        compared = tuple(name for name in SECTIONS if name in data)
        return cls(**{name: data[name] for name in compared}, compared=compared)
