"""Datasets from the config, and the resumable, data-parallel-sharded pretraining loader.

Every dataset is a Megatron indexed dataset: `data.path` (one prefix or a weighted blend), or the
embedded corpus preprocessed once into the user cache. Each prefix is split by document into
contiguous train/valid/test ranges (`data.split`, Megatron's rounding), and each range becomes a
GPT or BERT dataset whose index mappings are sized for what the run consumes and already shuffled
(Megatron's shuffle_idx / shuffled samples mapping), so the loader reads them in order.

Sample order is a pure function of (seed, position in the sample stream), and global batch g is
stream positions [g*B, (g+1)*B) with B = micro_batch_size * dp_size, rank r taking its contiguous
slice of micro_batch_size. So the global batches do not depend on the data-parallel layout, and a
run resumed at consumed_samples yields exactly what the uninterrupted run would have from there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from scalable_transformer.cache import cache_dir
from scalable_transformer.config.rules import parse_split
from scalable_transformer.data.bert_dataset import BertDataset
from scalable_transformer.data.blend import BlendedDataset, blend_sizes, parse_blend
from scalable_transformer.data.corpus import _atomic_write, corpus_fingerprint, embedded_corpus
from scalable_transformer.data.gpt_dataset import GPTDataset
from scalable_transformer.data.indexed import IndexedDataset, IndexedDatasetError, check_vocab
from scalable_transformer.data.preprocess import preprocess
from scalable_transformer.data.tokenizers import Tokenizer
from scalable_transformer.models import get_spec, spec_for
from scalable_transformer.models.spec import DataSpec

if TYPE_CHECKING:
    from scalable_transformer.config.schema import Config

# Bump when the preprocessed embedded corpus changes (document order, preprocess settings).
EMBEDDED_DATA_VERSION = 1
# The corpus is stored sorted by name (pydoc topics, then modules); Megatron's split takes
# contiguous document ranges, so the documents are written in a fixed shuffled order first, which
# makes valid/test a random sample of the corpus and keeps them fixed whatever the training seed.
_EMBEDDED_ORDER_SEED = 0
SPLIT_NAMES = ("train", "valid", "test")


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Contiguous document ranges [begin, end) of train, valid and test.

    Megatron's rounding: the bounds are round(cumulative weight * num_documents). Where that leaves a
    split with a positive weight empty, documents move to it from the largest split (Megatron would
    leave it empty), so "949,50,1" always yields a test set when there are 3 documents or more.
    """
    weights = parse_split(split)
    needed = sum(w > 0 for w in weights)
    if num_documents < needed:
        raise ValueError(f"cannot split {num_documents} documents into {needed} non-empty parts ({split!r})")
    cumulative = np.cumsum([0.0, *weights])
    bounds = [round(c * num_documents) for c in cumulative]
    bounds[-1] = num_documents
    sizes = [bounds[k + 1] - bounds[k] for k in range(3)]
    for k in range(3):
        while weights[k] > 0 and sizes[k] == 0:
            donor = int(np.argmax(sizes))
            sizes[donor] -= 1
            sizes[k] += 1
    ends = np.cumsum(sizes).tolist()
    return [(ends[k] - sizes[k], ends[k]) for k in range(3)]


def embedded_dataset_prefix(tokenizer: Tokenizer, family: str) -> str:
    """Prefix of the embedded corpus preprocessed for model family `family` with `tokenizer`, built on
    first use in the user cache, as the family's `DataSpec.corpus` says: sentence-split (BERT) or
    documents closed by EOD (GPT)."""
    data = get_spec(family).data
    kind = data.corpus
    corpus_key = corpus_fingerprint()[:16]
    root = cache_dir() / "datasets"
    prefix = root / f"embedded-v{EMBEDDED_DATA_VERSION}-{kind}-{tokenizer.fingerprint}-{corpus_key}"
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        try:
            IndexedDataset(prefix)
            return str(prefix)
        except IndexedDatasetError:
            pass  # damaged cache: preprocess again and replace it
    jsonl = root / f"embedded-v{EMBEDDED_DATA_VERSION}-{corpus_key}.jsonl"
    if not jsonl.is_file():
        docs = embedded_corpus()
        order = np.random.default_rng(_EMBEDDED_ORDER_SEED).permutation(len(docs))
        lines = (json.dumps({"name": docs[i][0], "text": docs[i][1]}, ensure_ascii=False) for i in order)
        _atomic_write(jsonl, ("\n".join(lines) + "\n").encode("utf-8"))
    # preprocess writes under temporary names and renames: concurrent ranks cannot see half a file.
    preprocess(
        [str(jsonl)],
        str(prefix),
        tokenizer,
        split_sentences=data.split_sentences,
        append_eod=data.append_eod,
        progress=False,
    )
    return str(prefix)


def open_indexed(prefix: str, what: str = "data.path") -> IndexedDataset:
    """The indexed dataset at `prefix`, or a FileNotFoundError naming it and what was looked for."""
    path = Path(prefix).expanduser()
    missing = [str(p) for p in (Path(f"{path}.bin"), Path(f"{path}.idx")) if not p.is_file()]
    if missing:
        hint = " (give the prefix, without .bin/.idx)" if path.suffix in (".bin", ".idx") else ""
        raise FileNotFoundError(f"{what}: dataset {prefix!r} not found: missing {', '.join(missing)}{hint}")
    return IndexedDataset(str(path))


def _global_batch_size(cfg: Config) -> int:
    t = cfg.train
    if t.global_batch_size is not None:
        return t.global_batch_size
    return t.micro_batch_size * (t.gradient_accumulation_steps or 1) * max(cfg.parallel.dp, 1)


