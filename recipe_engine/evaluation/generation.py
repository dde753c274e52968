"""Generation tasks: greedy completions of each problem's prompt, scored by what they do.

Batched greedy decoding with the KV cache (prompts left-padded, longest first); a row stops at the first of the
task's stop sequences or the end-of-sequence token, or after ``max_new_tokens``, and leaves the batch at once: its
rows of the KV cache are dropped (``Cache.batch_select_indices``), so the rows still running are the only ones
computed (``transformers``' ``generate`` keeps computing finished rows until the whole batch is done, which on a
CPU costs as much as the running rows). Each completion is cut before its first stop sequence. The tasks
(``generation_tasks.py``) score a completion: HumanEval by running the prompt, the completion and the task's tests
in the sandbox (``sandbox.py``), GSM8K by its final number. The headline metric is pass@1 (greedy, one sample) or
exact match.
"""
from __future__ import annotations

import inspect
import os
import time
from typing import Callable

import torch

from ..errors import RecipeError
from ..records.evaluation import Completion, GenerationResult, GenerationScore
from ..system.progress import interval_s

from . import registry
from .generation_tasks import TASKS, GenerationTask
from .sandbox import Limits, isolation


def _stopped(tokenizer, stop: tuple[str, ...], rows: list[list[int]]) -> list[bool]:
    """Whether each row's generated tokens already contain one of ``stop`` in their settled text: trailing
    replacement characters (a character whose bytes are not all generated yet) are left out, as the next
    tokens may complete them into something else."""
    return [any(s in text.rstrip("\ufffd") for s in stop)
            for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]


def cut(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to (not including) its first stop sequence."""
    ends = [text.find(s) for s in stop if s in text]
    return text[:min(ends)] if ends else text


def eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    ids = ids if ids is not None else tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [])


def forward_options(model) -> tuple[dict, str]:
    """``logits_to_keep=1`` where the model's forward takes it (the prompt's other positions need no logits),
    and the name of its KV-cache argument and output (``cache`` in recent transformers, ``past_key_values`` in
    5.17 and earlier)."""
    parameters = inspect.signature(model.forward).parameters
    return ({"logits_to_keep": 1} if "logits_to_keep" in parameters else {},
            "cache" if "cache" in parameters else "past_key_values")


@torch.no_grad()
def greedy_rows(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                done: Callable[[list[list[int]]], list[bool]], eos: list[int],
                alive: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of a left-padded batch with the KV cache; each row's new tokens (its
    end-of-sequence token excluded). After every token, ``done(tokens)`` says which of the running rows
    (their generated ``tokens``) have finished; a finished row (or one that emitted ``eos``) leaves
    the batch and its KV-cache rows are dropped. Positions as ``generate``'s: ``cumsum(mask) − 1``.
    ``alive(tokens_so_far, running)`` is called after each step (progress)."""
    extra, cache_name = forward_options(model)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                **extra)
    cache, last = out[cache_name], positions[:, -1]
    running = list(range(input_ids.shape[0]))
    generated: list[list[int]] = [[] for _ in running]
    nxt = out.logits[:, -1].argmax(-1)
    eos_set = set(eos)
    for step in range(max_new_tokens):
        tokens = nxt.tolist()
        finished = [t in eos_set for t in tokens]
        for row, token, end in zip(running, tokens, finished):
            if not end:
                generated[row].append(token)
        open_rows = [i for i, end in enumerate(finished) if not end]
        if open_rows and step + 1 < max_new_tokens:
            verdicts = done([generated[running[i]] for i in open_rows])
            open_rows = [i for i, end in zip(open_rows, verdicts) if not end]
        if alive is not None:
            alive(step + 1, len(open_rows))
        if not open_rows or step + 1 == max_new_tokens:
            break
        if len(open_rows) < len(running):
            keep = torch.tensor(open_rows, device=nxt.device)
            cache.batch_select_indices(keep)
            attention_mask, last, nxt = attention_mask[keep], last[keep], nxt[keep]
            running = [running[i] for i in open_rows]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(running), 1)], dim=1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=attention_mask, position_ids=last[:, None],
                    use_cache=True, **{cache_name: cache}, **extra)
        cache, nxt = out[cache_name], out.logits[:, -1].argmax(-1)
    return generated


