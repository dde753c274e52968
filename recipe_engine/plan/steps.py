"""``recipe plan``: steps, the statistics each needs, and how many calibration passes will run."""
from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from ..architectures.adapters import ADAPTERS
from ..architectures.shape import ModelShape
from ..errors import RecipeError
from ..execution.packed_source import plan_note
from ..execution.placement import DEVICE_SHARE
from ..execution.steps import group_steps
from ..sources.sizes import exceeds_memory
from ..sources.models import load_config, local_packed_description
from ..recipe.schema import Recipe
from .compiled import Passes, Plan, compile_plan
from .estimates import plan_memory


def plan_rows(recipe: Recipe, config=None, plan: Plan | None = None
              ) -> tuple[list[tuple[str, str, str, str]], Passes | None]:
    """Rows (step, scope, statistics, passes) and the total calibration passes as (fewest, most), read from
    the compiled ``plan`` (compiled here from ``config`` when not given).

    Consecutive layer-scope steps share one layer-sequential pass group (its count: the largest of its
    steps'). Counts can depend on the layer count a step receives (SLEB), so they need the model's
    config; without one the passes column is ``?`` and the total None.
    """
    if plan is None and config is not None:
        plan = compile_plan(recipe, config)
    steps = list(plan.steps) if plan is not None else list(recipe.modifiers)
    groups = plan.group_passes() if plan is not None else [None] * len(group_steps(steps))
    rows = []
    for group, passes in zip(group_steps(steps), groups):
        shown = format_passes(passes)
        for position, (index, step) in enumerate(group):
            text = f"{shown} (shared by steps {group[0][0]}-{group[-1][0]})" if len(group) > 1 else shown
            rows.append((f"{index} {step.step_name()}", step.scope, ", ".join(step.needs) or "-",
                         text if position == 0 else "↑ same pass"))
    return rows, plan.total_passes() if plan is not None else None


def steps_passes(steps: list, shape: ModelShape) -> Passes:
    """Calibration passes of ``steps`` run in order from ``shape`` (which is updated as each step's
    ``check`` leaves it): consecutive layer-scope steps share one pass group (its count: the largest). For a
    step that runs steps of its own (a combinator) on shapes it tries; a recipe's are in its ``Plan``."""
    total = (0, 0)
    for group in group_steps(list(steps)):
        counts = []
        for _, step in group:
            count = step.passes(shape)
            counts.append((count, count) if isinstance(count, int) else tuple(count))
            step.check(shape)
        total = (total[0] + max(c[0] for c in counts), total[1] + max(c[1] for c in counts))
    return total


def format_passes(passes: Passes | None) -> str:
    """``7``, ``3–12`` (data-dependent: fewest–most) or ``?`` (no model config)."""
    if passes is None:
        return "?"
    return str(passes[0]) if passes[0] == passes[1] else f"{passes[0]}–{passes[1]}"


def plan_config(recipe: Recipe):
    """The model's config, or ``(None, reason)`` when it cannot be read here (e.g. a hub id offline)."""
    try:
        return load_config(recipe.model), None
    except RecipeError as exc:
        return None, exc.detail


def compile_for_plan(recipe: Recipe) -> tuple[Plan | None, str | None]:
    """``recipe plan``'s plan: the recipe compiled against its model's config, or ``(None, reason)`` when the
    config cannot be read here (e.g. a hub id offline)."""
    config, problem = plan_config(recipe)
    return (compile_plan(recipe, config) if config is not None else None), problem


def memory_plan(recipe: Recipe, plan: Plan | None = None, problem: str | None = None) -> dict:
    """``estimates.plan_memory`` of the plan, streamed as ``apply`` would decide; ``{"unavailable": reason}``
    when there is no plan (the model's config cannot be read here) or the estimate cannot be made."""
    if plan is None:
        plan, problem = compile_for_plan(recipe)
        if plan is None:
            return {"unavailable": problem}
    try:
        streamed = recipe.stream == "on" or (recipe.stream == "auto" and exceeds_memory(recipe.model))
        estimate = plan_memory(plan, streamed)
    except RecipeError as exc:
        return {"unavailable": exc.detail}
    memory = estimate.to_dict()
    if recipe.device != "cpu" and recipe.calibration.offload is not True:  # an accelerator may hold them
        on_device = plan_memory(plan, streamed, estimate.runtime_bytes, on_device=True, accelerator=True)
        memory["accelerator"] = {"device_peak_bytes": on_device.device_peak_bytes,
                                 "host_peak_bytes": on_device.host_peak_bytes,
                                 "accelerator_runtime_bytes": on_device.accelerator_runtime_bytes,
                                 "pinned_bytes": max(step.pinned_bytes for step in on_device.steps),
                                 "evaluation_device_bytes": on_device.evaluation_device_bytes}
    return memory


