"""rich progress bars for every loop over layers or batches (on stderr)."""
from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

T = TypeVar("T")


class Progress:
    """Thin wrapper so the session and modifiers share one live display (or none when disabled)."""

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._rich: RichProgress | None = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=self.console, transient=True)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def track(self, items: Iterable[T], description: str) -> Iterator[T]:
        """``items`` with a bar. The display is held locally: a generator closed after the display ended (a
        signal unwinds the ``with Progress`` block before the garbage collector closes the generator)
        removes its task from the display it was added to, not from ``None``."""
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

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False, highlight=False)
