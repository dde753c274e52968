"""Output directories: the pre-flight of ``apply``'s, disk room, the atomic write of a finished one."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from safetensors import SafetensorError

from ..errors import RecipeError
from ..records.report import OUTPUT_KIND, is_recipe_output
from ..system.cleanup import sweep_stale, temporary_directory, write_marker
from .targets import Target, check_target, current_umask


def check_output_free(output: str, force: bool, file: str | None = None, inputs=()) -> None:
    """Pre-flight of ``apply``'s output directory, before anything is loaded: the rule of ``targets`` for a
    directory the run replaces whole (what ``--force`` may delete: an earlier recipe output only; never an input
    of the run, ``inputs``, or anything holding or inside one). Also sweeps temporary directories left beside it
    by killed runs."""
    path = check_target(Target("output", output, directory=True, ours=is_recipe_output, what="a recipe output",
                               force=force, replaced=True, file=file), inputs)
    if path.parent.is_dir():
        sweep_stale(path.parent, path.name)


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
