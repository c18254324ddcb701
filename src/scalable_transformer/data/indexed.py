"""Megatron's mmap indexed dataset: token sequences in PREFIX.bin, their layout in PREFIX.idx.

Byte-compatible with Megatron-LM's `MMapIndexedDataset` / megatron.core `IndexedDataset` and
GPT-NeoX's `MMapIndexedDataset`, so datasets built by those tools load here and ours load there.

PREFIX.bin: the tokens of every sequence, back to back, little-endian, in the dtype of the header.
PREFIX.idx, all integers little-endian:

    offset  size   field
    0       9      magic b"MMIDIDX\\x00\\x00"
    9       8      version, u64 = 1
    17      1      dtype code, u8 (DTYPE_CODES)
    18      8      S = number of sequences, u64
    26      8      D = number of document indices, u64 (= documents + 1: the list starts with 0)
    34      4*S    sequence lengths in tokens, int32
    34+4S   8*S    sequence pointers: byte offset of each sequence in .bin, int64
    34+12S  8*D    document indices: document k is sequences [doc[k], doc[k+1]), int64
   (34+12S+8D  S   optional: one int8 "mode" per sequence, written by multimodal Megatron; ignored)

A sequence is what one `add_item` call wrote (a sentence for BERT, a whole document for GPT);
a document groups consecutive sequences. Opening a dataset checks every size and offset before
anything is memory-mapped, so a truncated or inconsistent file raises IndexedDatasetError naming
the file and the position instead of crashing or returning garbage.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import IndexedDatasetError
from ..files import publish, temporary_beside

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8

# Codes of megatron.core.datasets.indexed_dataset.DType. Legacy Megatron/fairseq files disagree on 6
# and 7 (both float64 there); tokens are never floats, so only 1-5 and 8 occur in practice.
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}

# Validation walks the index in blocks of this many entries, so opening a dataset with billions of
# sequences needs a bounded amount of memory.
_BLOCK = 1 << 22


def best_dtype(vocab_size: int | None) -> np.dtype[Any]:
    """Token dtype for a vocabulary: uint16 below 65500 ids, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike[str]) -> str:
    return os.fspath(prefix) + ".bin"


def idx_path(prefix: str | os.PathLike[str]) -> str:
    return os.fspath(prefix) + ".idx"


def _dtype_code(dtype: npt.DTypeLike) -> int:
    dt = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():
        if (known.kind, known.itemsize) == (dt.kind, dt.itemsize):
            return code
    names = ", ".join(str(d) for d in DTYPE_CODES.values())
    raise ValueError(f"dtype {dt} cannot be stored in an indexed dataset (one of: {names})")


