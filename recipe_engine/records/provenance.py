"""What a report records of where it was made: the packages' versions, the recipe file's git commit, the peak
memory, and which process of a distributed launch writes."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

import torch

from ..system.host_memory import high_water_bytes

REPORTED_PACKAGES = ("recipe-engine", "torch", "transformers", "pydantic", "datasets", "safetensors",
                     "lm-eval", "peft", "rich", "pyyaml")


def is_main_process() -> bool:
    """False on every rank but 0 of a distributed launch (``torchrun`` / ``accelerate launch`` set
    ``RANK``), so that only one process writes the output directory."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


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
