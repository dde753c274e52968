"""``python -m benchmarks.acceptance``: the GPU acceptance (the package's docstring has the legs and the calls)."""
import sys

from benchmarks.acceptance.driver import main

sys.exit(main())
