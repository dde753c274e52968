"""The ``recipe`` command line (``recipe = "recipe_engine.cli:main"``; also ``python -m recipe_engine.cli``)."""
from .commands import build_parser, main

__all__ = ["build_parser", "main"]