def _temp_beside(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return temporary_beside(path)


class IndexedDatasetBuilder:
    """Writes PREFIX.bin and PREFIX.idx.

    Tokens go to a temporary file beside `bin_path` as they arrive; `finalize(idx_path)` writes the
    index to another temporary file and renames the .bin, then the .idx, into place. Until then
    nothing exists under the final names, and a builder left by an exception (use it as a context
    manager, or call `abort()`) removes its temporary files. The index metadata is kept in memory:
    12 bytes per sequence and 8 per document.
    """

    def __init__(self, bin_path: str | os.PathLike[str], dtype: npt.DTypeLike = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        self._disk_dtype = self.dtype.newbyteorder("<")
        self.bin_path = Path(bin_path)
        self._tmp_bin: Path | None = _temp_beside(self.bin_path)
        self._tmp_idx: Path | None = None
        self._file = self._tmp_bin.open("wb")
        self._lengths = array("i")  # int32 per sequence, as the .idx stores them
        self._doc_indices = array("q", [0])
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._finalized = False

    # -- writing --------------------------------------------------------------------------------

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"add_item takes a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.dtype == self.dtype or arr.size == 0:
            return arr.astype(self._disk_dtype, copy=False)
        if self._info is not None:
            if arr.dtype.kind not in "iub":
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._info.min or hi > self._info.max:
                raise ValueError(
                    f"token id {hi if hi > self._info.max else lo} does not fit the dataset dtype "
                    f"{self.dtype} ({self._info.min}..{self._info.max}); build with a wider dtype"
                )
        return arr.astype(self._disk_dtype)

    def add_item(self, tokens: Any) -> None:
        """Append one sequence (a sentence or a whole document) of token ids."""
        arr = self._as_tokens(tokens)
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {arr.size} tokens exceeds the format's int32 length")
        self._file.write(arr.tobytes())
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the previous call form one document."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Any, lengths: Iterable[int]) -> None:
        """Append one document whose tokens are already concatenated: `lengths` sequences, in order."""
        arr = self._as_tokens(tokens)
        lens = array("i", lengths)
        if sum(lens) != arr.size or any(n < 0 for n in lens):
            raise ValueError(f"sequence lengths {list(lens)[:8]}... do not add up to {arr.size} tokens")
        self._file.write(arr.tobytes())
        self._lengths.extend(lens)
        self._doc_indices.append(len(self._lengths))

    def _add_documents(
        self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray
    ) -> None:
        """Bulk `add_document` for trusted input (preprocess): tokens already in the dataset dtype."""
        self._file.write(tokens.astype(self._disk_dtype, copy=False).tobytes())
        start = len(self._lengths)
        self._lengths.frombytes(lengths.astype(np.int32, copy=False).tobytes())
        ends = start + np.cumsum(sequences_per_document, dtype=np.int64)
        self._doc_indices.frombytes(ends.tobytes())

    def add_index(self, other_prefix: str | os.PathLike[str]) -> None:
        """Append every sequence and document of the dataset at `other_prefix` (shard merging)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {other_prefix}: its dtype is {other.dtype}, this builder writes {self.dtype}"
            )
        offset = len(self._lengths)
        self._lengths.frombytes(np.ascontiguousarray(other.sequence_lengths, dtype=np.int32).tobytes())
        docs = other.document_indices[1:].astype(np.int64) + offset
        self._doc_indices.frombytes(docs.tobytes())
        del other
        with open(bin_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, 16 << 20)

    # -- finishing ------------------------------------------------------------------------------

    def finalize(self, idx_path: str | os.PathLike[str]) -> None:
        """Write the index and move both files to their final names.

        Sequences added after the last `end_document()` form a final document (Megatron's reader
        requires the last document index to equal the number of sequences).
        """
        if self._finalized or self._tmp_bin is None:
            raise RuntimeError("IndexedDatasetBuilder.finalize called twice or after abort")
        if self._doc_indices[-1] != len(self._lengths):
            self.end_document()
        final_idx = Path(idx_path)
        try:
            self._file.close()
            self._tmp_idx = _temp_beside(final_idx)
            lengths = np.frombuffer(self._lengths, dtype=np.int32)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            if len(lengths) > 1:
                np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            with self._tmp_idx.open("wb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<Q", VERSION))
                f.write(struct.pack("<B", self._code))
                f.write(struct.pack("<Q", len(lengths)))
                f.write(struct.pack("<Q", len(self._doc_indices)))
                f.write(lengths.astype("<i4", copy=False).tobytes())
                f.write(pointers.astype("<i8", copy=False).tobytes())
                f.write(np.frombuffer(self._doc_indices, dtype=np.int64).astype("<i8", copy=False).tobytes())
            # .bin first: once the .idx exists under its final name, its .bin is complete.
            publish(self._tmp_bin, self.bin_path)
            self._tmp_bin = None
            publish(self._tmp_idx, final_idx)
            self._tmp_idx = None
            self._finalized = True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard everything written so far (temporary files included). Safe to call twice."""
        if not self._file.closed:
            self._file.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        self._tmp_bin = self._tmp_idx = None

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving the block without finalize() (an exception, or a forgotten call) discards the build.
        if not self._finalized:
            self.abort()

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._doc_indices) - 1


class IndexedDataset:
    """A Megatron mmap indexed dataset opened read-only: `ds[i]` is sequence i as a numpy array.

    Arrays returned are read-only views into the memory-mapped .bin (no copy). Pickling keeps only
    the prefix; unpickling (e.g. in a DataLoader worker) maps the files again.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self._open(os.fspath(prefix), validate=True)

    def _open(self, prefix: str, validate: bool) -> None:
        self.path_prefix = prefix
        self._idx_file, self._bin_file = idx_path(prefix), bin_path(prefix)
        for path, what in ((self._idx_file, "index"), (self._bin_file, "data")):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"indexed dataset {prefix!r}: {what} file {path} not found "
                    "(a dataset is PREFIX.bin + PREFIX.idx; give the prefix without the suffix)"
                )
        idx_size = os.path.getsize(self._idx_file)
        with open(self._idx_file, "rb") as f:
            header = f.read(HEADER_BYTES)
        name = self._idx_file
        if len(header) < HEADER_BYTES:
            raise IndexedDatasetError(
                f"{name}: truncated header: the file is {len(header)} bytes, the header alone is "
                f"{HEADER_BYTES} bytes (magic, version, dtype code, sequence and document counts)"
            )
        if header[:9] != MAGIC:
            raise IndexedDatasetError(
                f"{name}: bad magic at byte 0: {header[:9]!r}, expected {MAGIC!r} (Megatron mmap "
                "indexed dataset); is it a legacy 'cached'/'lazy' dataset (magic TNTIDX) or not an index?"
            )
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != VERSION:
            raise IndexedDatasetError(f"{name}: unsupported version {version} at byte 9, expected {VERSION}")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{name}: unknown dtype code {code} at byte 17, expected one of {sorted(DTYPE_CODES)}"
            )
        self.dtype: np.dtype[Any] = DTYPE_CODES[code]
        n_seq, n_doc = struct.unpack_from("<QQ", header, 18)
        if n_doc < 1:
            raise IndexedDatasetError(
                f"{name}: document index count {n_doc} at byte 26, expected at least 1 (the leading 0)"
            )
        lengths_at = HEADER_BYTES
        pointers_at = lengths_at + 4 * n_seq
        docs_at = pointers_at + 8 * n_seq
        end = docs_at + 8 * n_doc
        if idx_size < end:
            raise IndexedDatasetError(
                f"{name}: truncated: the file is {idx_size} bytes, but its header ({n_seq} sequences, "
                f"{n_doc} document indices) needs {end} bytes"
            )
        if idx_size not in (end, end + n_seq):  # + n_seq: multimodal Megatron's int8 mode per sequence
            raise IndexedDatasetError(
                f"{name}: the file is {idx_size} bytes, expected {end} for {n_seq} sequences and "
                f"{n_doc} document indices ({idx_size - end} unexpected trailing bytes)"
            )
        self._idx_mmap = np.memmap(self._idx_file, dtype=np.uint8, mode="r")
        self.sequence_lengths: np.ndarray = self._idx_mmap[lengths_at:pointers_at].view("<i4")
        """Tokens in each sequence, int32 (read-only view of the .idx)."""
        self.sequence_pointers: np.ndarray = self._idx_mmap[pointers_at:docs_at].view("<i8")
        """Byte offset of each sequence in the .bin, int64."""
        self.document_indices: np.ndarray = self._idx_mmap[docs_at:end].view("<i8")
        """Document k is sequences [document_indices[k], document_indices[k+1]); starts with 0."""
        self._itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(self._bin_file)
        if validate:
            self.num_tokens = self._validate(bin_size)
        else:
            self.num_tokens = bin_size // self._itemsize
        if bin_size != self.num_tokens * self._itemsize:
            raise IndexedDatasetError(
                f"{self._bin_file}: the file is {bin_size} bytes, but {name} describes "
                f"{self.num_tokens} tokens of {self.dtype} = {self.num_tokens * self._itemsize} bytes"
            )
        disk = self.dtype.newbyteorder("<")
        if bin_size == 0:  # mmap cannot map an empty file
            self._tokens: np.ndarray = np.empty(0, dtype=disk)
            self._bin_mmap: np.memmap | None = None
        else:
            self._bin_mmap = np.memmap(self._bin_file, dtype=disk, mode="r")
            self._tokens = self._bin_mmap.view(np.ndarray)
        self._token_range: tuple[int, int] | None = None

    def _validate(self, bin_size: int) -> int:
        """Check lengths, pointers and document indices block by block; return the token count."""
        name = self._idx_file
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        n_seq = len(lengths)
        expected_ptr = 0
        for start in range(0, n_seq, _BLOCK):
            block = lengths[start : start + _BLOCK].astype(np.int64)
            if (bad := np.flatnonzero(block < 0)).size:
                i = start + int(bad[0])
                raise IndexedDatasetError(
                    f"{name}: sequence {i} has negative length {int(lengths[i])} "
                    f"(at byte {HEADER_BYTES + 4 * i})"
                )
            expected = expected_ptr + np.concatenate(([0], np.cumsum(block[:-1]))) * self._itemsize
            if (bad := np.flatnonzero(pointers[start : start + _BLOCK] != expected)).size:
                i = start + int(bad[0])
                raise IndexedDatasetError(
                    f"{name}: sequence {i}: pointer {int(pointers[i])} at byte "
                    f"{HEADER_BYTES + 4 * n_seq + 8 * i} is inconsistent with the lengths, expected "
                    f"{int(expected[bad[0]])} (previous pointer + previous length * {self._itemsize} bytes)"
                )
            expected_ptr = int(expected[-1]) + int(block[-1]) * self._itemsize
        docs_at = HEADER_BYTES + 12 * n_seq
        if docs[0] != 0:
            raise IndexedDatasetError(
                f"{name}: document index 0 is {int(docs[0])} at byte {docs_at}, expected 0"
            )
        for start in range(0, len(docs) - 1, _BLOCK):
            block = docs[start : start + _BLOCK + 1]
            if (bad := np.flatnonzero(np.diff(block) < 0)).size:
                k = start + int(bad[0])
                raise IndexedDatasetError(
                    f"{name}: document {k} ends before it starts: document indices {int(docs[k])} then "
                    f"{int(docs[k + 1])} at byte {docs_at + 8 * (k + 1)} (must not decrease)"
                )
        if docs[-1] != n_seq:
            k = len(docs) - 1
            raise IndexedDatasetError(
                f"{name}: last document index is {int(docs[-1])} at byte {docs_at + 8 * k}, expected "
                f"{n_seq} (the number of sequences)"
            )
        tokens = expected_ptr // self._itemsize
        if bin_size != expected_ptr:
            raise IndexedDatasetError(
                f"{self._bin_file}: the file is {bin_size} bytes, but {name} describes {tokens} tokens "
                f"of {self.dtype} = {expected_ptr} bytes"
            )
        return tokens

    # -- reading --------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def _index(self, i: int) -> int:
        n = len(self.sequence_lengths)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} ({n} sequences)")
        return j

    def __getitem__(self, i: int | slice) -> Any:
        """Sequence i (numpy array of the dataset dtype), or a list of arrays for a step-1 slice."""
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("slices of an indexed dataset must be contiguous (step 1)")
            return [self[j] for j in range(start, stop)]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        j = self._index(i)
        size = int(self.sequence_lengths[j])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of "
                f"{self.path_prefix} ({size} tokens)"
            )
        start = int(self.sequence_pointers[j]) // self._itemsize + offset
        return self._tokens[start : start + length]

    def document(self, k: int) -> list[np.ndarray]:
        """The sequences of document k."""
        n = self.num_documents
        if not -n <= k < n:
            raise IndexError(f"document {k} out of range for {self.path_prefix} ({n} documents)")
        k %= n
        return [self.get(j) for j in range(int(self.document_indices[k]), int(self.document_indices[k + 1]))]

    def _scan_range(self) -> tuple[int, int]:
        if self._token_range is None:
            lo, hi = 0, -1
            if self.num_tokens:
                step = 1 << 24
                mins, maxs = [], []
                for s in range(0, self.num_tokens, step):
                    block = self._tokens[s : s + step]
                    mins.append(int(block.min()))
                    maxs.append(int(block.max()))
                lo, hi = min(mins), max(maxs)
            self._token_range = (lo, hi)
        return self._token_range

    def max_token_id(self) -> int:
        """Largest token id in the .bin (-1 when empty). Scans the whole file once, then cached."""
        return self._scan_range()[1]

    def min_token_id(self) -> int:
        """Smallest token id in the .bin (0 when empty); cached with max_token_id."""
        return self._scan_range()[0]

    def __getstate__(self) -> dict[str, Any]:
        return {"path_prefix": self.path_prefix, "token_range": self._token_range}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Validated when first opened; a worker re-maps without re-scanning the index.
        self._open(state["path_prefix"], validate=False)
        self._token_range = state["token_range"]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )


def check_vocab(ds: IndexedDataset, vocab_size: int, name: str | None = None) -> None:
    """Raise IndexedDatasetError if a token id of `ds` is negative or >= `vocab_size`."""
    label = name or ds.path_prefix
    hi, lo = ds.max_token_id(), ds.min_token_id()
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise IndexedDatasetError(
            f"dataset {label} ({ds.path_prefix}) holds token id {bad} (ids found: {lo}..{hi}), but the "
            f"model's vocab size is {vocab_size} (ids 0..{vocab_size - 1}); was it preprocessed with "
            "another tokenizer, or is model.vocab_size too small?"
        )
