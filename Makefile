# Quickstart targets; each does its own setup (.venv with CPU torch).
.PHONY: setup demo test
setup:
	@bash scripts/setup.sh
demo: setup
	.venv/bin/recipe apply recipes/flatten20_smollm2.yaml --force
test: setup
	.venv/bin/python -m pytest -q
