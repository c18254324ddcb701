"""`stx preprocess` on Parquet files and on datasets saved by HF `datasets` (save_to_disk): built here
with pyarrow and datasets themselves, and tokenized to the same sequences as the same texts given as
JSON lines."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

from scalable_transformer.cli import preprocess as cli_pp
from scalable_transformer.cli.parsers import add_preprocess_arguments
from scalable_transformer.data import text_readers
from scalable_transformer.data.indexed import IndexedDataset
from scalable_transformer.data.preprocess import PreprocessError, preprocess
from scalable_transformer.data.text_readers import expand_inputs, iter_texts
from scalable_transformer.data.tokenizers import Tokenizer
from text_corpus import documents, tiny_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
pp = importlib.import_module("scalable_transformer.data.preprocess")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return documents(300, seed=1)


def _jsonl(path: Path, docs: list, key: str = "text") -> str:
    path.write_text("".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs)))
    return str(path)


def _parquet(path: Path, docs: list, key: str = "text", row_group_size: int = 64) -> str:
    table = pa.table({"id": list(range(len(docs))), key: docs})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def _saved(path: Path, docs: list, key: str = "text", shards: int = 3) -> str:
    dataset = datasets.Dataset.from_dict({"id": list(range(len(docs))), key: docs})
    dataset.save_to_disk(str(path), num_shards=shards)
    return str(path)


def _run(inputs: list[str], prefix: Path, tok: Tokenizer, **kwargs):
    return preprocess(inputs, str(prefix), tok, progress=False, **kwargs)


def _files(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_and_saved_dataset_equal_the_same_text_as_jsonl(tmp_path, monkeypatch, tok, docs, workers):
    monkeypatch.setattr(text_readers, "BLOCK_BYTES", 900)  # many blocks per file
    kw = {"workers": workers, "append_eod": True}
    json_summary = _run([_jsonl(tmp_path / "c.jsonl", docs)], tmp_path / "out" / "json", tok, **kw)
    parquet_summary = _run([_parquet(tmp_path / "c.parquet", docs)], tmp_path / "out" / "parquet", tok, **kw)
    _run([_saved(tmp_path / "saved", docs)], tmp_path / "out" / "saved", tok, **kw)
    reference = _files(tmp_path / "out" / "json")
    assert _files(tmp_path / "out" / "parquet") == reference
    assert _files(tmp_path / "out" / "saved") == reference
    assert parquet_summary.documents == json_summary.documents == len(docs)
    assert parquet_summary.tokens == json_summary.tokens
    counts = parquet_summary.inputs[str(tmp_path / "c.parquet")]
    assert counts.lines == len(docs) and counts.bytes == sum(len(d.encode()) for d in docs)
    # the tokens are the tokenizer's own, one sequence per document, EOD closing each
    ds = IndexedDataset(tmp_path / "out" / "saved")
    assert [ds[i].tolist() for i in range(len(ds))] == [[*ids, tok.eod_id] for ids in tok.encode_batch(docs)]


def test_saved_dataset_rows_are_load_from_disk_rows(tmp_path, docs):
    """The rows read from the Arrow files state.json lists are those datasets.load_from_disk gives,
    also after a shuffle and select (save_to_disk writes the selected rows)."""
    original = datasets.Dataset.from_dict({"text": docs})
    original.shuffle(seed=3).select(range(250)).save_to_disk(str(tmp_path / "shuffled"), num_shards=4)
    loaded = datasets.load_from_disk(str(tmp_path / "shuffled"))
    assert list(iter_texts([tmp_path / "shuffled"])) == loaded["text"]
    assert len(loaded) == 250 and loaded["text"] != docs[:250]


def test_text_column_named_by_flag_and_sentence_lists(tmp_path, tok, docs):
    sentences = [[s + "." for s in d.split(". ")] for d in docs[:30]]
    _run([_jsonl(tmp_path / "c.jsonl", sentences, key="content")], tmp_path / "j", tok, json_key="content")
    _run(
        [_parquet(tmp_path / "c.parquet", sentences, key="content")], tmp_path / "p", tok, json_key="content"
    )
    _run(
        [_saved(tmp_path / "s", sentences, key="content", shards=1)],
        tmp_path / "s_out",
        tok,
        json_key="content",
    )
    assert _files(tmp_path / "p") == _files(tmp_path / "j") == _files(tmp_path / "s_out")
    parser = argparse.ArgumentParser()
    add_preprocess_arguments(parser)
    args = parser.parse_args(["--input", "x.parquet", "--output-prefix", "o", "--text-column", "content"])
    assert args.json_key == "content"


def test_directories_mix_jsonl_parquet_and_saved_datasets(tmp_path, tok, docs):
    root = tmp_path / "corpus"
    root.mkdir()
    _jsonl(root / "a.jsonl", docs[:100])
    _parquet(root / "b.parquet", docs[100:200])
    _saved(root / "c_saved", docs[200:], shards=2)
    (root / "c_saved" / "note.jsonl").write_text('{"text": "inside the saved dataset: not read"}\n')
    assert expand_inputs([root]) == [root / "a.jsonl", root / "b.parquet", root / "c_saved"]
    _run([str(root)], tmp_path / "dir", tok)
    _run([_jsonl(tmp_path / "all.jsonl", docs)], tmp_path / "flat", tok)
    assert _files(tmp_path / "dir") == _files(tmp_path / "flat")


def _nothing_written(root: Path) -> None:
    assert [p for p in os.listdir(root) if p.startswith("out")] == []


def test_missing_column_names_the_file_and_the_columns(tmp_path, tok, docs):
    parquet = _parquet(tmp_path / "c.parquet", docs, key="content")
    with pytest.raises(
        PreprocessError, match=r"c\.parquet: no column 'text' \(columns present: 'id', 'content'\)"
    ):
        _run([parquet], tmp_path / "out" / "p", tok)
    saved = _saved(tmp_path / "s", docs, key="content", shards=1)
    with pytest.raises(PreprocessError, match=r"data-00000-of-00001\.arrow: no column 'text' .*'content'"):
        _run([saved], tmp_path / "out" / "s", tok, skip_bad_lines=True)  # a whole file, never skipped
    _nothing_written(tmp_path)


def test_failure_after_good_inputs_leaves_no_output(tmp_path, tok, docs):
    good = _parquet(tmp_path / "good.parquet", docs)
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "numbers.parquet")
    with pytest.raises(
        PreprocessError, match=r"numbers\.parquet: column 'text' holds int64, expected strings"
    ):
        _run([good, str(tmp_path / "numbers.parquet")], tmp_path / "out" / "x", tok, workers=2)
    (tmp_path / "broken.parquet").write_bytes(Path(good).read_bytes()[:200])
    with pytest.raises(PreprocessError, match=r"broken\.parquet: cannot read it as a Parquet file"):
        _run([good, str(tmp_path / "broken.parquet")], tmp_path / "out" / "y", tok)
    _nothing_written(tmp_path)


def test_null_rows_are_bad_rows(tmp_path, tok, docs):
    path = _parquet(tmp_path / "n.parquet", [*docs[:5], None, *docs[5:10]])
    with pytest.raises(PreprocessError, match=r"n\.parquet: row 5 \(0-based\): column 'text' holds null"):
        _run([path], tmp_path / "out", tok)
    summary = _run([path], tmp_path / "ok", tok, skip_bad_lines=True)
    assert summary.documents == 10 and summary.skipped == {"not text": 1}


def test_dataset_dict_directory_names_its_splits(tmp_path, tok, docs):
    split = datasets.Dataset.from_dict({"text": docs[:10]})
    datasets.DatasetDict({"train": split, "validation": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PreprocessError, match=r"DatasetDict .*splits: train, validation.*dd/train"):
        _run([str(tmp_path / "dd")], tmp_path / "out", tok)
    _run([str(tmp_path / "dd" / "train")], tmp_path / "train", tok)
    assert IndexedDataset(tmp_path / "train").num_documents == 10


def test_without_pyarrow_the_error_says_what_to_install(tmp_path, monkeypatch, tok, docs):
    path = _parquet(tmp_path / "c.parquet", docs[:3])
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc"):
        monkeypatch.setitem(sys.modules, name, None)  # `import pyarrow` raises ImportError
    with pytest.raises(PreprocessError, match=r"needs the pyarrow package \(pip install"):
        _run([path], tmp_path / "out", tok)
    _nothing_written(tmp_path)


def test_cli_reads_parquet(tmp_path, capsys, tok, docs):
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    parquet = _parquet(tmp_path / "c.parquet", docs[:20], key="body")
    parser = argparse.ArgumentParser()
    add_preprocess_arguments(parser)
    argv = ["--input", parquet, "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(tmp_path)]
    assert cli_pp.run(parser.parse_args([*argv, "--text-column", "body"])) == 0
    assert "20 documents" in capsys.readouterr().out
    assert cli_pp.run(parser.parse_args([*argv[:3], str(tmp_path / "p"), *argv[4:]])) == 2
    err = capsys.readouterr().err
    assert "no column 'text' (columns present: 'id', 'body')" in err and "--text-column" in err
