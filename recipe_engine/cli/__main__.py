"""``python -m recipe_engine.cli`` (and ``torchrun -m recipe_engine.cli``): the ``recipe`` command."""
import sys

from . import main

if __name__ == "__main__":  # not when a tool (doctest collection) imports the module
    sys.exit(main())
