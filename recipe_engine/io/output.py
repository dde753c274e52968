"""Atomic output directories and the run report's provenance fields."""
from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError

from ..errors import RecipeError
from ..system.cleanup import MARKER, read_marker, sweep_stale, temporary_directory, write_marker
from ..system.host_memory import high_water_bytes
from .report import ReportError, load_report
from .user_paths import (Target, check_target, check_writable_parent, current_umask, input_problem, link_kind,
                         name_problem, special_kind)

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
    here = Path.cwd().resolve()
    if target.resolve() == here or target.resolve() in here.parents:
        what = "the current directory" if target.resolve() == here else "a directory holding the current one"
        raise fail(f"output '{output}' is {what}; a run replaces its output directory whole, which it cannot do "
                   f"to the directory it runs in (give a new directory, e.g. --output ./out)")
    if target.is_symlink() or target.exists():
        if not target.is_dir() or target.is_symlink():
            kind = link_kind(target) or special_kind(target) or "not a directory"
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
    ``host_memory.PeakWatch``, else the process's high-water mark) and peak CUDA allocation when a GPU was
    used."""
    if watch is not None:
        watch.start()  # closes the last phase into the overall peak
    rss = (watch.overall_bytes if watch is not None else high_water_bytes()) / 2**20
    peak = {"rss_mib": rss}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peak


def check_file_output(output: str | Path, force: bool, option: str = "--output", inputs=()) -> Path:
    """A single-file output (``recipe export``): the rule of ``user_paths`` (an existing regular file is replaced
    with ``force``). Returns the path."""
    return check_target(Target(option, output, force=force), inputs)


def check_free_bytes(target: Path, size: int, what: str, option: str = "--output") -> None:
    """The file system that will hold ``target`` has room for ``size`` bytes (+5 %), or one line."""
    problem = space_problem(target, size)
    if problem:
        raise RecipeError(f"{option} {target}: not enough disk space for {what}: {problem}")


SWEEP_FILE = "sweep.json"
#: The marker type (``cleanup.MARKER``) of a ``recipe sweep`` directory.
SWEEP_KIND = "recipe-sweep"
