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
from ..records.evaluation import Evaluation, PerplexityResult, Retained
from . import registry
from .perplexity import perplexity, streamed_perplexity


def first_available_text(names: list[str], split: str):
    """First text source in ``names`` that loads; the error lists why each one failed."""
    reasons = []
    for name in names:
        try:
            return load_text(name, split)
        except SourceError as exc:
            reasons.append(exc.detail)
    raise SourceError("no evaluation text available: " + "; ".join(reasons))


def evaluate_model(model, tokenizer, config: EvaluateConfig, device, progress=None) -> Evaluation:
    """Run the configured evaluation on an in-memory model (moved to ``device`` for the duration): perplexity,
    then each kind of task (``registry.by_kind``) into its section."""
    model.to(device)
    try:
        ppl = config.perplexity
        measured = _perplexity(ppl, lambda text, origin: perplexity(
            model, tokenizer, text, ppl.seq_len, ppl.limit, device, origin, progress)) if ppl is not None else None
        sections = {kind.section: kind.run(model, tokenizer, names, config, device, progress)
                    for kind, names in registry.by_kind(config.tasks)}
    finally:
        model.to("cpu")
    return Evaluation(perplexity=measured, **sections)


def _perplexity(config, measure) -> PerplexityResult:
    """The first available text of ``config.dataset`` and ``measure(text, origin)``'s figures on it."""
    source = first_available_text(config.dataset, config.split)
    return PerplexityResult(dataset=source.name, origin=source.origin, **measure(source.text, source.origin))


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


def evaluate_session(session, config: EvaluateConfig, progress=None) -> Evaluation:
    """``evaluate_model`` on the session's model; a streamed model gets layer-streamed perplexity
    (``streamed_perplexity``) and the tasks of a kind that streams with one unit resident at a time
    (``forward_streamed``); a kind that does not (generation) is refused."""
    if session.stream is None:
        return evaluate_model(session.model, session.context.tokenizer, config, session.context.device, progress)
    groups = registry.by_kind(config.tasks)
    for kind, names in groups:
        if not kind.streams:
            raise RecipeError(f"{kind.name} tasks ({', '.join(names)}) need the model in memory; this one is "
                              f"streamed from disk (--stream off / stream: off to load it whole)")
    ppl = config.perplexity
    measured = _perplexity(ppl, lambda text, origin: streamed_perplexity(
        session, text, ppl.seq_len, ppl.limit, origin)) if ppl is not None else None
    sections = {}
    for kind, names in groups:
        with forward_streamed(session, session.context.device):
            sections[kind.section] = kind.run(session.model, session.context.tokenizer, names, config,
                                              session.context.device, progress)
    return Evaluation(perplexity=measured, **sections)


def retained(before: Evaluation, after: Evaluation) -> Retained:
    """Retained fraction: dense PPL / compressed PPL for perplexity, after/before for accuracies and pass rates."""
    return Retained.between(before, after)
