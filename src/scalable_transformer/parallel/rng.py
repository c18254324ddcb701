"""Dropout random streams as Megatron-LM has them (its `CudaRNGStatesTracker` with a model-parallel stream).

Three rules:
  1. Replicated activations (everything outside tensor-parallel regions) draw from the default
     generator, seeded identically on the tensor-parallel ranks of a stage, so they get the same mask
     (otherwise the replicas would diverge).
  2. Tensor-parallel regions draw from a stream of their own per tp rank: the attention core (each
     rank holds other heads) and, with sequence parallelism, the hidden dropouts of the embedding and
     every block (each rank holds another sequence shard). Otherwise the shards would reuse one mask.
     The embedding's dropout is not one: it runs on the replicated [b, s, h] before sequence
     parallelism slices it.
  3. Pipeline ranks seed the default generator with seed + 100 * pp_rank (Megatron's offset), so
     stages do not repeat each other's masks.

How rule 2 is implemented: a forward pre-hook on each region's module draws one number from the
default generator (the same on every tp rank, so rule 1's stream stays in step), seeds the default
generator from (that number, tp rank) for the module's forward, and the forward hook restores the
default stream. Activation checkpointing restores the default generator's state before recomputing,
so the recompute draws the same number and therefore the same region masks: torch's checkpoint needs
no extra state, unlike Megatron's tracker.

Where it stops: the masks depend on the layout (tp, pp, which ranks hold what), so runs with dropout on
match the single-process run statistically, not step for step. DTensor's offset-based RNG, which
would give layout-independent masks, only supports CUDA-like devices (not the CPU), and the
attention core and hidden dropouts run on plain local tensors here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ..models.layers import CoreAttention, TransformerBlock

PIPELINE_SEED_OFFSET = 100  # Megatron's per-stage offset of the default seed


def stage_seed(seed: int, pp_rank: int) -> int:
    """The default generator's seed on pipeline rank pp_rank (rule 3)."""
    return seed + PIPELINE_SEED_OFFSET * pp_rank


def _region_seed(drawn: int, tp_rank: int) -> int:
    digest = hashlib.sha256(f"{drawn}:{tp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TensorParallelStream:
    """Forward pre-hook / hook pair that runs a module's forward on this tp rank's own stream."""

    def __init__(self, tp_rank: int, device: torch.device) -> None:
        self.tp_rank = tp_rank
        self.cuda = device.type == "cuda"
        self._saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        drawn = int(torch.randint(0, 2**62, (1,)).item())  # advances the default stream on every tp rank
        cuda_state = torch.cuda.get_rng_state() if self.cuda else None
        self._saved.append((torch.get_rng_state(), cuda_state))
        seed = _region_seed(drawn, self.tp_rank)
        torch.manual_seed(seed)  # seeds the CPU and every CUDA generator

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        cpu_state, cuda_state = self._saved.pop()
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave)


def tensor_parallel_regions(model: nn.Module, sequence_parallel: bool) -> list[nn.Module]:
    """The modules whose dropout runs on tp-sharded activations (rule 2); those with a dropout
    probability of 0 draw nothing, so they need no stream (and the hooks' cost is saved)."""
    regions: list[nn.Module] = [m for m in model.modules() if isinstance(m, CoreAttention) and m.dropout > 0]
    if sequence_parallel:
        regions += [m.dropout for m in model.modules() if isinstance(m, TransformerBlock) and m.dropout.p > 0]
    return regions


def apply_dropout_streams(
    model: nn.Module, tp_rank: int, sequence_parallel: bool, device: torch.device
) -> None:
    """Give `model`'s tensor-parallel regions this tp rank's dropout stream (call after TP, before
    activation checkpointing wraps the blocks; hooks on the inner modules survive the wrapping)."""
    stream = TensorParallelStream(tp_rank, device)
    for module in tensor_parallel_regions(model, sequence_parallel):
        stream.attach(module)
