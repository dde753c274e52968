"""Atomic output directories and the run report's provenance fields."""
from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import os
import resource
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError

from ..errors import RecipeError
from ..system.cleanup import MARKER, read_marker, sweep_stale, temporary_directory, write_marker
from .report import ReportError, load_report

OUTPUT_KIND = "recipe-output"

REPORTED_PACKAGES = ("recipe-engine", "torch", "transformers", "pydantic", "datasets", "safetensors",
                     "lm-eval", "peft", "rich", "pyyaml")


def is_main_process() -> bool:
    """False on every rank but 0 of a distributed launch (``torchrun`` / ``accelerate launch`` set
    ``RANK``), so that only one process writes the output directory."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def is_recipe_output(directory: Path) -> bool:
    """An earlier ``recipe apply`` output: our marker, or (written before the marker existed) a
    ``report.json`` with a recipe record beside ``recipe.yaml``."""
    marker = read_marker(directory)
    if marker is not None:
        return marker.get("type") == OUTPUT_KIND and marker.get("state") == "complete"

    try:
        load_report(directory)
    except ReportError:
        return False
    return (directory / "recipe.yaml").is_file()


#: ``stat`` file kinds that no command replaces, by name.
SPECIAL_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                 (stat.S_ISSOCK, "a socket"))


def special_kind(target: Path) -> str | None:
    """``"a character device"`` etc. when ``target`` exists and is neither a regular file, a directory nor a
    symbolic link, else None."""
    try:
        mode = os.lstat(target).st_mode
    except OSError:
        return None
    return next((name for test, name in SPECIAL_KINDS if test(mode)), None)


def input_problem(target: Path, inputs) -> str | None:
    """Why writing ``target`` would replace an input of the run (the source model, its files, a text the
    run reads): it is one, holds one, or is an existing file or directory inside one; else None."""
    here = target.expanduser().resolve()
    for given in inputs:
        source = Path(given).expanduser().resolve()
        if here == source:
            return f"is the run's input {given}"
        if here in source.parents:
            return f"holds the run's input {given}"
        if source in here.parents and (target.exists() or target.is_symlink()):
            return f"lies inside the run's input {given}"
    return None


#: The longest suffix written beside an output ``NAME``: ``.NAME.tmp-XXXXXXXX`` (also ``.old-``, ``.resume``,
#: ``.lock``, an export's ``.tmp-PID``): the leading dot and 13 characters.
SIBLING_EXTRA = 14


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


def check_output_free(output: str, force: bool, file: str | None = None, inputs=()) -> None:
    """Pre-flight of the output path, before anything is loaded: refuse what a write would trip over
    (a file in the way, an unwritable or missing parent) and what ``--force`` must not delete (anything but
    an earlier recipe output; an input of the run, ``inputs``, or anything holding or inside one). Also
    sweeps temporary directories left beside it by killed runs."""
    fail = lambda message: RecipeError(message, file=file, field="output")
    if not output or not output.strip():
        raise fail("output is empty; give a directory")
    target = Path(output).expanduser()
    problem = input_problem(target, inputs)
    if problem:
        raise fail(f"output '{output}' {problem}; not replaced (choose another --output)")
    problem = name_problem(target)
    if problem:
        raise fail(f"output '{output}': {problem}")
    if target.is_symlink() or target.exists():
        if not target.is_dir() or target.is_symlink():
            kind = "a symbolic link" if target.is_symlink() else special_kind(target) or "not a directory"
            raise fail(f"output '{output}' exists and is {kind}; not replaced (choose another --output)")
        if not force:
            raise fail(f"output '{output}' already exists (use --force to replace it)")
        try:
            occupied = any(target.iterdir())
        except OSError as exc:
            raise fail(f"cannot read output '{output}': {exc.strerror or exc}") from None
        if occupied and not is_recipe_output(target):
            raise fail(f"output '{output}' exists and is not a recipe output (no {MARKER}); --force replaces "
                       f"only earlier recipe outputs: move it away yourself or choose another --output")
    check_writable_parent(target, fail)
    if target.parent.is_dir():
        sweep_stale(target.parent, target.name)


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


def space_problem(target: Path, size: int) -> str | None:
    """None when the file system that will hold ``target`` has room for ``size`` bytes plus 5 %, else
    ``"needs about X GiB, Y GiB free on DIR"``."""
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    needed = int(size * 1.05) + 2**20
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return f"needs about {needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free on {existing}"


@contextlib.contextmanager
def atomic_directory(output: str, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success mark it as a recipe output and rename it to
    ``output``.

    Any exception (including :class:`~recipe_engine.system.cleanup.Interrupted` from SIGINT/SIGTERM/SIGHUP)
    removes the temporary directory, so an interrupted run leaves nothing behind; an ``OSError`` while
    writing (disk full, permissions) becomes one located :class:`RecipeError`. With ``force`` an existing
    output is replaced only after the new one is done.
    """
    target = Path(output).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with temporary_directory(target.parent, target.name, OUTPUT_KIND) as tmp:
            yield tmp
            write_marker(tmp, OUTPUT_KIND, "complete")
            default_modes(tmp)
            if target.exists() or target.is_symlink():
                if not force:
                    raise RecipeError(f"output '{output}' appeared during the run; not replaced",
                                      field="output")
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                write_marker(old, OUTPUT_KIND, "replacing")
                os.replace(target, old / "previous")
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
    except (OSError, SafetensorError) as exc:
        detail = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise RecipeError(f"writing output '{output}' failed: {detail}; nothing written",
                          field="output") from None


