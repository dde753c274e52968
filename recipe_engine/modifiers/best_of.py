"""BestOf: run whole alternative step lists and keep the one with the lowest held-out calibration loss."""
from __future__ import annotations

import copy
import gc
import math
import statistics
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from recipe_engine.api import (SCORE_FRACTION, Modifier, RecipeError, SharedWork, WindowSplit, byte_count,
                               calibration_nll_bytes, check_scoring_task, check_steps, heldout_agreement,
                               heldout_failures, heldout_reference, heldout_split, kept_original_sets, parse_step,
                               percentage, percentage_field, register, share_of, step_to_dict, steps_passes)


class HeldoutScore(BaseModel):
    """How the alternatives are scored: the calibration NLL of the score windows, never used to fit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    split: Literal["heldout"] = Field("heldout", description="heldout: fit on the fit windows, score on the "
                                                            "score windows (recipe_engine.recipe.split)")
    fraction: float = Field(SCORE_FRACTION, gt=0, lt=1, description="share of the calibration windows held out "
                                                                    "for scoring")
    seed: int | None = Field(None, description="seed of the split (None: the calibration's seed)")
    prefer_earlier_within: float = Field(
        0.0, ge=0, description="choose the first listed alternative whose score is within this many paired "
                               "standard errors of the lowest (1: the one-standard-error rule, alternatives "
                               "listed from the least fitted); 0: the lowest score")
    task: str | None = Field(None, description="a generation task (humaneval, gsm8k): score on its last "
                                               "`problems` problems (see `by`) instead of the score windows' NLL")
    by: Literal["pass", "agreement"] = Field("pass", description=(
        "task: pass (each alternative generates; its failures, code run in the sandbox) or agreement (the "
        "original model generates once; each alternative's NLL of those completions, one forward per problem, "
        "nothing run)"))
    problems: int = Field(20, ge=2, description="task: how many of its last problems score each alternative")
    max_new_tokens: int = Field(300, ge=1, description="task: tokens generated per problem at most")
    allow_code_execution: bool = Field(False, description="task: run model-written code (humaneval) in the "
                                                          "sandbox (or RECIPE_ALLOW_CODE_EVAL=1)")

    @property
    def measure(self) -> tuple[str, str, str]:
        """The record keys of the score and of its per-unit losses, and the score's unit."""
        if self.task is None:
            return "nll", "window_nlls", "nats"
        return ("failure_rate", "failures", "failure rate") if self.by == "pass" else \
            ("agreement_nll", "problem_nlls", "nats")


