"""A cache entry that concurrent processes each build is published once: the first to finish wins and
the others use its file (files.write_once). Two runs starting together on a cold cache (two pytest
workers, a sweep's jobs on a shared cache directory) had trained tokenizers of different vocabularies,
and a run's losses then differed from its reference by 0.2% from the first step."""

from __future__ import annotations

from pathlib import Path

from scalable_transformer.data import tokenizers
from scalable_transformer.files import write_once


def test_write_once_keeps_the_first_file(tmp_path: Path):
    path = tmp_path / "entry.json"
    assert write_once(path, b"first")
    assert not write_once(path, b"second")
    assert path.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]  # no temporary left behind


def test_a_tokenizer_trained_while_another_process_cached_one_is_replaced_by_that_one(tmp_path, monkeypatch):
    monkeypatch.setenv("STX_CACHE_DIR", str(tmp_path))
    train = tokenizers.train_wordpiece
    theirs = train(["another process trained on other text: alpha beta gamma delta"] * 20, 80)

    def train_while_another_process_publishes(texts, vocab_size):
        ours = train(texts, vocab_size)
        (cached,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"] or [None]
        assert cached is None  # nothing cached yet: this process trains
        target = tokenizers.cache_dir() / tokenizers._embedded_name(vocab_size)
        target.write_text(theirs.to_str())  # the other process finishes first
        return ours

    monkeypatch.setattr(tokenizers, "train_wordpiece", train_while_another_process_publishes)
    tok = tokenizers._embedded(80)
    assert tok.fingerprint == tokenizers.Tokenizer(theirs).fingerprint
