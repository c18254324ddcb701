"""stx preprocess: input formats, worker-count independence, document structure, bad input, interrupts."""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from scalable_transformer.cli import preprocess as cli_pp
from scalable_transformer.cli.parsers import add_preprocess_arguments
from scalable_transformer.data import text_readers
from scalable_transformer.data.corpus import split_sentences
from scalable_transformer.data.indexed import IndexedDataset
from scalable_transformer.data.preprocess import PreprocessError, preprocess
from scalable_transformer.data.text_readers import expand_inputs
from scalable_transformer.data.tokenizers import Tokenizer
from text_corpus import documents, tiny_tokenizer

# The module, not the function `scalable_transformer.data.preprocess` that the package re-exports.
pp = importlib.import_module("scalable_transformer.data.preprocess")
zstandard = pytest.importorskip("zstandard")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return documents(240)


def _jsonl(docs: list[str], key: str = "text") -> str:
    return "".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs))


def _write_corpus(root: Path, docs: list[str]) -> list[str]:
    """The documents spread over every input kind; returns the inputs in document order."""
    (root / "a.txt").write_text("\n".join(docs[0:40]) + "\n")
    (root / "b.jsonl").write_text(_jsonl(docs[40:80]))
    with gzip.open(root / "c.jsonl.gz", "wt") as f:
        f.write(_jsonl(docs[80:120]))
    (root / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(docs[120:160]).encode()))
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "sub" / "f.json").write_text(_jsonl(docs[180:200]))  # sorted: e.json, then sub/f.json
    (root / "dir" / "e.json").write_text(_jsonl(docs[160:180]))
    (root / "dir" / "notes.md").write_text("not an input\n")
    (root / "shards").mkdir()
    for i in range(4):
        (root / "shards" / f"part-{i}.jsonl").write_text(_jsonl(docs[200 + 10 * i : 210 + 10 * i]))
    return [
        str(root / "a.txt"),
        str(root / "b.jsonl"),
        str(root / "c.jsonl.gz"),
        str(root / "d.jsonl.zst"),
        str(root / "dir"),
        str(root / "shards" / "part-*.jsonl"),
    ]


def _sequences(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_every_input_kind_and_worker_count_give_identical_files(tmp_path, monkeypatch, tok, docs):
    inputs = _write_corpus(tmp_path, docs)
    # Small blocks: many blocks per file, lines longer than a block, several blocks in flight.
    monkeypatch.setattr(text_readers, "BLOCK_BYTES", 700)
    one = preprocess(inputs, str(tmp_path / "out" / "w1"), tok, workers=1, progress=False)
    two = preprocess(inputs, str(tmp_path / "out" / "w2"), tok, workers=2, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "out" / f"w1{suffix}").read_bytes() == (
            tmp_path / "out" / f"w2{suffix}"
        ).read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == ["w1.bin", "w1.idx", "w2.bin", "w2.idx"]

    expected = tok.encode_batch(docs)
    assert _sequences(tmp_path / "out" / "w1") == expected  # one sequence per document, in input order
    ds = IndexedDataset(tmp_path / "out" / "w1")
    assert ds.dtype == np.uint16 and ds.num_documents == len(docs)
    assert one.documents == two.documents == len(docs) == one.sentences
    assert one.tokens == sum(map(len, expected)) and one.skipped == {}
    assert len(one.inputs) == 10 and all(c.documents > 0 for c in one.inputs.values())
    assert one.inputs[inputs[2]].documents == 40 and one.inputs[inputs[2]].lines == 40


def test_expand_inputs_order_and_dedup(tmp_path, docs):
    inputs = _write_corpus(tmp_path, docs)
    files = expand_inputs([*inputs, str(tmp_path / "b.jsonl")])
    names = [str(f.relative_to(tmp_path)) for f in files]
    assert names == [
        "a.txt",
        "b.jsonl",
        "c.jsonl.gz",
        "d.jsonl.zst",
        "dir/e.json",
        "dir/sub/f.json",
        *(f"shards/part-{i}.jsonl" for i in range(4)),
    ]


def test_split_sentences_and_append_eod_structure(tmp_path, tok, docs):
    path = tmp_path / "in.jsonl"
    path.write_text(_jsonl(docs[:30]))
    summary = preprocess(
        [str(path)], str(tmp_path / "s"), tok, split_sentences=True, append_eod=True, progress=False
    )
    ds = IndexedDataset(tmp_path / "s")
    assert ds.num_documents == 30 == summary.documents
    eod = tok.eod_id
    for k, doc in enumerate(docs[:30]):
        sentences = [ids for ids in tok.encode_batch(split_sentences(doc)) if ids]
        sentences[-1] = [*sentences[-1], eod]  # EOD ends the document's last sentence
        assert [s.tolist() for s in ds.document(k)] == sentences
    assert len(ds) == summary.sentences > summary.documents
    assert int((np.concatenate([ds[i] for i in range(len(ds))]) == eod).sum()) == 30

    preprocess([str(path)], str(tmp_path / "d"), tok, append_eod=True, progress=False)
    plain = _sequences(tmp_path / "d")
    assert plain == [[*ids, eod] for ids in tok.encode_batch(docs[:30])]


def test_json_list_of_sentences(tmp_path, tok):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"text": ["Alpha beta.", "Gamma delta!", ""]}) + "\n")
    preprocess([str(path)], str(tmp_path / "s"), tok, split_sentences=True, progress=False)
    assert _sequences(tmp_path / "s") == tok.encode_batch(["Alpha beta.", "Gamma delta!"])
    preprocess([str(path)], str(tmp_path / "d"), tok, progress=False)
    assert _sequences(tmp_path / "d") == tok.encode_batch(["Alpha beta.\n\nGamma delta!\n\n"])


