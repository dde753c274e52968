"""Files shipped inside installed PyPI packages (located without importing them), and the engine's cache
directory ``$RECIPE_CACHE``."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import SourceError


def cache_root() -> Path:
    """``$RECIPE_CACHE`` (default ``~/.cache/recipe_engine``); a path that is, or lies under, something other
    than a directory is one line."""
    root = Path(os.environ.get("RECIPE_CACHE") or Path.home() / ".cache" / "recipe_engine").expanduser()
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == root else f" ({existing} is not a directory)"
        raise SourceError(f"the model cache $RECIPE_CACHE={root} is not a directory{where}; set RECIPE_CACHE "
                          f"to a directory")
    return root


def package_file(package: str, relative: str, install: str, owner: str, needs: str = "package") -> Path:
    """File ``relative`` inside installed ``package``, located without importing it; a missing package or
    file is one line naming ``owner`` (what needs it) and the ``install`` command."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"{owner} needs the PyPI {needs}: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise SourceError(f"{owner}: {path} missing; reinstall with {install}")
    return path
