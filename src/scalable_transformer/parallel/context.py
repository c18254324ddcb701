"""Context parallelism, the process-group side: the keys' and values' all-gather, handing it to the
model, and each cp rank's share of a batch.

The model's side (which tokens a rank holds, positions, the mask of global positions) is
models/context_parallel.py. Here:
  - `SequenceAllGather`: the ranks' tensors concatenated along a dimension, with autograd; its
    backward reduce-scatters (sums) the gradient, so each rank's k and v get the gradients of every
    rank's queries (as Llama 3's all-gather context parallelism does; the ring of point-to-point
    transfers with an online-softmax merge is not built);
  - `apply_context_parallel`: gives the model and every attention module the `ContextParallel`;
  - `split_batch`: a batch's [b, S] tensors cut to this rank's two chunks, at the one place a batch
    enters the model (the trainer), never inside layers.
Parameters are replicated over cp: parallel/dims.py reduces gradients over dp x cp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models.context_parallel import ContextParallel, split_sequence
from ..models.layers import CoreAttention
from ..models.moe import MoELayer


def all_gather_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The group's tensors concatenated along `dim` in rank order (no autograd)."""
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((dist.get_world_size(group) * x0.shape[0], *x0.shape[1:]))
    dist.all_gather_single(out, x0, group=group)
    return out.movedim(0, dim)


class SequenceAllGather(torch.autograd.Function):
    """`all_gather_along` with autograd; backward: each rank's part of the gradient, summed over the
    ranks (reduce_scatter_single)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        g0 = grad.movedim(ctx.dim, 0).contiguous()
        out = g0.new_empty((g0.shape[0] // dist.get_world_size(ctx.group), *g0.shape[1:]))
        dist.reduce_scatter_single(out, g0, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def sequence_gather(group: Any) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """gather(x, dim) over `group` for `ContextParallel`: autograd when x needs a gradient, a plain
    all-gather otherwise (document ids, padding masks, evaluation)."""

    def gather(x: torch.Tensor, dim: int) -> torch.Tensor:
        if x.requires_grad:
            return SequenceAllGather.apply(x, dim, group)
        return all_gather_along(x, dim, group)

    return gather


def context_parallel_for(group: Any, size: int, rank: int) -> ContextParallel:
    return ContextParallel(size=size, rank=rank, gather=sequence_gather(group))


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> None:
    """Run `model` (a BERT/GPT whose forward reads `context_parallel`) on this rank's tokens: the model
    builds positions and masks from global positions, every attention module gathers keys and values."""
    if not hasattr(model, "context_parallel"):
        raise ValueError(
            f"{type(model).__name__} has no context-parallel forward (models/context_parallel.py)"
        )
    setattr(model, "context_parallel", cp)  # noqa: B010 (read by the model's forward)
    cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
    if not cores:
        raise ValueError(f"{type(model).__name__} has no attention (CoreAttention) to gather keys for")
    for core in cores:
        core.context_parallel = cp
    for layer in model.modules():
        if isinstance(layer, MoELayer):  # its load-balancing loss counts whole sequences
            layer.context_parallel = cp


def split_batch(
    batch: dict[str, torch.Tensor], cp: int, rank: int, seq_length: int
) -> dict[str, torch.Tensor]:
    """This cp rank's share of a batch: every tensor whose dimension 1 is the sequence ([b, S]: ids,
    labels, token types, padding masks, document ids) cut to the rank's two chunks; per-sample
    tensors (BERT's nsp_labels [b]) whole."""
    if cp == 1:
        return batch
    return {
        key: split_sequence(value, cp, rank, 1)
        if value.dim() >= 2 and value.shape[1] == seq_length
        else value
        for key, value in batch.items()
    }
