"""Recipes: the schema, file loading, the modifier contract and registry, budgets and the symbolic checks."""
