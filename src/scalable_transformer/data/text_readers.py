"""Read a corpus's texts: input files named by paths, directories and globs; gzip and zstd streams;
whole-line blocks of a file; JSON lines or plain text lines parsed into documents; the text column
of Parquet files and of datasets saved by HF `datasets` (data/columnar_readers.py), in blocks of rows.

The formats and their errors are those `stx preprocess` documents (data/preprocess.py); `iter_texts`
streams the documents for a tokenizer's training.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import PreprocessError
from .columnar_readers import (
    PARQUET_SUFFIXES,
    check_not_dataset_dict,
    columnar_size,
    is_saved_dataset,
    iter_row_batches,
)

BLOCK_BYTES = 1 << 20
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_JSON_SUFFIXES = frozenset({".jsonl", ".json", ".ndjson"})
_TEXT_SUFFIXES = frozenset({".txt", ".text"})
_GLOB_CHARS = frozenset("*?[")


# -- inputs ---------------------------------------------------------------------------------------


def input_format(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """("json" | "text" | "parquet" | "saved-dataset", compression or None) of an input, from its
    name (a saved dataset is a directory)."""
    if Path(path).is_dir():
        return "saved-dataset", None
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in PARQUET_SUFFIXES:
        return "parquet", None
    compression = _COMPRESSION.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = "json" if suffixes and suffixes[-1] in _JSON_SUFFIXES else "text"
    return kind, compression


def _readable_in_directory(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    return bool(suffixes) and (
        suffixes[-1] in _JSON_SUFFIXES or suffixes[-1] in _TEXT_SUFFIXES or suffixes[-1] in PARQUET_SUFFIXES
    )


def _directory_files(root: Path) -> list[Path]:
    """The readable files under `root`, and the datasets saved in it (each one input, a directory)."""
    check_not_dataset_dict(root)
    if is_saved_dataset(root):
        return [root]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here != root and is_saved_dataset(here):
            found.append(here)
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [here / f for f in filenames if not f.startswith(".") and _readable_in_directory(here / f)]
    return sorted(found)


def expand_inputs(inputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The input files named by paths, directories and globs, in order; each file once. A dataset
    saved by `datasets` (a directory) is one input."""
    files: list[Path] = []
    for spec in inputs:
        text = os.fspath(spec)
        path = Path(text).expanduser()
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = _directory_files(path)
            if not found:
                raise PreprocessError(
                    f"input directory {path} holds no readable file "
                    "(.jsonl, .json, .ndjson, .txt, .text, optionally .gz or .zst; .parquet; a dataset "
                    "saved by datasets' save_to_disk)"
                )
        elif _GLOB_CHARS & set(text):
            found = []
            for match in sorted(glob.glob(os.path.expanduser(text), recursive=True)):
                m = Path(match)
                found += [m] if m.is_file() else _directory_files(m) if m.is_dir() else []
            if not found:
                raise PreprocessError(f"input pattern {text!r} matches no file")
        else:
            raise PreprocessError(f"input not found: {path}")
        files += found
    if not files:
        raise PreprocessError("no input given")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


# -- reading --------------------------------------------------------------------------------------


def input_size(path: Path) -> int:
    """Bytes on disk of an input (a saved dataset: its Arrow files)."""
    return (
        columnar_size(path) if input_format(path)[0] in ("parquet", "saved-dataset") else path.stat().st_size
    )


@dataclass
class Block:
    """Whole lines of one input file: `data` starts at line `first_line` (1-based), at byte
    `offset` of the (decompressed) stream. `last` marks the file's final block. A columnar input's
    block holds `rows` of its text column instead (data empty), the first being row `first_line`
    (0-based, as datasets and pandas count rows), and `row_bytes` bytes of text."""

    file_index: int
    path: str
    kind: str
    compressed: bool
    data: bytes
    first_line: int
    offset: int
    last: bool
    disk_position: int  # bytes of the on-disk file consumed so far, for the progress bar
    rows: list[Any] | None = None
    row_bytes: int = 0

    @property
    def lines(self) -> int:
        """Lines (rows of a columnar input) in the block."""
        if self.rows is not None:
            return len(self.rows)
        return self.data.count(b"\n") + (0 if not self.data or self.data.endswith(b"\n") else 1)