class SizeBudget(BaseModel):
    """The size every alternative must fit: an alternative over it is refused (``refused``), with its figures.
    With a budget the alternatives may leave different shapes (depth, width, bits), so no step may follow."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    parameters: int | str | None = Field(None, description=(
        "decoder-layer parameters at most: a count, or a percentage of those of the model the step receives "
        "(80%: the size of a 20 % depth cut)"))
    bits_per_weight: float | None = Field(None, gt=0, le=32, description=(
        "average stored bits per weight of the decoder's linears at most: codes, scales and zero points as "
        "written; an unquantized weight counts its dtype's bits"))
    weight_bytes: int | str | None = Field(None, description=(
        "bytes of the decoder layers' weights as stored at most (what each decoded token reads from them and "
        "what they take on disk): a count (400000000, 400MB, 381.5MiB) or a percentage of those of the model "
        "the step receives; the linears at their stored bits per weight, norms and biases in the run's dtype"))

    @field_validator("parameters")
    @classmethod
    def _count_or_percent(cls, value: int | str | None) -> int | str | None:
        if value is None or isinstance(value, str):
            return value if value is None else percentage_field(
                value, what="a parameter count or a percentage", example="80%", up_to_100=True)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        raise ValueError(f"expected a parameter count or a percentage such as 80%, got {value!r}")

    @field_validator("weight_bytes")
    @classmethod
    def _bytes_or_percent(cls, value: int | str | None) -> int | str | None:
        if value is None:
            return None
        if percentage(value) is not None:
            return percentage_field(value, what="a byte count or a percentage", example="50%", up_to_100=True)
        if byte_count(value) is None:
            raise ValueError(f"expected a byte count (400000000, 400MB, 381.5MiB) or a percentage in (0%, 100%] "
                             f"such as 50%, got {value!r}")
        return value

    def parameter_limit(self, received: int) -> int | None:
        """The most decoder-layer parameters allowed, given those of the model the step receives."""
        return _limit(self.parameters, received, int)

    def byte_limit(self, received: int) -> int | None:
        """The most bytes of decoder-layer weights allowed, given those of the model the step receives."""
        return _limit(self.weight_bytes, received, byte_count)

    def sizes(self, received, final) -> dict[str, Any]:
        """The alternative's decoder-layer parameters and weight bytes, their shares of the received model's,
        and its bits per weight."""
        parameters, before = _layer_parameters(final), _layer_parameters(received)
        weight_bytes, bytes_before = _layer_weight_bytes(final), _layer_weight_bytes(received)
        bits = final.linear_bits if final.linear_bits is not None else 8.0 * final.dtype_bytes
        return {"decoder_parameters": parameters, "share_of_parameters": parameters / before,
                "decoder_weight_bytes": weight_bytes, "share_of_weight_bytes": weight_bytes / bytes_before,
                "bits_per_weight": bits}

    def problem(self, received, final) -> str | None:
        """Why ``final`` (an alternative's shape) is over the budget, or None."""
        if self.weight_bytes is not None and final.num_experts and final.quantized_by is not None:
            return (f"a weight-bytes budget does not count {final.quantized_by}'s quantized expert tensors "
                    f"(budget parameters or bits_per_weight instead)")
        sizes = self.sizes(received, final)
        figures = self.figures(sizes)
        over = []
        limit = self.parameter_limit(_layer_parameters(received))
        if limit is not None and sizes["decoder_parameters"] > limit:
            over.append(f"{figures['parameters']} > {limit:,} ({self.parameters})")
        if self.bits_per_weight is not None and sizes["bits_per_weight"] > self.bits_per_weight + 1e-9:
            over.append(f"{figures['bits']} > {self.bits_per_weight:g}")
        limit = self.byte_limit(_layer_weight_bytes(received))
        if limit is not None and sizes["decoder_weight_bytes"] > limit:
            over.append(f"{figures['bytes']} > {limit:,} ({self.weight_bytes})")
        return f"over the budget: {'; '.join(over)}" if over else None

    @staticmethod
    def figures(sizes: dict[str, Any]) -> dict[str, str]:
        """An alternative's :meth:`sizes` in words, by bound: parameters, bits per weight and bytes of weights."""
        return {"parameters": f"{sizes['decoder_parameters']:,} decoder-layer parameters "
                              f"({100 * sizes['share_of_parameters']:.2f} %)",
                "bits": f"{sizes['bits_per_weight']:.3f} bits per weight",
                "bytes": f"{sizes['decoder_weight_bytes']:,} bytes of decoder-layer weights "
                         f"({100 * sizes['share_of_weight_bytes']:.2f} % of those received)"}


def describe(steps: list[Modifier]) -> str:
    """``[SLEB<n:6>, LinearPatch]``: an alternative in the compact step syntax (non-default parameters)."""
    def one(step: Modifier) -> str:
        params = step.model_dump(mode="json", exclude_defaults=True, by_alias=False)
        inner = ",".join(f"{k}:{v}" for k, v in params.items())
        return step.step_name() + (f"<{inner}>" if inner else "")
    return "[" + ", ".join(one(step) for step in steps) + "]"


def _layer_parameters(shape) -> int:
    return sum(shape.layer_parameters(layer) for layer in shape.layers)


def _limit(value: int | str | None, received: int, count) -> int | None:
    """A budget's bound: a percentage of ``received`` (rounded down), a count (read by ``count``), or None."""
    if value is None:
        return None
    return math.floor(share_of(value, received)) if percentage(value) is not None else count(value)


def _layer_weight_bytes(shape) -> int:
    """Bytes of the decoder layers' weights as stored (``ModelShape.layer_weight_bytes``), rounded up."""
    return math.ceil(sum(shape.layer_weight_bytes(layer) for layer in shape.layers))


def paired_margins(records: list[dict[str, Any]], lowest: int, key: str = "window_nlls") -> dict[str, Any] | None:
    """Each scored alternative's ``margin`` over the lowest-scoring one, from their per-window NLLs: the mean
    difference ``d̄ = mean_w (nll_a,w − nll_lowest,w)`` in nats and its paired standard error
    ``sd_w(d) / √windows`` (the windows are the same for every alternative, so window difficulty cancels).
    Returns the runner-up's margin (the smallest), or None when nothing else was scored. ``key``: the
    per-unit losses (``failures``: 1 − passed per held-out problem of a generation task)."""
    best = records[lowest][key]
    margins = []
    for record in records:
        if key not in record or record["alternative"] == lowest:
            continue
        d = [a - b for a, b in zip(record[key], best)]
        error = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None
        record["margin"] = {"nats": math.fsum(d) / len(d), "standard_error": error}
        margins.append({"alternative": record["alternative"], "steps": record["steps"], **record["margin"]})
    return min(margins, key=lambda m: m["nats"], default=None)


@register
class BestOf(Modifier):
    """Run whole alternatives (lists of steps) and keep the one with the lowest held-out calibration NLL.

    Each alternative runs on a copy of the model, fitted on the fit windows only; the one whose model has
    the lowest NLL on the held-out score windows is kept, the others are discarded.

    The calibration windows are split once (``recipe_engine.recipe.split.heldout_split``: a seeded ``fraction`` of
    them, 25 % by default, is held out): every alternative runs as a recipe would over the *fit* windows
    (its statistics, refits and searches never see a score window), then its model's token-weighted
    next-token NLL on the *score* windows is its score. The lowest score wins (ties: the first listed); with
    ``score.prefer_earlier_within: k`` the first listed alternative within ``k`` paired standard errors of
    the lowest wins instead (the one-standard-error rule of model selection, Breiman et al. 1984 and Hastie
    et al., ESL §7.10, for ``k = 1``, with the list order as the order of simplicity). The winner's model,
    extras and artifacts continue to the next step; ``report.json`` records the split, every alternative's
    score and per-window NLLs, its margin over the lowest with the paired standard error
    (``paired_margins``; the runner-up's is ``runner_up``: how sure the choice is), its own step records and
    wall time, the lowest and the choice.

    Validation: every alternative's steps are checked against the shape this step receives, like any step;
    all alternatives must leave the same layer count and decoder-layer parameters. An alternative whose
    checks refuse the model (e.g. FlattenAdjacent on Gemma 3) is skipped with its reason recorded
    (``refused: skip``) or fails the recipe (``refused: fail``); if every alternative is refused it fails.
    An alternative whose steps equal an earlier one's once budgets are counts is not run again (``same_as``).

    Refit (``refit: true``, the default): once chosen, the winner runs again on a fresh copy over *all*
    the calibration windows and that model is kept, as cross-validation refits the chosen model on all the
    data: the score windows only decide, so the step gives exactly what the chosen alternative gives run
    alone, with nothing lost to the held-out quarter. ``refit: false`` keeps the fit-window model (no
    extra run). With ``score.task`` the task's problems are the held-out set, so no calibration window is
    held out: every alternative fits on all of them and there is nothing to refit (``refit`` is not run,
    and the report says so).

    Cost: the sum of the alternatives' own costs on the fit windows, plus one pass over the score windows per
    alternative, plus (refit) the winner's own cost once more on all windows; work shared between alternatives
    over the same windows is done once (the layer-0 capture, and ``session.shared`` values of steps reached in
    the same state, e.g. ShortGPT's Block Influence). Memory: two extra copies of the model (the alternative
    being run and the best so far).

    Layering: BestOf is a modifier, not an engine construct; it uses the engine's declared API
    (``ModifierSession.branch`` / ``adopt``, ``check_steps``, ``heldout_split``), so any registered
    modifier (built-in or plugin) works as an alternative and the engine names none. A streamed run is refused
    (a branch needs a second in-memory copy of the model); ``--resume`` resumes after a finished BestOf, and an
    interrupted one is run again from its first alternative (branches keep no checkpoints).
    """

    needs = ("every alternative's own statistics on the fit windows; the NLL of the score windows",)
    needs_reference = True  # an alternative may compare against the original model (LinearPatch)
    stock_output = False    # an alternative may add a non-stock extra; the report says which one won
    refuses_streaming: ClassVar[str | None] = ("BestOf runs each alternative on an in-memory copy of the "
                                               "model, which a streamed run does not have")

    score: HeldoutScore = Field(default_factory=HeldoutScore, description="how alternatives are scored")
    alternatives: list[list[Modifier]] = Field(min_length=2, description="lists of steps, each a whole "
                                                                          "alternative")
    refused: Literal["skip", "fail"] = Field("skip", description="an alternative the model refuses at "
                                                                 "validation: skip it (reason recorded) or fail")
    refit: bool = Field(True, description="run the chosen alternative again on all calibration windows (the "
                                          "score windows only choose); false keeps its fit-window model")
    budget: SizeBudget | None = Field(None, description=(
        "the size every alternative must fit (decoder parameters, bits per weight); over it: refused. With a "
        "budget the alternatives may differ in size (depth, width, bits) and the step must be the last"))

    example = ("BestOf<alternatives:[[ShortGPT<n:1>],[SLEB<n:1>]]>",)

    @field_validator("alternatives", mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise RecipeError("expected a list of alternatives, each a list of steps", field="alternatives")
        parsed = []
        for a, steps in enumerate(value):
            if isinstance(steps, (str, dict)):
                steps = [steps]
            if not isinstance(steps, list) or not steps:
                raise RecipeError(f"alternative {a}: expected a non-empty list of steps", field=f"alternatives.{a}")
            built = []
            for i, raw in enumerate(steps):
                if isinstance(raw, Modifier):
                    built.append(raw)
                    continue
                try:
                    built.append(parse_step(raw, i))
                except RecipeError as exc:  # one line naming the alternative, its step and the field
                    step = f"step {i}" + (f" ({exc.modifier})" if exc.modifier else "")
                    raise RecipeError(f"alternative {a}, {step}: {exc.detail}",
                                      field=".".join(str(p) for p in ("alternatives", a, i, exc.field) if p is not None)
                                      ) from None
            if any(isinstance(step, BestOf) for step in built):
                raise RecipeError(f"alternative {a}: a BestOf inside a BestOf is not supported",
                                  field=f"alternatives.{a}")
            parsed.append(built)
        return parsed

    @field_serializer("alternatives")
    def _dump(self, alternatives: list[list[Modifier]]) -> list[list[dict[str, Any]]]:
        return [[step_to_dict(step) for step in steps] for steps in alternatives]

    # -- validation ----------------------------------------------------------------------------
    def _outcomes(self, shape) -> list[tuple[Any, str | None]]:
        """Per alternative: (its final shape, None) or (None, why the model refuses it)."""
        outcomes = []
        for a, steps in enumerate(self.alternatives):
            trial = copy.deepcopy(shape)
            try:
                check_steps(steps, trial)
                extras = [step.step_name() for step in steps if not step.output_is_stock(shape)]
                if shape.stock_only and extras:
                    raise RecipeError(f"{', '.join(extras)} would leave a checkpoint that is not stock, and the "
                                      f"recipe exports it")
            except RecipeError as exc:
                if self.refused == "fail":
                    raise self.fail(f"alternative {a} {describe(steps)}: {exc}", field=f"alternatives.{a}") from None
                outcomes.append((None, str(exc)))
                continue
            over = self.budget.problem(shape, trial) if self.budget is not None else None
            if over is not None:
                if self.refused == "fail":
                    raise self.fail(f"alternative {a} {describe(steps)}: {over}", field=f"alternatives.{a}")
                outcomes.append((None, over))
                continue
            outcomes.append((trial, None))
        if all(final is None for final, _ in outcomes):
            raise self.fail("every alternative is refused: " + "; ".join(
                f"alternative {a}: {why}" for a, (_, why) in enumerate(outcomes)), field="alternatives")
        first = next(a for a, (final, _) in enumerate(outcomes) if final is not None)
        reference = outcomes[first][0]
        if self.budget is not None:  # sizes may differ: the budget bounds them
            return outcomes
        for a, (final, _) in enumerate(outcomes):
            if final is not None and (final.num_layers, _layer_parameters(final)) != \
                    (reference.num_layers, _layer_parameters(reference)):
                raise self.fail(f"alternative {a} {describe(self.alternatives[a])} leaves {final.num_layers} layers "
                                f"({_layer_parameters(final):,} layer parameters), alternative {first} "
                                f"{reference.num_layers} ({_layer_parameters(reference):,}); alternatives must "
                                f"give the same size", field=f"alternatives.{a}")
        return outcomes

    def _repeats(self) -> dict[int, int]:
        """Alternatives whose steps equal an earlier one's once budgets are counts (``ReplaceMe<n:10%>`` and
        ``<n:13%>`` are both 1 layer of 12): index → the earlier one's. A repeat is not run again."""
        seen: dict[str, int] = {}
        repeats = {}
        for a, steps in enumerate(self.alternatives):
            key = repr([step_to_dict(step) for step in steps])
            if key in seen:
                repeats[a] = seen[key]
            else:
                seen[key] = a
        return repeats

    def output_is_stock(self, shape) -> bool:
        """Stock when every alternative the model accepts is (with ``shape.stock_only`` the others are refused)."""
        return all(step.output_is_stock(shape) for (final, _), steps in zip(self._outcomes(shape), self.alternatives)
                   if final is not None for step in steps)

    def check(self, shape) -> None:
        outcomes = self._outcomes(shape)
        notes = []  # said before the shape becomes the kept alternative's: each alternative against the received one
        for a, (final, why) in enumerate(outcomes):
            steps = describe(self.alternatives[a])
            if final is None:
                notes.append(f"{self.step_name()} skips alternative {a} {steps}: {why}")
            elif self.budget is not None:
                figures = self.budget.figures(self.budget.sizes(shape, final))
                notes.append(f"{self.step_name()} alternative {a} {steps} fits its budget: "
                             f"{', '.join(figures.values())}")
        final = next(final for final, _ in outcomes if final is not None)
        shape.layers, shape.pinned, shape.quantized_by = final.layers, final.pinned, final.quantized_by
        shape.linear_bits = final.linear_bits
        shape.intermediate_size, shape.num_heads, shape.num_kv_heads = \
            final.intermediate_size, final.num_heads, final.num_kv_heads
        finals = [final for final, _ in outcomes if final is not None]
        if self.budget is not None and any((f.layers, f.linear_bits) != (final.layers, final.linear_bits)
                                           for f in finals):
            shape.chosen_by = f"{self.step_name()} (under its budget)"
        shape.notes.extend(notes)
        shape.notes.extend(f"{self.step_name()} runs alternative {a} {describe(self.alternatives[a])} once: the same "
                           f"steps as alternative {earlier}" for a, earlier in self._repeats().items()
                           if outcomes[a][0] is not None)

    def check_sources(self) -> None:
        if self.score.task is not None:
            try:
                check_scoring_task(self.score.task, self.score.allow_code_execution, "score.allow_code_execution",
                                   executes=self.score.by == "pass")
            except RecipeError as exc:
                raise self.fail(exc.detail, field="score.task") from None
        for a, steps in enumerate(self.alternatives):
            for i, step in enumerate(steps):
                try:
                    step.check_sources()
                except RecipeError as exc:
                    raise self.fail(f"alternative {a}, step {i} ({step.step_name()}): {exc.detail}",
                                    field=f"alternatives.{a}.{i}.{exc.field or ''}".rstrip(".")) from None

    def check_calibration(self, calibration) -> None:
        try:
            split = self._split(calibration.samples, calibration.seed)
        except ValueError as exc:
            raise self.fail(f"{exc} (calibration.samples)", field="score") from None
        fit = calibration.model_copy(update={"samples": len(split.fit)})
        for a, steps in enumerate(self.alternatives):
            for i, step in enumerate(steps):
                try:
                    step.check_calibration(fit)
                except RecipeError as exc:
                    raise self.fail(f"alternative {a}, step {i} ({step.step_name()}) on the {len(split.fit)} fit "
                                    f"windows: {exc.detail}",
                                    field=f"alternatives.{a}.{i}.{exc.field or ''}".rstrip(".")) from None

    def passes(self, shape) -> tuple[int, int]:
        """Each alternative's own passes on the fit windows, plus one pass per alternative to score it. Fewest:
        an alternative whose first step repeats an earlier alternative's (same parameters but its
        ``shared_ignores``) reuses that step's work from the same starting model (``ModifierSession.shared``).
        The refit adds the cheapest alternative's passes (fewest) or the dearest's (most)."""
        low = high = 0
        first_steps: set[tuple[str, str]] = set()
        own_counts: list[tuple[int, int]] = []
        repeats = self._repeats()
        for a, steps in enumerate(self.alternatives):
            if a in repeats:
                continue
            trial = copy.deepcopy(shape)
            try:
                count = steps_passes(steps, trial)
            except RecipeError:
                continue  # refused: skipped at run time
            own_counts.append(count)
            first = steps[0]
            key = (first.step_name(), repr(first.model_dump(mode="json", exclude=set(first.shared_ignores))))
            own = first.passes(copy.deepcopy(shape)) if key in first_steps else 0
            first_steps.add(key)
            low, high = low + count[0] - (own if isinstance(own, int) else own[0]) + 1, high + count[1] + 1
        if own_counts and (self.refits or self.score.prefer_earlier_within):
            # the refit, or (no refit) the chosen one built again when it is not the lowest score
            low = low + (min(c[0] for c in own_counts) if self.refits else 0)
            high = high + max(c[1] for c in own_counts)
        return low, high

    def working_memory(self, shape, tokens: int) -> int:
        """Two fp32 copies of the model (the running alternative and the best so far: decoder layers,
        embeddings and an untied head) plus the largest working memory of any alternative's step, or of the
        score windows' calibration NLL (``calibration_nll_bytes``) if larger."""
        matrices = 1 if shape.tie_word_embeddings else 2
        copies = 2 * 4 * (_layer_parameters(shape) + matrices * shape.vocab_size * shape.hidden_size)
        largest = max((step.working_memory(received, tokens) for steps, shapes in self._received(shape)
                       for step, received in zip(steps, shapes)), default=0)
        scoring = calibration_nll_bytes(shape, shape.calibration_batch, shape.calibration_seq_len)
        return copies + max(largest, scoring)

    def _received(self, shape) -> list[tuple[list[Modifier], list]]:
        """Each alternative the architecture does not refuse, with the shape each of its steps receives."""
        checked = []
        for steps in self.alternatives:
            trial, shapes = copy.deepcopy(shape), []
            try:
                for step in steps:
                    shapes.append(copy.deepcopy(trial))
                    step.check(trial)
            except RecipeError:
                continue  # refused: skipped at run time
            checked.append((steps, shapes))
        return checked

    def kept_original_states(self, shape, windows: int, later_reads: bool) -> int:
        """The most any alternative keeps of the original model's states (``kept_original_sets`` over its
        steps, on the shape this step receives): on the fit windows while the alternatives run, on all of them
        when the chosen one is refitted (an upper bound: the chosen one may keep none)."""
        if not self.refits:
            windows = len(self._split(windows, 0).fit)
        return max((max(kept_original_sets(steps, shapes, windows, later_reads))
                    for steps, shapes in self._received(shape)), default=0)

    # -- run -------------------------------------------------------------------------------------
    def _seed(self, calibration_seed: int) -> int:
        return calibration_seed if self.score.seed is None else self.score.seed

    def _split(self, samples: int, calibration_seed: int) -> WindowSplit:
        """The fit and score windows: a held-out split for a calibration-NLL score; with ``score.task`` every
        window fits (the task's problems score) and none is held out."""
        if self.score.task is not None:
            return WindowSplit(tuple(range(samples)), ())
        return heldout_split(samples, self._seed(calibration_seed), self.score.fraction)

    @property
    def refits(self) -> bool:
        """Whether the chosen alternative runs again on all windows: ``refit``, unless it already fit on all."""
        return self.refit and self.score.task is None

    def _choose(self, records: list[dict[str, Any]], lowest: int) -> int:
        """The lowest score, or with ``prefer_earlier_within: k`` the first listed alternative whose margin
        over it is at most ``k`` paired standard errors (the one-standard-error rule for ``k = 1``)."""
        k = self.score.prefer_earlier_within
        for record in records[:lowest]:
            margin = record.get("margin")
            if k and margin and margin["standard_error"] is not None \
                    and margin["nats"] <= k * margin["standard_error"]:
                return record["alternative"]
        return lowest

    def _candidates(self, records: list[dict[str, Any]], chosen: int) -> dict[str, list]:
        """Every alternative's size and score, or why it was not scored, as the card's table of this step."""
        key, _, unit = self.score.measure
        columns = ["alternative", "steps", "decoder parameters", "bits / weight", "decoder weights",
                   f"score ({key}, {unit})", ""]
        rows = []
        for record in records:
            share, bits = record.get("share_of_parameters"), record.get("bits_per_weight")
            weights, score = record.get("decoder_weight_bytes"), record.get(key)
            status = ("chosen" if record["alternative"] == chosen else record.get("refused")
                      or (f"same as alternative {record['same_as']}" if "same_as" in record else ""))
            rows.append([record["alternative"], record["steps"], "" if share is None else f"{100 * share:.2f} %",
                         "" if bits is None else f"{bits:.3f}", "" if weights is None else f"{weights / 1e6:,.1f} MB",
                         "" if score is None else f"{score:.4f}", status])
        return {"columns": columns, "rows": rows}

    def _headline(self, records: list[dict[str, Any]], lowest: int, chosen: int,
                  runner_up: dict[str, Any] | None, tied: list[int]) -> str:
        """One line: what was chosen, its score and its margin (apply's summary prints it under its table)."""
        def margin(m: dict[str, Any]) -> str:
            error = m["standard_error"]
            unit = self.score.measure[2]
            return f"{m['nats']:.4f} {unit}" + ("" if error is None else f" (paired standard error {error:.4f})")

        line = f"chose alternative {chosen} {records[chosen]['steps']}, "
        if self.score.task is None:
            line += f"score-window NLL {records[chosen]['nll']:.4f}"
        elif self.score.by == "pass":
            line += (f"{self.score.task} pass rate {records[chosen]['pass_rate']:.4f} on its last "
                     f"{self.score.problems} problems")
        else:
            line += (f"NLL {records[chosen]['agreement_nll']:.4f} of the original model's completions of the last "
                     f"{self.score.problems} {self.score.task} problems")
        if chosen != lowest:
            return (line + f", {margin(records[chosen]['margin'])} above the lowest, alternative {lowest} "
                    f"{records[lowest]['steps']}: within {self.score.prefer_earlier_within:g} standard "
                    f"error{'' if self.score.prefer_earlier_within == 1 else 's'} and listed earlier")
        if tied:
            return line + (f", tied with alternative{'s' if len(tied) > 1 else ''} {', '.join(map(str, tied))}: the "
                           f"first listed is kept" + (f" (score more than {self.score.problems} problems to tell "
                                                      f"them apart)" if self.score.task is not None else ""))
        if runner_up is not None:
            line += f", by {margin(runner_up)} over alternative {runner_up['alternative']} {runner_up['steps']}"
        return line

    def _tied(self, records: list[dict[str, Any]], chosen: int) -> list[int]:
        """The other scored alternatives whose score equals the chosen one's (held-out NLL or failure rate)."""
        key = self.score.measure[0]
        return [r["alternative"] for r in records
                if key in r and r["alternative"] != chosen and r[key] == records[chosen][key]]

    def _reference(self, session) -> list[tuple[str, str, str]] | None:
        """``score.by: agreement``: the original model's completions of the held-out problems, generated once."""
        if self.score.task is None or self.score.by != "agreement":
            return None
        session.model.to(session.device)
        try:
            return heldout_reference(session.model, session.tokenizer, self.score.task, self.score.problems,
                                     self.score.max_new_tokens, 8, session.device, session.progress)
        finally:
            session.model.to(session.storage)

    def _score(self, session, branch, scored, memo: SharedWork, record: dict[str, Any], reference) -> float:
        """The alternative's score (lower is better), recorded: the score windows' mean NLL, or with
        ``score.task`` its failure rate on the task's last ``problems`` problems (greedy, as ``recipe eval``),
        or (``by: agreement``) its mean NLL of the original model's completions of them."""
        if self.score.task is None:
            windows = branch.branch(scored, copy=False, memo=memo).calibration_nll(per_window=True)
            nll = math.fsum(windows) / len(windows)
            record.update(nll=nll, ppl=math.exp(nll), window_nlls=windows)
            return nll
        branch.model.to(session.device)
        try:
            if reference is not None:
                scores, losses = heldout_agreement(branch.model, branch.tokenizer, reference, session.device,
                                                   session.progress)
                record.update(agreement_nll=scores["nll"], token_agreement=scores["token_agreement"],
                              problem_nlls=losses, problems=[pid for pid, _, _ in reference])
                return scores["nll"]
            ids, failures = heldout_failures(branch.model, branch.tokenizer, self.score.task, self.score.problems,
                                             self.score.max_new_tokens, 8, session.device, session.progress)
        finally:
            branch.model.to(session.storage)
        rate = math.fsum(failures) / len(failures)
        record.update(failure_rate=rate, pass_rate=1 - rate, failures=failures, problems=ids)
        return rate

    def apply(self, session) -> dict[str, Any]:
        split = self._split(session.calibration.shape[0], session.config.seed)
        fit, scored = session.calibration[list(split.fit)], session.calibration[list(split.score)]
        outcomes = self._outcomes(session.shape)
        fit_memo, score_memo = SharedWork(), SharedWork()  # one per set of windows
        records: list[dict[str, Any]] = []
        best, best_nll = None, math.inf
        repeats = self._repeats()
        reference = self._reference(session)
        for a, steps in enumerate(self.alternatives):
            record: dict[str, Any] = {"alternative": a, "steps": describe(steps)}
            records.append(record)
            if outcomes[a][1] is not None:
                record["refused"] = outcomes[a][1]
                continue
            if self.budget is not None:
                record.update(self.budget.sizes(session.shape, outcomes[a][0]))
            if a in repeats:
                record["same_as"] = repeats[a]  # its model and score would be the earlier one's
                continue
            started, passes = time.perf_counter(), session.passes.value
            session.progress.log(f"BestOf: alternative {a} {describe(steps)} on {len(split.fit)} fit windows")
            branch = session.branch(fit, steps, memo=fit_memo)
            record["records"] = branch.records
            nll = self._score(session, branch, scored, score_memo, record, reference)
            record.update(wall_s=time.perf_counter() - started, calibration_passes=session.passes.value - passes,
                          layers=len(branch.layers))
            if nll < best_nll:
                best, best_nll = (a, branch), nll
            branch = None  # a losing copy is freed before the next alternative copies the model
            gc.collect()  # a session's hooks and closures can form reference cycles: free the copy now
        lowest, branch = best
        runner_up = paired_margins(records, lowest, self.score.measure[1])
        chosen = self._choose(records, lowest)
        tied = self._tied(records, chosen)
        headline = self._headline(records, lowest, chosen, runner_up, tied)
        session.progress.log(f"BestOf: {headline}")
        if chosen != lowest and not self.refits:  # the chosen one's fit-window model was freed: build it again
            branch = best = None
            gc.collect()
            branch = session.branch(fit, self.alternatives[chosen], memo=fit_memo)
        refit = None
        if self.refit and not self.refits:  # asked for, but every alternative already fit on all windows
            refit = {"skipped": f"the alternatives fit on all {session.calibration.shape[0]} calibration windows "
                                f"(the score is {self.score.task}'s), so a refit would repeat the chosen one's run"}
        if self.refits:
            branch = best = None  # the fit-window model is freed before the refit copies the model
            gc.collect()
            started, passes = time.perf_counter(), session.passes.value
            session.progress.log(f"BestOf: refit of alternative {chosen} {describe(self.alternatives[chosen])} on "
                                 f"all {session.calibration.shape[0]} calibration windows")
            branch = session.branch(session.calibration, self.alternatives[chosen], memo=SharedWork())
            refit = {"windows": int(session.calibration.shape[0]), "records": branch.records,
                     "wall_s": time.perf_counter() - started, "calibration_passes": session.passes.value - passes}
        session.adopt(branch)
        shared = {"computed": dict(fit_memo.computed + score_memo.computed),
                  "reused": dict(fit_memo.reused + score_memo.reused)}
        return {"score": {"split": self.score.split, "fraction": self.score.fraction,
                          "seed": self._seed(session.config.seed), **split.record()},
                "alternatives": records, "lowest": lowest, "chosen": chosen,
                "chosen_steps": describe(self.alternatives[chosen]), "nll": records[chosen].get("nll"),
                "ppl": records[chosen].get("ppl"), "pass_rate": records[chosen].get("pass_rate"),
                "agreement_nll": records[chosen].get("agreement_nll"),
                "runner_up": runner_up, "tied": tied, "headline": headline,
                "table": self._candidates(records, chosen),
                "refit": refit, "shared_work": shared,
                "budget": self.budget.model_dump(mode="json", exclude_none=True) if self.budget else None,
                "layers": len(session.layers)}
