"""Datasets from the config, and the resumable, data-parallel-sharded pretraining loader.

Sample order is a pure function of (seed, position in the sample stream): the stream is epoch 0's
permutation of the dataset, then epoch 1's, ... and global batch g is stream positions
[g*B, (g+1)*B) with B = micro_batch_size * dp_size, rank r taking its contiguous slice of
micro_batch_size. So the global batches do not depend on the data-parallel layout, and a run resumed
at consumed_samples yields exactly what the uninterrupted run would have from there.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from scalable_transformer.data.bert_dataset import BertDataset
from scalable_transformer.data.corpus import (
    _atomic_write,
    corpus_fingerprint,
    embedded_documents,
    split_sentences,
)
from scalable_transformer.data.gpt_dataset import GPTDataset
from scalable_transformer.data.tokenizers import Tokenizer
from scalable_transformer.metrics.hardware import cache_dir

if TYPE_CHECKING:
    from scalable_transformer.config.schema import Config

# Bump when tokenization of the corpus (sentence splitting, layout of the cache) changes.
TOKENS_CACHE_VERSION = 1
# The document split must not move when the training seed changes (runs with different seeds are
# compared on the same validation set), so the documents are shuffled with a fixed seed of their own.
_SPLIT_SEED = 0


class TokenizedCorpus:
    """The embedded corpus as token ids: documents -> sentences -> ids, in flat numpy arrays.

    Sentences are tokenized separately, and since the sentence splitter only cuts at whitespace their
    concatenation is the tokenization of the whole document (what GPT uses).
    """

    def __init__(self, tokens: np.ndarray, sentence_lengths: np.ndarray, doc_sentences: np.ndarray) -> None:
        self.tokens = tokens
        self.sentence_lengths = sentence_lengths
        self.doc_sentences = doc_sentences
        self._sentence_starts = np.concatenate([[0], np.cumsum(sentence_lengths)])
        self._doc_starts = np.concatenate([[0], np.cumsum(doc_sentences)])

    def __len__(self) -> int:
        return len(self.doc_sentences)

    def sentences(self, doc: int) -> list[np.ndarray]:
        """The sentences of document `doc`, as views into the token array."""
        s0, s1 = self._doc_starts[doc], self._doc_starts[doc + 1]
        starts = self._sentence_starts
        return [self.tokens[starts[i] : starts[i + 1]] for i in range(s0, s1)]

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (a view)."""
        s0, s1 = self._doc_starts[doc], self._doc_starts[doc + 1]
        return self.tokens[self._sentence_starts[s0] : self._sentence_starts[s1]]


def tokenize_embedded_corpus(tokenizer: Tokenizer) -> TokenizedCorpus:
    """The embedded corpus tokenized by `tokenizer`, cached (.npz, keyed by the tokenizer and corpus
    fingerprints) so a second run skips the ~1-2 s of tokenization."""
    path = cache_dir() / (
        f"tokens-v{TOKENS_CACHE_VERSION}-{tokenizer.fingerprint}-{corpus_fingerprint()[:16]}.npz"
    )
    if path.is_file():
        try:
            with np.load(path) as z:
                return TokenizedCorpus(z["tokens"], z["sentence_lengths"], z["doc_sentences"])
        except (OSError, ValueError, KeyError):
            pass  # corrupt cache: rebuild and overwrite it
    per_doc = [split_sentences(text) for text in embedded_documents()]
    ids = tokenizer.encode_batch([s for sents in per_doc for s in sents])
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    tokens = np.fromiter((t for sent in ids for t in sent), dtype=dtype, count=sum(map(len, ids)))
    sentence_lengths = np.array([len(s) for s in ids], dtype=np.int64)
    doc_sentences = np.array([len(sents) for sents in per_doc], dtype=np.int64)
    buf = io.BytesIO()
    np.savez(buf, tokens=tokens, sentence_lengths=sentence_lengths, doc_sentences=doc_sentences)
    with contextlib.suppress(OSError):  # unwritable cache: still usable, just tokenized again next time
        _atomic_write(path, buf.getvalue())
    return TokenizedCorpus(tokens, sentence_lengths, doc_sentences)


