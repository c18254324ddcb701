"""BERT pretraining samples over a sentence-split Megatron indexed dataset, with Megatron-LM's semantics.

Legend: s = seq_length; items of the indexed dataset are sentences, documents are ranges of them
(document_indices).
The samples mapping is built once per (data, document range, s, seed, num_samples, short_seq_prob,
binary head) and cached as .npy beside the data: rows (first sentence, end sentence, target length,
document), shuffled. Per epoch and document, sentences are accumulated until the target length:
  * target = max_num_tokens = s - 3 ([CLS] A [SEP] B [SEP]), or s - 2 without a binary head; with
    probability short_seq_prob it is drawn uniformly from [2, max_num_tokens] instead;
  * a sample is cut at the target unless fewer than two sentences would remain, and always at the
    end of the document; documents with fewer sentences than a sample needs (2 with a binary head),
    and documents of several sentences one of which is over 512 tokens, are skipped (Megatron's rules);
  * epochs are added until `num_samples` rows exist (complete epochs, each with fresh targets).
Everything else happens in `__getitem__`, seeded by (seed, index), so a sample is the same on every
rank, worker and resume:
  * binary head: A = the first k sentences (k uniform in [1, n-1]), B = the rest. nsp_labels = 1
    ("is_random", Megatron's name) means B is NOT the true continuation:
      nsp -- with probability 0.5, B is replaced by sentences of a random other document from a
             random start (original BERT; the row's unused sentences are not reused here);
      sop -- with probability 0.5, A and B are swapped (what Megatron's BERT does);
  * the pair is truncated to the target by removing tokens from the longer segment, from the front
    or the back with equal probability (Megatron's truncate_segments);
  * masking: mask_prob of the non-special tokens (at least one) are selected -- whole words (a piece
    starting with "##" joins the word before it) with whole_word_masking; of the selected tokens
    80% become [MASK], 10% a random non-special token, 10% stay unchanged. labels hold the original
    id where selected and -100 elsewhere (the loss mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from scalable_transformer.data.gpt_dataset import (
    CachedIndexMixin,
    data_identity,
    document_range,
    load_or_build_index,
)

if TYPE_CHECKING:
    from scalable_transformer.data.indexed import IndexedDataset
    from scalable_transformer.data.tokenizers import Tokenizer

# Megatron skips documents holding a sentence longer than this (tokens).
LONG_SENTENCE_LEN = 512
_MAPPING_STREAM, _MAPPING_SHUFFLE_STREAM, _SAMPLE_STREAM = 21, 22, 23


def build_samples_mapping(
    document_indices: np.ndarray,
    sentence_lengths: np.ndarray,
    first_doc: int,
    max_num_tokens: int,
    short_seq_prob: float,
    min_sentences: int,
    seed: int,
    num_samples: int | None,
) -> np.ndarray:
    """Shuffled rows (first sentence, end sentence, target length, document), int64 [n, 4], for
    documents first_doc, first_doc + 1, ... whose sentence ranges are `document_indices` (len = docs + 1).
    """
    bounds = np.asarray(document_indices, dtype=np.int64)
    counts = np.diff(bounds)
    longest = np.zeros(len(counts), dtype=np.int64)
    nonempty = counts > 0
    if nonempty.any():
        # reduceat over the non-empty documents only: it misreads zero-length ranges.
        longest[nonempty] = np.maximum.reduceat(
            np.asarray(sentence_lengths[bounds[0] : bounds[-1]], dtype=np.int64),
            (bounds[:-1] - bounds[0])[nonempty],
        )
    # As Megatron: the long-sentence rule applies to documents of several sentences only.
    usable = np.flatnonzero((counts >= min_sentences) & ((counts == 1) | (longest <= LONG_SENTENCE_LEN)))
    rows: list[tuple[int, int, int, int]] = []
    if len(usable) == 0:
        return np.zeros((0, 4), dtype=np.int64)
    lengths = sentence_lengths[bounds[usable[0]] : bounds[usable[-1] + 1]].tolist()
    base = int(bounds[usable[0]])
    draws = int(counts[usable].sum()) + len(usable)  # one target per document start and per cut
    rng = np.random.default_rng([seed, _MAPPING_STREAM])
    epoch = 0
    while epoch == 0 or (num_samples is not None and len(rows) < num_samples):
        short = rng.random(draws) < short_seq_prob
        targets = np.where(short, rng.integers(2, max_num_tokens + 1, draws), max_num_tokens).tolist()
        t = 0
        before = len(rows)
        for d in usable.tolist():
            first, last = int(bounds[d]), int(bounds[d + 1])
            target, t = targets[t], t + 1
            start, seq_len, num_sent = first, 0, 0
            for sent in range(first, last):
                seq_len += lengths[sent - base]
                num_sent += 1
                remaining = last - sent - 1
                if (seq_len >= target and remaining > 1 and num_sent >= min_sentences) or remaining == 0:
                    rows.append((start, sent + 1, target, first_doc + d))
                    start, seq_len, num_sent = sent + 1, 0, 0
                    target, t = targets[t], t + 1
        if len(rows) == before:
            break
        epoch += 1
    mapping = np.array(rows, dtype=np.int64).reshape(-1, 4)
    order = np.random.default_rng([seed, _MAPPING_SHUFFLE_STREAM]).permutation(len(mapping))
    return mapping[order]


def continuation_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Boolean array over the vocabulary: True where the token is a WordPiece continuation ("##...")."""
    hf = tokenizer.hf
    flags = np.zeros(tokenizer.vocab_size, dtype=bool)
    for i in range(tokenizer.vocab_size):
        token = hf.id_to_token(i)
        flags[i] = token is not None and token.startswith("##")
    return flags


