"""GPT pretraining samples over a Megatron indexed dataset, with Megatron-LM's index mappings.

Legend: s = seq_length; a "document" is a range of document_indices (one sequence per document, or
several when the data was sentence-split: they are read back to back).
Three arrays, built once per (data, document range, s, seed, epochs needed) and cached as .npy:
  * doc_idx    [epochs * documents]: the documents of the range, in a fresh seeded order every epoch;
  * sample_idx [samples + 1, 2]: (position in doc_idx, token offset) where sample k starts. Sample k
               is the s + 1 tokens from there on, read across document (and epoch) boundaries;
               consecutive samples share one token (stride s), and EOD tokens are whatever the
               preprocessing put at the end of documents (`--append-eod`);
  * shuffle_idx [samples]: the order samples are served in.
Epochs are added until num_samples (what training consumes) is covered. As in Megatron, when the
last epoch is needed for less than 80% of its samples it is shuffled separately and served last,
so the earlier epochs are used in full first.

The index cache (`load_or_build_index`, used by the BERT and blended datasets as well) writes
beside the data, or into the user cache directory when the data directory is read-only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from scalable_transformer.cache import cache_dir
from scalable_transformer.errors import IndexedDatasetError
from scalable_transformer.files import atomic_output
from scalable_transformer.models.spec import IGNORE_INDEX

if TYPE_CHECKING:
    from scalable_transformer.data.indexed import IndexedDataset

# Bump when the content of any cached index mapping changes for the same description.
INDEX_CACHE_VERSION = 1
# Sub-streams of the seed, so that no two uses of one seed draw the same numbers.
_DOC_STREAM, _SHUFFLE_STREAM = 11, 12
# Megatron: a final epoch used for less than this share of its samples is shuffled separately.
_SEPARATE_FINAL_EPOCH_BELOW = 0.80
_MMAP_ABOVE_BYTES = 1 << 20


# ---------------------------------------------------------------- index cache


def _save_npy(path: Path, array: np.ndarray) -> None:
    """np.save, atomically: a reader never sees a partial file."""
    with atomic_output(path) as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)


def _load_npy(path: Path) -> np.ndarray:
    # Large mappings are memory-mapped (shared by the page cache between ranks and workers); small
    # ones are read, which also avoids mmap's refusal of zero-length arrays.
    if path.stat().st_size > _MMAP_ABOVE_BYTES:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    return np.load(path, allow_pickle=False)


def _save_all(directory: Path, stem: str, arrays: dict[str, np.ndarray], description: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        _save_npy(directory / f"{stem}.{name}.npy", array)
    # Last, and for people only: what the hash in the file names stands for.
    (directory / f"{stem}.json").write_text(description + "\n", encoding="utf-8")


def index_cache_dirs(prefix: str | None) -> list[Path]:
    """Where index mappings are looked for and written, in order: beside the data, then the user
    cache directory."""
    dirs = [Path(prefix).expanduser().absolute().parent] if prefix else []
    return [*dirs, cache_dir() / "index-cache"]


def load_or_build_index(
    prefix: str | None,
    kind: str,
    description: dict[str, Any],
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], Path | None, bool]:
    """Index arrays `names` for `description`, loaded (memory-mapped) from the cache or built and saved.

    Files are `<prefix name>.<kind>-<hash of description>.<name>.npy`; each appears atomically and
    their content is a pure function of the description, so ranks building concurrently are safe.
    Returns (arrays, the path of the files without `.<name>.npy` or None if nothing could be
    written, whether they came from the cache).
    """
    text = json.dumps({"cache_version": INDEX_CACHE_VERSION, "kind": kind, **description}, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    stem = f"{Path(prefix).name if prefix else 'data'}.{kind}-{digest}"
    dirs = index_cache_dirs(prefix)
    for directory in dirs:
        paths = [directory / f"{stem}.{name}.npy" for name in names]
        if all(p.is_file() for p in paths):
            try:
                arrays = {n: _load_npy(p) for n, p in zip(names, paths, strict=True)}
                return arrays, directory / stem, True
            except (OSError, ValueError):
                pass  # truncated or foreign file: rebuild and overwrite
    arrays = build()
    for directory in dirs:
        try:
            _save_all(directory, stem, arrays, json.dumps(json.loads(text), indent=2, sort_keys=True))
        except OSError:  # read-only data directory: try the next place
            continue
        return arrays, directory / stem, False
    return arrays, None, False


class CachedIndexMixin:
    """Pickles a dataset without its index arrays when they are cached on disk, and maps them again
    on unpickling: DataLoader workers started by spawn/forkserver then share the page cache instead
    of receiving a copy of every mapping (the indexed dataset pickles as its prefix likewise)."""

    INDEX_NAMES: tuple[str, ...] = ()
    cache_path: Path | None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.cache_path is not None:
            for name in self.INDEX_NAMES:
                del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.cache_path is not None:
            for name in self.INDEX_NAMES:
                setattr(self, name, _load_npy(Path(f"{self.cache_path}.{name}.npy")))


def data_identity(indexed: IndexedDataset) -> dict[str, Any]:
    """What identifies an indexed dataset in cache keys: its absolute prefix and its sizes (so a
    dataset preprocessed again under the same name does not reuse stale mappings)."""
    return {
        "prefix": str(Path(indexed.path_prefix).expanduser().absolute()),
        "num_sequences": len(indexed),
        "num_documents": int(indexed.num_documents),
        "num_tokens": int(indexed.num_tokens),
    }


def document_range(indexed: IndexedDataset, documents: tuple[int, int] | None) -> tuple[int, int]:
    """`documents` checked against the dataset (None = all documents)."""
    n = int(indexed.num_documents)
    begin, end = (0, n) if documents is None else (int(documents[0]), int(documents[1]))
    if not 0 <= begin <= end <= n:
        raise ValueError(
            f"document range [{begin}, {end}) is outside the {n} documents of {indexed.path_prefix}"
        )
    return begin, end


def document_lengths(indexed: IndexedDataset, begin: int, end: int) -> np.ndarray:
    """Tokens of documents [begin, end), int64 (sum of the lengths of their sequences)."""
    bounds = np.asarray(indexed.document_indices[begin : end + 1], dtype=np.int64)
    seq_lengths = indexed.sequence_lengths
    if end == begin:
        return np.zeros(0, dtype=np.int64)
    cumulative = np.zeros(bounds[-1] - bounds[0] + 1, dtype=np.int64)
    np.cumsum(seq_lengths[bounds[0] : bounds[-1]], dtype=np.int64, out=cumulative[1:])
    rel = bounds - bounds[0]
    return cumulative[rel[1:]] - cumulative[rel[:-1]]


class DocumentReader:
    """Token slices of documents of an indexed dataset, across the sequences they consist of."""

    def __init__(self, indexed: IndexedDataset) -> None:
        self.indexed = indexed  # only this: it pickles as its prefix, its arrays would be copied

    def read(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document `doc` (to its end when length is None)."""
        bounds = self.indexed.document_indices
        s0, s1 = int(bounds[doc]), int(bounds[doc + 1])
        if s1 - s0 == 1:
            return self.indexed.get(s0, offset, length)
        parts: list[np.ndarray] = []
        remaining = length
        for seq in range(s0, s1):
            n = int(self.indexed.sequence_lengths[seq])
            if offset >= n:
                offset -= n
                continue
            take = n - offset if remaining is None else min(n - offset, remaining)
            if take > 0:
                parts.append(self.indexed.get(seq, offset, take))
            offset = 0
            if remaining is not None:
                remaining -= take
                if remaining == 0:
                    break
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.indexed.dtype)