def parse_split(split: str) -> tuple[float, float, float]:
    """Normalised train/valid/test weights from Megatron's split string ("949,50,1", "98/2", "1,0,0");
    missing trailing weights are 0."""
    try:
        weights = [float(w) for w in re.split(r"[,/]", split.strip()) if w.strip()]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"data.split must be 1-3 non-negative weights like '949,50,1' with a positive sum, got {split!r}"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def split_documents(num_documents: int, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document indices of train, valid and test: a fixed-seed shuffle of all documents cut by the
    weights of `split` (rounded as Megatron), moving documents out of train so that every split with a
    positive weight gets at least one."""
    weights = parse_split(split)
    needed = sum(w > 0 for w in weights)
    if num_documents < needed:
        raise ValueError(f"cannot split {num_documents} documents into {needed} non-empty parts ({split!r})")
    sizes = [round(w * num_documents) for w in weights]
    sizes[0] += num_documents - sum(sizes)
    for k in (1, 2):
        while weights[k] > 0 and sizes[k] == 0:
            donor = int(np.argmax(sizes))
            sizes[donor] -= 1
            sizes[k] += 1
    order = np.random.default_rng(_SPLIT_SEED).permutation(num_documents)
    bounds = np.cumsum([0, *sizes])
    train, valid, test = (np.sort(order[bounds[k] : bounds[k + 1]]) for k in range(3))
    return train, valid, test


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[Dataset, Dataset, Dataset]:
    """Train, valid and test datasets of `cfg.model.type` ("bert" or "gpt") with cfg.model.seq_length
    tokens per sample, from the embedded corpus split by document (cfg.data.split)."""
    if cfg.data.path is not None:
        raise ValueError(f"data.path={cfg.data.path!r}: indexed datasets are not supported yet (issue 3)")
    if cfg.model.type not in ("bert", "gpt"):
        raise ValueError(f"model.type must be 'bert' or 'gpt', got {cfg.model.type!r}")
    corpus = tokenize_embedded_corpus(tokenizer)
    parts = split_documents(len(corpus), cfg.data.split)
    seq_length, seed = cfg.model.seq_length, cfg.train.seed
    datasets: list[Dataset]
    if cfg.model.type == "gpt":
        datasets = [
            GPTDataset([corpus.document(d) for d in docs], seq_length, tokenizer.eod_id, seed)
            for docs in parts
        ]
    else:
        datasets = [
            BertDataset(
                [corpus.sentences(d) for d in docs],
                tokenizer,
                seq_length,
                mask_prob=cfg.data.mask_prob,
                short_seq_prob=cfg.data.short_seq_prob,
                binary_head_task=cfg.data.binary_head_task,
                seed=seed,
                binary_head=cfg.model.bert_binary_head,
            )
            for docs in parts
        ]
    return datasets[0], datasets[1], datasets[2]


class PretrainingSampler(Sampler[list[int]]):
    """Endless micro-batches of dataset indices for one data-parallel rank (see the module docstring).

    Epoch e's order is a permutation seeded by (seed, e) (identity when shuffle=False); the stream runs
    on across epoch boundaries, so no sample is dropped and a global batch may span two epochs.
    The trainer counts consumed samples itself (with worker prefetch the sampler runs ahead).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if total_samples <= 0:
            raise ValueError(f"cannot sample from an empty dataset (total_samples={total_samples})")
        if micro_batch_size <= 0 or dp_size <= 0:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be positive"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if consumed_samples < 0 or consumed_samples % (micro_batch_size * dp_size):
            raise ValueError(
                f"consumed_samples ({consumed_samples}) must be a non-negative multiple of "
                f"micro_batch_size * dp_size ({micro_batch_size * dp_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = (
                np.random.default_rng([self.seed, 3, epoch]).permutation(self.total_samples)
                if self.shuffle
                else np.arange(self.total_samples)
            )
        return self._orders[epoch]

    def index_at(self, position: int) -> int:
        """Dataset index at `position` of the global sample stream."""
        epoch, offset = divmod(position, self.total_samples)
        return int(self._order(epoch)[offset])

    def __iter__(self) -> Iterator[list[int]]:
        global_batch = self.micro_batch_size * self.dp_size
        position = self.consumed_samples + self.dp_rank * self.micro_batch_size
        while True:
            yield [self.index_at(p) for p in range(position, position + self.micro_batch_size)]
            position += global_batch


def build_loader(
    dataset: Dataset,
    micro_batch_size: int,
    consumed_samples: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """An endless training loader of collated micro-batches (dict of stacked LongTensors [b, ...])
    for data-parallel rank `dp_rank`, starting after `consumed_samples` samples of the global stream."""
    sampler = PretrainingSampler(
        len(dataset),  # type: ignore[arg-type]
        consumed_samples,
        micro_batch_size,
        dp_rank,
        dp_size,
        seed,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=default_collate,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


def eval_batches(
    dataset: Dataset, micro_batch_size: int, num_batches: int, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """`num_batches` collated micro-batches of `dataset` in index order, wrapping around when it is
    small; with dp_size > 1 each rank takes its slice of every global batch, as in training."""
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    global_batch = micro_batch_size * dp_size
    for b in range(num_batches):
        start = b * global_batch + dp_rank * micro_batch_size
        yield default_collate([dataset[(start + j) % n] for j in range(micro_batch_size)])
