"""The model families by `model.type`, and the few functions every caller uses through them.

`spec_for(cfg)` (or `get_spec(name)`) is the only place a model type string is looked up; the rest of
the package reads the returned `ModelSpec` (models/spec.py) instead of branching on the type.

Adding a family, say a LLaMA-style decoder, is one new folder `models/llama/`:
  - `model.py`: the nn.Module (reuse layers.py blocks or add RMSNorm/SwiGLU/GQA ones there), with
    `init_weights()`, meta-device-safe construction, `has_embedding`/`has_head` and a forward that
    takes hidden states when the embedding is removed (copy gpt/model.py); its loss(outputs, batch,
    normalizers, ops) reducing over the vocabulary only through `ops`, and its metric names;
  - `hf.py` (optional): to/from Hugging Face `LlamaForCausalLM`;
  - `__init__.py`: `SPEC = ModelSpec(...)`: input keys, TP names (e.g. untied output "output"),
    embedding/head part names, pipeline inputs/outputs/target packing, data kind ("eod", "causal-lm");
and one line here in `SPECS` (plus the choice in config/schema.py's model.type docs); its parameter
counts by part go into config/model_shapes.py (torch-free, for the planner; tests/unit/test_shapes.py
checks them against the built model). Nothing in
parallel/, data/, train/ or checkpoint/ changes unless the family needs a new kind of part there
(e.g. grouped-query attention needs its TP plan to split K/V heads: a new field in
TensorParallelNames and its use in parallel/tensor.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scalable_transformer.config.model_shapes import parameter_parts
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.bert import SPEC as BERT
from scalable_transformer.models.gpt import SPEC as GPT
from scalable_transformer.models.layers import check_model_config
from scalable_transformer.models.spec import PLAIN_LOSS_OPS, HFMapping, LossOps, ModelSpec

SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (BERT, GPT)}


def get_spec(model_type: str) -> ModelSpec:
    """The spec of family `model_type`; ValueError naming the known ones otherwise."""
    spec = SPECS.get(model_type)
    if spec is None:
        raise ValueError(f"model.type={model_type!r} is not one of {tuple(SPECS)}")
    return spec


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The spec of the family `cfg.type` names."""
    return get_spec(cfg.type)


def hf_mappings() -> list[HFMapping]:
    """Every family's Hugging Face mappings."""
    return [m for s in SPECS.values() for m in s.hf]


def hf_mapping_for_type(hf_model_type: str) -> HFMapping | None:
    """The mapping whose Hugging Face config.model_type is `hf_model_type`, or None."""
    return next((m for m in hf_mappings() if m.model_type == hf_model_type), None)


def hf_unsupported(cfg: ModelConfig) -> list[str]:
    """Why no Hugging Face architecture holds cfg's model, one line per candidate class naming the
    settings that prevent it (empty: one does)."""
    mappings = spec_for(cfg).hf
    reasons = {m.hf_class: m.unsupported(cfg) for m in mappings}
    if not mappings:
        return [f"model.type = {cfg.type} has no Hugging Face mapping"]
    if any(not r for r in reasons.values()):
        return []
    return [f"{cls}: {'; '.join(r)}" for cls, r in reasons.items()]


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised fp32 model on the CPU (or the current default device) for a resolved cfg."""
    spec = spec_for(cfg)
    check_model_config(cfg)
    return spec.build(cfg)


def model_inputs(model_type: str, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The positional arguments of the model's forward, taken from a batch dict."""
    return get_spec(model_type).inputs(batch)


def compute_loss(
    model_type: str,
    outputs: Any,
    batch: dict[str, torch.Tensor],
    normalizers: dict[str, int] | None = None,
    ops: LossOps = PLAIN_LOSS_OPS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss to backprop, detached fp32 scalar metrics incl. "loss"). Counts (mlm_correct,
    mlm_count, binary_correct, binary_count) are exact integers held in fp32 so all metrics can be
    reduced together. `normalizers` = step-wide counts for gradient accumulation (see `bert_loss`)."""
    return get_spec(model_type).loss(outputs, batch, normalizers, ops)


def count_parameters_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, without building the model; the values sum to `count_parameters(cfg)`.
    `layers` is num_layers times one block. Tied output weights are counted once, in `embedding`.
    The arithmetic is config.model_shapes.parameter_parts (torch-free); this checks cfg first."""
    spec_for(cfg)  # an unknown family is an error here too
    check_model_config(cfg)
    return parameter_parts(cfg)


def count_parameters(cfg: ModelConfig) -> int:
    """Exactly sum(p.numel() for p in build_model(cfg).parameters()), computed analytically."""
    return sum(count_parameters_breakdown(cfg).values())