# ---------------------------------------------------------------- GPT


def plan_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> tuple[int, int, int]:
    """(epochs, samples, samples shuffled in the first group) for `num_samples` windows of
    seq_length + 1 tokens (None = one epoch): epochs until the last requested sample's tokens
    are there, as Megatron counts; the second group is a final epoch used for less than 80% of its
    samples, shuffled on its own and served last."""
    if tokens_per_epoch == 0:
        return 0, 0, 0
    num_epochs = 1 if num_samples is None else max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    first_group = total
    if num_epochs > 1 and num_samples is not None:
        before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        if num_samples - before_final < int(_SEPARATE_FINAL_EPOCH_BELOW * per_epoch):
            first_group = before_final
    return num_epochs, total, first_group


def build_gpt_indices(
    lengths: np.ndarray, first_doc: int, seq_length: int, seed: int, num_epochs: int, first_group: int
) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx (see the module docstring) over `num_epochs` epochs of
    documents first_doc, first_doc + 1, ... of `lengths` tokens each."""
    num_docs = len(lengths)
    total = (num_epochs * int(lengths.sum()) - 1) // seq_length if num_epochs else 0
    if total <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return {"doc_idx": empty, "sample_idx": np.zeros((1, 2), dtype=np.int64), "shuffle_idx": empty}
    # Every epoch is a permutation of its own: each document once per epoch.
    doc_dtype = np.int32 if first_doc + num_docs < 2**31 else np.int64
    epochs = [np.random.default_rng([seed, _DOC_STREAM, e]).permutation(num_docs) for e in range(num_epochs)]
    doc_idx = (first_doc + np.concatenate(epochs)).astype(doc_dtype)
    # Sample k starts at token k * s of the flattened doc_idx stream: find its document and offset.
    ends = np.cumsum(lengths[doc_idx - first_doc], dtype=np.int64)
    starts = np.arange(total + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[doc_idx[position] - first_doc])
    sample_idx = np.stack([position, offset], axis=1).astype(np.int64)

    rng = np.random.default_rng([seed, _SHUFFLE_STREAM])
    shuffle_dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_idx = np.concatenate(
        [rng.permutation(first_group), first_group + rng.permutation(total - first_group)]
    ).astype(shuffle_dtype)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _build_or_explain(
    lengths: np.ndarray, first_doc: int, seq_length: int, seed: int, num_epochs: int, first_group: int
) -> dict[str, np.ndarray]:
    """build_gpt_indices, with numpy's out-of-memory traceback turned into what to change."""
    try:
        return build_gpt_indices(lengths, first_doc, seq_length, seed, num_epochs, first_group)
    except MemoryError:
        raise IndexedDatasetError(
            f"the GPT sample index ({num_epochs:,} epochs of {len(lengths):,} documents) does not fit in "
            "memory: lower train.micro_batch_size, train.global_batch_size or train.train_iters"
        ) from None