def samples_needed(cfg: Config) -> tuple[int, int, int]:
    """Samples the run reads from train, valid and test: train_iters * global batch, and
    eval_iters * global batch for each evaluation split (every evaluation reads the same batches)."""
    batch = _global_batch_size(cfg)
    return cfg.train.train_iters * batch, cfg.train.eval_iters * batch, cfg.train.eval_iters * batch


def _dataset(
    cfg: Config,
    tokenizer: Tokenizer,
    indexed: IndexedDataset,
    documents: tuple[int, int],
    num_samples: int | None,
) -> Dataset:
    kind = spec_for(cfg.model).data.dataset
    if kind not in _DATASETS:
        raise ValueError(f"no dataset class for data kind {kind!r}; known: {tuple(_DATASETS)}")
    return _DATASETS[kind](cfg, tokenizer, indexed, documents, num_samples)


def _causal_lm_dataset(
    cfg: Config,
    tokenizer: Tokenizer,
    indexed: IndexedDataset,
    documents: tuple[int, int],
    num_samples: int | None,
) -> Dataset:
    m = cfg.model
    documents_ids = m.reset_position_ids or m.reset_attention_mask
    packed = documents_ids or cfg.data.eod_mask_loss
    return GPTDataset(
        indexed,
        m.seq_length,
        cfg.train.seed,
        num_samples,
        documents,
        eod_id=tokenizer.eod_id if packed else None,
        document_ids=documents_ids,
        mask_eod_loss=cfg.data.eod_mask_loss,
    )


def _masked_lm_dataset(
    cfg: Config,
    tokenizer: Tokenizer,
    indexed: IndexedDataset,
    documents: tuple[int, int],
    num_samples: int | None,
) -> Dataset:
    seq_length, seed = cfg.model.seq_length, cfg.train.seed
    return BertDataset(
        indexed,
        tokenizer,
        seq_length,
        seed,
        num_samples,
        documents,
        mask_prob=cfg.data.mask_prob,
        short_seq_prob=cfg.data.short_seq_prob,
        binary_head=cfg.model.bert_binary_head,
        binary_head_task=cfg.data.binary_head_task,
        whole_word_masking=cfg.data.whole_word_masking,
    )


_DATASETS = {"causal-lm": _causal_lm_dataset, "masked-lm": _masked_lm_dataset}


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[Dataset, Dataset, Dataset]:
    """Train, valid and test datasets of the model family's data kind (`DataSpec`), cfg.model.seq_length
    tokens per sample, from cfg.data.path (or the embedded corpus) split by document (cfg.data.split).

    Sized for the run: train holds at least train_iters * global batch samples, valid and test
    eval_iters * global batch (a split with weight 0 is empty). Token ids are checked against the
    vocabulary: the tokenizer's when the family needs it (BERT), else the model's (cfg.model.vocab_size).
    """
    spec = spec_for(cfg.model)  # ValueError naming the known model types
    data: DataSpec = spec.data
    # BERT draws [MASK] and random replacements from the tokenizer, so its ids must be the
    # tokenizer's; GPT only needs ids the model can embed.
    vocab_size = (
        tokenizer.vocab_size if data.tokenizer_vocab else cfg.model.vocab_size or tokenizer.vocab_size
    )
    if cfg.data.path is None:
        blend = [(1.0, embedded_dataset_prefix(tokenizer, spec.name))]
        names = ["the embedded corpus"]
    else:
        blend = parse_blend(cfg.data.path)
        names = [f"{prefix!r} of data.path" for _, prefix in blend]
    weights = [w for w, _ in blend]
    indexed = [open_indexed(prefix) for _, prefix in blend]
    for ds, name in zip(indexed, names, strict=True):
        check_vocab(ds, vocab_size, name)
    ranges = [split_ranges(ds.num_documents, cfg.data.split) for ds in indexed]
    split_weights = parse_split(cfg.data.split)
    out: list[Dataset] = []
    for k, size in enumerate(samples_needed(cfg)):
        size = size if split_weights[k] > 0 else 0
        if len(blend) == 1:
            out.append(_dataset(cfg, tokenizer, indexed[0], ranges[0][k], size or None))
            continue
        taken, build = blend_sizes(weights, size)
        parts = []
        for j, ds in enumerate(indexed):
            part = _dataset(cfg, tokenizer, ds, ranges[j][k], build[j] or None)
            if len(part) < taken[j]:  # type: ignore[arg-type]
                raise ValueError(
                    f"{names[j]}: its {SPLIT_NAMES[k]} split (documents {ranges[j][k]}) yields no samples"
                )
            parts.append(part)
        out.append(BlendedDataset(parts, weights, sum(taken)))
    return out[0], out[1], out[2]


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
    pin_memory: bool | None = None,
    *,
    prefetch_factor: int = 4,
    shuffle: bool = False,
) -> DataLoader:
    """An endless training loader of collated micro-batches (dict of stacked LongTensors [b, ...])
    for data-parallel rank `dp_rank`, starting after `consumed_samples` samples of the global stream.

    The datasets of `build_datasets` are already shuffled by their index mappings, so they are read
    in order (shuffle=False, as Megatron's pretraining sampler); shuffle=True permutes every epoch
    of the dataset by (seed, epoch). With num_workers > 0, that many persistent worker processes
    each keep `prefetch_factor` micro-batches in flight. pin_memory: None = when CUDA is available.
    """
    sampler = PretrainingSampler(
        len(dataset),  # type: ignore[arg-type]
        consumed_samples,
        micro_batch_size,
        dp_rank,
        dp_size,
        seed,
        shuffle=shuffle,
    )
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    workers = {"prefetch_factor": prefetch_factor, "persistent_workers": True} if num_workers > 0 else {}
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=default_collate,
        pin_memory=pin_memory,
        **workers,  # type: ignore[arg-type]
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
