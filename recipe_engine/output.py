"""Atomic output directories and the run report's provenance fields."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from .errors import RecipeError

REPORTED_PACKAGES = ("recipe-engine", "torch", "transformers", "pydantic", "datasets", "safetensors",
                     "lm-eval", "peft", "rich", "pyyaml")


def is_main_process() -> bool:
    """False on every rank but 0 of a distributed launch (``torchrun`` / ``accelerate launch`` set
    ``RANK``), so that only one process writes the output directory."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def check_output_free(output: str, force: bool, file: str | None = None) -> None:
    if Path(output).exists() and not force:
        raise RecipeError(f"output '{output}' already exists (use --force to replace it)",
                          file=file, field="output")


@contextlib.contextmanager
def atomic_directory(output: str, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``output``.

    Any exception (including KeyboardInterrupt) removes the temporary directory, so an interrupted run
    leaves nothing behind. With ``force`` an existing output is replaced only after the new one is done.
    """
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if target.exists():
            if not force:
                raise RecipeError(f"output '{output}' appeared during the run; not replaced", field="output")
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "previous")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def peak_memory() -> dict[str, float]:
    """Peak resident set size of this process (MiB) and peak CUDA allocation when a GPU was used."""
    peak = {"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peak
