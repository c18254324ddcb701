"""Plain PyTorch Megatron-style model families; nothing here knows about distribution.

One folder per family (bert/, gpt/), each exposing a `ModelSpec` (spec.py) registered in
registry.py; layers.py holds the shared blocks, stage.py the pipeline-stage pruning.
"""

from scalable_transformer.config.rules import padded_vocab_size
from scalable_transformer.models.bert import BertModel
from scalable_transformer.models.gpt import GPTModel
from scalable_transformer.models.layers import TransformerBlock
from scalable_transformer.models.moe import MOE_METRICS, MoEStep
from scalable_transformer.models.registry import (
    SPECS,
    build_model,
    compute_loss,
    count_parameters,
    count_parameters_breakdown,
    get_spec,
    model_inputs,
    spec_for,
)
from scalable_transformer.models.spec import PLAIN_LOSS_OPS, LossOps, ModelSpec

__all__ = [
    "MOE_METRICS",
    "PLAIN_LOSS_OPS",
    "SPECS",
    "BertModel",
    "GPTModel",
    "LossOps",
    "MoEStep",
    "ModelSpec",
    "TransformerBlock",
    "build_model",
    "compute_loss",
    "count_parameters",
    "count_parameters_breakdown",
    "get_spec",
    "model_inputs",
    "padded_vocab_size",
    "spec_for",
]
