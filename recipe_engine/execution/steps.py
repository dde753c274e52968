"""Running recipe steps on a session: consecutive layer-scope steps share one calibration pass, a
model-scope step runs alone; each step leaves one report record."""
from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..records.report import RunReport
from ..recipe.modifier import LayerModifier, Modifier
from ..recipe.schema import step_to_dict
from ..system.host_memory import PeakWatch
from ..system.progress import Progress
from .distributed import module_digest

if TYPE_CHECKING:
    from ..plan.estimates import MemoryPlan
    from .modifier_view import ModifierView
    from .session import Session


def group_steps(steps: list[Modifier]) -> list[list[tuple[int, Modifier]]]:
    """Consecutive layer-scope steps share one pass; each model-scope step is its own group."""
    groups: list[list[tuple[int, Modifier]]] = []
    for index, step in enumerate(steps):
        if step.scope == "layer" and groups and groups[-1][0][1].scope == "layer":
            groups[-1].append((index, step))
        else:
            groups.append([(index, step)])
    return groups


def run_steps(session: Session, steps: list[Modifier], bar: Progress, watch: PeakWatch | None = None,
              plan: MemoryPlan | None = None, checkpoints=None,
              report: RunReport | None = None) -> list[dict[str, Any]]:
    """Run the steps (consecutive layer steps share one pass); each record has the step's own wall time,
    and with ``watch``/``plan`` the measured peak RSS of its group beside ``recipe plan``'s estimate. With
    ``checkpoints``, finished groups of an interrupted run are skipped and each group (and each layer of a
    pass) is checkpointed when done. Every step sees the same view of the session (``session.view``, held here
    for the run): a step may key what it keeps across layers and steps by it."""
    view = session.view  # held here: the session keeps its view weakly
    try:
        records = _run_groups(session, view, steps, bar, watch, plan, checkpoints, report)
    except BaseException:
        if session.stream is not None:
            session.stream.drain(quietly=True)  # no staging write outlives the run's files
        raise
    if session.stream is not None:
        session.stream.drain()  # a staging write behind the last step's compute, finished (or its error raised)
    return records


def _run_groups(session: Session, view: ModifierView, steps: list[Modifier], bar: Progress, watch: PeakWatch | None,
                plan: MemoryPlan | None, checkpoints, report: RunReport | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = checkpoints.records if checkpoints is not None else []
    watch = watch or PeakWatch()
    groups = group_steps(steps)
    for number, group in enumerate(groups):
        steps_here = [step for _, step in group]
        later = [step for later_group in groups[number + 1:] for _, step in later_group]
        if checkpoints is not None:
            if number < checkpoints.next_group:
                session.end_group(steps_here, later)
                continue
            checkpoints.begin_group(number, [step for _, step in group], records, report)
        watch.start()
        session.outputs.label_steps(group)
        start, passes_before = time.perf_counter(), session.context.passes.value
        names = ", ".join(step.step_name() for _, step in group)
        bar.phase(f"step {group[0][0]}: {names}")
        numbers = f"{group[0][0]}" + (f"-{group[-1][0]}" if len(group) > 1 else "")
        outer = session.context.timings.begin_step(f"{numbers} {names}")
        session.begin_group(later)
        # a named range in a torch.profiler trace (benchmarks/pipeline_overhead.py splits host time by step)
        with torch.profiler.record_function(f"recipe step {session.context.timings.step}"):
            if group[0][1].scope == "layer":
                layer_steps: list[LayerModifier] = [step for _, step in group]  # type: ignore[misc]
                outputs = session.pipeline.run_layer_modifiers(layer_steps, checkpoints)
                results = [outputs[str(k)] for k in range(len(group))]
            else:
                step = group[0][1]
                with _whole_model(session, step), session.context.timings.phase("compress"):
                    results = [step.apply(view)]
        elapsed = time.perf_counter() - start
        session.end_group(steps_here, later)
        session.context.timings.record(event="step", wall_s=round(elapsed, 3))
        session.context.timings.end_step(outer)
        session.completed_steps.extend([json.dumps(step_to_dict(step), sort_keys=True) for _, step in group])
        if session.context.parallel.active and group[0][1].scope == "model":  # the guard: every rank did the same
            session.context.parallel.agree(f"step {group[0][0]} ({names})",
                                   module_digest(session.model, [list(o) for o in session.layer_origin]))
        peak = watch.stop()
        own = [result.pop("own_s", elapsed) for result in results]
        for (index, step), result, own_s in zip(group, results, own):
            memory = {"peak_rss_mib": None if peak is None else peak / 2**20}
            if plan is not None:
                memory["estimate_rss_mib"] = max(plan.steps[i].host_bytes for i, _ in group) / 2**20
            records.append({"index": index, "modifier": step.step_name(), "group": number,
                            "params": step.model_dump(mode="json"), "wall_s": own_s,
                            "shared_pass": len(group) > 1, "pass_shared_s": elapsed - sum(own),
                            "calibration_passes": session.context.passes.value - passes_before,
                            "layers_after": len(session.layers), **memory, "result": result})
        if checkpoints is not None:
            checkpoints.group_done(session, number, records, report)
            session.context.timings.record(event="checkpoint")  # its own line: not charged to the next step
    return records


@contextlib.contextmanager
def _whole_model(session: Session, step: Modifier) -> Iterator[None]:
    """A model-scope step that does not declare ``streams`` sees the whole model (and the original, if it
    needs it) materialized in host memory; ``recipe plan`` says so."""
    if session.stream is None or step.streams:
        yield
        return
    reference = session.reference_session().residency.resident() if step.needs_reference else contextlib.nullcontext()
    with session.residency.resident(), reference:
        yield