def generate(model, tokenizer, prompts: list[str], stop: tuple[str, ...], max_new_tokens: int, batch_size: int,
             device, progress=None, label: str = "generation") -> list[str]:
    """Greedy completions of ``prompts`` (in their order), cut at ``stop``; with ``progress``, a line every
    ``interval_s()`` seconds (tokens generated, rows still running) so a long batch shows it is alive."""
    eos = eos_ids(model, tokenizer)
    pad_token, side = tokenizer.pad_token, tokenizer.padding_side
    if pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    completions: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for b, batch in enumerate(progress.track(batches, label) if progress is not None else batches):
            encoded = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True).to(device)
            last_line = time.perf_counter()

            def alive(tokens: int, running: int) -> None:
                nonlocal last_line
                if time.perf_counter() - last_line >= interval_s():
                    last_line = time.perf_counter()
                    progress.log(f"{label} batch {b + 1}/{len(batches)}: {tokens} tokens generated, "
                                 f"{len(batch) - running}/{len(batch)} rows stopped")
            rows = greedy_rows(model, encoded["input_ids"], encoded["attention_mask"], max_new_tokens,
                               lambda tokens: _stopped(tokenizer, stop, tokens), eos,
                               alive if progress is not None else None)
            for i, text in zip(batch, tokenizer.batch_decode(rows, skip_special_tokens=True)):
                completions[i] = cut(text, stop)
    finally:
        tokenizer.pad_token, tokenizer.padding_side = pad_token, side
        model.train(was_training)
    return completions


def run_task(model, tokenizer, task: GenerationTask, limit: int | None, max_new_tokens: int, batch_size: int,
             device, progress=None, limits: Limits = Limits()) -> GenerationScore:
    """Generate and score one task's first ``limit`` problems."""
    problems = task.problems()
    chosen = problems[:limit] if limit else problems
    start = time.perf_counter()
    completions = generate(model, tokenizer, [p.prompt for p in chosen], task.stop, max_new_tokens, batch_size,
                           device, progress, f"{task.name} generation")
    generated = time.perf_counter() - start
    checks = progress.track(list(zip(chosen, completions)), f"{task.name} checks") if progress is not None \
        else zip(chosen, completions)
    results = [task.score(problem, completion, limits) for problem, completion in checks]
    passed = sum(results)
    if progress is not None:
        progress.log(f"{task.name}: {passed}/{len(chosen)} {task.metric} = {passed / len(chosen):.4f}")
    return GenerationScore(task.metric, passed / len(chosen), passed, len(chosen), len(problems), max_new_tokens,
                           list(task.stop), task.fingerprint(), generated, time.perf_counter() - start - generated,
                           isolation() if task.executes_code else None,
                           {p.id: Completion(ok, c) for p, c, ok in zip(chosen, completions, results)})


#: Set to 1 to allow running model-written code without the flag or recipe field.
CODE_EVAL_ENV = "RECIPE_ALLOW_CODE_EVAL"


def code_execution_allowed(config) -> bool:
    """The opt-in to execute model-written code: ``evaluate.allow_code_execution`` or ``$RECIPE_ALLOW_CODE_EVAL=1``."""
    return config.allow_code_execution or os.environ.get(CODE_EVAL_ENV, "").strip() == "1"


