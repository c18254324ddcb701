"""Tokenizers users bring (BERT vocab.txt, GPT-2 vocab.json + merges.txt) and `stx tokenizer train`."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import pytest

from scalable_transformer.cli.parsers import add_tokenizer_train_arguments
from scalable_transformer.cli.tokenizer import run_train
from scalable_transformer.data.preprocess import PreprocessError
from scalable_transformer.data.tokenizers import load_tokenizer, train_tokenizer, vocab_is_lowercase

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"


def test_bert_vocab_uncased():
    tok = load_tokenizer(str(FIXTURES / "bert-uncased" / "vocab.txt"))
    assert "BertWordPieceLowerCase" in tok.name and vocab_is_lowercase(
        FIXTURES / "bert-uncased" / "vocab.txt"
    )
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 2, 3, 4, 5)
    assert tok.eod_id == tok.sep_id and tok.vocab_size == 18
    # hello world ! the fox ##es jump ##ing .   (lower-cased; "quick" -> [UNK] is not present here)
    assert tok.encode("Hello World! The foxes jumping.") == [10, 11, 17, 6, 9, 12, 14, 13, 15]
    assert tok.encode("Héllo zebra") == [10, 2]  # accents stripped as in BERT uncased; unknown -> [UNK]
    assert tok.encode("[MASK] fox") == [5, 9]  # special tokens are matched whole
    assert tok.decode(tok.encode("the foxes")) == "the foxes"


def test_bert_vocab_cased_and_explicit_type():
    cased = load_tokenizer(str(FIXTURES / "bert-cased"))  # a directory holding vocab.txt
    assert "BertWordPieceCase" in cased.name
    assert cased.encode("Hello World! The foxes jumping.") == [8, 10, 18, 6, 12, 13, 15, 14, 16]
    assert (cased.pad_id, cased.unk_id, cased.cls_id, cased.sep_id, cased.mask_id) == (0, 2, 3, 4, 5)
    forced = load_tokenizer(
        "embedded",
        vocab_file=str(FIXTURES / "bert-cased" / "vocab.txt"),
        tokenizer_type="BertWordPieceLowerCase",
    )
    assert forced.encode("Hello World") == [9, 11]  # lower-cased: hello world
    uncased_as_cased = load_tokenizer(
        str(FIXTURES / "bert-uncased" / "vocab.txt"), tokenizer_type="BertWordPieceCase"
    )
    assert uncased_as_cased.encode("Hello hello") == [2, 10]


def test_bert_vocab_missing_special_token(tmp_path):
    lines = (FIXTURES / "bert-uncased" / "vocab.txt").read_text().splitlines()
    (tmp_path / "vocab.txt").write_text("\n".join(t for t in lines if t != "[MASK]") + "\n")
    with pytest.raises(ValueError, match=r"vocab\.txt: BERT vocab lacks the special token\(s\) \[MASK\]"):
        load_tokenizer(str(tmp_path / "vocab.txt"))


def test_gpt2_vocab_and_merges(tmp_path):
    vocab, merges = FIXTURES / "gpt2-tiny" / "vocab.json", FIXTURES / "gpt2-tiny" / "merges.txt"
    for tok in (
        load_tokenizer(None, vocab_file=str(vocab), merge_file=str(merges)),
        load_tokenizer(str(FIXTURES / "gpt2-tiny")),
        load_tokenizer(str(vocab), tokenizer_type="GPT2BPETokenizer"),
    ):
        assert "GPT2BPETokenizer" in tok.name and tok.vocab_size == 19
        assert tok.eod_id == 18
        assert tok.encode("hello world!") == [12, 17, 0]  # hello, Ġworld, !
        assert tok.encode("hold") == [3, 5, 4, 1]  # no merge applies
        assert tok.encode("hello<|endoftext|>") == [12, 18]
        assert tok.decode([12, 17, 0]) == "hello world!"
        with pytest.raises(ValueError, match="no mask token"):
            _ = tok.mask_id
    shutil.copy(vocab, tmp_path / "vocab.json")
    with pytest.raises(FileNotFoundError, match=r"merges file not found: .*merges\.txt"):
        load_tokenizer(str(tmp_path / "vocab.json"))
    data = json.loads(vocab.read_text())
    del data["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps(data))
    shutil.copy(merges, tmp_path / "merges.txt")
    with pytest.raises(ValueError, match=r"GPT-2 vocab lacks the special token\(s\) <\|endoftext\|>"):
        load_tokenizer(str(tmp_path))


def test_bad_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds none of"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="give one of them"):
        load_tokenizer(str(tmp_path / "a.json"), vocab_file=str(FIXTURES / "bert-cased" / "vocab.txt"))
    with pytest.raises(ValueError, match="needs a tokenizer file"):
        load_tokenizer("embedded", tokenizer_type="GPT2BPETokenizer")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"neither a HF tokenizer\.json nor a GPT-2 vocab\.json"):
        load_tokenizer(str(tmp_path / "x.json"))


def _corpus(path: Path, n: int = 300) -> None:
    rng = random.Random(0)
    words = ["Alpha", "beta", "Gamma", "delta", "epsilon", "zeta", "Eta", "theta", "iota", "kappa"]
    with path.open("w") as f:
        for _ in range(n):
            text = " ".join(rng.choice(words) + rng.choice(["", "s", "ing", "ed"]) for _ in range(20)) + "."
            f.write(json.dumps({"body": text}) + "\n")


def test_train_wordpiece_writes_loadable_vocab(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    _corpus(tmp_path / "c.jsonl")
    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress((tmp_path / "c.jsonl").read_bytes())
    )
    path = train_tokenizer(
        [str(tmp_path / "c.jsonl.zst")], "wordpiece", 150, str(tmp_path / "wp"), json_key="body"
    )
    assert path == tmp_path / "wp" / "tokenizer.json"
    assert sorted(p.name for p in (tmp_path / "wp").iterdir()) == ["tokenizer.json", "vocab.txt"]
    vocab = (tmp_path / "wp" / "vocab.txt").read_text().splitlines()
    assert vocab[:6] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>"]
    from_json = load_tokenizer(str(path))
    from_vocab = load_tokenizer(str(tmp_path / "wp" / "vocab.txt"))
    assert "BertWordPieceLowerCase" in from_vocab.name and from_vocab.vocab_size == from_json.vocab_size
    text = "Gammas theta Etaing kappaed zzz."
    assert from_vocab.encode(text) == from_json.encode(text) and from_json.encode(text)
    assert (from_vocab.cls_id, from_vocab.sep_id, from_vocab.mask_id, from_vocab.eod_id) == (2, 3, 4, 5)

    cased = train_tokenizer(
        [str(tmp_path / "c.jsonl")], "wordpiece", 150, str(tmp_path / "cased"), "body", False
    )
    assert "BertWordPieceCase" in load_tokenizer(str(cased.parent / "vocab.txt")).name


def test_train_bpe_writes_gpt2_files(tmp_path):
    _corpus(tmp_path / "c.jsonl")
    path = train_tokenizer(
        [str(tmp_path)], "bpe", 300, str(tmp_path / "bpe"), json_key="body", lowercase=False
    )
    assert sorted(p.name for p in path.parent.iterdir()) == ["merges.txt", "tokenizer.json", "vocab.json"]
    assert (path.parent / "merges.txt").read_text().startswith("#version")
    from_json = load_tokenizer(str(path))
    from_files = load_tokenizer(None, vocab_file=str(path.parent / "vocab.json"))
    assert from_files.eod_id == from_json.eod_id == 0
    text = "Gammas theta Etaing kappaed zzz é."
    assert from_files.encode(text) == from_json.encode(text)
    assert from_json.decode(from_json.encode(text)) == text  # byte-level: nothing is unknown


def test_train_errors_and_cli(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PreprocessError, match="no document"):
        train_tokenizer([str(tmp_path / "empty.jsonl")], "bpe", 300, str(tmp_path / "o"))
    with pytest.raises(ValueError, match="wordpiece' or 'bpe'"):
        train_tokenizer([str(tmp_path / "empty.jsonl")], "unigram", 300, str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    _corpus(tmp_path / "c.jsonl", 100)
    parser = argparse.ArgumentParser()
    add_tokenizer_train_arguments(parser)
    args = parser.parse_args(
        [
            *("--input", str(tmp_path / "c.jsonl"), "--type", "wordpiece", "--vocab-size", "120"),
            *("--output", str(tmp_path / "t"), "--json-key", "body", "--cased"),
        ]
    )
    assert run_train(args) == 0
    assert "tokenizer.json, vocab.txt" in capsys.readouterr().out
    assert "BertWordPieceCase" in load_tokenizer(str(tmp_path / "t" / "vocab.txt")).name
    args = parser.parse_args(
        ["--input", str(tmp_path / "no"), "--type", "bpe", "--vocab-size", "300", "--output", "x"]
    )
    assert run_train(args) == 2
    assert "input not found" in capsys.readouterr().err
