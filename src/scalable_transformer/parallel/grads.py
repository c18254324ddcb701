"""Gradient norm and clipping over any layout: plain, DDP-replicated, DTensor (TP / FSDP2) gradients.

`torch.nn.utils.clip_grad_norm_` handles one kind at a time: its foreach kernels cannot mix plain
tensors with DTensors, or DTensors on different meshes (tensor-parallel weights next to replicated
norm weights, FSDP2 shards of both). So the grads are grouped by (mesh, placements); each group's
norm comes from `torch.nn.utils.get_total_norm` (DTensor groups reduce themselves over their mesh),
the groups are combined, and the squares are summed over the pipeline group, whose stages hold
disjoint parameters. Clipping then scales every local shard by one coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .distributed import collective_device


def local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's values (a DTensor's local shard aliases its storage)."""
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _group_key(grad: torch.Tensor) -> tuple:
    if isinstance(grad, DTensor):
        return ("dtensor", id(grad.device_mesh), grad.placements, grad.dtype)
    return ("plain", grad.device, grad.dtype)


def grad_norm(
    params: Iterable[torch.nn.Parameter],
    *,
    exclude: Collection[int] = (),
    pp_group=None,
) -> torch.Tensor:
    """Global L2 norm of the gradients of `params` (float64 scalar on CPU), counted once each.

    `exclude`: id()s of parameters whose grads duplicate another rank's (pipeline tied copies).
    `pp_group`: the group whose ranks hold other parameters (pipeline stages); None = none.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and id(p) not in exclude:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    squares = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += norm.detach().to("cpu", torch.float64) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        device = collective_device(pp_group)
        total = squares.to(device)
        dist.all_reduce(total, group=pp_group)
        squares = total.cpu()
    return squares.sqrt()


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale every gradient by max_norm / total_norm when the norm exceeds max_norm (Megatron's rule)."""
    if not math.isfinite(total_norm) or max_norm <= 0 or total_norm <= max_norm:
        return
    coefficient = max_norm / (total_norm + 1e-6)
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            by_device.setdefault((g.device, g.dtype), []).append(g)
    for grads in by_device.values():
        torch._foreach_mul_(grads, coefficient)
