"""GPT, BERT and blended datasets over indexed datasets written with the real builder, and the loader.

Fixture token ids encode where they come from: in the GPT data, document d holds the consecutive ids
1000 * (d + 1) + i; in the BERT data, sentence j of document d holds 1000 * (d + 1) + 50 * j + i
(continuation pieces '##' are a separate id range). So a sample can be traced back to its documents.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from bert_checks import MaskTally, check_bert_sample, original_ids
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from scalable_transformer.config.schema import Config
from scalable_transformer.data import gpt_dataset as gpt_mod
from scalable_transformer.data.bert_dataset import BertDataset, build_samples_mapping
from scalable_transformer.data.blend import BlendedDataset, blend_sizes, build_blending_indices, parse_blend
from scalable_transformer.data.gpt_dataset import GPTDataset, plan_epochs
from scalable_transformer.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    bin_path,
    idx_path,
)
from scalable_transformer.data.loader import build_datasets, build_loader, split_ranges
from scalable_transformer.data.tokenizers import SPECIAL_TOKENS, Tokenizer

EOD = 5  # <|endoftext|> in SPECIAL_TOKENS order
VOCAB = 40_000
PIECE0 = 30_000  # ids from here on are '##' continuation pieces


def write_indexed(prefix: Path, documents: list[list[list[int]]], dtype=np.uint16) -> IndexedDataset:
    """documents -> sequences -> token ids, through the real builder."""
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype)
    for doc in documents:
        for seq in doc:
            builder.add_item(np.asarray(seq, dtype=np.int64))
        builder.end_document()
    builder.finalize(idx_path(prefix))
    return IndexedDataset(prefix)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A WordPiece tokenizer over ids 0..VOCAB-1: the special tokens, words, then '##' pieces."""
    words = [f"w{i}" for i in range(len(SPECIAL_TOKENS), PIECE0)]
    pieces = [f"##p{i}" for i in range(PIECE0, VOCAB)]
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *words, *pieces])}
    return Tokenizer(HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]")), name="fixture")


def gpt_documents(num_docs: int, rng: np.random.Generator, eod: bool = True) -> list[list[list[int]]]:
    docs = []
    for d in range(num_docs):
        n = int(rng.integers(1, 40))
        ids = list(range(1000 * (d + 1), 1000 * (d + 1) + n)) + ([EOD] if eod else [])
        docs.append([ids])
    return docs


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory) -> tuple[IndexedDataset, list[list[int]]]:
    rng = np.random.default_rng(0)
    docs = gpt_documents(30, rng)
    ds = write_indexed(tmp_path_factory.mktemp("gpt") / "corpus_text_document", docs)
    return ds, [doc[0] for doc in docs]


def bert_documents(num_docs: int, rng: np.random.Generator) -> list[list[list[int]]]:
    """Documents of 1-8 sentences of 2-30 tokens; some words are followed by 1-2 '##' pieces."""
    docs = []
    for d in range(num_docs):
        sentences = []
        for j in range(int(rng.integers(1, 9))):
            sentence: list[int] = []
            for i in range(int(rng.integers(2, 31))):
                if sentence and rng.random() < 0.25:
                    sentence.append(PIECE0 + int(rng.integers(0, VOCAB - PIECE0)))
                else:
                    sentence.append(1000 * (d + 1) + 50 * j + i)
            sentences.append(sentence)
        docs.append(sentences)
    return docs


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory) -> IndexedDataset:
    return write_indexed(
        tmp_path_factory.mktemp("bert") / "wiki", bert_documents(25, np.random.default_rng(1))
    )


def doc_of(token: int) -> int:
    return token // 1000 - 1


def config(model_type: str, path: str | None, seq_length: int, **data) -> Config:
    cfg = Config()
    cfg.model.type = model_type
    cfg.model.seq_length = seq_length
    cfg.model.vocab_size = VOCAB
    cfg.data.path = path
    cfg.train.train_iters, cfg.train.micro_batch_size, cfg.train.eval_iters = 10, 4, 2
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


# ---------------------------------------------------------------- GPT


