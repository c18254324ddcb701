"""parallelize(): apply parallelism to a plain model in one fixed, documented order.

Order (torchtitan's): tensor parallel -> activation checkpointing -> torch.compile -> FSDP/DDP.
TP must see the plain Linear layers; checkpointing must wrap whole blocks before compile traces
them; FSDP/DDP wrap last so they shard/replicate the final module structure. Only the
single-process steps exist until the parallel-engine issue lands; each later step slots into
this function in its place.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from ..config.load import ConfigError
from ..config.schema import Config


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's transformer blocks (every model in `models/` keeps them in `.layers`)."""
    layers = model.get_submodule("layers")
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}.layers must be an nn.ModuleList of transformer blocks")
    return layers


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, num_layers: int) -> None:
    """Recompute each transformer block's activations in backward (non-reentrant checkpointing).

    `full` wraps every block; `selective` wraps only the attention core of each block (the
    s^2 part whose activations are largest and cheapest to recompute).
    """
    if mode == "none":
        return
    if num_layers != 1:
        raise ConfigError(
            f"parallel.checkpoint_num_layers = {num_layers}: only 1 (checkpoint every block) is "
            "supported in this version"
        )
    layers = blocks(model)
    for i, block in enumerate(layers):
        if mode == "full":
            layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            attention = block.get_submodule("attention")
            attention.core = checkpoint_wrapper(  # type: ignore[assignment]
                attention.get_submodule("core"), checkpoint_impl=CheckpointImpl.NO_REENTRANT
            )


def apply_compile(model: torch.nn.Module) -> None:
    """Compile each block separately: identical blocks share one compiled graph, cold start stays short."""
    layers = blocks(model)
    for i, block in enumerate(layers):
        layers[i] = torch.compile(block)  # type: ignore[assignment]


def parallelize(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """Apply the configured parallelism and memory options to `model`, in the order above."""
    # 1. tensor parallel: arrives with the parallel engine (issue 4)
    apply_activation_checkpointing(
        model, cfg.parallel.activation_checkpointing, cfg.parallel.checkpoint_num_layers
    )
    if cfg.parallel.compile:
        apply_compile(model)
    # 4. FSDP / DDP: arrive with the parallel engine (issue 4)
    return model
