"""One rule for every path a user names for a command to write.

The paths: ``apply``'s output directory (``--output`` or the recipe's ``output``), ``--timings`` (or the
default log ``OUTPUT.timings.jsonl`` beside the output), ``--profile``; ``export --output``;
``eval --json`` and ``bench --json``; ``sweep --output``. Each is checked by :func:`check_targets` in the
command's pre-flight, before a weight loads, and refused in one line naming the option when it

* is empty, or its name is too long for the file system (with the ``.NAME.tmp-XXXXXXXX`` written beside it);
* is an input of the command (the source model, a file inside it or a directory holding it, the recipe file,
  a calibration or evaluation text, an ``--eval`` / ``--baseline`` record), by path or as a hard link;
* is a device node, FIFO or socket (``/dev/null`` included), or a symbolic link (to anything: a run replaces
  a path, it never writes through a link);
* is, holds or lies inside another path the same run writes (``--timings`` inside the output);
* exists and is not ours: a file is replaced only when it is recognisably one this tool wrote (a timings
  log, a ``recipe eval`` / ``bench`` record; an empty file holds nothing to lose) or, for a command whose
  ``--force`` replaces files (``export``), with ``--force``; a directory is written into only when it is
  empty or carries our marker (``cleanup.MARKER``) of its kind. ``apply``'s ``--force`` is about the output
  directory only and never replaces a file that is not ours;
* is of the wrong type (a directory where a file goes, a file where a directory goes), or its directory
  cannot take a new entry (read-only, missing permission, a file in the way).

``apply``'s output directory follows the same rule as a directory the run *replaces* whole (``replaced``,
``output.check_output_free``): an existing one only with ``--force`` and only when it is empty or an earlier
recipe output, never the working directory or one holding it; it takes part in :func:`check_targets` as one of
the run's paths that no other may lie in. Files are written atomically: to a temporary sibling, renamed into
place (:func:`open_fresh`, :func:`replace_text`).
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from ..errors import RecipeError
from ..system.cleanup import MARKER, read_marker
from ..system.file_kinds import special_kind, special_kind_of

#: The longest suffix written beside an output ``NAME``: ``.NAME.tmp-XXXXXXXX`` (also ``.old-``, ``.resume``,
#: ``.lock``, an export's ``.tmp-PID``): the leading dot and 13 characters.
SIBLING_EXTRA = 14

#: The most bytes read to recognise a file of ours (a record or a log's first line).
RECOGNISE_BYTES = 1 << 20


def link_kind(target: Path) -> str | None:
    """``"a symbolic link to a character device"`` (or ``to a directory``, ``to nothing`` ...) when ``target`` is
    a symbolic link, else None."""
    if not target.is_symlink():
        return None
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return "a symbolic link to nothing"
    kind = special_kind_of(mode)
    kind = kind or ("a directory" if stat.S_ISDIR(mode) else "a regular file")
    return f"a symbolic link to {kind} ({os.path.realpath(target)})"


def input_problem(target: Path, inputs: Iterable) -> str | None:
    """Why writing ``target`` would replace an input of the run (the source model, its files, a text the
    run reads): it is one (by path or as a hard link), holds one, or is an existing file or directory inside
    one; else None."""
    here = target.expanduser().resolve()
    for given in inputs:
        source = Path(given).expanduser().resolve()
        if here == source or _same_file(target, source):
            return f"is the run's input {given}"
        if here in source.parents:
            return f"holds the run's input {given}"
        if source in here.parents and (target.exists() or target.is_symlink()):
            return f"lies inside the run's input {given}"
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def name_problem(target: Path) -> str | None:
    """Why the file system cannot hold ``target``'s name and the siblings written beside it, or None."""
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    size = len(os.fsencode(target.name))
    if size + SIBLING_EXTRA > limit:
        return (f"its name is {size} bytes; {existing} holds names up to {limit} bytes and the run writes "
                f"'.NAME.tmp-XXXXXXXX' beside it, so at most {limit - SIBLING_EXTRA} (choose a shorter name)")
    return None


