"""BERT pretraining samples with Megatron-LM's semantics, held in memory.

Legend: s = seq_length.
Samples are cut from documents once, in `__init__` (Megatron's samples mapping + segment logic):
  * sentences are accumulated until a target length is reached: max_num_tokens = s - 3 ([CLS] A [SEP]
    B [SEP]) or s - 2 without a binary head; with probability short_seq_prob the target is drawn
    uniformly from [2, max_num_tokens] instead;
  * binary head: A = the first k sentences (k uniform in [1, n-1]), B = the rest. Label 1 ("is_random",
    Megatron's name, and HF's next_sentence_label convention) means B is NOT the true continuation:
      nsp -- with probability 0.5, B is replaced by sentences from a random other document, and the
             unused sentences of this chunk go back to the pool (original BERT);
      sop -- with probability 0.5, A and B are swapped (what Megatron's BERT actually does);
  * the pair is truncated to the target by removing tokens from the longer segment, from the front
    or the back with equal probability (Megatron's truncate_segments).
Masking happens in `__getitem__`, seeded by (seed, index), so a sample is the same on every rank,
worker and resume: mask_prob of the non-special positions (at least one) are selected; of those 80%
become [MASK], 10% a random non-special token, 10% stay unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from scalable_transformer.data.tokenizers import Tokenizer


class BertDataset(Dataset):
    """Map-style BERT dataset. Item i is a dict of LongTensors:
    input_ids [s], token_type_ids [s], attention_mask [s] (1 real, 0 pad), labels [s] (original id at
    masked positions, -100 elsewhere) and, with a binary head, nsp_labels [] (1 = random next / swapped).
    """

    def __init__(
        self,
        documents_tokens: Sequence[Sequence[Sequence[int] | np.ndarray]],
        tokenizer: Tokenizer,
        seq_length: int,
        mask_prob: float = 0.15,
        short_seq_prob: float = 0.1,
        binary_head_task: str = "nsp",
        seed: int = 1234,
        binary_head: bool = True,
    ) -> None:
        if binary_head_task not in ("nsp", "sop"):
            raise ValueError(f"binary_head_task must be 'nsp' or 'sop', got {binary_head_task!r}")
        if not 0.0 < mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
        if not 0.0 <= short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
        if seq_length < 8:
            raise ValueError(f"seq_length must be at least 8 for BERT samples, got {seq_length}")
        self.seq_length = seq_length
        self.mask_prob = mask_prob
        self.short_seq_prob = short_seq_prob
        self.binary_head_task = binary_head_task
        self.binary_head = binary_head
        self.seed = seed
        self.cls_id, self.sep_id = tokenizer.cls_id, tokenizer.sep_id
        self.mask_id, self.pad_id = tokenizer.mask_id, tokenizer.pad_id
        special = tokenizer.special_ids | {self.cls_id, self.sep_id, self.mask_id, self.pad_id}
        self._special = np.array(sorted(special), dtype=np.int64)
        # Random replacements are drawn from real tokens only, never [MASK]/[PAD]/...
        self._random_pool = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), self._special)
        self.max_num_tokens = seq_length - (3 if binary_head else 2)
        docs = [self._chop(doc) for doc in documents_tokens]
        self._build(docs, np.random.default_rng([seed, 0]))

    def _chop(self, doc: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """Sentences as int arrays; empty ones dropped and ones longer than a whole sample cut into
        pieces, so no sample is one sentence truncated by hundreds of tokens (Megatron instead drops
        documents with sentences over 512 tokens)."""
        out: list[np.ndarray] = []
        for sent in doc:
            arr = np.asarray(sent, dtype=np.int64)
            for start in range(0, len(arr), self.max_num_tokens):
                out.append(arr[start : start + self.max_num_tokens])
        return out

    def _target_length(self, rng: np.random.Generator) -> int:
        if rng.random() < self.short_seq_prob:
            return int(rng.integers(2, self.max_num_tokens + 1))
        return self.max_num_tokens

    def _build(self, docs: list[list[np.ndarray]], rng: np.random.Generator) -> None:
        nsp = self.binary_head and self.binary_head_task == "nsp"
        min_sentences = 2 if self.binary_head else 1
        nonempty = [d for d, sents in enumerate(docs) if sents]
        samples: list[tuple[np.ndarray, np.ndarray, int]] = []  # (tokens, token types, is_random)
        for d, sents in enumerate(docs):
            if len(sents) < min_sentences:
                continue
            target = self._target_length(rng)
            chunk: list[np.ndarray] = []
            chunk_len = 0
            i = 0
            while i < len(sents):
                chunk.append(sents[i])
                chunk_len += len(sents[i])
                i += 1
                remaining = len(sents) - i
                # Megatron's cut rule: at the target length, unless that would leave a tail too short
                # for a sample of its own; always at the end of the document.
                if remaining and not (
                    chunk_len >= target and len(chunk) >= min_sentences and remaining >= min_sentences
                ):
                    continue
                if not self.binary_head:
                    tokens_a, tokens_b, is_random = np.concatenate(chunk), None, 0
                else:
                    a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
                    tokens_a = np.concatenate(chunk[:a_end])
                    if nsp and len(nonempty) > 1 and (len(chunk) == 1 or rng.random() < 0.5):
                        tokens_b = self._random_next(docs, nonempty, d, target - len(tokens_a), rng)
                        is_random = 1
                        i -= len(chunk) - a_end  # the unused sentences start the next chunk
                    elif len(chunk) >= 2:
                        tokens_b = np.concatenate(chunk[a_end:])
                        is_random = 0
                        if not nsp and rng.random() < 0.5:
                            tokens_a, tokens_b, is_random = tokens_b, tokens_a, 1
                    else:  # a lone sentence with nothing to pair it with
                        chunk, chunk_len = [], 0
                        continue
                samples.append(self._assemble(tokens_a, tokens_b, target, is_random, rng))
                chunk, chunk_len = [], 0
                target = self._target_length(rng)
        n, s = len(samples), self.seq_length
        self._tokens = np.full((n, s), self.pad_id, dtype=np.int64)
        self._types = np.zeros((n, s), dtype=np.int64)
        self._lengths = np.zeros(n, dtype=np.int64)
        self._is_random = np.zeros(n, dtype=np.int64)
        for k, (tokens, types, is_random) in enumerate(samples):
            self._tokens[k, : len(tokens)] = tokens
            self._types[k, : len(types)] = types
            self._lengths[k] = len(tokens)
            self._is_random[k] = is_random

    @staticmethod
    def _random_next(
        docs: list[list[np.ndarray]], nonempty: list[int], d: int, target_b: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Sentences of a random other document, from a random start, until `target_b` tokens."""
        other = d
        while other == d:
            other = nonempty[int(rng.integers(len(nonempty)))]
        sents = docs[other]
        start = int(rng.integers(len(sents)))
        picked: list[np.ndarray] = []
        n = 0
        for sent in sents[start:]:
            picked.append(sent)
            n += len(sent)
            if n >= target_b:
                break
        return np.concatenate(picked)

    def _assemble(
        self,
        tokens_a: np.ndarray,
        tokens_b: np.ndarray | None,
        target: int,
        is_random: int,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """[CLS] A [SEP] (B [SEP]) with token types, after Megatron's truncate_segments."""
        len_a, len_b = len(tokens_a), 0 if tokens_b is None else len(tokens_b)
        a0, a1, b0, b1 = 0, len_a, 0, len_b  # kept ranges
        excess = len_a + len_b - target
        if excess > 0:
            front = rng.random(excess) < 0.5
            for from_front in front:
                if a1 - a0 > b1 - b0:
                    a0, a1 = (a0 + 1, a1) if from_front else (a0, a1 - 1)
                else:
                    b0, b1 = (b0 + 1, b1) if from_front else (b0, b1 - 1)
        cls, sep = [self.cls_id], [self.sep_id]
        if tokens_b is None:
            tokens = np.concatenate([cls, tokens_a[a0:a1], sep])
            return tokens, np.zeros(len(tokens), dtype=np.int64), is_random
        tokens = np.concatenate([cls, tokens_a[a0:a1], sep, tokens_b[b0:b1], sep])
        types = np.zeros(len(tokens), dtype=np.int64)
        types[a1 - a0 + 2 :] = 1
        return tokens, types, is_random

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        n = int(self._lengths[idx])
        tokens = self._tokens[idx].copy()
        labels = np.full(self.seq_length, -100, dtype=np.int64)
        rng = np.random.default_rng([self.seed, 1, idx])
        candidates = np.flatnonzero(~np.isin(tokens[:n], self._special))
        if len(candidates):
            num = min(len(candidates), max(1, round(len(candidates) * self.mask_prob)))
            picked = np.sort(rng.choice(candidates, size=num, replace=False))
            labels[picked] = tokens[picked]
            action = rng.random(num)
            to_mask = picked[action < 0.8]
            to_random = picked[(action >= 0.8) & (action < 0.9)]
            tokens[to_mask] = self.mask_id
            tokens[to_random] = self._random_pool[rng.integers(len(self._random_pool), size=len(to_random))]
        attention_mask = np.zeros(self.seq_length, dtype=np.int64)
        attention_mask[:n] = 1
        sample = {
            "input_ids": torch.from_numpy(tokens),
            "token_type_ids": torch.from_numpy(self._types[idx].copy()),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
        }
        if self.binary_head:
            sample["nsp_labels"] = torch.tensor(int(self._is_random[idx]), dtype=torch.long)
        return sample