@contextlib.contextmanager
def _open_stream(path: Path, compression: str | None) -> Iterator[tuple[Any, IO[bytes]]]:
    """(decompressed stream, raw file) of an input."""
    with path.open("rb") as raw:
        if compression == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz, raw
        elif compression == "zstd":
            try:  # optional at run time: only .zst inputs need it, and say so when it is missing
                import zstandard
            except ImportError as e:
                raise PreprocessError(
                    f"{path}: reading .zst files needs the zstandard package (pip install zstandard)"
                ) from e
            with io.BufferedReader(
                _ZstdFrames(raw, zstandard.ZstdDecompressor(), path), BLOCK_BYTES
            ) as stream:
                yield stream, raw
        else:
            yield raw, raw


class TruncatedStreamError(PreprocessError):
    """A compressed input that ends inside a frame: the file is incomplete. Never skippable: the lines
    it would have held are unknown, so --skip-bad-lines cannot count them."""


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file, raising TruncatedStreamError when the file
    ends inside a frame (zstandard's stream_reader returns the partial data as if it were complete)."""

    def __init__(self, raw: IO[bytes], decompressor: Any, path: Path) -> None:
        self._raw, self._d, self._path = raw, decompressor, path
        self._obj = decompressor.decompressobj()
        self._out = bytearray()
        self._in_frame = False
        self._produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._out:
            chunk = self._raw.read(BLOCK_BYTES)
            if not chunk:
                if self._in_frame:
                    raise TruncatedStreamError(
                        f"{self._path}: truncated compressed stream: the file ends inside a zstd frame, "
                        f"after {self._produced} decompressed bytes; the file is incomplete (copy or "
                        "compress it again). --skip-bad-lines does not skip this"
                    )
                return 0
            self._feed(chunk)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        del self._out[:n]
        self._produced += n
        return n

    def _feed(self, chunk: bytes) -> None:
        while chunk:
            self._in_frame = True
            self._out += self._obj.decompress(chunk)
            if not self._obj.eof:
                return
            chunk = self._obj.unused_data  # the next frame (pzstd writes several)
            self._obj = self._d.decompressobj()
            self._in_frame = False


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    with contextlib.suppress(ImportError):  # optional at run time (see _open_stream)
        import zstandard

        errors += (zstandard.ZstdError,)
    return errors


def iter_blocks(
    file_index: int, path: Path, block_bytes: int | None = None, column: str = "text"
) -> Iterator[Block]:
    """Blocks of whole lines of one file (about `block_bytes`, default BLOCK_BYTES), or of whole rows
    of a columnar input's `column`; always at least one, possibly empty, block."""
    block_bytes = block_bytes or BLOCK_BYTES
    kind, compression = input_format(path)
    if kind in ("parquet", "saved-dataset"):
        for run in iter_row_batches(path, column, block_bytes):
            yield Block(
                file_index, str(path), kind, False, b"", run.first_row, 0, run.last, run.disk_position,
                rows=run.rows, row_bytes=run.text_bytes,
            )  # fmt: skip
        return
    errors = _read_errors()
    line, offset = 1, 0
    pending: list[bytes] = []  # a line longer than a block is gathered here, without quadratic copies
    with _open_stream(path, compression) as (stream, raw):

        def read() -> bytes:
            try:
                return stream.read(block_bytes)
            except EOFError:  # gzip's "ended before the end-of-stream marker": never skippable
                raise TruncatedStreamError(
                    f"{path}: truncated compressed stream: the file ends before its end-of-stream marker; "
                    "the file is incomplete (copy or compress it again). --skip-bad-lines does not skip this"
                ) from None
            except errors as e:
                raise PreprocessError(
                    f"{path}: cannot read {compression or 'file'} data after byte {offset}"
                    f"{' of the decompressed stream' if compression else ''}: {e}"
                ) from e

        buf = read()
        while True:
            nxt = read() if buf else b""
            if buf:
                cut = buf.rfind(b"\n")
                if cut < 0 and nxt:
                    pending.append(buf)
                    buf = nxt
                    continue
                if cut < 0:  # the final line has no newline
                    cut = len(buf) - 1
                data = b"".join([*pending, buf[: cut + 1]])
                pending = [buf[cut + 1 :]] if cut + 1 < len(buf) else []
            else:
                data = b"".join(pending)
                pending = []
            last = not nxt and not pending
            yield Block(file_index, str(path), kind, bool(compression), data, line, offset, last, raw.tell())
            if last:
                return
            line += data.count(b"\n")
            offset += len(data)
            buf = nxt


def _decode_lines(block: Block, skip_bad_lines: bool, skipped: Counter[str]) -> list[str | None]:
    """Lines of a block; a line that is not UTF-8 raises, or is None when skipped."""
    raw_lines = block.data.split(b"\n") if block.data else []
    if block.data.endswith(b"\n"):
        raw_lines.pop()
    out: list[str | None] = []
    offset = block.offset
    for i, raw in enumerate(raw_lines):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            if not skip_bad_lines:
                where = " of the decompressed stream" if block.compressed else ""
                raise PreprocessError(
                    f"{block.path}:{block.first_line + i}: invalid UTF-8 at byte offset {offset + e.start}"
                    f"{where} (byte 0x{raw[e.start]:02x}: {e.reason}); fix the file or pass "
                    "--skip-bad-lines (skip_bad_lines=True) to skip such lines"
                ) from None
            skipped["invalid utf-8"] += 1
            out.append(None)
        offset += len(raw) + 1
    return out


def _describe(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def parse_block(
    block: Block, json_key: str, skip_bad_lines: bool, skipped: Counter[str]
) -> list[str | list[str]]:
    """Documents of a block: a text, or a JSON list of sentences. Bad lines raise or are counted."""
    if block.rows is not None:
        return _parse_rows(block, json_key, skip_bad_lines, skipped)
    try:
        text = block.data.decode("utf-8")
        lines: list[str | None] = list(text.split("\n")) if text else []
        if text.endswith("\n"):
            lines.pop()
    except UnicodeDecodeError:
        lines = _decode_lines(block, skip_bad_lines, skipped)
    if block.first_line == 1 and lines and lines[0] is not None and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]  # a UTF-8 byte-order mark is not text

    def bad(i: int, reason: str, message: str) -> None:
        if not skip_bad_lines:
            raise PreprocessError(
                f"{block.path}:{block.first_line + i}: {message}; fix the file or pass --skip-bad-lines "
                "(skip_bad_lines=True) to skip such lines"
            )
        skipped[reason] += 1

    docs: list[str | list[str]] = []
    for i, line in enumerate(lines):
        if line is None:
            continue
        if not line.strip():
            skipped["blank line"] += 1
            continue
        if block.kind == "text":
            docs.append(line[:-1] if line.endswith("\r") else line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            hint = ""
            if block.first_line + i == 1 and line.lstrip().startswith("["):
                hint = " (a JSON array? inputs are JSON lines: one object per line)"
            bad(i, "malformed json", f"malformed JSON: {e.msg} at column {e.colno}{hint}")
            continue
        if not isinstance(obj, dict):
            bad(i, "not an object", f"the line is a JSON {_describe(obj)}, expected an object")
            continue
        if json_key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:20]) or "none"
            bad(i, "missing key", f"no key {json_key!r} in the JSON object (keys present: {keys})")
            continue
        value = obj[json_key]
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            docs.append(value)
        else:
            bad(
                i,
                "not text",
                f"{json_key!r} holds a JSON {_describe(value)}, expected a string or a list of strings",
            )
    return docs


