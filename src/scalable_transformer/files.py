"""Writing a file so that no reader ever sees part of it: the one helper every writer uses.

A root module that imports nothing of the package (as cache.py and errors.py), so any layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_output(path: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends without an error, all at once: it is
    written as a temporary file in the same directory (unique per writer, so concurrent ranks never
    share one) and renamed over `path` (os.replace), so a reader sees the old file or the new one.
    On an error the temporary file is removed and `path` is untouched. `durable`: fsync the file
    before the rename and the directory after it (a checkpoint's metadata must survive a power cut,
    not only a crash)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """`data` (str as UTF-8) into `path` through `atomic_output`."""
    with atomic_output(path, durable=durable) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file in directory `path` durable (where the OS allows opening it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
