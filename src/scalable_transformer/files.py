"""Writing a file so that no reader ever sees part of it: the one helper every writer uses.

`atomic_output` / `write_atomic` for a file written in one go; `temporary_beside` + `publish` for a
writer whose file outlives one block (the indexed dataset builder streams tokens into its .bin for
hours, then publishes the .bin and the .idx in that order). The one other rename in the package is
checkpoint/manager.py's, of a whole checkpoint directory that every rank staged.

A root module that imports nothing of the package (as cache.py and errors.py), so any layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def temporary_beside(path: Path) -> Path:
    """A new empty file in `path`'s directory (so the rename stays on one file system), named after
    it and unique per writer, so concurrent ranks never share one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def publish(tmp: Path, path: Path, *, durable: bool = False) -> None:
    """Rename the finished temporary file `tmp` over `path` (os.replace): a reader sees the old file or
    the new one, never part of one. `durable`: fsync the directory after the rename."""
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary files
    os.replace(tmp, path)
    if durable:
        fsync_directory(path.parent)


@contextlib.contextmanager
def atomic_output(path: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends without an error, all at once: it is
    written as a temporary file beside `path` (`temporary_beside`; the file's `name` is its path, for
    a caller that checks the file before it is published) and renamed over `path` (`publish`). On an
    error the temporary file is removed and `path` is untouched. `durable`: fsync the file before the
    rename and the directory after it (a checkpoint's metadata must survive a power cut, not only a
    crash)."""
    tmp = temporary_beside(path)
    try:
        with tmp.open("wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        publish(tmp, path, durable=durable)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_once(path: Path, data: bytes) -> bool:
    """`data` into `path` unless a file is there already, all at once; False (and nothing written)
    when another process published `path` first: a cache entry that concurrent processes each build
    (two runs starting on a cold cache trained tokenizers of 10093 and 10089 tokens, measured) must be
    the same for all of them, so each uses the one that won (os.link fails on an existing name)."""
    tmp = temporary_beside(path)
    try:
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


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
