"""``python -m recipe_engine.cli`` (and ``torchrun -m recipe_engine.cli``): the ``recipe`` command."""
import sys

from .commands import main

sys.exit(main())
