"""Generation tasks: greedy completions of each problem's prompt, scored by what they do.

Batched greedy decoding with the KV cache (``model.generate``, prompts left-padded, longest first); a row stops at
the first of the task's stop sequences or the end-of-sequence token, the batch when every row has, or after
``max_new_tokens``; each completion is cut before its first stop sequence. The tasks (``generation_tasks.py``)
score a completion: HumanEval by running the prompt, the completion and the task's tests in the sandbox
(``sandbox.py``), GSM8K by its final number. The headline metric is pass@1 (greedy, one sample) or exact match.
"""
from __future__ import annotations

import os
import time

import torch

from ..errors import RecipeError
from ..system.progress import interval_s

from .generation_tasks import TASKS, GenerationTask
from .sandbox import Limits, isolation


class StopOnSequences:
    """``StoppingCriteria``: a row is done once its generated text contains one of ``stop``; with ``progress``,
    a line every ``interval_s()`` seconds (tokens generated, rows done) so a long batch shows it is alive."""

    def __init__(self, tokenizer, stop: tuple[str, ...], prompt_width: int, progress=None, label: str = ""):
        self.tokenizer, self.stop, self.width = tokenizer, stop, prompt_width
        self.progress, self.label, self.last = progress, label, time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.width:], skip_special_tokens=True)
        done = torch.tensor([any(s in t for s in self.stop) for t in texts], device=input_ids.device)
        now = time.perf_counter()
        if self.progress is not None and now - self.last >= interval_s():
            self.last = now
            self.progress.log(f"{self.label}: {input_ids.shape[1] - self.width} tokens generated, "
                              f"{int(done.sum())}/{len(texts)} rows stopped")
        return done


def cut(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to (not including) its first stop sequence."""
    ends = [text.find(s) for s in stop if s in text]
    return text[:min(ends)] if ends else text


def _eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    ids = ids if ids is not None else tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [])


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], stop: tuple[str, ...], max_new_tokens: int, batch_size: int,
             device, progress=None, label: str = "generation") -> list[str]:
    """Greedy completions of ``prompts`` (in their order), cut at ``stop``."""
    from transformers import GenerationConfig, StoppingCriteriaList  # deferred: only generation needs them

    eos = _eos_ids(model, tokenizer)
    pad_token, side = tokenizer.pad_token, tokenizer.padding_side
    if pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                              pad_token_id=tokenizer.pad_token_id)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    completions: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for b, batch in enumerate(progress.track(batches, label) if progress is not None else batches):
            encoded = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True).to(device)
            width = encoded["input_ids"].shape[1]
            out = model.generate(**encoded, generation_config=config, stopping_criteria=StoppingCriteriaList(
                [StopOnSequences(tokenizer, stop, width, progress, f"{label} batch {b + 1}/{len(batches)}")]))
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            for i, text in zip(batch, texts):
                completions[i] = cut(text, stop)
    finally:
        tokenizer.pad_token, tokenizer.padding_side = pad_token, side
        model.train(was_training)
    return completions


def run_task(model, tokenizer, task: GenerationTask, limit: int | None, max_new_tokens: int, batch_size: int,
             device, progress=None, limits: Limits = Limits()) -> dict:
    """Generate and score one task's first ``limit`` problems; the record of ``report.json``."""
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
    return {"metric": task.metric, "value": passed / len(chosen), "passed": passed, "samples": len(chosen),
            "samples_available": len(problems), "max_new_tokens": max_new_tokens, "stop": list(task.stop),
            "fingerprint": task.fingerprint(), "generation_s": generated,
            "check_s": time.perf_counter() - start - generated,
            "sandbox": isolation() if task.executes_code else None,
            "problems": {p.id: {"passed": ok, "completion": c} for p, c, ok in zip(chosen, completions, results)}}


#: Set to 1 to allow running model-written code without the flag or recipe field.
CODE_EVAL_ENV = "RECIPE_ALLOW_CODE_EVAL"


def code_execution_allowed(config) -> bool:
    """The opt-in to execute model-written code: ``evaluate.allow_code_execution`` or ``$RECIPE_ALLOW_CODE_EVAL=1``."""
    return config.allow_code_execution or os.environ.get(CODE_EVAL_ENV, "").strip() == "1"


def check_generation(config) -> None:
    """Before any model is loaded: each generation task's rows are installed, and a task that executes
    model-written code has the opt-in."""
    names = generation_tasks(list(config.tasks))
    for name in names:
        TASKS[name].path()
    executing = [n for n in names if TASKS[n].executes_code]
    if executing and not code_execution_allowed(config):
        raise RecipeError(f"task {', '.join(executing)} executes model-written code: pass --allow-code-execution "
                          f"(recipe: evaluate.allow_code_execution: true; or {CODE_EVAL_ENV}=1) to run it in the "
                          f"sandbox (docs/evaluation.md)")


def heldout_failures(model, tokenizer, name: str, count: int, max_new_tokens: int, batch_size: int,
                     device, progress=None) -> tuple[list[str], list[float]]:
    """The task's last ``count`` problems (held out from an evaluation of its first ones): their ids and a loss
    per problem, 1 − passed, for choosing between models by what they generate (lower is better)."""
    task = TASKS[name]
    chosen = task.problems()[-count:]
    completions = generate(model, tokenizer, [p.prompt for p in chosen], task.stop, max_new_tokens, batch_size,
                           device, progress, f"{name} held-out generation")
    return [p.id for p in chosen], [0.0 if task.score(p, c, Limits()) else 1.0 for p, c in zip(chosen, completions)]


def check_scoring_task(name: str, allowed: bool) -> None:
    """A task a step scores by: a generation task, installed, with the opt-in when it executes code."""
    if name not in TASKS:
        raise RecipeError(f"no generation task '{name}' (generation tasks: {', '.join(TASKS)})")
    TASKS[name].path()
    if TASKS[name].executes_code and not allowed and os.environ.get(CODE_EVAL_ENV, "").strip() != "1":
        raise RecipeError(f"task {name} executes model-written code: set allow_code_execution: true here (or "
                          f"{CODE_EVAL_ENV}=1) to run it in the sandbox (docs/evaluation.md)")


def generation_tasks(names: list[str]) -> list[str]:
    """The generation tasks among ``names`` (the rest are lm-eval's)."""
    return [n for n in names if n in TASKS]


def run_generation(model, tokenizer, names: list[str], limit: int | None, max_new_tokens: int, batch_size: int,
                   device, progress=None) -> dict:
    """``{"tasks": {name: record}, "average": mean headline value}`` over the generation tasks ``names``."""
    records = {name: run_task(model, tokenizer, TASKS[name], limit, max_new_tokens, batch_size, device, progress)
               for name in names}
    return {"tasks": records, "average": sum(r["value"] for r in records.values()) / len(records),
            "limit": limit, "device": str(device), "batch_size": batch_size}
