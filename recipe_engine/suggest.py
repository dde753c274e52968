"""'Did you mean' suggestions for misspelled names."""
from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest choice, or ``""``.

    >>> did_you_mean("lamda_scale", ["lambda_scale", "layers"])
    "; did you mean 'lambda_scale'?"
    """
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