def _parse_rows(
    block: Block, column: str, skip_bad_lines: bool, skipped: Counter[str]
) -> list[str | list[str]]:
    """Documents of a columnar block: each row's value, as a JSON line's value under the key is read."""
    assert block.rows is not None
    docs: list[str | list[str]] = []
    for i, value in enumerate(block.rows):
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            docs.append(value)
            continue
        if not skip_bad_lines:
            raise PreprocessError(
                f"{block.path}: row {block.first_line + i} (0-based): column {column!r} holds "
                f"{'null' if value is None else 'a list with a null'}, expected a string or a list of "
                "strings; "
                "fix the data or pass --skip-bad-lines (skip_bad_lines=True) to skip such rows"
            )
        skipped["not text"] += 1
    return docs


def iter_texts(
    inputs: Iterable[str | os.PathLike[str]], json_key: str = "text", skip_bad_lines: bool = False
) -> Iterator[str]:
    """Stream the document texts of `inputs` (same formats and errors as `preprocess`); a JSON list
    of sentences is joined with blank lines."""
    skipped: Counter[str] = Counter()
    for fi, path in enumerate(expand_inputs(inputs)):
        for block in iter_blocks(fi, path, column=json_key):
            for doc in parse_block(block, json_key, skip_bad_lines, skipped):
                yield doc if isinstance(doc, str) else "\n\n".join(doc)
