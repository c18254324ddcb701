"""Where scalable-transformer keeps what it can rebuild: tokenizers, corpora, index mappings, CPU peaks.

A root module that imports nothing of the package, so any layer (data/, metrics/, ...) may use it
without pulling in another layer.
"""

from __future__ import annotations

import os
from pathlib import Path


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