def _check_options(seq_length: int, mask_prob: float, short_seq_prob: float, binary_head_task: str) -> None:
    if binary_head_task not in ("nsp", "sop"):
        raise ValueError(f"binary_head_task must be 'nsp' or 'sop', got {binary_head_task!r}")
    if not 0.0 < mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    if seq_length < 8:
        raise ValueError(f"seq_length must be at least 8 for BERT samples, got {seq_length}")


class BertDataset(CachedIndexMixin, Dataset):
    """Map-style BERT dataset over documents [begin, end) of a sentence-split indexed dataset.

    Item i is a dict of LongTensors: input_ids [s], token_type_ids [s], attention_mask [s] (1 real,
    0 pad), labels [s] (original id at selected positions, -100 elsewhere) and, with a binary head,
    nsp_labels [] (1 = random next / swapped). len() is every row of the epochs built, at least
    `num_samples` (None = one epoch).
    """

    INDEX_NAMES = ("samples",)

    def __init__(
        self,
        indexed: IndexedDataset,
        tokenizer: Tokenizer,
        seq_length: int,
        seed: int,
        num_samples: int | None = None,
        documents: tuple[int, int] | None = None,
        *,
        mask_prob: float = 0.15,
        short_seq_prob: float = 0.1,
        binary_head: bool = True,
        binary_head_task: str = "nsp",
        whole_word_masking: bool = False,
    ) -> None:
        _check_options(seq_length, mask_prob, short_seq_prob, binary_head_task)
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed
        self.mask_prob = mask_prob
        self.binary_head = binary_head
        self.nsp = binary_head and binary_head_task == "nsp"
        self.sop = binary_head and binary_head_task == "sop"
        self.whole_word_masking = whole_word_masking
        self.max_num_tokens = seq_length - (3 if binary_head else 2)
        self.documents = document_range(indexed, documents)
        self._tokens(tokenizer, whole_word_masking)
        self._samples_mapping(short_seq_prob, num_samples)

    def _tokens(self, tokenizer: Tokenizer, whole_word_masking: bool) -> None:
        """The special ids, the pool random replacements are drawn from, and the word continuations."""
        self.cls_id, self.sep_id = tokenizer.cls_id, tokenizer.sep_id
        self.mask_id, self.pad_id = tokenizer.mask_id, tokenizer.pad_id
        special = tokenizer.special_ids | {self.cls_id, self.sep_id, self.mask_id, self.pad_id}
        self._is_special = np.zeros(tokenizer.vocab_size, dtype=bool)
        self._is_special[sorted(special)] = True
        # Random replacements are drawn from real tokens only, never [MASK]/[PAD]/...
        self._random_pool = np.flatnonzero(~self._is_special).astype(np.int32)
        self._continuation = np.zeros(0, dtype=bool)
        if whole_word_masking:
            self._continuation = continuation_ids(tokenizer)
            if not self._continuation.any():
                raise ValueError(
                    f"whole_word_masking needs a WordPiece tokenizer (pieces spelled '##...'); "
                    f"{tokenizer.name or 'the tokenizer'} has none"
                )

    def _samples_mapping(self, short_seq_prob: float, num_samples: int | None) -> None:
        """The rows (first sentence, end sentence, target length, document), from the cache or built."""
        indexed, seed = self.indexed, self.seed
        begin, end = self.documents
        self.description = {
            **data_identity(indexed),
            "documents": [begin, end],
            "seq_length": self.seq_length,
            "seed": seed,
            "num_samples": num_samples,
            "short_seq_prob": short_seq_prob,
            "binary_head": self.binary_head,
        }
        bounds = np.asarray(indexed.document_indices[begin : end + 1], dtype=np.int64)
        min_sentences = 2 if self.binary_head else 1
        arrays, self.cache_path, self.cache_hit = load_or_build_index(
            indexed.path_prefix,
            "bert",
            self.description,
            self.INDEX_NAMES,
            lambda: {
                "samples": build_samples_mapping(
                    bounds,
                    indexed.sequence_lengths,
                    begin,
                    self.max_num_tokens,
                    short_seq_prob,
                    min_sentences,
                    seed,
                    num_samples,
                )
            },
        )
        self.samples = arrays["samples"]
        if len(self.samples) == 0 and end > begin:
            raise ValueError(
                f"no BERT samples in documents [{begin}, {end}) of {indexed.path_prefix}: a sample needs "
                f"documents of at least {min_sentences} sentence(s) of at most {LONG_SENTENCE_LEN} tokens "
                "(was the data preprocessed with --split-sentences?)"
            )
        # Documents a random next segment can come from (NSP).
        self._other_docs = begin + np.flatnonzero(np.diff(bounds) > 0)

    def __len__(self) -> int:
        return len(self.samples)

    def _sentences(self, first: int, last: int) -> list[np.ndarray]:
        return [np.asarray(self.indexed[i], dtype=np.int64) for i in range(first, last)]

    def _random_next(self, doc: int, target_b: int, rng: np.random.Generator) -> np.ndarray | None:
        """Sentences of a random other document, from a random start, until `target_b` tokens."""
        others = self._other_docs
        here = int(np.searchsorted(others, doc))
        has_self = here < len(others) and others[here] == doc
        n = len(others) - has_self
        if n <= 0:
            return None
        k = int(rng.integers(n))
        other = int(others[k + 1 if has_self and k >= here else k])
        first, last = int(self.indexed.document_indices[other]), int(self.indexed.document_indices[other + 1])
        picked: list[np.ndarray] = []
        total = 0
        for sent in range(int(rng.integers(first, last)), last):
            picked.append(np.asarray(self.indexed[sent], dtype=np.int64))
            total += len(picked[-1])
            if total >= target_b:
                break
        return np.concatenate(picked)

    def _segments(self, idx: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None, int, int]:
        """(A, B or None, target length, is_random) of sample `idx`."""
        first, last, target, doc = (int(v) for v in self.samples[idx])
        sentences = self._sentences(first, last)
        if not self.binary_head:
            return np.concatenate(sentences), None, target, 0
        pivot = int(rng.integers(1, len(sentences))) if len(sentences) >= 3 else 1
        tokens_a = np.concatenate(sentences[:pivot])
        tokens_b = np.concatenate(sentences[pivot:])
        is_random = int(rng.random() < 0.5)
        if is_random and self.sop:
            tokens_a, tokens_b = tokens_b, tokens_a
        elif is_random:
            replacement = self._random_next(doc, target - len(tokens_a), rng)
            if replacement is None:  # a single document: nothing to draw from
                is_random = 0
            else:
                tokens_b = replacement
        return tokens_a, tokens_b, target, is_random

    def _assemble(
        self, tokens_a: np.ndarray, tokens_b: np.ndarray | None, target: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """[CLS] A [SEP] (B [SEP]) and token types, after Megatron's truncate_segments."""
        len_a, len_b = len(tokens_a), 0 if tokens_b is None else len(tokens_b)
        a0, a1, b0, b1 = 0, len_a, 0, len_b  # kept ranges
        excess = len_a + len_b - target
        if excess > 0:
            for from_front in (rng.random(excess) < 0.5).tolist():
                if a1 - a0 > b1 - b0:
                    a0, a1 = (a0 + 1, a1) if from_front else (a0, a1 - 1)
                else:
                    b0, b1 = (b0 + 1, b1) if from_front else (b0, b1 - 1)
        cls, sep = [self.cls_id], [self.sep_id]
        if tokens_b is None:
            tokens = np.concatenate([cls, tokens_a[a0:a1], sep]).astype(np.int64)
            return tokens, np.zeros(len(tokens), dtype=np.int64)
        tokens = np.concatenate([cls, tokens_a[a0:a1], sep, tokens_b[b0:b1], sep]).astype(np.int64)
        types = np.zeros(len(tokens), dtype=np.int64)
        types[a1 - a0 + 2 :] = 1
        return tokens, types

    def _select(self, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Sorted positions to predict: mask_prob of the non-special tokens, at least one; whole
        words (a '##' piece after a non-special token joins it) with whole_word_masking."""
        candidates = np.flatnonzero(~self._is_special[tokens])
        if len(candidates) == 0:
            return candidates
        budget = min(len(candidates), max(1, round(len(candidates) * self.mask_prob)))
        if not self.whole_word_masking:
            return np.sort(candidates[rng.permutation(len(candidates))[:budget]])
        joins = self._continuation[tokens[candidates]]
        joins[1:] &= np.diff(candidates) == 1  # a piece right after [SEP] starts a word of its own
        joins[0] = False
        word_starts = np.flatnonzero(~joins)
        word_sizes = np.diff(np.append(word_starts, len(candidates)))
        picked: list[int] = []
        total = 0
        # Megatron's order: words in random order, skipping any that would overshoot the budget.
        for w in rng.permutation(len(word_starts)).tolist():
            if total >= budget:
                break
            size = int(word_sizes[w])
            if picked and total + size > budget:
                continue
            picked.append(w)
            total += size
        positions = [candidates[word_starts[w] : word_starts[w] + word_sizes[w]] for w in picked]
        return np.sort(np.concatenate(positions))

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        rng = np.random.default_rng([self.seed, _SAMPLE_STREAM, idx])
        tokens_a, tokens_b, target, is_random = self._segments(idx, rng)
        tokens, types = self._assemble(tokens_a, tokens_b, target, rng)
        n, s = len(tokens), self.seq_length

        labels = np.full(s, -100, dtype=np.int64)
        picked = self._select(tokens, rng)
        labels[picked] = tokens[picked]
        action = rng.random(len(picked))
        to_mask = picked[action < 0.8]
        to_random = picked[(action >= 0.8) & (action < 0.9)]
        tokens[to_mask] = self.mask_id
        tokens[to_random] = self._random_pool[rng.integers(len(self._random_pool), size=len(to_random))]

        input_ids = np.full(s, self.pad_id, dtype=np.int64)
        input_ids[:n] = tokens
        token_type_ids = np.zeros(s, dtype=np.int64)
        token_type_ids[:n] = types
        attention_mask = np.zeros(s, dtype=np.int64)
        attention_mask[:n] = 1
        sample = {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
        }
        if self.binary_head:
            sample["nsp_labels"] = torch.from_numpy(np.array(is_random, dtype=np.int64))
        return sample
