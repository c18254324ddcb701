"""GPT: causal decoder with a language-model head (tied to the word embeddings by default).

Shape legend: b batch, s sequence, h hidden, v padded vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from scalable_transformer.config.rules import padded_vocab_size
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.context_parallel import ContextParallel
from scalable_transformer.models.layers import (
    Embedding,
    Logits,
    TransformerBlock,
    blocks_of,
    check_model_config,
    context_parallel_inputs,
    document_mask,
    document_positions,
    init_weights,
    make_norm,
    rotary_for,
    rotary_length,
    run_blocks,
    shared_bias,
)
from scalable_transformer.models.spec import IGNORE_INDEX, PLAIN_LOSS_OPS, LossOps


class GPTModel(nn.Module):
    """embedding -> blocks -> final_norm -> logits (output matrix or the tied word embedding). A
    pipeline stage is this class with parts removed (models/stage.py): `has_embedding` / `has_head`
    say which run."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_model_config(cfg)
        assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
        self.cfg = cfg
        vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        self.embedding = Embedding(cfg, vocab, num_tokentypes=0)
        self.rotary = rotary_for(cfg)
        self.recompute_chunk = 0  # set by parallel.apply for chunked full recompute
        self.recompute_checkpoint = None  # and where such a chunk keeps its input
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, causal=True, layer=i) for i in range(cfg.num_layers)
        )
        # Post-LN blocks already end on a norm.
        self.final_norm = None if cfg.apply_residual_connection_post_layernorm else make_norm(cfg)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.logits = Logits()
        self.has_embedding = self.has_head = True
        self.context_parallel: ContextParallel | None = None  # set by parallel/context.py
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Name-seeded Megatron init (models.layers.init_weights); seed None: torch.initial_seed()."""
        init_weights(self, self.cfg, seed)

    def forward(self, inputs: torch.Tensor, document_ids_bs: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] (or, without the embedding, hidden states x [b, s, h]) -> next-token
        logits [b, s, v], or x [b, s, h] without the head. document_ids_bs: each token's document in
        a packed sample, which model.reset_position_ids / reset_attention_mask restart positions and
        attention at (every pipeline stage gets them)."""
        cfg = self.cfg
        docs = document_ids_bs
        if self.context_parallel is not None:  # this rank's tokens; positions and mask global
            x_bsh, bias, rotary = self._context_parallel_inputs(inputs, docs)
        else:
            positions_bs = document_positions(docs) if docs is not None and cfg.reset_position_ids else None
            x_bsh = self.embedding(inputs, positions_bs=positions_bs) if self.has_embedding else inputs
            seq = rotary_length(inputs, self.has_embedding, docs, cfg.seq_length)
            rotary = None if self.rotary is None else self.rotary(seq, positions_bs)
            bias = shared_bias(self.layers, seq, x_bsh)  # sliding window, ALiBi: causality included
            if docs is not None and cfg.reset_attention_mask:
                bias = document_mask(docs, bias)
        x_bsh = run_blocks(
            blocks_of(self.layers), x_bsh, bias, rotary, self.recompute_chunk, self.recompute_checkpoint
        )
        if not self.has_head:
            return x_bsh
        if self.final_norm is not None:
            x_bsh = self.final_norm(x_bsh)
        weight_vh = self.embedding.word.weight if self.output is None else self.output.weight
        return self.logits(x_bsh, weight_vh)

    def _context_parallel_inputs(
        self, input_ids_bs: torch.Tensor, docs_bs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """(stack input, attention mask of global positions, rotary tables) of this cp rank's tokens."""
        cp, cfg = self.context_parallel, self.cfg
        assert cp is not None
        # a later pipeline stage gets hidden states (a sequence shard of them under SP): static length
        local_seq = input_ids_bs.shape[1] if self.has_embedding else cfg.seq_length // cp.size
        positions_bs, mask = context_parallel_inputs(
            cp,
            self.layers,
            input_ids_bs,
            local_seq,
            document_ids_bs=docs_bs,
            reset_position_ids=cfg.reset_position_ids,
            reset_attention_mask=cfg.reset_attention_mask,
        )
        x_bsh = (
            self.embedding(input_ids_bs, positions_bs=positions_bs) if self.has_embedding else input_ids_bs
        )
        rotary = None if self.rotary is None else self.rotary(local_seq * cp.size, positions_bs)
        return x_bsh, mask, rotary


def gpt_loss(
    logits_bsv: torch.Tensor,
    batch: dict[str, torch.Tensor],
    normalizers: dict[str, int] | None = None,
    ops: LossOps = PLAIN_LOSS_OPS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token cross-entropy (fp32) averaged over positions whose label is not -100.

    With `normalizers` ({"tokens": labelled positions of the whole optimizer step}) the result is
    this micro-batch's share of the step's mean (see `bert_loss`). `ops` reduces over the
    vocabulary (tensor parallelism passes versions for sharded logits).
    """
    labels_n = batch["labels"].reshape(-1)
    count = (labels_n != IGNORE_INDEX).sum()
    loss = ops.cross_entropy_sum(logits_bsv, labels_n, IGNORE_INDEX)
    # Sum / clamp(count) rather than mean: a fully ignored micro-batch gives 0, not NaN.
    loss = loss / (normalizers["tokens"] if normalizers else count.clamp(min=1))
    return loss, {"lm_loss": loss.detach(), "loss": loss.detach()}


def gpt_metric_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The metric keys `gpt_loss` returns (the same for every GPT)."""
    return ("loss", "lm_loss")
