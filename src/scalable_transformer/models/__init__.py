"""Plain PyTorch Megatron-style BERT and GPT; nothing here knows about distribution."""

from scalable_transformer.models.bert import BertModel
from scalable_transformer.models.gpt import GPTModel
from scalable_transformer.models.layers import TransformerBlock, padded_vocab_size
from scalable_transformer.models.registry import (
    MODELS,
    build_model,
    compute_loss,
    count_parameters,
    count_parameters_breakdown,
    model_inputs,
)

__all__ = [
    "MODELS",
    "BertModel",
    "GPTModel",
    "TransformerBlock",
    "build_model",
    "compute_loss",
    "count_parameters",
    "count_parameters_breakdown",
    "model_inputs",
    "padded_vocab_size",
]
