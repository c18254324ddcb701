"""Model-type dispatch: build a model, feed it a batch, score its outputs, count its parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.bert import BertModel, bert_loss
from scalable_transformer.models.gpt import GPTModel, gpt_loss
from scalable_transformer.models.layers import check_model_config, norm_numel, padded_vocab_size

MODELS: dict[str, type[nn.Module]] = {"bert": BertModel, "gpt": GPTModel}
_INPUT_KEYS = {"bert": ("input_ids", "token_type_ids", "attention_mask"), "gpt": ("input_ids",)}


def _check_type(model_type: str) -> None:
    if model_type not in MODELS:
        raise ValueError(f"model.type={model_type!r} is not one of {tuple(MODELS)}")


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised fp32 model on the CPU (or the current default device) for a resolved cfg."""
    check_model_config(cfg)
    return MODELS[cfg.type](cfg)


def model_inputs(model_type: str, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The positional arguments of the model's forward, taken from a batch dict."""
    _check_type(model_type)
    missing = [key for key in _INPUT_KEYS[model_type] if key not in batch]
    if missing:
        raise KeyError(f"{model_type} batch lacks {missing}; it has {sorted(batch)}")
    return tuple(batch[key] for key in _INPUT_KEYS[model_type])


def compute_loss(
    model_type: str, outputs: Any, batch: dict[str, torch.Tensor], normalizers: dict[str, int] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss to backprop, detached fp32 scalar metrics incl. "loss"). Counts (mlm_correct,
    mlm_count, binary_correct, binary_count) are exact integers held in fp32 so all metrics can be
    reduced together. `normalizers` = step-wide counts for gradient accumulation (see `bert_loss`)."""
    _check_type(model_type)
    if model_type == "bert":
        return bert_loss(outputs, batch, normalizers)
    return gpt_loss(outputs, batch, normalizers)


def count_parameters_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, without building the model; the values sum to `count_parameters(cfg)`.
    `layers` is num_layers times one block. Tied output weights are counted once, in `embedding`."""
    check_model_config(cfg)
    assert cfg.vocab_size is not None and cfg.ffn_hidden_size is not None
    assert cfg.max_position_embeddings is not None
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    norm = norm_numel(cfg)
    post_ln = cfg.apply_residual_connection_post_layernorm
    bert = cfg.type == "bert"

    embedding = vocab * h
    if cfg.position_embedding_type == "learned":
        embedding += cfg.max_position_embeddings * h
    if bert:
        embedding += cfg.num_tokentypes * h
    if post_ln:
        embedding += norm

    up = 2 * f if cfg.activation == "geglu" else f
    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * up + up) + (f * h + h)
    block = attention + mlp + 2 * norm

    untied_decoder = 0 if cfg.tie_word_embeddings else vocab * h
    if bert:
        lm_head = (h * h + h) + norm + vocab + untied_decoder
        binary_head = (h * h + h) + (2 * h + 2) if cfg.bert_binary_head else 0
    else:
        lm_head, binary_head = untied_decoder, 0
    return {
        "embedding": embedding,
        "layers": cfg.num_layers * block,
        "final_norm": 0 if post_ln else norm,
        "lm_head": lm_head,
        "binary_head": binary_head,
    }


def count_parameters(cfg: ModelConfig) -> int:
    """Exactly sum(p.numel() for p in build_model(cfg).parameters()), computed analytically."""
    return sum(count_parameters_breakdown(cfg).values())