def test_gpt_windows_cross_documents_with_eod(gpt_data):
    indexed, docs = gpt_data
    ds = GPTDataset(indexed, seq_length=16, seed=3)
    assert ds.num_epochs == 1 and len(ds) == (sum(map(len, docs)) - 1) // 16
    stream = np.concatenate([docs[d] for d in ds.doc_idx])  # the epoch's documents, in its order
    assert sorted(ds.doc_idx.tolist()) == list(range(len(docs)))
    starts = []
    for i in range(len(ds)):
        x = ds[i]
        assert x["input_ids"].shape == x["labels"].shape == (16,)
        assert x["input_ids"].dtype == torch.long
        assert torch.equal(x["input_ids"][1:], x["labels"][:-1])  # labels = inputs shifted by one
        window = np.concatenate([x["input_ids"].numpy(), x["labels"][-1:].numpy()])
        start = 16 * int(ds.shuffle_idx[i])
        assert np.array_equal(stream[start : start + 17], window)
        starts.append(start)
        # Every EOD inside the window closes a document: the next token starts another one.
        for p in np.flatnonzero(window[:-1] == EOD):
            assert window[p + 1] % 1000 == 0
    assert sorted(starts) == list(range(0, 16 * len(ds), 16))  # stride s: each target once
    assert starts != sorted(starts)  # served shuffled


