"""Agreement with a reference model on a generation task: a cheap score that needs no generation by the candidate
and runs none of its code.

The reference (the dense model) writes its greedy completion ``c`` of each task prompt ``p`` once, as
``recipe eval`` does (the completions of its ``--json`` record, or :func:`reference_completions`). A candidate's
score is its mean next-token negative log-likelihood of those completions, teacher-forced, in one forward per
problem::

    NLL = − (1 / T) · Σ_problems Σ_{t ∈ c} log p_candidate(x_t | x_<t)      (T: completion tokens in all)

with ``p`` tokenized as generation tokenizes it and ``c`` appended as its own tokens (what the reference
emitted, up to its stop sequence). Beside it, the **token agreement**: the share of those ``T`` positions where
the candidate's own greedy choice (argmax) is the reference's token. A lower NLL means the candidate would more
likely write what the reference writes; on the coder model's compression frontier it ranks pass@1
(BENCHMARKS.md, "HumanEval frontier"). The score uses log-softmax in fp32 whatever the model dtype.
Deviation from a KL to the reference's distribution: only the reference's chosen tokens are scored, so the
reference's logits need not be kept (151,936 × T floats for Qwen2.5).
"""
from __future__ import annotations

import math
import time

import torch

from ..errors import RecipeError
from ..records.evaluation import Evaluation
from .generation import forward_options, generate
from .generation_tasks import TASKS


def record_completions(record: dict, task: str, origin: str) -> list[tuple[str, str, str]]:
    """``(problem id, prompt, completion)`` of ``task`` from a ``recipe eval --json`` record (``origin`` names it
    in errors), in the task's problem order."""
    generation = Evaluation.from_json(record).generation
    scored = generation.tasks.get(task) if generation else None
    problems = scored.problems if scored else None
    if not problems:
        raise RecipeError(f"{origin}: no {task} completions (a `recipe eval --tasks {task} --json` record of the "
                          f"reference model has them)")
    prompts = {problem.id: problem.prompt for problem in TASKS[task].problems()}
    unknown = [pid for pid in problems if pid not in prompts]
    if unknown:
        raise RecipeError(f"{origin}: {task} problem {unknown[0]} is not in the installed task's rows (another "
                          f"version of the task?)")
    order = [pid for pid in prompts if pid in problems]
    return [(pid, prompts[pid], problems[pid].completion) for pid in order]


def reference_completions(model, tokenizer, task: str, problems: list, max_new_tokens: int, batch_size: int,
                          device, progress=None) -> list[tuple[str, str, str]]:
    """The reference model's greedy completions of ``problems`` (``generation_tasks.Problem``), cut at the
    task's stop sequences: what ``recipe eval`` would record."""
    stop = TASKS[task].stop
    texts = generate(model, tokenizer, [p.prompt for p in problems], stop, max_new_tokens, batch_size, device,
                     progress, f"{task} reference completions")
    return [(p.id, p.prompt, text) for p, text in zip(problems, texts)]


def _forward_logits(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """The logits of the last ``keep`` positions of one sequence ``ids`` [1, n] (only those computed where the
    forward takes ``logits_to_keep``: ``generation.forward_options``)."""
    supported, _ = forward_options(model)
    if supported:
        return model(input_ids=ids, logits_to_keep=keep).logits[0]
    return model(input_ids=ids).logits[0, -keep:]


@torch.no_grad()
def completion_scores(model, tokenizer, completions: list[tuple[str, str, str]], device,
                      progress=None, label: str = "agreement") -> dict:
    """The candidate ``model``'s NLL and token agreement of the reference ``completions`` (see the module):
    ``{"nll", "token_agreement", "tokens", "problems", "per_problem": {id: {"nll", "tokens", "agreement"}}}``;
    a problem whose completion is empty has no tokens and no per-problem NLL."""
    was_training = model.training
    model.eval()
    total_nll, total_tokens, total_agree, per_problem = [], 0, 0, {}
    start = time.perf_counter()
    rows = progress.track(completions, label) if progress is not None else completions
    try:
        for pid, prompt, completion in rows:
            prompt_ids = tokenizer(prompt)["input_ids"]
            written = tokenizer(completion, add_special_tokens=False)["input_ids"]
            if not written:
                per_problem[pid] = {"nll": None, "tokens": 0, "agreement": None}
                continue
            ids = torch.tensor([prompt_ids + written], device=device)
            # the logits at positions P-1 … P+L-2 predict the L completion tokens
            logits = _forward_logits(model, ids, len(written) + 1)[:-1].float()
            target = torch.tensor(written, device=logits.device)
            log_probs = torch.log_softmax(logits, dim=-1)
            nll = -log_probs.gather(1, target[:, None])[:, 0].double()
            agree = int((logits.argmax(-1) == target).sum())
            per_problem[pid] = {"nll": float(nll.mean()), "tokens": len(written), "agreement": agree / len(written)}
            total_nll.append(float(nll.sum()))
            total_tokens += len(written)
            total_agree += agree
    finally:
        model.train(was_training)
    if not total_tokens:
        raise RecipeError("every reference completion is empty: nothing to score")
    return {"nll": math.fsum(total_nll) / total_tokens, "token_agreement": total_agree / total_tokens,
            "tokens": total_tokens, "problems": len(completions), "seconds": time.perf_counter() - start,
            "per_problem": per_problem}


def heldout_reference(model, tokenizer, name: str, count: int, max_new_tokens: int, batch_size: int, device,
                      progress=None) -> list[tuple[str, str, str]]:
    """The reference ``model``'s completions of the task's last ``count`` problems (held out from an evaluation
    of its first ones), for scoring candidates by :func:`heldout_agreement`."""
    return reference_completions(model, tokenizer, name, TASKS[name].problems()[-count:], max_new_tokens,
                                 batch_size, device, progress)


def heldout_agreement(model, tokenizer, completions: list[tuple[str, str, str]], device,
                      progress=None) -> tuple[dict, list[float]]:
    """The candidate's agreement record (:func:`completion_scores`) and one loss per problem with tokens: its
    mean NLL of that problem's reference completion (lower is better)."""
    scores = completion_scores(model, tokenizer, completions, device, progress, "held-out agreement")
    losses = [scores["per_problem"][pid]["nll"] for pid, _, _ in completions
              if scores["per_problem"][pid]["tokens"]]
    return scores, losses
