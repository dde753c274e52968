"""Whole runs: ``apply`` (one recipe) and ``sweep`` (a grid of recipes)."""
