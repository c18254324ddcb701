"""GPT: causal decoder with a language-model head (tied to the word embeddings by default).

Shape legend: b batch, s sequence, h hidden, v padded vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.layers import (
    Embedding,
    Logits,
    RotaryEmbedding,
    TransformerBlock,
    check_model_config,
    cross_entropy_sum,
    init_weights,
    make_norm,
    padded_vocab_size,
    run_blocks,
)

IGNORE_INDEX = -100


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_model_config(cfg)
        assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
        self.cfg = cfg
        vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.embedding = Embedding(cfg, vocab, num_tokentypes=0)
        self.rotary = (
            RotaryEmbedding(head_dim, cfg.rotary_base, cfg.max_position_embeddings)
            if cfg.position_embedding_type == "rotary"
            else None
        )
        self.recompute_chunk = 0  # set by parallel.apply for chunked full recompute
        self.layers = nn.ModuleList(TransformerBlock(cfg, causal=True) for _ in range(cfg.num_layers))
        # Post-LN blocks already end on a norm.
        self.final_norm = None if cfg.apply_residual_connection_post_layernorm else make_norm(cfg)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.logits = Logits()
        self.init_weights()

    def init_weights(self) -> None:
        init_weights(self, self.cfg)

    def forward(self, input_ids_bs: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] -> next-token logits [b, s, v]."""
        x_bsh = self.embedding(input_ids_bs)
        rotary = None if self.rotary is None else self.rotary(input_ids_bs.shape[1])
        x_bsh = run_blocks(self.layers, x_bsh, None, rotary, self.recompute_chunk)
        if self.final_norm is not None:
            x_bsh = self.final_norm(x_bsh)
        weight_vh = self.embedding.word.weight if self.output is None else self.output.weight
        return self.logits(x_bsh, weight_vh)


def gpt_loss(
    logits_bsv: torch.Tensor, batch: dict[str, torch.Tensor], normalizers: dict[str, int] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token cross-entropy (fp32) averaged over positions whose label is not -100.

    With `normalizers` ({"tokens": labelled positions of the whole optimizer step}) the result is
    this micro-batch's share of the step's mean (see `bert_loss`).
    """
    labels_n = batch["labels"].reshape(-1)
    count = (labels_n != IGNORE_INDEX).sum()
    loss = cross_entropy_sum(logits_bsv.reshape(labels_n.numel(), -1), labels_n, IGNORE_INDEX)
    # Sum / clamp(count) rather than mean: a fully ignored micro-batch gives 0, not NaN.
    loss = loss / (normalizers["tokens"] if normalizers else count.clamp(min=1))
    return loss, {"lm_loss": loss.detach(), "loss": loss.detach()}
