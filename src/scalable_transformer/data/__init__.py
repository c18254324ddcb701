"""Data: the embedded corpus and tokenizer, BERT/GPT pretraining datasets and the resumable loader."""

from scalable_transformer.data.bert_dataset import BertDataset
from scalable_transformer.data.corpus import embedded_corpus, embedded_documents, split_sentences
from scalable_transformer.data.gpt_dataset import GPTDataset
from scalable_transformer.data.loader import (
    PretrainingSampler,
    build_datasets,
    build_loader,
    eval_batches,
    split_documents,
)
from scalable_transformer.data.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "BertDataset",
    "GPTDataset",
    "PretrainingSampler",
    "Tokenizer",
    "build_datasets",
    "build_loader",
    "embedded_corpus",
    "embedded_documents",
    "eval_batches",
    "load_tokenizer",
    "split_documents",
    "split_sentences",
]