def check_writable_parent(target: Path, fail) -> None:
    """``target`` can be created: no file in the way of its parent directories, and the nearest existing
    one accepts a new entry (probed by creating and removing an empty directory: the only test that is
    right for permissions, read-only mounts, ``/proc`` and root alike). ``fail(message)`` builds the error."""
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise fail(f"cannot create '{target}': '{existing}' is a file, not a directory")
    try:
        Path(tempfile.mkdtemp(prefix=".recipe-probe-", dir=existing)).rmdir()
    except OSError as exc:
        raise fail(f"cannot write '{target}': {existing}: {exc.strerror or exc}") from None


def never(_path: Path) -> bool:
    return False


@dataclass(frozen=True)
class Target:
    """One path a command writes: the ``option`` that named it (``--timings``), its ``value``, whether it is
    a ``directory`` written into (else one file), how to recognise an existing one as ``ours`` (``what``
    names that in a refusal) and whether the command's ``--force`` was given and replaces any regular file
    (``force``: ``export``)."""
    option: str
    value: str | Path
    directory: bool = False
    ours: Callable[[Path], bool] = field(default=never, compare=False)
    what: str = ""
    force: bool = False
    #: What the user can do instead (a path the user did not name: the default timings log)
    instead: str = ""
    #: A directory the run replaces whole (``apply``'s output, a recipe field: refusals name the recipe ``file``)
    replaced: bool = False
    file: str | None = None

    @property
    def path(self) -> Path:
        return Path(self.value).expanduser()

    def fail(self, message: str, sep: str = " ") -> RecipeError:
        if self.replaced:
            return RecipeError(f"output '{self.value}'{sep}{message}", file=self.file, field="output")
        return RecipeError(f"{self.option} {self.value}: {message}")

    def parent_fail(self, message: str) -> RecipeError:
        """A refusal of the directory that would hold the path."""
        if self.replaced:
            return RecipeError(message, file=self.file, field="output")
        return RecipeError(f"{self.option}: {message}")

    def empty(self) -> RecipeError:
        return RecipeError(f"{self.option} is empty; give a {self.noun}" + ("" if self.replaced else " name"),
                           **({"file": self.file, "field": "output"} if self.replaced else {}))

    @property
    def another(self) -> str:
        return f"another {self.option}" if self.replaced else f"another {self.noun}"

    @property
    def noun(self) -> str:
        return "directory" if self.directory else "file"


def check_targets(targets: list[Target], inputs: Iterable = (), others: dict[str, Path] | None = None) -> None:
    """The rule for each of ``targets`` (module docstring), and none of them equal to, holding or inside
    another or one of ``others`` (label → path: the output directory, checked on its own)."""
    inputs = [Path(i) for i in inputs if Path(i).expanduser().exists()]
    for target in targets:
        if not str(target.value).strip():
            raise target.empty()
    check_apart({**{t.option: t.path for t in targets}, **(others or {})})
    for target in targets:
        check_target(target, inputs)


def check_apart(paths: dict[str, Path]) -> None:
    """No two of the run's paths (label → path) are the same, and none lies inside another."""
    where = {label: _absolute(path) for label, path in paths.items()}
    labels = list(where)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            if where[a] == where[b]:
                raise RecipeError(f"{a} and {b} name the same path {paths[a]}; give each its own")
            for inner, outer in ((a, b), (b, a)):
                if where[outer] in where[inner].parents:
                    raise RecipeError(f"{inner} {paths[inner]} lies inside {outer} {paths[outer]}, which the same "
                                      f"run writes; choose a path outside it")


def _absolute(path: Path) -> Path:
    """``path`` absolute, its directories' links resolved (its last part kept: a link there is refused)."""
    path = Path(os.path.abspath(path.expanduser()))
    return path.parent.resolve() / path.name if path.name else path


def check_target(target: Target, inputs: Iterable = ()) -> Path:
    """The rule for one path (module docstring); returns it."""
    path = target.path
    if not str(target.value).strip():
        raise target.empty()
    problem = input_problem(path, inputs)
    if problem:
        raise target.fail(f"{problem}; not replaced (choose {target.another})")
    if name_problem(path):
        raise target.fail(name_problem(path), sep=": ")
    if target.replaced:
        _check_replaced(target, path)
    else:
        if link_kind(path):
            raise target.fail(f"is {link_kind(path)}; not replaced, nor written through (choose {target.another})")
        if special_kind(path):
            raise target.fail(f"is {special_kind(path)}, not a regular {target.noun}; not replaced (choose "
                              f"{target.another})")
        if path.exists():
            _check_existing(target, path)
    probe = path / MARKER if target.directory and path.is_dir() and not target.replaced else path
    check_writable_parent(probe, target.parent_fail)
    return path