def test_blank_and_empty_documents_are_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "alpha beta"}\n\n   \n{"text": ""}\n{"text": "gamma"}')  # no final newline
    summary = preprocess([str(path)], str(tmp_path / "o"), tok, progress=False)
    assert summary.documents == 2 and summary.skipped == {"blank line": 2, "empty document": 1}
    assert _sequences(tmp_path / "o") == tok.encode_batch(["alpha beta", "gamma"])


# -- bad input ----------------------------------------------------------------------------------


def _no_output(root: Path) -> None:
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(("out", ".out"))]
    assert leftovers == [], leftovers


def test_missing_and_empty_inputs(tmp_path, tok):
    with pytest.raises(PreprocessError, match=r"ends with \.bin/\.idx: give the prefix"):
        preprocess([str(tmp_path / "nope.jsonl")], str(tmp_path / "out.bin"), tok, progress=False)
    with pytest.raises(PreprocessError, match=r"input not found: .*nope\.jsonl"):
        preprocess([str(tmp_path / "nope.jsonl")], str(tmp_path / "out"), tok, progress=False)
    with pytest.raises(PreprocessError, match=r"pattern .*\*\.zzz.* matches no file"):
        preprocess([str(tmp_path / "*.zzz")], str(tmp_path / "out"), tok, progress=False)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(PreprocessError, match=r"directory .*emptydir holds no readable file"):
        preprocess([str(tmp_path / "emptydir")], str(tmp_path / "out"), tok, progress=False)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "good.jsonl").write_text('{"text": "alpha"}\n')
    with pytest.raises(
        PreprocessError, match=r"input .*empty\.jsonl holds no document \(0 lines: an empty file\)"
    ):
        preprocess(
            [str(tmp_path / "good.jsonl"), str(tmp_path / "empty.jsonl")],
            str(tmp_path / "out"),
            tok,
            progress=False,
        )
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(PreprocessError, match=r"blank\.txt holds no document \(2 lines: 2 blank line\)"):
        preprocess([str(tmp_path / "blank.txt")], str(tmp_path / "out"), tok, progress=False)
    summary = preprocess(
        [str(tmp_path / "good.jsonl"), str(tmp_path / "empty.jsonl")],
        str(tmp_path / "out"),
        tok,
        progress=False,
        skip_bad_lines=True,
    )
    assert summary.documents == 1 and summary.skipped == {"empty input": 1}
    with pytest.raises(PreprocessError, match=r"no document in the inputs"):
        preprocess(
            [str(tmp_path / "empty.jsonl")], str(tmp_path / "none"), tok, progress=False, skip_bad_lines=True
        )
    assert not (tmp_path / "none.bin").exists() and not (tmp_path / "none.idx").exists()


def test_invalid_utf8_names_file_line_and_byte_offset(tmp_path, tok):
    good = '{"text": "alpha"}\n'
    bad = b'{"text": "be\xfft\xc3"}\n'
    data = good.encode() * 2 + bad + good.encode()
    (tmp_path / "in.jsonl").write_bytes(data)
    offset = 2 * len(good) + bad.index(b"\xff")
    with pytest.raises(
        PreprocessError, match=rf"in\.jsonl:3: invalid UTF-8 at byte offset {offset} \(byte 0xff"
    ):
        preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), tok, progress=False)
    _no_output(tmp_path)
    with gzip.open(tmp_path / "in.txt.gz", "wb") as f:
        f.write(b"alpha\nbeta\n" + b"x" * 10 + b"\x80\n")
    with pytest.raises(
        PreprocessError, match=r"in\.txt\.gz:3: invalid UTF-8 at byte offset 21 of the decompressed"
    ):
        preprocess([str(tmp_path / "in.txt.gz")], str(tmp_path / "out"), tok, progress=False, workers=2)
    summary = preprocess(
        [str(tmp_path / "in.jsonl")], str(tmp_path / "out"), tok, progress=False, skip_bad_lines=True
    )
    assert summary.documents == 3 and summary.skipped == {"invalid utf-8": 1}


