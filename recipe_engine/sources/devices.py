"""The device a command runs on: parsed (CPU and CUDA only) and, for a run here, present on this machine."""
from __future__ import annotations

import torch

from ..errors import SourceError


def parse_device(name: str) -> torch.device:
    """``torch.device(name)`` with a one-line error for what torch cannot parse or the engine does not run
    on (only CPU and CUDA: the session's memory and linear-algebra paths are written for those two)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SourceError(f"device '{name}' is not a device (auto, cpu, cuda, cuda:i)") from None
    if device.type not in ("cpu", "cuda"):
        raise SourceError(f"device '{name}' is not supported (auto, cpu, cuda, cuda:i)")
    # ``cpu:N`` is the CPU, as torch itself has it (a tensor moved there reports ``cpu``): one form, so
    # that comparing a tensor's device with the run's holds
    return torch.device("cpu") if device.type == "cpu" else device


def resolve_device(name: str) -> torch.device:
    """``auto`` takes the first GPU when present, else CPU; a CUDA device must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = parse_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SourceError(f"device '{name}' requested but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SourceError(f"device '{name}' requested but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device