def check_generation(config, option: str | None = None, names: list[str] | None = None) -> None:
    """Before any model is loaded: each generation task's rows are installed, and a task that executes
    model-written code has the opt-in. The message names the opt-in the command takes: ``option``, a flag of
    its own (``recipe eval``'s ``--allow-code-execution``), or with none the recipe's
    ``evaluate.allow_code_execution`` (``apply``, ``validate``, ``sweep``: in the file or by ``--set``);
    ``$RECIPE_ALLOW_CODE_EVAL=1`` in either case. ``names``: the generation tasks (default: those of ``config``)."""
    if names is None:
        names = [name for name in config.tasks if registry.kind_of(name).name == registry.GENERATION]
    for name in names:
        TASKS[name].path()
    executing = [n for n in names if TASKS[n].executes_code]
    if executing and not code_execution_allowed(config):
        way = (f"pass {option}" if option else "set evaluate.allow_code_execution: true in the recipe (or "
                                               "--set evaluate.allow_code_execution=true)")
        raise RecipeError(f"task {', '.join(executing)} executes model-written code: {way}, or {CODE_EVAL_ENV}=1, "
                          f"to run it in the sandbox (docs/evaluation.md)")
    if executing:
        isolation()  # no sandbox mode this user can run (and none asked for by name): one line, before loading


def heldout_failures(model, tokenizer, name: str, count: int, max_new_tokens: int, batch_size: int,
                     device, progress=None) -> tuple[list[str], list[float]]:
    """The task's last ``count`` problems (held out from an evaluation of its first ones): their ids and a loss
    per problem, 1 − passed, for choosing between models by what they generate (lower is better)."""
    task = TASKS[name]
    chosen = task.problems()[-count:]
    completions = generate(model, tokenizer, [p.prompt for p in chosen], task.stop, max_new_tokens, batch_size,
                           device, progress, f"{name} held-out generation")
    return [p.id for p in chosen], [0.0 if task.score(p, c, Limits()) else 1.0 for p, c in zip(chosen, completions)]


def check_scoring_task(name: str, allowed: bool, field: str = "allow_code_execution", executes: bool = True) -> None:
    """A task a step scores by: a generation task, installed, with the opt-in when it executes code (and the
    score runs it: ``executes``): the step's parameter ``field`` (its path in the step,
    ``score.allow_code_execution``; in the recipe or by ``--set modifiers.<step>.FIELD=true``) or
    ``$RECIPE_ALLOW_CODE_EVAL=1``."""
    if name not in TASKS:
        raise RecipeError(f"no generation task '{name}' (generation tasks: {', '.join(TASKS)})")
    TASKS[name].path()
    if not executes:
        return
    if TASKS[name].executes_code and not allowed and os.environ.get(CODE_EVAL_ENV, "").strip() != "1":
        raise RecipeError(f"task {name} executes model-written code: set {field}: true in this step (or --set "
                          f"modifiers.<step>.{field}=true), or {CODE_EVAL_ENV}=1, to run it in the sandbox "
                          f"(docs/evaluation.md)")
    if TASKS[name].executes_code:
        isolation()


def run_generation(model, tokenizer, names: list[str], limit: int | None, max_new_tokens: int, batch_size: int,
                   device, progress=None) -> GenerationResult:
    """The generation tasks ``names`` and the mean of their headline values."""
    records = {name: run_task(model, tokenizer, TASKS[name], limit, max_new_tokens, batch_size, device, progress)
               for name in names}
    return GenerationResult(records, sum(r.value for r in records.values()) / len(records), limit, str(device),
                            batch_size)


class Generation(registry.TaskKind):
    """Generation tasks: greedy completions of each problem, scored by what they do; the model in memory."""

    name, section, streams = registry.GENERATION, "generation", False

    def check(self, names: list[str], config, option: str | None) -> None:
        check_generation(config, option, names)

    def run(self, model, tokenizer, names: list[str], config, device, progress=None) -> GenerationResult:
        return run_generation(model, tokenizer, names, config.limit, config.max_new_tokens, config.generation_batch,
                              device, progress)


registry.register_kind(Generation())
