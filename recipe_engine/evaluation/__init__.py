"""Evaluation: perplexity protocol (and zero-shot tasks) on an in-memory model."""
from .perplexity import perplexity
from .run import evaluate_model, retained

__all__ = ["perplexity", "evaluate_model", "retained"]
