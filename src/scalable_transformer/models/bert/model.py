"""Megatron-style BERT: bidirectional encoder, masked-LM head and optional binary (NSP/SOP) head.

Shape legend: b batch, s sequence, h hidden, v padded vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    init_weights,
    make_norm,
    rotary_for,
    rotary_length,
    run_blocks,
)
from scalable_transformer.models.spec import IGNORE_INDEX, PLAIN_LOSS_OPS, LossOps


class BertLMHead(nn.Module):
    """dense -> gelu -> norm -> decoder (the word embeddings when tied) + per-token output bias."""

    def __init__(self, cfg: ModelConfig, vocab: int) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.approximate = "tanh" if cfg.activation == "openai-gelu" else "none"
        self.norm = make_norm(cfg)
        self.decoder = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.logits = Logits()

    def forward(self, x_bsh: torch.Tensor, word_weight_vh: torch.Tensor | None) -> torch.Tensor:
        x_bsh = self.norm(F.gelu(self.dense(x_bsh), approximate=self.approximate))
        weight_vh = word_weight_vh if self.decoder is None else self.decoder.weight
        assert weight_vh is not None, "a tied BertLMHead needs the word embedding weight"
        return self.logits(x_bsh, weight_vh, bias_v=self.bias)


class BertModel(nn.Module):
    """embedding -> blocks -> final_norm -> lm_head (+ pooler -> binary_head). A pipeline stage is
    this class with parts removed (models/stage.py): `has_embedding` / `has_head` say which run."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_model_config(cfg)
        assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
        self.cfg = cfg
        vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        self.embedding = Embedding(cfg, vocab, cfg.num_tokentypes)
        self.rotary = rotary_for(cfg)
        self.recompute_chunk = 0  # set by parallel.apply for chunked full recompute
        self.recompute_checkpoint = None  # and where such a chunk keeps its input
        self.layers = nn.ModuleList(TransformerBlock(cfg, causal=False) for _ in range(cfg.num_layers))
        # Post-LN blocks already end on a norm.
        self.final_norm = None if cfg.apply_residual_connection_post_layernorm else make_norm(cfg)
        self.lm_head = BertLMHead(cfg, vocab)
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if cfg.bert_binary_head else None
        self.binary_head = nn.Linear(cfg.hidden_size, 2) if cfg.bert_binary_head else None
        self.has_embedding = self.has_head = True
        self.context_parallel: ContextParallel | None = None  # set by parallel/context.py
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Name-seeded Megatron init (models.layers.init_weights); seed None: torch.initial_seed()."""
        init_weights(self, self.cfg, seed)

    def forward(
        self,
        inputs: torch.Tensor,
        token_type_ids_bs: torch.Tensor | None = None,
        attention_mask_bs: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids [b, s] (or, without the embedding, hidden states x [b, s, h]) -> (mlm_logits
        [b, s, v], binary_logits [b, 2] or None), or x [b, s, h] without the head; mask 1 = real token."""
        if self.context_parallel is not None:  # this rank's tokens; positions and mask global
            x_bsh, mask_b11s, rotary = self._context_parallel_inputs(
                inputs, token_type_ids_bs, attention_mask_bs
            )
        else:
            x_bsh = self.embedding(inputs, token_type_ids_bs) if self.has_embedding else inputs
            mask_b11s = None if attention_mask_bs is None else attention_mask_bs[:, None, None, :].bool()
            seq = rotary_length(inputs, self.has_embedding, attention_mask_bs, self.cfg.seq_length)
            rotary = None if self.rotary is None else self.rotary(seq)
        x_bsh = run_blocks(
            blocks_of(self.layers), x_bsh, mask_b11s, rotary, self.recompute_chunk, self.recompute_checkpoint
        )
        if not self.has_head:
            return x_bsh
        if self.final_norm is not None:
            x_bsh = self.final_norm(x_bsh)
        # tied: the word embedding (a later stage's own copy of it under a pipeline)
        word_vh = self.embedding.word.weight if self.lm_head.decoder is None else None
        mlm_logits_bsv = self.lm_head(x_bsh, word_vh)
        binary_logits_b2 = None
        if self.pooler is not None and self.binary_head is not None:
            binary_logits_b2 = self.binary_head(torch.tanh(self.pooler(x_bsh[:, 0])))
        return mlm_logits_bsv, binary_logits_b2

    def _context_parallel_inputs(
        self,
        input_ids_bs: torch.Tensor,
        token_type_ids_bs: torch.Tensor | None,
        attention_mask_bs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """(stack input, attention mask of global positions, rotary tables) of this cp rank's tokens;
        the binary head's token 0 is on cp rank 0 (the loss counts it there only)."""
        cp = self.context_parallel
        assert cp is not None
        # a later pipeline stage gets hidden states (a sequence shard of them under SP): static length
        local_seq = input_ids_bs.shape[1] if self.has_embedding else self.cfg.seq_length // cp.size
        positions_bs, mask = context_parallel_inputs(
            cp, self.layers, input_ids_bs, local_seq, padding_bs=attention_mask_bs
        )
        if self.has_embedding:
            x_bsh = self.embedding(input_ids_bs, token_type_ids_bs, positions_bs=positions_bs)
        else:
            x_bsh = input_ids_bs
        rotary = None if self.rotary is None else self.rotary(local_seq * cp.size, positions_bs)
        return x_bsh, mask, rotary


def bert_loss(
    outputs: tuple[torch.Tensor, torch.Tensor | None],
    batch: dict[str, torch.Tensor],
    normalizers: dict[str, int] | None = None,
    ops: LossOps = PLAIN_LOSS_OPS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MLM cross-entropy averaged over labelled positions, plus the binary-head cross-entropy
    (summed, as Megatron) when the model has one. Cross-entropy runs in fp32 for bf16/fp16 runs.

    `normalizers` ({"tokens": labelled positions, "samples": sequences} of the whole optimizer
    step) turn the per-micro-batch means into this micro-batch's share of the step's mean, so
    the shares of k accumulated micro-batches add up to the loss of one k-times-larger batch.
    `ops` reduces over the vocabulary (tensor parallelism passes versions for sharded logits).
    Metric keys: `bert_metric_names`.
    """
    mlm_logits_bsv, binary_logits_b2 = outputs
    labels_n = batch["labels"].reshape(-1)
    labelled_n = labels_n != IGNORE_INDEX
    count = labelled_n.sum()
    correct = None
    if ops.accuracy:
        # before the loss, which may overwrite the logits with log-probabilities; over the labelled
        # rows only: over all b*s rows it cost ~8% of a tiny-bert step
        picked = ops.argmax_rows(mlm_logits_bsv.detach().reshape(labels_n.numel(), -1), labelled_n)
        correct = (picked == labels_n[labelled_n]).sum().float()
    # Sum / clamp(count) rather than mean: a micro-batch without masked tokens gives 0, not NaN.
    token_norm = normalizers["tokens"] if normalizers else count.clamp(min=1)
    mlm_loss = ops.cross_entropy_sum(mlm_logits_bsv, labels_n, IGNORE_INDEX) / token_norm
    metrics = {"mlm_loss": mlm_loss.detach(), "mlm_count": count.float()}
    if correct is not None:
        metrics["mlm_correct"] = correct
    loss = mlm_loss
    if binary_logits_b2 is not None:
        nsp_b = batch["nsp_labels"].reshape(-1)
        sample_norm = normalizers["samples"] if normalizers else nsp_b.numel()
        # context parallelism: only the cp rank holding token 0 scores the sentences (share 1, the
        # others 0: their pooled token is another one, and the samples must count once)
        share = normalizers.get("binary_share", 1) if normalizers else 1
        binary_loss = F.cross_entropy(binary_logits_b2.float(), nsp_b, reduction="sum") / sample_norm
        if share != 1:
            binary_loss = binary_loss * share
        loss = loss + binary_loss
        metrics["binary_loss"] = binary_loss.detach()
        if ops.accuracy:
            correct = (binary_logits_b2.detach().argmax(-1) == nsp_b).sum().float()
            metrics["binary_correct"] = correct * share
        # made on the device: a host tensor would be copied to it (a synchronization on a GPU)
        metrics["binary_count"] = torch.full((), float(nsp_b.numel() * share), device=nsp_b.device)
    metrics["loss"] = loss.detach()
    return loss, metrics


def bert_metric_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The metric keys `bert_loss` returns for a model built from cfg."""
    names = ("loss", "mlm_loss", "mlm_correct", "mlm_count")
    return names + (("binary_loss", "binary_correct", "binary_count") if cfg.bert_binary_head else ())
