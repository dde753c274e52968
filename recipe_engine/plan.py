"""``recipe plan``: steps, the statistics each needs, and how many calibration passes will run."""
from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from .runner import group_steps
from .schema import Recipe


def plan_rows(recipe: Recipe) -> tuple[list[tuple[str, str, str, str]], int]:
    """Rows (step, scope, statistics, passes) and the total number of calibration passes.

    Consecutive layer-scope steps share one layer-sequential pass.
    """
    rows, total = [], 0
    for group in group_steps(recipe.modifiers):
        passes = max(step.passes() for _, step in group) if group[0][1].scope == "layer" \
            else group[0][1].passes()
        total += passes
        for position, (index, step) in enumerate(group):
            shared = f"{passes} (shared by steps {group[0][0]}-{group[-1][0]})" if len(group) > 1 else str(passes)
            rows.append((f"{index} {step.step_name()}", step.scope, ", ".join(step.needs) or "-",
                         shared if position == 0 else "↑ same pass"))
    return rows, total


def memory_plan(recipe: Recipe) -> dict:
    """``memory.estimate`` for the recipe's model, streamed as ``apply`` would decide; ``{"unavailable":
    reason}`` when the model's config cannot be read here (e.g. a hub id offline)."""
    from .errors import RecipeError
    from .memory import estimate
    from .models import load_config
    from .streaming import exceeds_memory

    try:
        config = load_config(recipe.model)
        streamed = recipe.stream == "on" or (recipe.stream == "auto" and exceeds_memory(recipe.model))
        return estimate(recipe, config, streamed)
    except RecipeError as exc:
        return {"unavailable": exc.detail}


def rank_memory(recipe: Recipe, memory: dict, ranks: int) -> dict:
    """Per-rank host memory of a data-parallel run over ``ranks`` processes (``recipe_engine.distributed``):
    every rank holds all calibration activations (replicated) and, while a layer's outputs are gathered,
    one more set plus its own share twice (send and padded buffers)."""
    from .models import load_config
    from .shape import ModelShape

    cal = recipe.calibration
    shape = ModelShape.from_config(load_config(recipe.model))
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
    rows, total = plan_rows(recipe)
    cal = recipe.calibration
    table = Table(title=f"plan: {recipe.name} ({cal.samples} × {cal.seq_len} tokens from {', '.join(cal.sources)})")
    for column in ("step", "scope", "statistics", "calibration passes"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"total calibration passes: {total}")
    memory = memory_plan(recipe)
    if "unavailable" in memory:
        console.print(f"memory estimate: unavailable ({memory['unavailable']})")
        return
    mode = "streamed from disk" if memory["streamed"] else "whole model in memory"
    console.print(f"memory estimate ({mode}): peak host {_gib(memory['host_peak_bytes'])} = runtime "
                  f"{_gib(memory['runtime_bytes'])} + activations {_gib(memory['activations_bytes'])} + the "
                  f"largest step (model {_gib(memory['model_bytes'])})")
    if ranks > 1:
        per = rank_memory(recipe, memory, ranks)
        console.print(f"data-parallel over {ranks} ranks: per rank activations {_gib(per['activations_bytes'])} "
                      f"(all calibration activations, replicated; each rank runs up to {per['batches_per_rank']} "
                      f"batches through each layer) + gather {_gib(per['gather_bytes'])}; peak host per rank "
                      f"{_gib(per['host_peak_bytes_per_rank'])}, {ranks} ranks on one host "
                      f"{_gib(per['host_peak_bytes_all_ranks'])}")
    for index, step in enumerate(memory["steps"]):
        note = "  [needs the whole model resident]" if step["whole_model"] and memory["streamed"] else ""
        console.print(f"  step {index} {step['step']}: weights {_gib(step['weights_bytes'])}, working "
                      f"{_gib(step['working_bytes'])}{note}")
