"""Sizes of a model before it loads: its weight files on disk, whether they exceed memory (``stream: auto``), and
the bytes its parameters take in a dtype."""
from __future__ import annotations

from pathlib import Path

import torch

from ..system.host_memory import available_memory
from .models import DTYPES, resolve_model


def exceeds_memory(spec: str) -> bool:
    """``stream: auto``'s rule: the model's weight files exceed half of the available host memory."""
    return checkpoint_bytes_on_disk(spec) > available_memory() / 2


def checkpoint_bytes_on_disk(spec: str) -> int:
    """Size of the safetensors weight files of a model spec (0 for a hub id not yet downloaded)."""
    source = resolve_model(spec)
    return 0 if source.kind == "hub" else checkpoint_bytes(source.location)


def checkpoint_bytes(directory: str | Path) -> int:
    """Bytes of the safetensors files in ``directory``."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def estimated_output_bytes(config, dtype: str) -> int:
    """Bytes of the model's parameters in ``dtype`` (built on the meta device; tied weights once).
    The steps only remove, merge or narrow layers, so the written checkpoint is at most about this."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize
