"""Where full recompute keeps a checkpointed region's input between its forward and its recomputation.

Full activation checkpointing keeps one tensor per checkpointed region (a block, or a chunk of
checkpoint_num_layers blocks): its input, the residual stream [b, s, h]. Without sequence parallelism
that tensor is whole and identical on every tensor-parallel rank, so at 175B (tp 16, micro-batch 32)
these inputs alone are tens of GiB per device. Megatron (`--distribute-saved-activations`) and
DeepSpeed (`partition_activations`, `cpu_checkpointing`) keep less; so does `InputStash`:

  distributed  each of the t tensor-parallel ranks keeps its 1/t slice of the flattened input; the
               region all-gathers it over the tp group before it is recomputed in backward
  host         the kept tensor (whole or slice) lives in host memory (pinned on CUDA) and is copied
               back to the device before the recomputation

torch.utils.checkpoint (non-reentrant) keeps whatever the checkpointed function was called with, so
the input is not passed to it: the function closes over the stash instead. Its first call (the
forward) takes the real input, which keeps the autograd graph connected to it; a later call (the
recomputation) rebuilds the input from the stash as a new leaf, whose graph autograd discards after
taking the saved tensors it needs. torch's `save_on_cpu` and the activation-offloading hooks were
considered: they move what autograd saves, and under checkpointing the input is not saved by autograd
but held by the checkpoint's closure, so they would not reach it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint


class InputStash:
    """A checkpoint function (`checkpoint(fn, x, *args)`, as `plain_checkpoint`) that keeps the
    region's input x distributed over `tp_group` (None or size 1: whole) and/or in host memory."""

    def __init__(self, tp_group: dist.ProcessGroup | None, to_host: bool) -> None:
        self.group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.to_host = to_host

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        kept = x.detach()
        if self.group is not None:
            t, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            flat = kept.reshape(-1)
            if flat.numel() % t:
                flat = torch.nn.functional.pad(flat, (0, t - flat.numel() % t))
            # a copy: a view would keep the whole input's storage alive
            kept = flat.chunk(t)[rank].clone()
        if self.to_host and kept.device.type != "cpu":
            host = torch.empty(kept.shape, dtype=kept.dtype, pin_memory=kept.device.type == "cuda")
            kept = host.copy_(kept, non_blocking=True)
        return kept

    def _unpack(self, kept: torch.Tensor, like: tuple[torch.Size, torch.dtype, torch.device]) -> torch.Tensor:
        shape, dtype, device = like
        x = kept.to(device, non_blocking=True)
        if self.group is not None:
            t = dist.get_world_size(self.group)
            full = torch.empty(x.numel() * t, dtype=dtype, device=device)
            dist.all_gather_single(full, x, group=self.group)
            x = full[: shape.numel()]
        return x.view(shape)

    def checkpoint(self, fn: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        like = (x.shape, x.dtype, x.device)
        requires_grad = x.requires_grad
        kept = self._pack(x)
        first = [x]  # the forward's real input, dropped as soon as the forward has it

        def run(_device: torch.Tensor, *rest: Any, **kw: Any) -> Any:
            if first:
                return fn(first.pop(), *rest, **kw)
            return fn(self._unpack(kept, like).requires_grad_(requires_grad), *rest, **kw)

        # an empty tensor on x's device stands in for x: checkpoint reads the device (whose RNG state
        # and autocast settings it restores for the recomputation) from its tensor arguments
        device = x.new_empty(0)
        return torch.utils.checkpoint.checkpoint(run, device, *args, use_reentrant=False, **kwargs)


def checkpoint_function(
    tp_group: dist.ProcessGroup | None, distribute: bool, to_host: bool
) -> Callable[..., Any] | None:
    """The checkpoint function full recompute should use: None (torch's own, keeping the whole input on
    the device) unless the input is distributed over tp_group or kept in host memory."""
    if not (distribute or to_host):
        return None
    return InputStash(tp_group if distribute else None, to_host).checkpoint
