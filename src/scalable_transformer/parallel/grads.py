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
    """Global L2 norm of the gradients of `params`, counted once each: a float32 scalar on the
    gradients' device, never read on the host here (the caller decides when to read it).

    `exclude`: id()s of parameters whose grads duplicate another rank's (pipeline tied copies).
    `pp_group`: the group whose ranks hold other parameters (pipeline stages); None = none.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and id(p) not in exclude:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    squares: torch.Tensor | None = None
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = norm.detach().float() ** 2
        squares = square if squares is None else squares + square.to(squares.device)
    if squares is None:  # no gradients on this rank (a pipeline stage without parameters)
        squares = torch.zeros((), dtype=torch.float32, device=_grad_device(params))
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        device = collective_device(pp_group)
        total = squares.to(device)
        dist.all_reduce(total, group=pp_group)
        squares = total.to(squares.device)
    return squares.sqrt()


def _grad_device(params: Iterable[torch.nn.Parameter]) -> torch.device:
    for p in params:
        return local(p.detach()).device
    return torch.device("cpu")


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)) (torch's clip_grad_norm_ rule,
    Megatron's threshold) without reading the norm on the host: the coefficient stays on the device,
    and a gradient at or under the threshold is multiplied by exactly 1."""
    if max_norm <= 0 or not math.isfinite(max_norm):
        return
    coefficient = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in by_device.items():
        torch._foreach_mul_(grads, coefficient.to(device))