def default_modes(directory: Path) -> None:
    """Give every file under ``directory`` the mode a plain ``open`` gives (``0o666 & ~umask``) and every
    directory ``0o777 & ~umask``: safetensors writes through a private temporary file (mode 0600) renamed
    into place, which would leave ``model.safetensors`` unreadable to the other accounts that can read the
    rest of the output (a serving account). A file system without POSIX modes (vfat, some network mounts)
    refuses ``chmod``; there every file already has the mount's one mode, so that refusal is ignored."""
    mask = current_umask()
    for root, directories, files in os.walk(directory):
        for name, mode in [(d, 0o777) for d in directories] + [(f, 0o666) for f in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, mode & ~mask)
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                        raise


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


def package_versions() -> dict[str, str]:
    versions = {}
    for name in REPORTED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_info(path: str) -> dict[str, object] | None:
    """Commit and dirty flag of a file when it lives in a git work tree."""
    file = Path(path)
    if not file.is_file():
        return None
    try:
        run = lambda *args: subprocess.run(["git", *args], cwd=file.parent.resolve(), check=True,
                                           capture_output=True, text=True).stdout.strip()
        commit = run("rev-parse", "HEAD")
        tracked = run("ls-files", "--", file.name)
        dirty = bool(run("status", "--porcelain", "--", file.name))
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return {"commit": commit, "tracked": bool(tracked), "dirty": dirty}


def peak_memory(watch=None) -> dict[str, float]:
    """Peak resident set size of this process (MiB; over every phase of ``watch``, a
    ``host_memory.PeakWatch``, else ``ru_maxrss``) and peak CUDA allocation when a GPU was used."""
    if watch is not None:
        watch.start()  # closes the last phase into the overall peak
    rss = watch.overall_bytes / 2**20 if watch is not None else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = {"rss_mib": rss}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peak


def check_file_output(output: str | Path, force: bool, option: str = "--output", inputs=()) -> Path:
    """A single-file output (``recipe export``, ``--json``): not a directory (also not with ``--force``), not an
    existing file without ``--force``, not a symbolic link, a device node, FIFO or socket, not an input of the
    command (``inputs``: the source model, its files), and its directory can take a new entry. Returns the path."""
    fail = lambda message: RecipeError(f"{option} {output}: {message}")
    target = Path(output).expanduser()
    if not str(output).strip():
        raise RecipeError(f"{option} is empty; give a file name")
    problem = input_problem(target, inputs)
    if problem:
        raise fail(f"{problem}; not replaced (choose another file)")
    problem = name_problem(target)
    if problem:
        raise fail(problem)
    if target.is_symlink():
        raise fail("is a symbolic link; not replaced (choose another file)")
    if special_kind(target):
        raise fail(f"is {special_kind(target)}, not a regular file; not replaced (choose another file)")
    if target.is_dir():
        raise fail("is a directory; give a file name (--force replaces files only)")
    if target.exists() and not force:
        raise fail("already exists (use --force to replace it)")
    check_writable_parent(target, lambda message: RecipeError(f"{option}: {message}"))
    return target


def check_free_bytes(target: Path, size: int, what: str, option: str = "--output") -> None:
    """The file system that will hold ``target`` has room for ``size`` bytes (+5 %), or one line."""
    problem = space_problem(target, size)
    if problem:
        raise RecipeError(f"{option} {target}: not enough disk space for {what}: {problem}")


SWEEP_FILE = "sweep.json"
