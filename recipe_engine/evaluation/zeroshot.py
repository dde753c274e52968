"""Zero-shot accuracy through lm-evaluation-harness on the in-memory model (wrapped by ``HFLM``, no reload).

``task_data: local`` (default) runs the offline task configs in ``tasks/`` (stock prompts and metrics, rows
read from disk, see ``task_data.py``); ``task_data: hub`` runs lm-eval's stock tasks by name (needs the
network or an HF cache). The headline metric of a task is ``acc_norm`` where the task reports it, else
``acc`` (the convention of the SliceGPT/SLEB/FlattenGPT tables); the average is their plain mean, like
the papers' "Avg." column.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import torch

from ..errors import SourceError
from ..records.evaluation import ZERO_SHOT_METRICS, ZeroShotResult, ZeroShotTask
from ..sources.hub import hub_unreachable
from ..suggest import did_you_mean
from . import registry, task_data

TASKS_DIR = Path(__file__).with_name("tasks")
PAPER_TASKS = ["arc_easy", "arc_challenge", "piqa", "hellaswag", "winogrande"]


def task_manager(data: str):
    """Offline: only the configs in ``tasks/`` (fast to index); hub: lm-eval's stock task index."""
    # deferred: lm-eval takes seconds to import; only zero-shot tasks need it
    from lm_eval.tasks import TaskManager

    if data == "local":
        return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return TaskManager()


def check_tasks(tasks: list[str], data: str) -> None:
    """Before any model is loaded: every task has a config (local: ``tasks/``; hub: lm-eval's task index,
    with the hub reachable), with a did-you-mean for a near miss; an offline task's files exist."""
    tasks = [t for t in tasks if registry.kind_of(t).name == registry.MULTIPLE_CHOICE]  # the others: their kind's
    if not tasks:
        return
    if data == "local":
        known = registry.names()
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise SourceError(f"no offline config for task(s) {', '.join(unknown)}{did_you_mean(unknown[0], known)} "
                              f"(offline: {', '.join(known)}); use task_data: hub for lm-eval's stock tasks")
        for task in tasks:
            task_data.source_files(task)  # raises the one-line install hint before lm-eval starts
        return

    problem = hub_unreachable()
    if problem:
        raise SourceError(f"task_data: hub reads task(s) {', '.join(tasks)} from the HF hub, and {problem} "
                          f"(task_data: local runs {', '.join(task_data.LOCAL_TASKS)} offline)")
    known = hub_task_names()
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise SourceError(f"lm-eval has no task(s) {', '.join(unknown)}{did_you_mean(unknown[0], known)}")


@functools.lru_cache(maxsize=1)
def hub_task_names() -> frozenset[str]:
    """Every task, group and tag name in lm-eval's stock index (read from its installed configs)."""
    return frozenset(task_manager("hub").all_tasks)


def headline(metrics: dict) -> tuple[str, float]:
    """(metric name, value): ``acc_norm`` when reported, else ``acc``."""
    for name in ("acc_norm", "acc"):
        if f"{name},none" in metrics:
            return name, float(metrics[f"{name},none"])
    raise SourceError(f"task reports neither acc nor acc_norm (metrics: {', '.join(metrics)})")


def summarize(results: dict, tasks: list[str], data: str) -> ZeroShotResult:
    """lm-eval's result dict → the tasks' records and the mean headline value."""
    records = {}
    for task in tasks:
        metrics = results["results"][task]
        metric, value = headline(metrics)
        reported = {}
        for name in ZERO_SHOT_METRICS:
            if f"{name},none" in metrics:
                stderr = metrics.get(f"{name}_stderr,none")
                reported.update({name: float(metrics[f"{name},none"]),
                                 f"{name}_stderr": float(stderr) if isinstance(stderr, (int, float)) else None})
        records[task] = ZeroShotTask(metric, value, results["n-samples"][task]["effective"],
                                     results["n-samples"][task]["original"], **reported,
                                     fingerprint=task_data.fingerprint(task) if data == "local" else None)
    return ZeroShotResult(records, data, sum(r.value for r in records.values()) / len(tasks))


def run_harness(model, tokenizer, tasks: list[str], limit: int | None, data: str, batch_size: int = 1,
                log_samples: bool = False, device=None) -> dict:
    """``lm_eval.simple_evaluate`` on the in-memory model; returns lm-eval's raw result dict. ``device``:
    where inputs go when the model's own parameters do not say (a streamed skeleton is on ``meta``)."""
    # deferred: lm-eval takes seconds to import; only zero-shot tasks need it
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    check_tasks(tasks, data)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if device is not None and wrapped.device.type == "meta":
        wrapped._device = torch.device(device)  # HFLM reads the device from the first parameter
    try:
        return lm_eval.simple_evaluate(model=wrapped, tasks=list(tasks), num_fewshot=0, limit=limit,
                                       task_manager=task_manager(data), log_samples=log_samples,
                                       bootstrap_iters=1000, random_seed=0, numpy_random_seed=0,
                                       torch_random_seed=0)
    except (ConnectionError, OSError) as exc:  # a hub task's rows (offline mode without a cache, a lost network)
        if data == "local":
            raise
        raise SourceError(f"task_data: hub: cannot read the rows of {', '.join(tasks)}: "
                          f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from None


def zero_shot(model, tokenizer, tasks: list[str], limit: int | None, device, data: str = "local",
              batch_size: int = 1) -> ZeroShotResult:
    """Zero-shot accuracies of ``tasks`` (first ``limit`` rows each) on the model, already on ``device``."""
    results = run_harness(model, tokenizer, tasks, limit, data, batch_size, device=device)
    return replace(summarize(results, tasks, data), limit=limit, lm_eval_version=version("lm_eval"),
                   device=str(device))


class MultipleChoice(registry.TaskKind):
    """lm-eval's zero-shot tasks: all of them in one ``simple_evaluate``; a streamed model runs them too."""

    name, section, streams = registry.MULTIPLE_CHOICE, "zero_shot", True

    def check(self, names: list[str], config, option: str | None) -> None:
        check_tasks(names, config.task_data)

    def run(self, model, tokenizer, names: list[str], config, device, progress=None) -> ZeroShotResult:
        return zero_shot(model, tokenizer, names, config.limit, device, config.task_data)


registry.register_kind(MultipleChoice())
for _task in task_data.LOCAL_TASKS:
    registry.register_task(_task, registry.MULTIPLE_CHOICE)
