"""Megatron mmap indexed dataset: writer/reader round trip, the byte layout, and every bad file."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from scalable_transformer.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
    check_vocab,
)


def _random_documents(rng: np.random.Generator, high: int) -> list[list[np.ndarray]]:
    """Documents of 0..4 sequences of 0..40 tokens, plus an empty document, a document holding
    only an empty sequence and a very long one."""
    docs = [
        [rng.integers(0, high, rng.integers(0, 40)) for _ in range(rng.integers(0, 5))] for _ in range(60)
    ]
    docs.insert(3, [])
    docs.insert(7, [np.array([], dtype=np.int64)])
    docs.insert(20, [rng.integers(0, high, 5), rng.integers(0, high, 300_000), rng.integers(0, high, 2)])
    docs.append([np.array([high - 1, 0])])  # the extreme ids
    return docs


def _build(prefix: Path, docs: list[list[np.ndarray]], dtype: np.dtype) -> None:
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype) as builder:
        for doc in docs:
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()
        builder.finalize(f"{prefix}.idx")


def _hand_idx(dtype_code: int, lengths: list[int], docs: list[int], itemsize: int) -> bytes:
    """An .idx laid out from the format description, field by field (not with our writer)."""
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    out = b"MMIDIDX\x00\x00"  # magic, 9 bytes
    out += struct.pack("<Q", 1)  # version
    out += struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths))  # sequence count
    out += struct.pack("<Q", len(docs))  # document index count (documents + 1)
    out += struct.pack(f"<{len(lengths)}i", *lengths)
    out += struct.pack(f"<{len(pointers)}q", *pointers)
    out += struct.pack(f"<{len(docs)}q", *docs)
    return out


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_random_documents(tmp_path, dtype):
    rng = np.random.default_rng(0)
    high = 65_000 if dtype == np.uint16 else 2**31 - 1
    docs = _random_documents(rng, high)
    _build(tmp_path / "ds", docs, np.dtype(dtype))
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]  # no temporary file left

    ds = IndexedDataset(tmp_path / "ds")
    seqs = [s for doc in docs for s in doc]
    assert len(ds) == len(seqs) and ds.num_documents == len(docs)
    assert ds.dtype == np.dtype(dtype) and ds.sequence_lengths.dtype == np.int32
    assert ds.num_tokens == sum(len(s) for s in seqs)
    np.testing.assert_array_equal(ds.document_indices, np.cumsum([0] + [len(d) for d in docs]))
    np.testing.assert_array_equal(ds.sequence_lengths, [len(s) for s in seqs])
    itemsize = np.dtype(dtype).itemsize
    np.testing.assert_array_equal(
        ds.sequence_pointers, np.cumsum([0] + [len(s) * itemsize for s in seqs[:-1]])
    )
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
        assert ds[i].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ds[-1], seqs[-1])
    long = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    np.testing.assert_array_equal(ds.get(long, 1000, 7), seqs[long][1000:1007])
    np.testing.assert_array_equal(ds.get(long, 299_990), seqs[long][299_990:])
    for k, doc in enumerate(docs[:25]):
        got = ds.document(k)
        assert len(got) == len(doc) and all(np.array_equal(a, b) for a, b in zip(got, doc, strict=True))
    assert ds.max_token_id() == high - 1 and ds.min_token_id() == 0
    assert [list(x) for x in ds[2:5]] == [list(s) for s in seqs[2:5]]
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[long], seqs[long])
    with pytest.raises(IndexError):
        ds[len(seqs)]
    with pytest.raises(IndexError):
        ds.get(long, 299_999, 5)


def test_best_dtype_and_codes():
    assert best_dtype(30_522) == np.uint16 and best_dtype(65_499) == np.uint16
    assert best_dtype(65_500) == np.int32 and best_dtype(50_257) == np.uint16 and best_dtype(None) == np.int32
    expected = {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }
    assert {c: str(d) for c, d in DTYPE_CODES.items()} == expected


def test_hand_built_index_is_read_and_matches_our_writer(tmp_path):
    # Three documents: [a, b], [] (no sequence), [c] where b is an empty sequence.
    lengths, docs = [3, 0, 4], [0, 2, 2, 3]
    tokens = [7, 8, 9, 65_535, 0, 1, 2]
    idx = _hand_idx(8, lengths, docs, itemsize=2)
    assert len(idx) == 34 + 3 * 4 + 3 * 8 + 4 * 8  # header + lengths + pointers + document indices
    (tmp_path / "hand.idx").write_bytes(idx)
    (tmp_path / "hand.bin").write_bytes(struct.pack("<7H", *tokens))

    ds = IndexedDataset(tmp_path / "hand")
    assert len(ds) == 3 and ds.num_documents == 3 and ds.dtype == np.uint16 and ds.num_tokens == 7
    assert [list(ds[i]) for i in range(3)] == [[7, 8, 9], [], [65_535, 0, 1, 2]]
    assert list(ds.document_indices) == docs and list(ds.sequence_pointers) == [0, 6, 6]
    assert ds.max_token_id() == 65_535

    with IndexedDatasetBuilder(tmp_path / "ours.bin", np.uint16) as b:
        b.add_item([7, 8, 9])
        b.add_item([])
        b.end_document()
        b.end_document()
        b.add_item(np.array([65_535, 0, 1, 2]))
        b.end_document()
        b.finalize(tmp_path / "ours.idx")
    assert (tmp_path / "ours.idx").read_bytes() == idx
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "hand.bin").read_bytes()


def test_int32_hand_built_and_multimodal_modes_tolerated(tmp_path):
    idx = _hand_idx(4, [2], [0, 1], itemsize=4) + b"\x00"  # + one int8 mode per sequence
    (tmp_path / "m.idx").write_bytes(idx)
    (tmp_path / "m.bin").write_bytes(struct.pack("<2i", 100_000, 5))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and list(ds[0]) == [100_000, 5]


def test_add_index_merges_shards(tmp_path):
    rng = np.random.default_rng(1)
    docs = _random_documents(rng, 1000)[:30]
    _build(tmp_path / "all", docs, np.dtype(np.uint16))
    _build(tmp_path / "a", docs[:12], np.dtype(np.uint16))
    _build(tmp_path / "b", docs[12:], np.dtype(np.uint16))
    with IndexedDatasetBuilder(tmp_path / "merged.bin", np.uint16) as builder:
        builder.add_index(tmp_path / "a")
        builder.add_index(str(tmp_path / "b"))
        builder.finalize(tmp_path / "merged.idx")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"all{suffix}").read_bytes()
    with (
        IndexedDatasetBuilder(tmp_path / "wide.bin", np.int32) as builder,
        pytest.raises(IndexedDatasetError),
    ):
        builder.add_index(tmp_path / "a")


def test_nothing_under_final_names_until_finalize(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "ds.bin", np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    assert not (tmp_path / "ds.bin").exists() and len(os.listdir(tmp_path)) == 1  # the temporary .bin
    builder.finalize(tmp_path / "ds.idx")
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    with pytest.raises(RuntimeError):
        builder.finalize(tmp_path / "ds.idx")


def test_exception_inside_builder_leaves_no_file(tmp_path):
    with pytest.raises(KeyboardInterrupt), IndexedDatasetBuilder(tmp_path / "ds.bin", np.uint16) as builder:
        builder.add_item([1, 2])
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    with IndexedDatasetBuilder(tmp_path / "ds.bin", np.uint16) as builder:
        builder.add_item([1, 2])  # no finalize: discarded
    assert os.listdir(tmp_path) == []


def test_unterminated_last_document_is_closed(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds.bin", np.uint16) as builder:
        builder.add_item([1])
        builder.end_document()
        builder.add_item([2])
        builder.add_item([3])
        builder.finalize(tmp_path / "ds.idx")
    assert list(IndexedDataset(tmp_path / "ds").document_indices) == [0, 1, 3]


def test_builder_rejects_ids_outside_the_dtype(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds.bin", np.uint16) as builder:
        with pytest.raises(ValueError, match="70000"):
            builder.add_item([1, 70_000])
        with pytest.raises(ValueError, match="-1"):
            builder.add_item([-1])
        with pytest.raises(ValueError, match="1-D"):
            builder.add_item([[1, 2]])
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(tmp_path / "x.bin", np.uint32)


# -- bad files ----------------------------------------------------------------------------------


def _good(tmp_path: Path) -> Path:
    """ds: 3 sequences of lengths 3, 0, 4 in documents [0, 2, 3], uint16."""
    (tmp_path / "ds.idx").write_bytes(_hand_idx(8, [3, 0, 4], [0, 2, 3], itemsize=2))
    (tmp_path / "ds.bin").write_bytes(struct.pack("<7H", *range(7)))
    IndexedDataset(tmp_path / "ds")  # sanity: the unmodified files are fine
    return tmp_path / "ds"


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


# Offsets in the good .idx: lengths at 34, pointers at 46, document indices at 70, end at 94.
BAD_CASES = {
    "truncated header": (
        lambda p: p.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00\x01"),
        r"truncated header",
    ),
    "truncated arrays": (
        lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:-1]),
        r"93 bytes.*3 sequences, 3 document indices.*needs 94 bytes",
    ),
    "trailing bytes": (
        lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes() + b"\x00" * 5),
        r"expected 94",
    ),
    "bad magic": (lambda p: _patch(p.with_suffix(".idx"), 0, b"TNTIDX\x00\x00"), r"bad magic at byte 0"),
    "bad version": (lambda p: _patch(p.with_suffix(".idx"), 9, struct.pack("<Q", 2)), r"version 2 at byte 9"),
    "unknown dtype": (lambda p: _patch(p.with_suffix(".idx"), 17, b"\x09"), r"dtype code 9 at byte 17"),
    "dtype code 0": (lambda p: _patch(p.with_suffix(".idx"), 17, b"\x00"), r"dtype code 0 at byte 17"),
    "no document index": (
        lambda p: _patch(p.with_suffix(".idx"), 26, struct.pack("<Q", 0)),
        r"(document index count 0 at byte 26|expected 70)",
    ),
    "huge sequence count": (
        lambda p: _patch(p.with_suffix(".idx"), 18, struct.pack("<Q", 2**40)),
        r"truncated.*1099511627776 sequences",
    ),
    "negative length": (
        lambda p: _patch(p.with_suffix(".idx"), 34 + 4, struct.pack("<i", -1)),
        r"sequence 1 has negative length -1 \(at byte 38\)",
    ),
    "pointer mismatch": (
        lambda p: _patch(p.with_suffix(".idx"), 46 + 16, struct.pack("<q", 8)),
        r"sequence 2: pointer 8 at byte 62 .* expected 6",
    ),
    "first document index not 0": (
        lambda p: _patch(p.with_suffix(".idx"), 70, struct.pack("<q", 1)),
        r"document index 0 is 1 at byte 70",
    ),
    "document indices decrease": (
        lambda p: (
            _patch(p.with_suffix(".idx"), 78, struct.pack("<q", 3)),
            _patch(p.with_suffix(".idx"), 86, struct.pack("<q", 2)),
        ),
        r"document 1 ends before it starts.*byte 86",
    ),
    "last document index out of range": (
        lambda p: _patch(p.with_suffix(".idx"), 86, struct.pack("<q", 7)),
        r"last document index is 7 at byte 86, expected 3",
    ),
    "bin too short": (
        lambda p: p.with_suffix(".bin").write_bytes(b"\x00" * 13),
        r"ds\.bin: the file is 13 bytes.*7 tokens of uint16 = 14 bytes",
    ),
    "bin too long": (
        lambda p: p.with_suffix(".bin").write_bytes(b"\x00" * 16),
        r"ds\.bin: the file is 16 bytes",
    ),
    "missing bin": (lambda p: p.with_suffix(".bin").unlink(), r"data file .*ds\.bin not found"),
    "missing idx": (lambda p: p.with_suffix(".idx").unlink(), r"index file .*ds\.idx not found"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_files_raise_clear_errors(tmp_path, case):
    prefix = _good(tmp_path)
    corrupt, message = BAD_CASES[case]
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(prefix)
    assert isinstance(info.value, ValueError)
    assert "ds.idx" in str(info.value) or "ds.bin" in str(info.value)


def test_check_vocab(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds.bin", np.uint16) as builder:
        builder.add_item([3, 9, 41])
        builder.finalize(tmp_path / "ds.idx")
    ds = IndexedDataset(tmp_path / "ds")
    check_vocab(ds, 42, "train")
    with pytest.raises(IndexedDatasetError, match=r"dataset wiki .*token id 41.*vocab size is 41"):
        check_vocab(ds, 41, "wiki")