def rank_memory(plan: Plan, memory: dict, ranks: int) -> dict:
    """Per-rank host memory of a data-parallel run over ``ranks`` processes (``recipe_engine.execution.distributed``):
    every rank holds all calibration activations (replicated) and, while a layer's outputs are gathered,
    one more set plus its own share twice (send and padded buffers)."""
    recipe = plan.recipe
    cal = recipe.calibration
    shape = plan.shapes[0]
    one_set = cal.samples * cal.seq_len * shape.hidden_size * (4 if recipe.dtype == "float32" else 2)
    gather = round(one_set * (1 + 2 / ranks))
    peak = memory["host_peak_bytes"] + gather
    batches = math.ceil(cal.samples / cal.batch_size)
    return {"ranks": ranks, "batches_per_rank": math.ceil(batches / ranks) if batches >= ranks else batches,
            "activations_bytes": memory["activations_bytes"], "gather_bytes": gather,
            "host_peak_bytes_per_rank": peak, "host_peak_bytes_all_ranks": ranks * peak}


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def print_plan(recipe: Recipe, console: Console, ranks: int = 1) -> None:
    plan, problem = compile_for_plan(recipe)
    rows, total = plan_rows(recipe, plan=plan)
    cal = recipe.calibration
    table = Table(title=f"plan: {recipe.name} ({cal.samples} × {cal.seq_len} tokens from {', '.join(cal.sources)})")
    for column in ("step", "scope", "statistics", "calibration passes"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"total calibration passes: {format_passes(total)}"
                  + (f" (unavailable: {problem})" if total is None else ""))
    packed = local_packed_description(recipe.model)
    if packed and not recipe.quantizes:
        adapter = ADAPTERS.get(plan.shapes[0].model_type) if plan is not None and plan.shapes else None
        console.print(f"note: {plan_note(packed, recipe.dtype, adapter)}")
    memory = memory_plan(recipe, plan, problem)
    if "unavailable" in memory:
        console.print(f"memory estimate: unavailable ({memory['unavailable']})")
        return
    mode = "streamed from disk" if memory["streamed"] else "whole model in memory"
    kept = max(step["kept_states_bytes"] for step in memory["steps"])
    evaluation = memory.get("evaluation_host_bytes", 0) == memory["host_peak_bytes"]
    window = memory.get("evaluation_window_bytes", 0)
    parts = (f"the evaluation: runtime {_gib(memory['runtime_bytes'])} + the model "
             f"{_gib(memory['host_peak_bytes'] - memory['runtime_bytes'] - window)} + one perplexity window's "
             f"logits {_gib(window)}" if evaluation else
             f"runtime {_gib(memory['runtime_bytes'])} + activations {_gib(memory['activations_bytes'])} + the "
             f"largest step (model {_gib(memory['model_bytes'])})")
    console.print(f"memory estimate ({mode}): peak host {_gib(memory['host_peak_bytes'])} = {parts}"
                  + (f"; up to {_gib(kept)} of the original model's states kept for a later step that reads "
                     f"the original model (at most a quarter of the available memory)" if kept else ""))
    if "accelerator" in memory:
        device = memory["accelerator"]
        console.print(f"with the activations on an accelerator (calibration.offload: auto, when they fit in "
                      f"{DEVICE_SHARE:.0%} of its free memory; statistics and solves there too): peak device "
                      f"{_gib(device['device_peak_bytes'])}, peak host {_gib(device['host_peak_bytes'])} (on a CUDA "
                      f"GPU: its runtime {_gib(device['accelerator_runtime_bytes'])}"
                      + (f", page-locked copies of two layers {_gib(device['pinned_bytes'])}" if device["pinned_bytes"]
                         else "") + ")"
                      + ("; the peak is the in-memory evaluation, which moves the whole model there (stream: on "
                         "evaluates a layer at a time)" if device["evaluation_device_bytes"] == device[
                             "device_peak_bytes"] else ""))
    if ranks > 1:
        per = rank_memory(plan, memory, ranks)
        console.print(f"data-parallel over {ranks} ranks: per rank activations {_gib(per['activations_bytes'])} "
                      f"(all calibration activations, replicated; each rank runs up to {per['batches_per_rank']} "
                      f"batches through each layer) + gather {_gib(per['gather_bytes'])}; peak host per rank "
                      f"{_gib(per['host_peak_bytes_per_rank'])}, {ranks} ranks on one host "
                      f"{_gib(per['host_peak_bytes_all_ranks'])}")
    for index, step in enumerate(memory["steps"]):
        note = "  [needs the whole model resident]" if step["whole_model"] and memory["streamed"] else ""
        console.print(f"  step {index} {step['step']}: weights {_gib(step['weights_bytes'])}, working "
                      f"{_gib(step['working_bytes'])}"
                      + (f", kept original states {_gib(step['kept_states_bytes'])}" if step["kept_states_bytes"]
                         else "")
                      + (f", next layer read ahead {_gib(step['read_ahead_bytes'])}" if step["read_ahead_bytes"]
                         else "") + note)