def test_gpt_epochs_are_added_for_num_samples(gpt_data):
    indexed, docs = gpt_data
    per_epoch = (sum(map(len, docs)) - 1) // 16
    ds = GPTDataset(indexed, 16, seed=3, num_samples=3 * per_epoch)
    assert ds.num_epochs >= 3 and len(ds) >= 3 * per_epoch
    n = len(docs)
    epochs = [ds.doc_idx[e * n : (e + 1) * n].tolist() for e in range(ds.num_epochs)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # each epoch: every document once
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    for i in range(0, len(ds), 7):  # windows roll over epoch boundaries seamlessly
        k = int(ds.shuffle_idx[i])
        assert np.array_equal(ds.tokens(i), stream[16 * k : 16 * k + 17])
    # A final epoch needed for only a few samples is shuffled separately and served last.
    epochs_needed, total, first_group = plan_epochs(ds.tokens_per_epoch, 16, per_epoch + 2)
    assert epochs_needed == 2 and first_group < total
    small = GPTDataset(indexed, 16, seed=3, num_samples=per_epoch + 2)
    assert sorted(small.shuffle_idx[:first_group].tolist()) == list(range(first_group))


def test_gpt_shuffle_depends_on_seed_only(gpt_data):
    indexed, _ = gpt_data
    a, b, c = (GPTDataset(indexed, 8, seed) for seed in (1, 1, 2))
    assert np.array_equal(a.doc_idx, b.doc_idx) and np.array_equal(a.shuffle_idx, b.shuffle_idx)
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    assert [a.tokens(i).tolist() for i in range(20)] != [c.tokens(i).tolist() for i in range(20)]


def test_gpt_mapping_cache(gpt_data, tmp_path, monkeypatch):
    indexed, _ = gpt_data
    first = GPTDataset(indexed, 12, seed=9, num_samples=50)
    assert not first.cache_hit and first.cache_path.parent == Path(indexed.path_prefix).parent
    assert first.cache_path.name.startswith("corpus_text_document.gpt-")
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert Path(f"{first.cache_path}.{name}.npy").is_file()
    description = json.loads(Path(f"{first.cache_path}.json").read_text())
    assert description["seed"] == 9 and description["documents"] == [0, 30]
    again = GPTDataset(indexed, 12, seed=9, num_samples=50)
    assert again.cache_hit
    assert all(np.array_equal(first.tokens(i), again.tokens(i)) for i in range(len(first)))
    # A request needing the same epochs reuses the mapping.
    assert GPTDataset(indexed, 12, seed=9, num_samples=49).cache_hit

    # A corrupt file is rebuilt, not trusted.
    victim = Path(f"{first.cache_path}.shuffle_idx.npy")
    good = victim.read_bytes()
    broken = victim.with_suffix(".broken")
    broken.write_bytes(good[:20])
    os.replace(broken, victim)
    rebuilt = GPTDataset(indexed, 12, seed=9, num_samples=50)
    assert not rebuilt.cache_hit and victim.read_bytes() == good

    # A read-only data directory: the user cache directory takes the mapping.
    real_save = gpt_mod._save_all

    def read_only(directory, *args):
        if directory == Path(indexed.path_prefix).parent:
            raise PermissionError(13, "Read-only file system", str(directory))
        real_save(directory, *args)

    monkeypatch.setattr(gpt_mod, "_save_all", read_only)
    monkeypatch.setenv("STX_CACHE_DIR", str(tmp_path))
    elsewhere = GPTDataset(indexed, 12, seed=10)
    assert elsewhere.cache_path.parent == tmp_path / "index-cache" and not elsewhere.cache_hit
    assert GPTDataset(indexed, 12, seed=10).cache_hit


def test_gpt_documents_of_several_sequences(tmp_path):
    # Sentence-split data read as GPT documents: the sentences of a document are read back to back.
    docs = [[[10, 11, 12], [13, 14]], [[20], [21, 22, 23], [EOD]], [[30, 31]]]
    indexed = write_indexed(tmp_path / "split", docs)
    ds = GPTDataset(indexed, 3, seed=0)
    flat = [[t for s in doc for t in s] for doc in docs]
    stream = np.concatenate([flat[d] for d in ds.doc_idx])
    got = sorted(ds.tokens(i).tolist() for i in range(len(ds)))
    assert got == sorted(stream[3 * k : 3 * k + 4].tolist() for k in range(len(ds)))
    assert len(ds) == (len(stream) - 1) // 3


def test_gpt_document_range_and_empty_range(gpt_data):
    indexed, _ = gpt_data
    ds = GPTDataset(indexed, 8, seed=0, documents=(10, 20))
    assert set(ds.doc_idx.tolist()) == set(range(10, 20))
    assert all(10 <= doc_of(int(t)) < 20 for i in range(len(ds)) for t in ds.tokens(i) if t != EOD)
    assert len(GPTDataset(indexed, 8, seed=0, documents=(5, 5))) == 0
    with pytest.raises(ValueError, match="document range"):
        GPTDataset(indexed, 8, seed=0, documents=(0, 31))


# ---------------------------------------------------------------- BERT


def test_bert_samples_mapping_follows_megatron_rules(bert_data):
    bounds = np.asarray(bert_data.document_indices)
    lengths = np.asarray(bert_data.sequence_lengths)
    mapping = build_samples_mapping(bounds, lengths, 0, 61, 0.1, 2, seed=4, num_samples=None)
    doc_of_sentence = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    usable = {d for d in range(len(bounds) - 1) if bounds[d + 1] - bounds[d] >= 2}
    assert set(mapping[:, 3].tolist()) == usable  # one-sentence documents are skipped
    for first, end, target, doc in mapping.tolist():
        assert end - first >= 2 and doc_of_sentence[first] == doc_of_sentence[end - 1] == doc
        assert 2 <= target <= 61
    # Rows of a document tile its sentences exactly, once per epoch.
    for doc in usable:
        rows = sorted((f, e) for f, e, _, d in mapping.tolist() if d == doc)
        assert rows[0][0] == bounds[doc] and rows[-1][1] == bounds[doc + 1]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    assert mapping[:, 0].tolist() != sorted(mapping[:, 0].tolist())  # shuffled
    more = build_samples_mapping(bounds, lengths, 0, 61, 0.1, 2, seed=4, num_samples=3 * len(mapping))
    assert len(more) >= 3 * len(mapping)
    # A sentence over 512 tokens removes its document (Megatron's rule).
    long = lengths.copy()
    long[bounds[2]] = 600
    assert 2 not in build_samples_mapping(bounds, long, 0, 61, 0.1, 2, 4, None)[:, 3]


def _segments(x: dict[str, torch.Tensor], sep_id: int) -> tuple[list[int], list[int]]:
    ids = original_ids(x).tolist()
    first, second = [i for i, t in enumerate(ids) if t == sep_id]
    return ids[1:first], ids[first + 1 : second]


def _words(ids: list[int]) -> list[int]:
    return [t for t in ids if t < PIECE0]


@pytest.mark.parametrize("task", ["nsp", "sop"])
def test_bert_binary_head_tasks(bert_data, tok, task):
    ds = BertDataset(bert_data, tok, 64, seed=3, short_seq_prob=0.0, binary_head_task=task, num_samples=2000)
    labels = []
    for i in range(0, len(ds), 3):
        x = ds[i]
        a, b = (_words(s) for s in _segments(x, tok.sep_id))
        random = int(x["nsp_labels"])
        labels.append(random)
        if not random:  # B is the true continuation of A
            assert doc_of(a[0]) == doc_of(b[0]) and a[-1] < b[0]
        elif task == "sop":  # swapped: B is what came before A
            assert doc_of(a[0]) == doc_of(b[0]) and b[-1] < a[0]
        else:  # random next: B from another document
            assert doc_of(a[0]) != doc_of(b[0])
    assert np.mean(labels) == pytest.approx(0.5, abs=0.06)


def test_bert_sample_invariants_and_masking(bert_data, tok):
    ds = BertDataset(bert_data, tok, 48, seed=5, num_samples=3000)
    assert len(ds) >= 3000
    tally = MaskTally()
    for i in range(3000):
        check_bert_sample(ds[i], tok, 48, tally)
    assert tally.selected / tally.candidates == pytest.approx(0.15, abs=0.01)
    assert tally.replaced_by_mask / tally.selected == pytest.approx(0.8, abs=0.02)
    assert tally.kept / tally.selected == pytest.approx(0.1, abs=0.02)
    assert np.mean(np.array(tally.lengths) < 48) > 0.05  # short targets (0.1) and document ends
    # Deterministic per (seed, index), whatever was read before.
    again = BertDataset(bert_data, tok, 48, seed=5, num_samples=3000)
    assert again.cache_hit
    for i in (17, 3, 17):
        assert all(torch.equal(ds[i][k], again[i][k]) for k in ds[i])


def test_bert_truncation_keeps_the_longer_segment_trimmed(tmp_path, tok):
    # Two sentences of 25 and 8 tokens, 4 over the 29-token target of seq_length 32: the longer
    # segment loses 4 tokens, each from its front or its back at random (Megatron's truncate_segments).
    docs = [
        [list(range(1000 * d, 1000 * d + 25)), list(range(1000 * d + 50, 1000 * d + 58))]
        for d in range(1, 40)
    ]
    indexed = write_indexed(tmp_path / "pairs", docs)
    ds = BertDataset(indexed, tok, 32, seed=0, short_seq_prob=0.0, binary_head_task="sop")
    assert len(ds) == len(docs)
    firsts = set()
    for i in range(len(ds)):
        a, b = _segments(ds[i], tok.sep_id)
        long, short = (a, b) if len(a) > len(b) else (b, a)
        assert len(long) == 21 and short == list(range(short[0], short[0] + 8)) and short[0] % 1000 == 50
        assert long == list(range(long[0], long[0] + 21))
        firsts.add(long[0] % 1000)
    assert len(firsts) > 1 and min(firsts) < 4  # trimmed at both ends
    shorter = BertDataset(indexed, tok, 32, seed=0, short_seq_prob=1.0, binary_head_task="sop")
    lengths = [int(shorter[i]["attention_mask"].sum()) for i in range(len(shorter))]
    assert min(lengths) < 32 and len(set(lengths)) > 3


def test_bert_without_binary_head(bert_data, tok):
    ds = BertDataset(bert_data, tok, 40, seed=1, binary_head=False)
    assert len(ds) > 0
    for i in range(len(ds)):
        x = ds[i]
        assert "nsp_labels" not in x
        assert int((x["input_ids"] == tok.sep_id).sum()) == 1 and not x["token_type_ids"].any()
        words = _words(original_ids(x)[1 : int(x["attention_mask"].sum()) - 1].tolist())
        assert len({doc_of(t) for t in words}) == 1 and words == sorted(words)  # one contiguous segment


def test_bert_whole_word_masking(bert_data, tok):
    ds = BertDataset(bert_data, tok, 64, seed=2, whole_word_masking=True, num_samples=1500)
    selected = candidates = 0
    for i in range(len(ds)):
        x = ds[i]
        ids, labels = original_ids(x).tolist(), x["labels"].tolist()
        n = int(x["attention_mask"].sum())
        words: list[list[int]] = []  # positions of each word: a '##' piece joins the token before it
        for p in range(1, n - 1):
            if ids[p] in (tok.cls_id, tok.sep_id):
                continue
            if ids[p] >= PIECE0 and words and words[-1][-1] == p - 1:
                words[-1].append(p)
            else:
                words.append([p])
        for word in words:
            hit = [labels[p] != -100 for p in word]
            assert all(hit) or not any(hit), (i, word, hit)
        selected += sum(label != -100 for label in labels)
        candidates += sum(map(len, words))
    assert selected / candidates == pytest.approx(0.15, abs=0.02)
    plain = BertDataset(bert_data, tok, 64, seed=2, num_samples=1500)
    assert plain.cache_hit  # masking is not part of the mapping
    with pytest.raises(ValueError, match="WordPiece"):
        bpe = Tokenizer(HFTokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL_TOKENS)}, "[UNK]")))
        BertDataset(bert_data, bpe, 64, seed=2, whole_word_masking=True)