def test_malformed_json_missing_key_and_non_text(tmp_path, tok):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "alpha"}\n{"text": "beta"\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:2: malformed JSON"):
        preprocess([str(path)], str(tmp_path / "out"), tok, progress=False)
    path.write_text('{"text": "alpha"}\n{"body": "beta", "id": 3}\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:2: no key 'text' .*keys present: 'body', 'id'"):
        preprocess([str(path)], str(tmp_path / "out"), tok, progress=False)
    summary = preprocess(
        [str(path)], str(tmp_path / "out"), tok, json_key="body", skip_bad_lines=True, progress=False
    )
    assert summary.documents == 1 and summary.skipped == {"missing key": 1}
    path.write_text('{"text": 3}\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:1: 'text' holds a JSON number, expected a string"):
        preprocess([str(path)], str(tmp_path / "out2"), tok, progress=False)
    path.write_text('["alpha", "beta"]\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:1: the line is a JSON list, expected an object"):
        preprocess([str(path)], str(tmp_path / "out2"), tok, progress=False)
    path.write_text('[\n{"text": "alpha"}\n]\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:1: malformed JSON.*a JSON array\?"):
        preprocess([str(path)], str(tmp_path / "out2"), tok, progress=False)
    lines = ['{"text": "alpha"}', "{oops", '{"x": 1}', '{"text": null}', "7", '{"text": "beta"}']
    path.write_text("\n".join(lines) + "\n")
    summary = preprocess(
        [str(path)], str(tmp_path / "out2"), tok, skip_bad_lines=True, workers=2, progress=False
    )
    assert summary.documents == 2
    assert summary.skipped == {"malformed json": 1, "missing key": 1, "not text": 1, "not an object": 1}


def test_corrupt_compressed_input(tmp_path, tok):
    data = gzip.compress(_jsonl(["alpha beta"] * 500).encode())
    (tmp_path / "in.jsonl.gz").write_bytes(data[: len(data) // 2])
    # a truncated file is its own error (issue 11), never skippable
    with pytest.raises(PreprocessError, match=r"in\.jsonl\.gz: truncated compressed stream"):
        preprocess(
            [str(tmp_path / "in.jsonl.gz")], str(tmp_path / "out"), tok, progress=False, skip_bad_lines=True
        )
    (tmp_path / "in.jsonl.zst").write_bytes(b"not zstd at all")
    with pytest.raises(PreprocessError, match=r"in\.jsonl\.zst: cannot read zstd data"):
        preprocess([str(tmp_path / "in.jsonl.zst")], str(tmp_path / "out"), tok, progress=False)
    _no_output(tmp_path)


# -- interrupts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_preprocess_leaves_no_files(tmp_path, monkeypatch, tok, docs, error, workers):
    (tmp_path / "in.jsonl").write_text(_jsonl(docs))
    monkeypatch.setattr(text_readers, "BLOCK_BYTES", 2000)
    calls = []
    original = pp.IndexedDatasetBuilder._add_documents

    def flaky(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise error("injected")
        return original(self, *args)

    monkeypatch.setattr(pp.IndexedDatasetBuilder, "_add_documents", flaky)
    with pytest.raises(error, match="injected"):
        preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), tok, workers=workers, progress=False)
    assert len(calls) == 3 and os.listdir(tmp_path) == ["in.jsonl"]


def test_failure_inside_a_worker(tmp_path, monkeypatch, tok, docs):
    (tmp_path / "in.jsonl").write_text(_jsonl(docs))
    monkeypatch.setattr(text_readers, "BLOCK_BYTES", 2000)
    original = pp._Encoder.encode

    def fails_late(self, block):  # runs in the forked workers, which inherit the patch
        if block.offset > 8000:
            raise PreprocessError("injected in a worker")
        return original(self, block)

    monkeypatch.setattr(pp._Encoder, "encode", fails_late)
    with pytest.raises(PreprocessError, match="injected in a worker"):
        preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), tok, workers=2, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]

    def dies(self, block):
        if block.offset > 8000:
            os._exit(3)  # a worker crash (OOM kill, segfault)
        return original(self, block)

    monkeypatch.setattr(pp._Encoder, "encode", dies)
    with pytest.raises(RuntimeError, match=r"worker process died.*in\.jsonl from line"):
        preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), tok, workers=2, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]


# -- command line -------------------------------------------------------------------------------


def test_cli_run(tmp_path, capsys, tok):
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("alpha beta. Gamma delta.\nepsilon\n")
    parser = argparse.ArgumentParser()
    add_preprocess_arguments(parser)
    args = parser.parse_args(
        [
            *("--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "o")),
            *("--tokenizer", str(tmp_path), "--split-sentences", "--append-eod", "--workers", "2"),
        ]
    )
    assert cli_pp.run(args) == 0
    out = capsys.readouterr().out
    assert "2 documents, 3 sequences" in out and "2 worker(s)" in out and "tokens/s" in out
    assert IndexedDataset(tmp_path / "o").num_documents == 2
    args = parser.parse_args(
        [
            "--input",
            str(tmp_path / "missing.txt"),
            "--output-prefix",
            str(tmp_path / "p"),
            "--tokenizer",
            str(tmp_path),
        ]
    )
    assert cli_pp.run(args) == 2
    assert "input not found" in capsys.readouterr().err
