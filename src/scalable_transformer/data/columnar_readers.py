"""Read the text column of columnar corpora: Parquet files and datasets saved by HF `datasets`
(`Dataset.save_to_disk`), the forms most public corpora come in. data/text_readers.py turns what
this yields into the blocks `stx preprocess` and `stx tokenizer train` tokenize.

Both are read with pyarrow, batch by batch (bounded memory whatever the corpus size):
  * a Parquet file: `pyarrow.parquet.ParquetFile.iter_batches` over the one column;
  * a saved dataset (a directory with `state.json` and `dataset_info.json`): the Arrow stream files
    its `state.json` lists under `_data_files`, in that order, memory-mapped; their rows in that order
    are the dataset's rows, which is how `datasets.load_from_disk` builds the dataset from the same
    files (tests/unit/test_preprocess_columnar.py checks the rows against `load_from_disk`). Reading
    them here keeps `datasets` (and pandas, dill, multiprocess, xxhash it brings) out of what stx needs
    at run time; pyarrow, which `datasets` itself reads them with, is enough.
A directory written by `DatasetDict.save_to_disk` (`dataset_dict.json`) holds one saved dataset per
split: name the split's directory.

The text column holds a string per row, or a list of strings (a document's sentences, as a JSON
lines "text" list); a null row is a bad row. A missing column or a column of another type is an error
naming the file and what it holds, whatever --skip-bad-lines says (it is the whole file, not a row).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PreprocessError

PARQUET_SUFFIXES = frozenset({".parquet"})
ROWS_PER_BATCH = 1024


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory written by `datasets.Dataset.save_to_disk`."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def check_not_dataset_dict(path: Path) -> None:
    """A `DatasetDict.save_to_disk` directory is refused, naming its splits."""
    listing = path / "dataset_dict.json"
    if not listing.is_file():
        return
    try:
        splits = json.loads(listing.read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PreprocessError(f"{listing}: not a readable datasets DatasetDict listing: {e}") from e
    raise PreprocessError(
        f"input directory {path} holds a DatasetDict saved by datasets (splits: {', '.join(splits)}); "
        f"give the split to read, e.g. {path / str(splits[0])}"
    )


def saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a saved dataset, in the order `state.json` lists them."""
    state_path = path / "state.json"
    try:
        state = json.loads(state_path.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PreprocessError(
            f"{state_path}: not a state.json written by datasets' save_to_disk "
            f"(expected '_data_files': [{{'filename': ...}}]): {e}"
        ) from e
    if state.get("_indices_data_files"):
        raise PreprocessError(
            f"{path}: the saved dataset keeps an indices mapping (_indices_data_files); save it again after "
            "dataset.flatten_indices()"
        )
    files = [path / name for name in names]
    for f in files:
        if not f.is_file():
            raise PreprocessError(f"{path}: state.json lists {f.name}, which is missing")
    return files


def columnar_size(path: Path) -> int:
    """Bytes on disk of a Parquet file or of a saved dataset's Arrow files (for the progress bar)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in saved_dataset_files(path))
    return path.stat().st_size


@dataclass
class RowBatch:
    """Rows `first_row`.. (0-based, counted over the whole input) of the text column."""

    rows: list[Any]
    first_row: int
    text_bytes: int
    disk_position: int
    last: bool


def _pyarrow() -> Any:
    try:  # optional at run time (the parquet extra): only Parquet and saved-dataset inputs need it
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as e:
        raise PreprocessError(
            "reading Parquet files and datasets saved with save_to_disk needs the pyarrow package "
            "(pip install 'scalable-transformer[parquet]', or pip install pyarrow)"
        ) from e
    return pyarrow


def _check_column(pa: Any, schema: Any, column: str, where: str) -> None:
    if column not in schema.names:
        present = ", ".join(repr(n) for n in schema.names[:30]) or "none"
        raise PreprocessError(
            f"{where}: no column {column!r} (columns present: {present}); name the text column with "
            "--text-column (text_column / json_key)"
        )
    kind = schema.field(column).type
    text = (pa.types.is_string(kind) or pa.types.is_large_string(kind)) if kind is not None else False
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if listed:
        value = kind.value_type
        listed = pa.types.is_string(value) or pa.types.is_large_string(value)
    if not (text or listed or pa.types.is_null(kind)):
        raise PreprocessError(
            f"{where}: column {column!r} holds {kind}, expected strings (or lists of strings, a document's "
            "sentences)"
        )


def _record_batches(pa: Any, path: Path, column: str) -> Iterator[tuple[Any, float]]:
    """(record batch of the one column, fraction of the input read after it)."""
    if path.is_dir():
        files = saved_dataset_files(path)
        for i, f in enumerate(files):
            with pa.memory_map(os.fspath(f)) as source:
                reader = pa.ipc.open_stream(source)
                _check_column(pa, reader.schema, column, str(f))
                for batch in reader:
                    yield batch.select([column]), i / len(files)
        return
    parquet = pa.parquet.ParquetFile(os.fspath(path))
    _check_column(pa, parquet.schema_arrow, column, str(path))
    total, done = max(parquet.metadata.num_rows, 1), 0
    for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[column]):
        done += batch.num_rows
        yield batch, done / total


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    return 0


def _cut(rows: list[Any], block_bytes: int) -> Iterator[tuple[list[Any], int]]:
    """Runs of whole rows of about `block_bytes` bytes of text (at least one row each)."""
    start, size = 0, 0
    for i, value in enumerate(rows):
        size += _text_bytes(value)
        if size >= block_bytes:
            yield rows[start : i + 1], size
            start, size = i + 1, 0
    if start < len(rows):
        yield rows[start:], size


def iter_row_batches(path: Path, column: str, block_bytes: int) -> Iterator[RowBatch]:
    """The text column of a Parquet file or saved dataset in runs of about `block_bytes` bytes;
    always at least one (possibly empty) run, the final one marked `last`."""
    pa = _pyarrow()
    size = columnar_size(path)
    row, pending = 0, None
    try:
        for batch, fraction in _record_batches(pa, path, column):
            for rows, nbytes in _cut(batch.column(0).to_pylist(), block_bytes):
                if pending is not None:
                    yield pending
                pending = RowBatch(rows, row, nbytes, int(size * fraction), last=False)
                row += len(rows)
    except (pa.ArrowException, OSError) as e:
        what = "saved dataset" if path.is_dir() else "Parquet file"
        raise PreprocessError(f"{path}: cannot read it as a {what}: {e}") from e
    if pending is None:
        pending = RowBatch([], row, 0, size, last=False)
    pending.last, pending.disk_position = True, size
    yield pending
