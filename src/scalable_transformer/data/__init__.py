"""Data: tokenizers, Megatron indexed datasets, BERT/GPT samples, blends and the resumable loader."""

from scalable_transformer.data.bert_dataset import BertDataset
from scalable_transformer.data.blend import BlendedDataset, parse_blend
from scalable_transformer.data.corpus import embedded_corpus, embedded_documents, split_sentences
from scalable_transformer.data.gpt_dataset import GPTDataset
from scalable_transformer.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    check_vocab,
)
from scalable_transformer.data.loader import (
    PretrainingSampler,
    build_datasets,
    build_loader,
    eval_batches,
    parse_split,
    split_ranges,
)
from scalable_transformer.data.preprocess import preprocess
from scalable_transformer.data.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "BertDataset",
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "PretrainingSampler",
    "Tokenizer",
    "build_datasets",
    "build_loader",
    "check_vocab",
    "embedded_corpus",
    "embedded_documents",
    "eval_batches",
    "load_tokenizer",
    "parse_blend",
    "parse_split",
    "preprocess",
    "split_ranges",
    "split_sentences",
]
