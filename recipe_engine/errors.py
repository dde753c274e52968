"""User-facing errors: one line naming the file, the step and the field."""
from __future__ import annotations

import contextlib
from typing import Iterator


class RecipeError(Exception):
    """A mistake in a recipe or in the command line: exit code 2, nothing written.

    The message is one line: ``FILE: step N (Name): field 'x': what was expected``.
    """

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, step: int | None = None,
                 modifier: str | None = None, field: str | None = None):
        self.file, self.step, self.modifier, self.field = file, step, modifier, field
        self.detail = message
        super().__init__(self.render())

    def render(self) -> str:
        parts = []
        if self.file:
            parts.append(str(self.file))
        if self.step is not None:
            parts.append(f"step {self.step}" + (f" ({self.modifier})" if self.modifier else ""))
        elif self.modifier:
            parts.append(self.modifier)
        if self.field:
            parts.append(f"field '{self.field}'")
        return one_line(": ".join(parts + [self.detail]))

    def located(self, *, file: str | None = None, step: int | None = None,
                modifier: str | None = None, field: str | None = None) -> "RecipeError":
        """Return a copy (of the same class) with missing location parts filled in."""
        return type(self)(self.detail, file=self.file or file,
                          step=self.step if self.step is not None else step,
                          modifier=self.modifier or modifier, field=self.field or field)


def one_line(text: str) -> str:
    """``text`` with line breaks and other unprintable characters escaped (``\\n``, ``\\x1e``), so that
    user input quoted in a message cannot split it over lines.

    >>> one_line("device 'a\\nb'")
    "device 'a\\\\nb'"
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class SourceError(RecipeError):
    """A model or data source that cannot be found or read (exit code 2)."""


class QualityGateError(Exception):
    """The compressed model fell below ``evaluate.min_retained`` (exit code 3, output kept)."""

    exit_code = 3


class OutOfMemory(Exception):
    """A command needed more GPU or host memory than it found (exit code 4): one line saying which, where it
    was (``recipe apply``: the progress display's step, pass and layer), torch's own words and what to do. An
    ``apply`` run keeps its resume checkpoints (``resumable``), as the kernel's OOM killer would leave them:
    ``--resume`` continues from the last one once memory is free. The failed allocation is the ``__cause__``."""

    exit_code = 4

    def __init__(self, memory: str, detail: str, where: str | None = None, advice: str = "nothing was written",
                 resumable: bool = False):
        self.memory, self.detail, self.where, self.resumable = memory, detail, where, resumable
        super().__init__(one_line(f"{self.what()}; {advice}"))

    def what(self) -> str:
        """``out of GPU memory during [step 1: GPTQ] layer-sequential pass 3/4: CUDA out of memory. ...``"""
        return one_line(f"out of {self.memory} memory{f' during {self.where}' if self.where else ''}: {self.detail}")

    @classmethod
    def of(cls, exc: BaseException) -> "OutOfMemory | None":
        """``exc`` itself, or the failed allocation it is as an ``OutOfMemory``; None for any other exception."""
        if isinstance(exc, cls):
            return exc
        memory = memory_kind(exc)
        return None if memory is None else cls(memory, allocation_detail(exc))


#: How torch words a failed host allocation (a ``RuntimeError``; a failed GPU one is ``torch.OutOfMemoryError``).
HOST_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"


def memory_kind(exc: BaseException) -> str | None:
    """``"GPU"`` or ``"host"`` when ``exc`` is a failed allocation (torch's ``OutOfMemoryError``, its host
    allocator's ``RuntimeError``, Python's ``MemoryError``), else None. By name: this module imports no torch."""
    if type(exc).__name__ == "OutOfMemoryError" and type(exc).__module__.startswith("torch"):
        return "GPU"
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and HOST_ALLOCATION_FAILED in str(exc)):
        return "host"
    return None


def allocation_detail(exc: BaseException) -> str:
    """torch's first sentence or two of a failed allocation (how much it tried, what was free), one line."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = text.split(" If reserved but unallocated")[0]
    return one_line(text[:300]).rstrip(". ") or type(exc).__name__


def library_reason(exc: BaseException) -> str:
    """The innermost cause of a library's exception, as one line (huggingface_hub's
    ``StrictDataclassClassValidationError`` wraps transformers' own ``ValueError``: its first line is only
    "Class validation error for validator ...")."""
    while exc.__cause__ is not None and exc.__cause__ is not exc:
        exc = exc.__cause__
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return one_line(text[:200] + ("..." if len(text) > 200 else "")) or type(exc).__name__


#: The signal the running command received, set by ``system.cleanup.handle_signals`` (None: none yet).
_received_signal: list[int | None] = [None]


def note_signal(signum: int | None) -> None:
    """Record (or, with None, clear) the signal the running command received."""
    _received_signal[0] = signum


def received_signal() -> int | None:
    """The signal the running command received, if any: a library that swallowed the interruption raised
    inside it and then failed otherwise (a half-imported module, a recursion) failed because of it."""
    return _received_signal[0]


@contextlib.contextmanager
def reading(what: str) -> Iterator[None]:
    """Around one call into transformers, huggingface_hub, safetensors or torch that reads a user's model
    file: whatever it raises (a config transformers rejects, a corrupt file) becomes one line naming ``what``.
    Our own errors, signals and a lack of memory pass through; so does a failure after a signal was received,
    which the signal caused (the caller turns it into the interruption)."""
    try:
        yield
    except (RecipeError, MemoryError):
        raise
    except Exception as exc:
        if received_signal() is not None:
            raise
        raise SourceError(f"cannot read {what}: {library_reason(exc)}") from None