def test_bert_needs_sentence_split_data(gpt_data, tok):
    indexed, _ = gpt_data  # one sequence per document
    with pytest.raises(ValueError, match="split-sentences"):
        BertDataset(indexed, tok, 64, seed=0)


# ---------------------------------------------------------------- blends


def test_parse_blend():
    assert parse_blend("/data/wiki_text_document") == [(1.0, "/data/wiki_text_document")]
    assert parse_blend(" 0.3 A  0.7 B ") == [(0.3, "A"), (0.7, "B")]
    assert parse_blend("1 A 3 B") == [(0.25, "A"), (0.75, "B")]
    for bad, token in (("-0.3 A 0.7 B", "-0.3"), ("0.3 A x B", "x"), ("A B", "A"), ("0 A 1 B", "0")):
        with pytest.raises(ValueError, match=f"'{token}' in data.path is not a positive number"):
            parse_blend(bad)
    with pytest.raises(ValueError, match="no dataset prefix"):
        parse_blend("0.3 A 0.7")
    with pytest.raises(ValueError, match="empty"):
        parse_blend("  ")


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.25], [0.01, 0.33, 0.66]])
def test_blending_indices_track_the_weights(weights):
    size = 3000
    built = build_blending_indices(weights, size)
    which, nth = built["dataset_index"], built["dataset_sample_index"]
    for k, w in enumerate(weights):
        taken = np.cumsum(which == k)
        assert np.all(np.abs(taken - w * np.arange(1, size + 1)) <= 1.0)  # every prefix
        assert nth[which == k].tolist() == list(range(int(taken[-1])))  # in each dataset's own order
    taken, build = blend_sizes(weights, size)
    assert all(t >= (which == k).sum() for k, t in enumerate(taken))
    assert all(b >= t for b, t in zip(build, taken, strict=True))