def _check_replaced(target: Target, path: Path) -> None:
    """A directory replaced whole: not the working directory (or one holding it); an existing one is a directory
    (no link), replaced only with ``force`` and only when empty or ``ours``."""
    here = Path.cwd().resolve()
    if path.resolve() == here or path.resolve() in here.parents:
        what = "the current directory" if path.resolve() == here else "a directory holding the current one"
        raise target.fail(f"is {what}; a run replaces its output directory whole, which it cannot do to the "
                          f"directory it runs in (give a new directory, e.g. --output ./out)")
    if not (path.is_symlink() or path.exists()):
        return
    if not path.is_dir() or path.is_symlink():
        kind = link_kind(path) or special_kind(path) or "not a directory"
        raise target.fail(f"exists and is {kind}; not replaced (choose {target.another})")
    if not target.force:
        raise target.fail("already exists (use --force to replace it)")
    try:
        occupied = any(path.iterdir())
    except OSError as exc:
        raise target.parent_fail(f"cannot read output '{target.value}': {exc.strerror or exc}") from None
    if occupied and not target.ours(path):
        raise target.fail(f"exists and is not {target.what} (no {MARKER}); --force replaces only earlier "
                          f"{target.what[2:]}s: move it away yourself or choose {target.another}")


def _check_existing(target: Target, path: Path) -> None:
    if target.directory:
        if not path.is_dir():
            raise target.fail("exists and is not a directory; give a directory")
        try:
            empty = not any(path.iterdir())
        except OSError as exc:
            raise target.fail(f"cannot read it: {exc.strerror or exc}") from None
        if not (empty or target.ours(path)):
            raise target.fail(f"exists and is not {target.what} (no {MARKER}); not written into (move it away "
                              f"or choose another directory)")
        return
    if path.is_dir():
        raise target.fail("is a directory; give a file name" + (" (--force replaces files only)" if target.force
                                                                 else ""))
    if target.force or _empty(path) or target.ours(path):
        return
    if target.what:
        raise target.fail(f"exists and is not {target.what}; not replaced (move it away or "
                          f"{target.instead or 'choose another file'})")
    raise target.fail("already exists (use --force to replace it)")


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


def _head(path: Path) -> str | None:
    """The first :data:`RECOGNISE_BYTES` of a regular file as text, or None."""
    try:
        with open(path, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None
            return handle.read(RECOGNISE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def is_timings_log(path: Path) -> bool:
    """A timings log of ours (``execution.timings``): its first line a record with ``seconds`` and ``at_s``."""
    head = _head(path)
    if head is None or "\n" not in head:
        return False
    try:
        record = json.loads(head.split("\n", 1)[0])
    except ValueError:
        return False
    return isinstance(record, dict) and {"seconds", "at_s"} <= record.keys()


def is_json_record(path: Path) -> bool:
    """A record ``recipe eval --json`` (``model``, ``lm_eval_version``) or ``recipe bench --json``
    (``models``, ``ratio_b_over_a``) wrote."""
    head = _head(path)
    try:
        record = json.loads(head) if head is not None and len(head) < RECOGNISE_BYTES else None
    except ValueError:
        return False
    return isinstance(record, dict) and ({"model", "lm_eval_version"} <= record.keys()
                                         or {"models", "ratio_b_over_a"} <= record.keys())


def marked(kind: str) -> Callable[[Path], bool]:
    """A directory carrying our marker of ``kind`` (``cleanup.MARKER``)."""
    return lambda path: (read_marker(path) or {}).get("type") == kind


def current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_fresh(path: Path):
    """A new file at ``path``, open for writing: created as a temporary sibling with the mode a plain
    ``open`` gives and renamed over ``path`` (a file there, checked as ours in the pre-flight, is replaced
    whole, never truncated or unlinked first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(descriptor, 0o666 & ~current_umask())
        os.replace(temporary, path)
    except BaseException:
        os.close(descriptor)
        Path(temporary).unlink(missing_ok=True)
        raise
    return os.fdopen(descriptor, "w", encoding="utf-8")


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling of ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temporary, 0o666 & ~current_umask())
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
