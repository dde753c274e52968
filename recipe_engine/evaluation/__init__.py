"""Evaluation: perplexity protocol (and zero-shot tasks) on an in-memory model."""
from .perplexity import perplexity
from .run import evaluate_model, evaluate_session, retained

__all__ = ["perplexity", "evaluate_model", "evaluate_session", "retained"]