def test_blended_dataset(gpt_data, tmp_path):
    indexed, _ = gpt_data
    other = write_indexed(tmp_path / "other", gpt_documents(20, np.random.default_rng(5)))
    parts = [GPTDataset(indexed, 8, 0, num_samples=40), GPTDataset(other, 8, 0, num_samples=80)]
    blend = BlendedDataset(parts, [1, 2], 100)
    assert len(blend) == 100 and not blend.cache_hit
    for i in range(100):
        k, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert torch.equal(blend[i]["input_ids"], parts[k][j]["input_ids"])
    assert BlendedDataset(parts, [1, 2], 100).cache_hit
    with pytest.raises(ValueError, match="takes"):
        BlendedDataset(parts, [1, 100], 1000)


# ---------------------------------------------------------------- build_datasets and the loader


def test_build_datasets_splits_by_document(gpt_data):
    indexed, docs = gpt_data
    ranges = split_ranges(len(docs), "80,10,10")
    assert ranges == [(0, 24), (24, 27), (27, 30)]
    assert split_ranges(1000, "949,50,1") == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges(10, "98,2") == [(0, 9), (9, 10), (10, 10)]
    train, valid, test = build_datasets(config("gpt", indexed.path_prefix, 8, split="80,10,10"), None)
    assert len(train) >= 10 * 4 and len(valid) >= 2 * 4 and len(test) >= 2 * 4
    for ds, (begin, end) in zip((train, valid, test), ranges, strict=True):
        seen = {doc_of(int(t)) for i in range(len(ds)) for t in ds.tokens(i) if t != EOD}
        assert seen == set(range(begin, end))
    _, _, empty = build_datasets(config("gpt", indexed.path_prefix, 8, split="98,2"), None)
    assert len(empty) == 0


