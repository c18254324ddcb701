"""Data: embedded corpus and tokenizer, the corpus through the indexed pipeline, the resumable sampler.

The datasets themselves are tested on small indexed fixtures in test_datasets_indexed.py.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from bert_checks import MaskTally, check_bert_sample

from scalable_transformer.config.schema import Config
from scalable_transformer.data import corpus as corpus_mod
from scalable_transformer.data.bert_dataset import BertDataset
from scalable_transformer.data.corpus import embedded_corpus, embedded_documents, split_sentences
from scalable_transformer.data.gpt_dataset import GPTDataset
from scalable_transformer.data.indexed import IndexedDataset
from scalable_transformer.data.loader import (
    PretrainingSampler,
    build_datasets,
    build_loader,
    embedded_dataset_prefix,
    eval_batches,
    parse_split,
    split_ranges,
)
from scalable_transformer.data.tokenizers import SPECIAL_TOKENS, Tokenizer, load_tokenizer, train_wordpiece

VOCAB = 2000
SEQ = 64


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """A private cache directory, so these tests build corpus, tokenizer and token cache from scratch."""
    path = tmp_path_factory.mktemp("data-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STX_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def docs(cache) -> list[str]:
    return embedded_documents()


@pytest.fixture(scope="session")
def tok(cache, docs) -> Tokenizer:
    return load_tokenizer("embedded", VOCAB)


def config(model_type: str = "bert", **data) -> Config:
    cfg = Config()
    cfg.model.type = model_type
    cfg.model.seq_length = SEQ
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


@pytest.fixture(scope="session")
def bert_sets(tok):
    return build_datasets(config("bert"), tok)


# ---------------------------------------------------------------- corpus


def test_corpus_is_deterministic_sizable_and_cached(cache, docs):
    names = [name for name, _ in embedded_corpus()]
    assert names == sorted(names)
    assert len(docs) > 300
    assert sum(map(len, docs)) > 1_000_000
    text = "\n".join(docs)
    assert "Assert statements are a convenient way to insert debugging assertions" in text  # a pydoc topic
    assert "JSON (JavaScript Object Notation)" in text  # the json module docstring
    assert not any(n.startswith(("module:test.", "module:idlelib", "module:lib2to3")) for n in names)
    assert any(n.startswith("topic:") for n in names) and any(n.startswith("module:") for n in names)
    # No temporary files were left behind.
    files = sorted(p.name for p in cache.iterdir() if p.name.startswith(("corpus-", ".corpus")))
    assert len(files) == 1 and files[0].endswith(".jsonl")


def test_corpus_rebuilds_a_corrupt_cache(cache, docs):
    path = corpus_mod._cache_path()
    good = path.read_bytes()
    cached = embedded_corpus()
    try:
        path.write_text('{"name": "x"\n')
        assert embedded_corpus() == cached  # a fresh build equals what the cache held
        assert path.read_bytes() == good
    finally:
        path.write_bytes(good)


def test_split_sentences():
    text = (
        "Return the value. Raises ValueError if absent, e.g. when x is None! Is it?  Yes\n"
        "it is (see Fig. 3 by J. Smith).\n\n   New paragraph without a period\nbut a line break"
    )
    assert split_sentences(text) == [
        "Return the value.",
        "Raises ValueError if absent, e.g. when x is None!",
        "Is it?",
        "Yes it is (see Fig. 3 by J. Smith).",
        "New paragraph without a period but a line break",
    ]
    assert split_sentences("version 3.11. lower case follows") == ["version 3.11. lower case follows"]
    assert split_sentences("") == []


def test_split_sentences_keeps_every_character(docs):
    for doc in docs[::25]:
        assert "".join(split_sentences(doc)).replace(" ", "") == "".join(doc.split())


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_and_round_trip(tok):
    assert tok.vocab_size == VOCAB
    ids = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.eod_id]
    assert ids == [tok.hf.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(6))
    text = "Return a new List containing all items from the iterable, in ascending order."
    (encoded,) = tok.encode_batch([text])
    assert not set(encoded) & set(ids)  # no [CLS]/[SEP] added
    assert tok.decode(encoded) == text.lower()
    assert any(tok.hf.id_to_token(i).startswith("##") for i in tok.encode("iterables ascendingly"))


def test_tokenizer_sentences_concatenate_to_the_document(tok, docs):
    for doc in docs[::40]:
        assert tok.encode(doc) == [t for s in tok.encode_batch(split_sentences(doc)) for t in s]


def test_tokenizer_cache_and_path_loading(cache, tok, tmp_path):
    path = next(cache.glob(f"tokenizer-*-{VOCAB}-*.json"))
    assert load_tokenizer("embedded", VOCAB).fingerprint == tok.fingerprint
    from_file = load_tokenizer(str(path))
    assert from_file.fingerprint == tok.fingerprint
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_tokenizer(str(bad))


def test_tokenizer_training_is_reproducible(docs):
    # The trainer breaks frequency ties in hash-map order; the ids must not depend on it.
    a, b = (train_wordpiece(docs[:40], 400).to_str() for _ in range(2))
    assert a == b


def test_tokenizer_without_bert_tokens(tmp_path, tok):
    spec = json.loads(tok.hf.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in ("[UNK]", "[SEP]")]
    spec["post_processor"] = None
    vocab = spec["model"]["vocab"]
    for t in ("[PAD]", "[CLS]", "[MASK]", "<|endoftext|>"):
        del vocab[t]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    other = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert other.eod_id == other.sep_id == tok.sep_id
    with pytest.raises(ValueError, match=r"\[MASK\]"):
        _ = other.mask_id


# ---------------------------------------------------------------- the embedded corpus as indexed datasets


@pytest.mark.slow
def test_embedded_corpus_is_preprocessed_once(cache, tok, bert_sets):
    prefix = embedded_dataset_prefix(tok, "bert")
    assert prefix.startswith(str(cache / "datasets")) and tok.fingerprint in prefix
    indexed = IndexedDataset(prefix)
    assert indexed.num_documents == len(embedded_documents())
    assert indexed.num_documents < len(indexed)  # sentence-split: several sequences per document
    assert indexed.max_token_id() < tok.vocab_size
    eod = IndexedDataset(embedded_dataset_prefix(tok, "gpt"))
    assert len(eod) == eod.num_documents == indexed.num_documents
    last = [int(eod[d][-1]) for d in range(0, eod.num_documents, 50)]
    assert last == [tok.eod_id] * len(last)  # every document closed by EOD
    # Contiguous split ranges, cached mappings: the second build reads the same samples.
    train = bert_sets[0]
    assert isinstance(train, BertDataset) and train.documents[0] == 0
    again = build_datasets(config("bert"), tok)[0]
    assert again.cache_hit and np.array_equal(train.samples, again.samples)  # type: ignore[attr-defined]
    files = {p.name for p in (cache / "datasets").iterdir()}
    assert not [f for f in files if f.endswith(".tmp")]
    # A damaged cached dataset is preprocessed again, not trusted. (Damaged by replacing the file:
    # truncating it in place would pull the pages from under the open datasets' memory maps.)
    idx = Path(f"{prefix}.idx")
    good = idx.read_bytes()
    broken = idx.with_suffix(".broken")
    broken.write_bytes(good[:100])
    os.replace(broken, idx)
    assert embedded_dataset_prefix(tok, "bert") == prefix and idx.read_bytes() == good


def test_bert_sample_invariants(tok, bert_sets):
    train, valid, test = bert_sets
    assert len(train) >= 300 * 16 and len(valid) >= 10 * 16 and len(test) >= 1
    tally = MaskTally()
    for i in range(0, 4000, 2):
        check_bert_sample(train[i], tok, SEQ, tally)
    assert tally.selected / tally.candidates == pytest.approx(0.15, abs=0.01)
    assert tally.replaced_by_mask / tally.selected == pytest.approx(0.8, abs=0.02)
    assert tally.kept / tally.selected == pytest.approx(0.1 + 0.1 / tok.vocab_size, abs=0.02)
    assert np.mean(tally.nsp) == pytest.approx(0.5, abs=0.05)
    # Shorter samples with probability short_seq_prob (0.1), plus the ends of documents.
    assert 0.08 < np.mean(np.array(tally.lengths) < SEQ) < 0.5


def test_bert_is_deterministic_per_seed(tok, bert_sets):
    again = build_datasets(config("bert"), tok)[0]
    assert all(torch.equal(bert_sets[0][i]["input_ids"], again[i]["input_ids"]) for i in range(0, 500, 7))
    cfg = config("bert")
    cfg.train.seed += 1
    other = build_datasets(cfg, tok)[0]
    assert not all(torch.equal(bert_sets[0][i]["input_ids"], other[i]["input_ids"]) for i in range(20))
    with pytest.raises(ValueError, match="binary_head_task"):
        BertDataset(again.indexed, tok, SEQ, seed=0, binary_head_task="mlm")  # type: ignore[attr-defined]


def test_gpt_from_corpus(tok):
    train, valid, _ = build_datasets(config("gpt"), tok)
    assert isinstance(train, GPTDataset) and len(train) >= 300 * 16 and len(valid) >= 10 * 16
    x = train[0]
    assert x["input_ids"].shape == x["labels"].shape == (SEQ,)
    assert torch.equal(x["input_ids"][1:], x["labels"][:-1])
    eods = sum(int((train[i]["input_ids"] == tok.eod_id).sum()) for i in range(0, len(train), 4))
    assert eods > 50


# ---------------------------------------------------------------- split


def test_split_ranges():
    train, valid, test = split_ranges(415, "949,50,1")
    assert valid[1] - valid[0] == 21 and test[1] - test[0] >= 1 and train[0] == 0 and test[1] == 415
    assert train[1] == valid[0] and valid[1] == test[0]  # contiguous, Megatron's way
    assert [b - a for a, b in split_ranges(10, "98,2")] == [9, 1, 0]
    assert parse_split("1/1") == (0.5, 0.5, 0.0)
    for bad in ("", "a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match=r"data\.split"):
            parse_split(bad)
    with pytest.raises(ValueError, match="cannot split 2 documents"):
        split_ranges(2, "1,1,1")


# ---------------------------------------------------------------- sampler and loader


def _take(sampler: PretrainingSampler, n: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), n))


def test_sampler_global_batches_do_not_depend_on_dp():
    total, mbs, seed = 37, 4, 7  # 37 samples: global batches straddle epoch boundaries
    single = _take(PretrainingSampler(total, 0, 2 * mbs, 0, 1, seed), 30)
    ranks = [_take(PretrainingSampler(total, 0, mbs, r, 2, seed), 30) for r in range(2)]
    assert [r0 + r1 for r0, r1 in zip(*ranks, strict=True)] == single
    stream = [i for batch in single for i in batch]
    epochs = [stream[k : k + total] for k in range(0, 5 * total, total)]
    assert all(sorted(e) == list(range(total)) for e in epochs)  # every epoch is a permutation
    assert epochs[0] != epochs[1]


def test_sampler_resume_and_seed():
    full = _take(PretrainingSampler(50, 0, 3, 1, 2, seed=5), 40)
    for k in (0, 6, 42, 96):  # 96 is past the first epoch
        assert _take(PretrainingSampler(50, k, 3, 1, 2, seed=5), 10) == full[k // 6 : k // 6 + 10]
    assert _take(PretrainingSampler(50, 0, 3, 1, 2, seed=6), 40) != full
    assert _take(PretrainingSampler(5, 0, 2, 0, 1, seed=5, shuffle=False), 3) == [[0, 1], [2, 3], [4, 0]]
    with pytest.raises(ValueError, match="multiple"):
        PretrainingSampler(50, 5, 3, 0, 2, seed=5)
    with pytest.raises(ValueError, match="empty"):
        PretrainingSampler(0, 0, 3, 0, 1, seed=5)


def test_loader_resumes_the_uninterrupted_stream(bert_sets):
    train = bert_sets[0]
    full = list(itertools.islice(iter(build_loader(train, 4, consumed_samples=0, seed=11)), 6))
    resumed = list(itertools.islice(iter(build_loader(train, 4, consumed_samples=12, seed=11)), 3))
    assert full[0]["input_ids"].shape == (4, SEQ) and full[0]["nsp_labels"].shape == (4,)
    for a, b in zip(full[3:], resumed, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_batches_in_order_with_wraparound():
    ds = [{"input_ids": torch.arange(4) + 10 * i} for i in range(12)]
    batches = list(eval_batches(ds, 5, 4))  # type: ignore[arg-type]
    assert len(batches) == 4 and batches[0]["input_ids"].shape == (5, 4)
    expected = [ds[i % len(ds)]["input_ids"] for i in range(20)]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), torch.stack(expected))
    ranks = [list(eval_batches(ds, 2, 3, dp_rank=r, dp_size=2)) for r in range(2)]  # type: ignore[arg-type]
    joined = torch.cat([torch.cat([r0["input_ids"], r1["input_ids"]]) for r0, r1 in zip(*ranks, strict=True)])
    assert torch.equal(joined, torch.stack(expected[:12]))
