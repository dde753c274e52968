"""The HF hub as a source: offline mode, whether the hub answers (one connection, no retries), and whether a name
could be a hub id rather than a path here."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse


def offline_mode(*variables: str) -> bool:
    """Is HF offline mode set by any of ``variables`` (default: both the hub's and datasets')?"""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in variables or ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """None when the HF hub answers a TCP connection (or offline mode is set: the caches are used without
    retries), else why not, in a few words. One connection attempt instead of the libraries' retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"the HF hub ({endpoint.hostname}) cannot be reached: {exc.strerror or type(exc).__name__}"
    return None


def names_a_local_path(name: str) -> bool:
    """Is ``name`` written as a path on this machine (``./x``, ``/x``, ``~/x``, or under a directory that
    exists here), so that, when it does not exist, it is "not found" rather than a hub id?"""
    parent = Path(name).parent
    return name.startswith((".", "/", "~")) or (parent != Path(".") and parent.expanduser().is_dir())


def valid_hub_id(name: str) -> bool:
    """Could ``name`` be an HF hub repository id (``huggingface_hub``'s own rules; no request)?"""
    # deferred: the hub client (~0.2 s) is needed only for hub sources
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