def test_build_datasets_blend_and_bert(gpt_data, bert_data, tok, tmp_path):
    indexed, _ = gpt_data
    other = write_indexed(tmp_path / "other", gpt_documents(20, np.random.default_rng(5)))
    cfg = config("gpt", f"0.25 {indexed.path_prefix} 0.75 {other.path_prefix}", 8)
    train, valid, _ = build_datasets(cfg, None)
    assert isinstance(train, BlendedDataset) and len(train) >= 40 and len(valid) >= 8
    shares = np.bincount(np.asarray(train.dataset_index), minlength=2) / len(train)
    assert shares == pytest.approx([0.25, 0.75], abs=1 / len(train) + 1e-9)
    bert = build_datasets(config("bert", bert_data.path_prefix, 32, split="90,10,0"), tok)
    assert len(bert[0]) >= 40 and len(bert[1]) >= 8 and len(bert[2]) == 0
    assert set(bert[0][0]) == {"input_ids", "token_type_ids", "attention_mask", "labels", "nsp_labels"}


def test_build_datasets_errors(gpt_data, tmp_path):
    indexed, _ = gpt_data
    missing = str(tmp_path / "nope_text_document")
    with pytest.raises(FileNotFoundError, match="nope_text_document"):
        build_datasets(config("gpt", missing, 8), None)
    with pytest.raises(FileNotFoundError, match=r"without \.bin/\.idx"):
        build_datasets(config("gpt", indexed.path_prefix + ".bin", 8), None)
    with pytest.raises(ValueError, match=r"'-1' in data\.path is not a positive number"):
        build_datasets(config("gpt", f"-1 {indexed.path_prefix} 2 {missing}", 8), None)
    small = config("gpt", indexed.path_prefix, 8)
    small.model.vocab_size = 1000  # the fixture's ids go up to ~31000
    with pytest.raises(IndexedDatasetError, match="vocab size is 1000"):
        build_datasets(small, None)


def test_build_datasets_checks_bert_ids_against_the_tokenizer(bert_data, tok, tmp_path):
    words = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *(f"w{i}" for i in range(100))])}
    small = Tokenizer(HFTokenizer(models.WordPiece(words, unk_token="[UNK]")), name="small")
    with pytest.raises(IndexedDatasetError, match=r"wiki.*vocab size is 106"):
        build_datasets(config("bert", bert_data.path_prefix, 32), small)


def _stream(loader, n: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(loader), n))


def test_loader_layout_independent_and_resumable(gpt_data):
    indexed, _ = gpt_data
    ds = GPTDataset(indexed, 8, seed=0, num_samples=200)
    single = _stream(build_loader(ds, 4, consumed_samples=0, seed=0), 12)
    ranks = [_stream(build_loader(ds, 2, 0, seed=0, dp_rank=r, dp_size=2), 12) for r in range(2)]
    for one, r0, r1 in zip(single, *ranks, strict=True):
        assert torch.equal(one["input_ids"], torch.cat([r0["input_ids"], r1["input_ids"]]))
    # The datasets are pre-shuffled: the loader reads them in order, across the end of the dataset.
    assert torch.equal(single[0]["input_ids"], torch.stack([ds[i]["input_ids"] for i in range(4)]))
    resumed = _stream(build_loader(ds, 2, consumed_samples=20, seed=0, dp_rank=1, dp_size=2), 7)
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(ranks[1][5:], resumed, strict=True))


def test_loader_workers_match_in_process(bert_data, tok):
    ds = BertDataset(bert_data, tok, 32, seed=0, num_samples=100)
    inline = _stream(build_loader(ds, 4, consumed_samples=8, seed=0), 6)
    loader = build_loader(ds, 4, consumed_samples=8, seed=0, num_workers=2, prefetch_factor=2)
    assert loader.persistent_workers and loader.prefetch_factor == 2 and not loader.pin_memory
    workers = _stream(loader, 6)
    for a, b in zip(inline, workers, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_datasets_pickle_without_their_mappings(gpt_data, bert_data, tok):
    # What a spawn/forkserver DataLoader worker receives: prefixes and cache paths, not arrays.
    indexed, _ = gpt_data
    gpt = GPTDataset(indexed, 8, seed=0, num_samples=20_000)
    bert = BertDataset(bert_data, tok, 32, seed=0, num_samples=20_000)
    for ds, mapping in ((gpt, gpt.sample_idx), (bert, bert.samples)):
        blob = pickle.dumps(ds)
        assert len(blob) < mapping.nbytes / 2
        copy = pickle.loads(blob)
        for i in (0, 7, len(ds) - 1):
            assert all(torch.equal(ds[i][k], copy[i][k]) for k in ds[i])
