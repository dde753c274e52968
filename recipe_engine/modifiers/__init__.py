"""Source checkout only: the built-in modifiers live in the repository's top-level ``modifiers/`` folder.

An install maps that folder onto this package (``[tool.setuptools.package-dir]`` in pyproject.toml), so
``pip install .`` ships ``modifiers/*.py`` as ``recipe_engine.modifiers`` and never this file. Running
from a checkout (``PYTHONPATH=.`` or an editable install), this file points the package at that folder.
"""
from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "modifiers")]
