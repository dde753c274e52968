"""The ``recipe`` command line (``recipe = "recipe_engine.cli:main"``; also ``python -m recipe_engine.cli``).

This module imports nothing heavy: :func:`main` handles signals and guards stdout/stderr first, then imports
the commands (torch, transformers: seconds), so Ctrl-C during those imports is the same one line as later."""
from __future__ import annotations

import signal
import sys

from ..errors import received_signal
from ..system.cleanup import Interrupted, handle_signals
from . import stdio
from .about import version

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 2 user error (one line), 3 quality gate, 128+n signal n (141: stdout's reader
    went away), 1 internal bug (a traceback: please report it). See docs/errors.md."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with stdio.guarded(), handle_signals() as signals:
            if args in (["--version"], ["-V"]):  # at once, without importing the engine
                print(f"recipe {version()}")
                return 0
            # nothing is written yet, so a signal ends the process there at once (raised inside torch's C++
            # code it would abort it)
            with signals.exit_at_once():
                from .commands import run  # deferred: the engine's imports (torch, transformers: seconds)
            try:
                return run(args)
            except Exception:  # raised after a signal, because of it: a library that swallowed the
                if received_signal() is None:  # interruption inside a lazy import fails otherwise
                    raise
                raise Interrupted(received_signal()) from None
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        stdio.say(f"interrupted by {signal.Signals(signum).name}; nothing written")
        return 128 + signum
    except stdio.StreamError as exc:
        return stdio.failed(exc)


def __getattr__(name: str):
    if name == "build_parser":
        from .commands import build_parser  # deferred: as in main

        return build_parser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
