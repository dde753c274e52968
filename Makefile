# Quickstart targets; each does its own setup (.venv with CPU torch).
# Local data (WikiText-2 raw, zero-shot task files): the shared data directory beside the checkout.
export RECIPE_DATA_DIR ?= $(abspath ../shared/data)
.PHONY: setup demo test lint check-install docs reference
setup:
	@bash scripts/setup.sh
demo: setup
	.venv/bin/recipe apply recipes/flatten20_smollm2.yaml --force
test: setup
	.venv/bin/python -m pytest -q
lint: setup  # ruff over the whole repository (rules in pyproject.toml's [tool.ruff])
	.venv/bin/ruff check .
check-install:
	@bash scripts/check_install.sh
docs: export NO_MKDOCS_2_WARNING = 1
docs: setup
	.venv/bin/python scripts/render_reference.py --check
	.venv/bin/mkdocs build --strict --site-dir site
reference: setup  # rerender docs/reference/ from the code (after adding a modifier, a parameter or an option)
	.venv/bin/python scripts/render_reference.py
