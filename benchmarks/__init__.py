"""The benchmarks, run from the repository root as modules: ``python -m benchmarks.NAME`` (``--help`` for each).

- ``benchmarks/*.py``: the result benchmarks; each measures a question and writes its rows into
  ``benchmarks/results/*.json`` (through ``rowstore``), which ``python benchmarks/report.py`` renders into
  BENCHMARKS.md (``benchmarks/results/README.md``: the schema).
- ``benchmarks.acceptance``: the GPU acceptance, the whole product on one lent GPU, one module per leg.
- ``benchmarks.diagnosis``: scripts that diagnose or explore (a method's parts, a profile's idle gaps, the
  host's samples); they print or write raw output, and a row that quotes them names their command.
"""
