"""GPT: causal decoder, next-token loss, GPT-2 as its Hugging Face equivalent."""

from __future__ import annotations

import torch

from scalable_transformer.config.rules import padded_vocab_size
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.gpt import hf
from scalable_transformer.models.gpt.model import GPTModel, gpt_loss, gpt_metric_names
from scalable_transformer.models.spec import (
    DataSpec,
    HFMapping,
    ModelSpec,
    PipelineSpec,
    TensorParallelNames,
)


def _logits_shape(cfg: ModelConfig, micro_batch: int) -> tuple[tuple[int, ...], ...]:
    assert cfg.vocab_size is not None
    return (
        (micro_batch, cfg.seq_length, padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)),
    )


def _labels(target_bs: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"labels": target_bs}


def _batch_shapes(cfg: ModelConfig, micro_batch: int) -> dict[str, tuple[int, ...]]:
    """input_ids and labels, and the document ids of packed samples when the model restarts at them."""
    keys = ["input_ids", "labels"]
    if cfg.reset_position_ids or cfg.reset_attention_mask:
        keys.append("document_ids")
    return dict.fromkeys(keys, (micro_batch, cfg.seq_length))


SPEC = ModelSpec(
    name="gpt",
    build=GPTModel,
    input_keys=("input_ids",),
    loss=gpt_loss,
    metric_names=gpt_metric_names,
    lm_metric="lm_loss",
    tensor_parallel=TensorParallelNames(untied_outputs=("output",), output_bias=None, logits="logits"),
    embedding_parts=("embedding",),
    head_parts=("final_norm", "output", "logits"),
    pipeline=PipelineSpec(
        first_stage_keys=("input_ids",),
        every_stage_kwargs=(),
        last_stage_outputs=_logits_shape,
        pack_target=lambda batch: batch["labels"],
        unpack_target=_labels,
    ),
    data=DataSpec(corpus="eod", dataset="causal-lm", tokenizer_vocab=False, label_keys=("labels",)),
    batch_shapes=_batch_shapes,
    optional_inputs=(("document_ids", "document_ids_bs"),),
    hf=(
        HFMapping(
            model_type="gpt2",
            hf_class="GPT2LMHeadModel",
            unsupported=hf.gpt2_unsupported,
            to_hf=hf.to_gpt2,
            overrides=hf.overrides_from_hf,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="llama",
            hf_class="LlamaForCausalLM",
            unsupported=hf.llama_unsupported,
            to_hf=hf.to_llama,
            overrides=hf.overrides_from_llama,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="mistral",
            hf_class="MistralForCausalLM",
            unsupported=hf.mistral_unsupported,
            to_hf=hf.to_mistral,
            overrides=hf.overrides_from_mistral,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="mixtral",
            hf_class="MixtralForCausalLM",
            unsupported=hf.mixtral_unsupported,
            to_hf=hf.to_mixtral,
            overrides=hf.overrides_from_mixtral,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="qwen2",
            hf_class="Qwen2ForCausalLM",
            unsupported=hf.qwen2_unsupported,
            to_hf=hf.to_qwen2,
            overrides=hf.overrides_from_qwen2,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="olmoe",
            hf_class="OlmoeForCausalLM",
            unsupported=hf.olmoe_unsupported,
            to_hf=hf.to_olmoe,
            overrides=hf.overrides_from_olmoe,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="qwen3",
            hf_class="Qwen3ForCausalLM",
            unsupported=hf.qwen3_unsupported,
            to_hf=hf.to_qwen3,
            overrides=hf.overrides_from_qwen3,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="qwen3_moe",
            hf_class="Qwen3MoeForCausalLM",
            unsupported=hf.qwen3_moe_unsupported,
            to_hf=hf.to_qwen3_moe,
            overrides=hf.overrides_from_qwen3_moe,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
        HFMapping(
            model_type="gpt_neox",
            hf_class="GPTNeoXForCausalLM",
            unsupported=hf.neox_unsupported,
            to_hf=hf.to_neox,
            overrides=hf.overrides_from_neox,
            vocab_keys=("embedding.word.weight", "output.weight"),
        ),
    ),
)

__all__ = ["SPEC", "GPTModel", "gpt_loss", "gpt_metric_names"]
