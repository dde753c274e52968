"""What ``recipe --version`` prints (standard library only: it answers without importing the engine)."""
from __future__ import annotations

import importlib.metadata


def version() -> str:
    """The installed package's version (its metadata)."""
    try:
        return importlib.metadata.version("recipe-engine")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree; pip install -e . records its version)"