class GPTDataset(CachedIndexMixin, Dataset):
    """Map-style GPT dataset over documents [begin, end) of an indexed dataset (s = seq_length).

    Item i is {"input_ids": [s], "labels": [s]} (LongTensors), labels being the input shifted left
    by one token. len() is every sample of the epochs built, at least `num_samples`
    (None = one epoch). With `eod_id` (packed documents, their ends marked by that token):
    `documents` adds "document_ids" [s], each token's document within the sample (0, 1, ...: a
    document starts after each end-of-document token), and `mask_eod_loss` sets the label of every
    position whose input is that token to -100 (no loss predicting across a document's end).
    """

    INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_length: int,
        seed: int,
        num_samples: int | None = None,
        documents: tuple[int, int] | None = None,
        eod_id: int | None = None,
        document_ids: bool = False,
        mask_eod_loss: bool = False,
    ) -> None:
        if (document_ids or mask_eod_loss) and eod_id is None:
            raise ValueError("document ids and the end-of-document loss mask need the tokenizer's eod_id")
        self.eod_id, self.document_ids, self.mask_eod_loss = eod_id, document_ids, mask_eod_loss
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be non-negative, got {num_samples}")
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed
        self.documents = document_range(indexed, documents)
        begin, end = self.documents
        self.num_samples = num_samples
        lengths = document_lengths(indexed, begin, end)
        self.tokens_per_epoch = int(lengths.sum())
        num_epochs, _, first_group = plan_epochs(self.tokens_per_epoch, seq_length, num_samples)
        # Keyed by the epochs the request needs, not by the request: runs of different lengths
        # share a mapping whenever they need the same epochs.
        self.description = {
            **data_identity(indexed),
            "documents": [begin, end],
            "seq_length": seq_length,
            "seed": seed,
            "num_epochs": num_epochs,
            "first_shuffle_group": first_group,
        }
        arrays, self.cache_path, self.cache_hit = load_or_build_index(
            indexed.path_prefix,
            "gpt",
            self.description,
            self.INDEX_NAMES,
            lambda: _build_or_explain(lengths, begin, seq_length, seed, num_epochs, first_group),
        )
        self.doc_idx, self.sample_idx = arrays["doc_idx"], arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        self._reader = DocumentReader(indexed)

    @property
    def num_epochs(self) -> int:
        """Passes over the document range that the samples are cut from."""
        n = self.documents[1] - self.documents[0]
        return len(self.doc_idx) // n if n else 0

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def tokens(self, idx: int) -> np.ndarray:
        """The s + 1 tokens of sample `idx` (int64)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        k = int(self.shuffle_idx[idx])
        (d0, o0), (d1, o1) = self.sample_idx[k], self.sample_idx[k + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        doc_idx, read = self.doc_idx, self._reader.read
        if d0 == d1:
            parts = [read(int(doc_idx[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [read(int(doc_idx[d0]), o0)]
            parts += [read(int(doc_idx[d])) for d in range(d0 + 1, d1)]
            parts.append(read(int(doc_idx[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(self.tokens(idx))
        item = {"input_ids": window[:-1], "labels": window[1:]}
        if self.eod_id is not None:  # set when documents or the loss mask are asked for
            ends = item["input_ids"].eq(self.eod_id)
            if self.mask_eod_loss:
                item["labels"] = item["labels"].masked_fill(ends, IGNORE_INDEX)
            if self.document_ids:
                # the token after an end-of-document token starts the next document
                item["document_ids"] = torch.cumsum(ends, 0) - ends.to(torch.int64)
        return item
