"""Progress of every loop over layers or batches, on stderr: rich bars in a terminal; elsewhere (a log file, a
pipe, a batch job) plain lines, at most one per interval, with no control characters."""
from __future__ import annotations

import os
import sys
import time
from typing import IO, Iterable, Iterator, TypeVar

from rich import console as rich_console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

T = TypeVar("T")

class Console(rich_console.Console):
    """rich's ``Console``, for which only a terminal is one: ``FORCE_COLOR`` and ``TTY_COMPATIBLE=1`` bring
    colour and live bars to a terminal that rich would not detect, but never escape sequences or carriage
    returns into a pipe or a file (``recipe apply ... | tee log``). ``NO_COLOR`` is honoured as by rich."""

    @property
    def is_terminal(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        try:
            tty = bool(isatty is not None and isatty())
        except ValueError:  # a closed stream
            tty = False
        return tty and super().is_terminal


#: Seconds between two plain progress lines (``$RECIPE_PROGRESS_INTERVAL`` overrides it).
INTERVAL_S = 10.0


def interval_s() -> float:
    """The plain lines' interval: ``$RECIPE_PROGRESS_INTERVAL`` seconds when set (≥ 0), else :data:`INTERVAL_S`."""
    value = os.environ.get("RECIPE_PROGRESS_INTERVAL", "").strip()
    try:
        return max(0.0, float(value)) if value else INTERVAL_S
    except ValueError:
        return INTERVAL_S


def duration(seconds: float) -> str:
    """``42s``, ``5m07s``, ``2h03m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Progress:
    """One live display the session and modifiers share (or none when disabled).

    A terminal on stderr gets rich bars; anything else gets plain lines (``plain``): after an item of a loop,
    when ``interval`` seconds passed since the last line (or since the display was made),
    ``[phase] description k/N, elapsed 42s, ~1m10s left`` (``phase``: the step or stage set by :meth:`phase`)."""

    def __init__(self, enabled: bool = True, console: Console | None = None, interval: float | None = None,
                 stream: IO[str] | None = None):
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.stream = stream or (console.file if console is not None else sys.stderr)
        # rich's own test: a TTY (or FORCE_COLOR / TTY_COMPATIBLE set), or a notebook, which renders its bars
        self.plain = not (self.console.is_terminal or self.console.is_jupyter)
        self.interval = interval_s() if interval is None else interval
        self._rich: RichProgress | None = None
        self._phase: str | None = None
        #: Whether the current phase evaluates a whole model (``phase(..., evaluating=True)``).
        self.evaluating = False
        #: The loops being tracked, outermost first: ``[description, item k of, total]`` (``where``), and the
        #: innermost one left before its end since the run last moved on (an exception closes the loops it
        #: unwinds, innermost first).
        self._loops: list[list] = []
        self._left: list | None = None
        self._last = time.perf_counter()  # the first line after one interval: a short command prints none

    def __enter__(self) -> "Progress":
        if self.enabled and not self.plain:
            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=self.console, transient=True)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def where(self) -> str | None:
        """Where the run is, as the plain lines say it: ``[phase] description k/N``, of the innermost loop an
        exception left (the loop's position when it was closed early), else of the innermost loop being
        tracked; None before any phase or loop."""
        loop = self._left or (self._loops[-1] if self._loops else None)
        parts = [f"[{self._phase}]" if self._phase else "", f"{loop[0]} {loop[1]}/{loop[2]}" if loop else ""]
        return " ".join(part for part in parts if part) or None

    def track(self, items: Iterable[T], description: str) -> Iterator[T]:
        """``items`` with a bar (or plain lines), their position kept for :meth:`where`."""
        items = list(items)
        position = [description, 0, len(items)]
        self._loops.append(position)
        self._left, finished = None, False
        try:
            for item in self._displayed(items, description):
                position[1] += 1
                self._left = None  # the run moved on
                yield item
            finished = True
        finally:
            self._loops = [loop for loop in self._loops if loop is not position]
            if not finished and self._left is None:
                self._left = list(position)

    def _displayed(self, items: list[T], description: str) -> Iterator[T]:
        """``items`` with a bar (or plain lines). The display is held locally: a generator closed after the
        display ended (a signal unwinds the ``with Progress`` block before the garbage collector closes the
        generator) removes its task from the display it was added to, not from ``None``."""
        if self.enabled and self.plain:
            yield from self._lines(list(items), description)
            return
        rich = self._rich
        if rich is None:
            yield from items
            return
        items = list(items)
        task = rich.add_task(description, total=len(items))
        try:
            for item in items:
                yield item
                rich.advance(task)
        finally:
            rich.remove_task(task)

    def _lines(self, items: list[T], description: str) -> Iterator[T]:
        start = time.perf_counter()
        for done, item in enumerate(items, 1):
            yield item
            now = time.perf_counter()
            if now - self._last >= self.interval:
                self._last, elapsed = now, now - start
                left = elapsed / done * (len(items) - done)
                phase = f"[{self._phase}] " if self._phase else ""
                self._write(f"{phase}{description} {done}/{len(items)}, elapsed {duration(elapsed)}, "
                            f"~{duration(left)} left")

    def phase(self, label: str, evaluating: bool = False) -> None:
        """Log ``label`` (a step, an evaluation) and name the plain lines after it by it. ``evaluating``: the
        phase evaluates a whole model (:attr:`evaluating`, for the advice when memory runs out)."""
        self._phase, self._left, self.evaluating = label, None, evaluating
        self.log(label)

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self.plain:
            self._write(message)
        else:
            self.console.print(message, markup=False, highlight=False)

    def _write(self, line: str) -> None:
        """One plain line: control characters (escapes, carriage returns) in a message become spaces."""
        clean = "".join(c if c.isprintable() or c == "\t" else " " for c in line)
        print(clean, file=self.stream, flush=True)
