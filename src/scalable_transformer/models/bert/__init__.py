"""BERT: bidirectional encoder, masked-LM (+ NSP/SOP binary) loss, BertForPreTraining as its Hugging
Face equivalent."""

from __future__ import annotations

import torch

from scalable_transformer.config.rules import padded_vocab_size
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.bert import hf
from scalable_transformer.models.bert.model import BertLMHead, BertModel, bert_loss, bert_metric_names
from scalable_transformer.models.spec import (
    IGNORE_INDEX,
    DataSpec,
    HFMapping,
    ModelSpec,
    PipelineSpec,
    TensorParallelNames,
)


def _batch_shapes(cfg: ModelConfig, micro_batch: int) -> dict[str, tuple[int, ...]]:
    """input_ids, token_type_ids, attention_mask, labels [b, s]; nsp_labels [b] with the binary head."""
    tokens = (micro_batch, cfg.seq_length)
    keys = ("input_ids", "token_type_ids", "attention_mask", "labels")
    shapes: dict[str, tuple[int, ...]] = dict.fromkeys(keys, tokens)
    if cfg.bert_binary_head:
        shapes["nsp_labels"] = (micro_batch,)
    return shapes


def _output_shapes(cfg: ModelConfig, micro_batch: int) -> tuple[tuple[int, ...], ...]:
    assert cfg.vocab_size is not None
    vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    mlm = (micro_batch, cfg.seq_length, vocab)
    return (mlm, (micro_batch, 2)) if cfg.bert_binary_head else (mlm,)


def _pack_target(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """labels [b, s] and nsp_labels [b] as one [b, s + 1] tensor: the schedule splits one target.
    Without a binary head (no nsp_labels) the last column is IGNORE_INDEX, which bert_loss never reads."""
    labels_bs = batch["labels"]
    nsp_b = batch.get("nsp_labels")
    if nsp_b is None:
        nsp_b = torch.full(labels_bs.shape[:1], IGNORE_INDEX, device=labels_bs.device)
    return torch.cat([labels_bs, nsp_b[:, None].to(labels_bs.dtype)], dim=1)


def _unpack_target(target_bt: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"labels": target_bt[:, :-1], "nsp_labels": target_bt[:, -1]}


def _outputs_from_stage(
    output: torch.Tensor | tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Without a binary head the last stage sends mlm_logits alone (stage outputs must be tensors)."""
    if isinstance(output, torch.Tensor):
        return output, None
    if len(output) == 1:
        return output[0], None
    return output[0], output[1]


SPEC = ModelSpec(
    name="bert",
    build=BertModel,
    input_keys=("input_ids", "token_type_ids", "attention_mask"),
    loss=bert_loss,
    metric_names=bert_metric_names,
    lm_metric="mlm_loss",
    tensor_parallel=TensorParallelNames(
        untied_outputs=("lm_head.decoder",), output_bias="lm_head.bias", logits="lm_head.logits"
    ),
    embedding_parts=("embedding",),
    head_parts=("final_norm", "lm_head", "pooler", "binary_head"),
    pipeline=PipelineSpec(
        first_stage_keys=("input_ids", "token_type_ids"),
        # every block needs the mask: a keyword of every stage, split like the args, never sent
        every_stage_kwargs=(("attention_mask", "attention_mask_bs"),),
        last_stage_outputs=_output_shapes,
        pack_target=_pack_target,
        unpack_target=_unpack_target,
        outputs_from_stage=_outputs_from_stage,
    ),
    data=DataSpec(
        corpus="sentences", dataset="masked-lm", tokenizer_vocab=True, label_keys=("labels", "nsp_labels")
    ),
    batch_shapes=_batch_shapes,
    hf=(
        HFMapping(
            model_type="bert",
            hf_class="BertForPreTraining",
            unsupported=hf.bert_unsupported,
            to_hf=hf.to_bert,
            overrides=hf.overrides_from_hf,
            vocab_keys=("embedding.word.weight", "lm_head.bias", "lm_head.decoder.weight"),
        ),
        HFMapping(
            model_type="megatron-bert",
            hf_class="MegatronBertForPreTraining",
            unsupported=hf.megatron_bert_unsupported,
            to_hf=hf.to_megatron_bert,
            overrides=hf.overrides_from_megatron_bert,
            vocab_keys=("embedding.word.weight", "lm_head.bias", "lm_head.decoder.weight"),
        ),
    ),
)

__all__ = ["SPEC", "BertLMHead", "BertModel", "bert_loss", "bert_metric_names"]
