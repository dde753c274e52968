"""The ``evaluate:`` block of a recipe: quality before and after compression."""
from __future__ import annotations

from ..architectures.adapters import adapter_for
from ..errors import RecipeError, SourceError
from ..execution.context import RunContext
from ..execution.session import Session
from ..execution.streaming import forward_streamed, open_stream
from ..sources.text import load_text
from ..sources.sizes import exceeds_memory
from ..sources.models import load_model
from ..recipe.schema import CalibrationConfig, EvaluateConfig
from .perplexity import perplexity, streamed_perplexity
from .generation import generation_tasks, run_generation
from .zeroshot import zero_shot


def first_available_text(names: list[str], split: str):
    """First text source in ``names`` that loads; the error lists why each one failed."""
    reasons = []
    for name in names:
        try:
            return load_text(name, split)
        except SourceError as exc:
            reasons.append(exc.detail)
    raise SourceError("no evaluation text available: " + "; ".join(reasons))


def evaluate_model(model, tokenizer, config: EvaluateConfig, device, progress=None) -> dict:
    """Run the configured evaluation on an in-memory model (moved to ``device`` for the duration)."""
    results: dict = {}
    model.to(device)
    try:
        if config.perplexity is not None:
            ppl = config.perplexity
            source = first_available_text(ppl.dataset, ppl.split)
            results["perplexity"] = {"dataset": source.name, "origin": source.origin, **perplexity(
                model, tokenizer, source.text, ppl.seq_len, ppl.limit, device, source.origin, progress)}
        lm_tasks, generating = harness_tasks(config.tasks), generation_tasks(config.tasks)
        if lm_tasks:
            results["zero_shot"] = zero_shot(model, tokenizer, lm_tasks, config.limit, device, config.task_data)
        if generating:
            results["generation"] = run_generation(model, tokenizer, generating, config.limit, config.max_new_tokens,
                                                   config.generation_batch, device, progress)
    finally:
        model.to("cpu")
    return results


def evaluation_session(spec: str, dtype: str, device, stream: str = "auto", progress=None):
    """A session for evaluating model ``spec`` (no calibration): in memory, or a read-only skeleton streamed
    from its files (``stream``: on, off, or auto = when its weights exceed half the free host memory)."""
    streamed = stream == "on" or (stream == "auto" and exceeds_memory(spec))
    model, tokenizer, source = load_model(spec, dtype, skeleton=streamed)
    adapter = adapter_for(model.config) if streamed else None  # in memory: any architecture evaluates
    stream = open_stream(model, adapter, source.location, None) if streamed else None
    session = Session(RunContext(tokenizer, adapter, CalibrationConfig(batch_size=1), device, progress), model, None,
                      stream=stream)
    return session, source


def evaluate_session(session, config: EvaluateConfig, progress=None) -> dict:
    """``evaluate_model`` on the session's model; a streamed model gets layer-streamed perplexity
    (``streamed_perplexity``) and zero-shot tasks with one unit resident at a time (``forward_streamed``)."""
    if session.stream is None:
        return evaluate_model(session.model, session.context.tokenizer, config, session.context.device, progress)
    if generation_tasks(config.tasks):
        raise RecipeError(f"generation tasks ({', '.join(generation_tasks(config.tasks))}) need the model in memory; "
                          f"this one is streamed from disk (--stream off / stream: off to load it whole)")
    results: dict = {}
    if config.perplexity is not None:
        ppl = config.perplexity
        source = first_available_text(ppl.dataset, ppl.split)
        results["perplexity"] = {"dataset": source.name, "origin": source.origin, **streamed_perplexity(
            session, source.text, ppl.seq_len, ppl.limit, source.origin)}
    if config.tasks:
        with forward_streamed(session, session.context.device):
            results["zero_shot"] = zero_shot(session.model, session.context.tokenizer, config.tasks, config.limit,
                                             session.context.device, config.task_data)
    return results


def harness_tasks(names: list[str]) -> list[str]:
    """The zero-shot (lm-eval) tasks among ``names``."""
    return [n for n in names if n not in generation_tasks(names)]


def retained(before: dict, after: dict) -> dict:
    """Retained fraction: dense PPL / compressed PPL for perplexity, after/before for accuracies and pass rates."""
    out: dict = {}
    if "perplexity" in before and "perplexity" in after:
        out["perplexity"] = before["perplexity"]["ppl"] / after["perplexity"]["ppl"]
    if "zero_shot" in before and "zero_shot" in after:
        b, a = before["zero_shot"]["average"], after["zero_shot"]["average"]
        out["zero_shot"] = a / b if b else None
    if "generation" in before and "generation" in after:
        b, a = before["generation"]["average"], after["generation"]["average"]
        out["generation"] = a / b if b else None
    return out
