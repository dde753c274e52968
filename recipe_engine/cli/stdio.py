"""Standard output and error that fail as one line: a full device (``> /dev/full``) or a reader gone
(``| head -1``) ends the command with the documented exit code, never a traceback. Standard library only:
the ``recipe`` entry point installs it before the engine (torch, transformers) is imported."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys
from typing import Iterator

#: A reader that went away (``recipe list-modifiers | head -1``): quiet, exit 128 + SIGPIPE as CLI tools do.
PIPE_CLOSED = 128 + signal.SIGPIPE
#: Any other failure to write standard output or error (no space, I/O error): a user's environment, exit 2.
WRITE_FAILED = 2


class StreamError(Exception):
    """Writing standard output or error failed; ``after`` says what was complete before it failed. Not an
    ``OSError``: code that handles a file's errors (argparse's own printing among it) must not swallow it."""

    def __init__(self, stream: str, cause: OSError, after: str | None = None):
        self.stream, self.cause, self.after = stream, cause, after
        super().__init__(f"{stream}: {cause.strerror or cause}")

    @property
    def exit_code(self) -> int:
        return PIPE_CLOSED if self.cause.errno == errno.EPIPE else WRITE_FAILED

    def line(self) -> str:
        reason = self.cause.strerror or str(self.cause)
        done = f" ({self.after}; only its summary is missing)" if self.after else "; nothing written"
        return f"error: cannot write to {self.stream}: {reason}{done}"


#: An ANSI escape sequence (CSI: colours, cursor moves, line erases; or a two-byte escape).
_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]?")
_BREAKS = re.compile(r"(\r\n|\r|\n)")


class _Guarded:
    """A text stream whose failed writes raise :class:`StreamError`; everything else is the stream's own.

    A stream that is not a terminal (a pipe, a log file) gets plain lines: escape sequences are dropped, and
    a carriage return (a progress bar of a library redrawing its line: tqdm, transformers, lm-eval) starts
    the line over, so only the state a line ends in is written (a bar that closes leaves its last state)."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name
        self._plain = not _isatty(stream)
        self._line, self._redrawn = "", False

    def write(self, text: str) -> int:
        self._put(self._lines(text) if self._plain else text)
        return len(text)

    def flush(self) -> None:
        if self._plain and self._line and not self._redrawn:  # a line being written, not a bar's redraw
            self._put(self._line)
            self._line = ""
        try:
            self._stream.flush()
        except OSError as exc:
            raise StreamError(self._name, exc) from None

    def _lines(self, text: str) -> str:
        done = []
        for part in _BREAKS.split(_ESCAPE.sub("", text)):
            if part in ("\n", "\r\n"):
                done.append(self._line + "\n")
                self._line, self._redrawn = "", False
            elif part == "\r":
                self._line, self._redrawn = "", True
            else:
                self._line += part
        return "".join(done)

    def _put(self, text: str) -> None:
        try:
            if text:
                self._stream.write(text)
        except OSError as exc:
            raise StreamError(self._name, exc) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """``sys.stdout``/``sys.stderr`` guarded for the block, flushed at its end (a failure surfaces inside the
    caller's ``try``, not in Python's own flush at exit); restored afterwards (``main`` may run in-process)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Guarded(saved[0], "standard output"), _Guarded(saved[1], "standard error")
    try:
        yield
        sys.stdout.flush()
    finally:
        with contextlib.suppress(StreamError, OSError, ValueError):  # a last line without its newline
            sys.stderr.flush()
        sys.stdout, sys.stderr = saved


@contextlib.contextmanager
def after_output(what: str) -> Iterator[None]:
    """Standard output written in the block follows a complete output (``what``: "the output out/x is
    complete"): a failure to print says so instead of "nothing written"."""
    try:
        yield
        sys.stdout.flush()
    except StreamError as exc:
        raise StreamError(exc.stream, exc.cause, what) from None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def failed(exc: StreamError) -> int:
    """Report a failed stream (one line on stderr, none for a closed pipe or when stderr itself failed),
    point the dead stream at ``/dev/null`` (Python flushes both at exit) and return the exit code."""
    _to_devnull(sys.__stderr__ if exc.stream == "standard error" else sys.__stdout__)
    if exc.cause.errno != errno.EPIPE and exc.stream != "standard error":
        say(exc.line())
    return exc.exit_code


def _to_devnull(stream) -> None:
    """What the Python documentation advises after EPIPE: the descriptor now writes nowhere, so the flush
    at exit cannot fail again (a stream without a descriptor, e.g. under a test's capture, is left alone)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def say(line: str) -> None:
    """One line on stderr; a stderr that cannot be written is not reported again."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)
