"""Where scalable-transformer keeps what it can rebuild: tokenizers, corpora, index mappings, CPU peaks.

A root module that imports nothing of the package, so any layer (data/, metrics/, ...) may use it
without pulling in another layer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .files import write_atomic


def cache_dir() -> Path:
    """The user cache directory of scalable-transformer: $STX_CACHE_DIR if set, else
    $XDG_CACHE_HOME/scalable-transformer, else ~/.cache/scalable-transformer. Not created here:
    writers call mkdir(parents=True, exist_ok=True)."""
    explicit = os.environ.get("STX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "scalable-transformer"


def read_json_entries(name: str) -> dict[str, Any]:
    """The JSON object in cache file `name` ({} when it is missing, unreadable or not an object)."""
    try:
        data = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def put_json_entry(name: str, key: str, entry: dict[str, Any]) -> None:
    """Set `key` to `entry` (plus `measured_at`) in cache file `name`, written whole to a temporary file
    and renamed over it: concurrent readers never see a half-written file."""
    path = cache_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    data = read_json_entries(name)
    data[key] = {**entry, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
