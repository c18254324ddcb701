"""Loss scaling for fp16: none (fp32/bf16), static (Megatron's --loss-scale) or dynamic (Megatron's rule).

The trainer's step reads::

    scaler.scale(loss).backward()                        # per micro-batch
    found_inf = scaler.unscale_(grads, group)            # same answer on every rank
    if not found_inf: optimizer.step()
    scaler.update(found_inf)

`unscale_` works on plain tensors and on DTensor grads (tensor parallel, FSDP2) alike, and agrees
found_inf over the process group, so that no rank steps while another skips. torch.amp.GradScaler
is not used: it has no hysteresis and no minimum scale, and it does not agree found_inf across ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import TrainConfig
from ..parallel.grads import local


class LossScaler:
    """The calls the trainer makes. The base class is the disabled scaler: scale 1, no checks."""

    def is_enabled(self) -> bool:
        return False

    def get_scale(self) -> float:
        """The factor the loss is multiplied by (1.0 when disabled)."""
        return 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale`; the loss itself when disabled."""
        return loss * self.get_scale() if self.is_enabled() else loss

    def unscale_(self, grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """Divide `grads` in place by the scale and return whether any rank of `group` holds an inf/nan.

        `group` None is the default (world) group; every rank of it must call this, grads or not.
        Disabled: returns False and touches neither the grads nor the process group.
        """
        if not self.is_enabled():
            return False
        return _unscale_and_check(grads, 1.0 / self.get_scale(), group)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; `found_inf` is what `unscale_` returned."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class NoLossScaler(LossScaler):
    """fp32 and bf16: bf16 has fp32's exponent range, so nothing underflows and nothing is scaled."""


class StaticLossScaler(LossScaler):
    """A constant scale: Megatron's ConstantGradScaler (--loss-scale) and DeepSpeed's static
    `loss_scale`. Overflowing steps are still reported by `unscale_` (the trainer skips them), but the
    scale never changes. Its state is the config, so `state_dict` is empty, as in Megatron."""

    def __init__(self, scale: float):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"static loss scale must be a finite number > 0, got {scale}")
        self._scale = float(scale)

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self._scale


class DynamicLossScaler(LossScaler):
    """Megatron-LM's DynamicGradScaler (megatron/core/optimizer/grad_scaler.py), update rule and all.

    On an overflowing step the growth tracker restarts at 0 and the hysteresis tracker drops by one;
    once it is at or below 0, the scale becomes max(scale * backoff_factor, min_scale), and every
    further overflow backs off again until the scale grows. After `growth_interval` clean steps in a row
    the scale is multiplied by growth_factor and the hysteresis tracker refilled to `hysteresis`.
    The defaults build_loss_scaler passes are DeepSpeed's (initial_scale_power 16, loss_scale_window
    1000, hysteresis 2, min_loss_scale 1).
    """

    def __init__(
        self,
        initial_scale: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        # Megatron asserts these; a user's config deserves a ValueError naming the value.
        if not (math.isfinite(initial_scale) and initial_scale > 0):
            raise ValueError(f"initial loss scale must be a finite number > 0, got {initial_scale}")
        if not 0 < min_scale <= initial_scale:
            raise ValueError(
                f"min_loss_scale must be > 0 and <= the initial scale {initial_scale}, got {min_scale}"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - state.keys()
        if missing:
            raise ValueError(f"dynamic loss scaler state lacks {sorted(missing)}; got keys {sorted(state)}")
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def _unscale_and_check(grads: list[torch.Tensor], inv_scale: float, group: dist.ProcessGroup | None) -> bool:
    # DTensor grads (TP, FSDP2): unscale the local shard, which aliases the DTensor's storage.
    shards = [local(g) for g in grads]
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in shards:
        by_device_dtype[(g.device, g.dtype)].append(g)
    found_per_device: dict[torch.device, torch.Tensor] = {}
    inv_per_device: dict[torch.device, torch.Tensor] = {}
    for (device, _), tensors in by_device_dtype.items():
        if device not in found_per_device:
            found_per_device[device] = torch.zeros(1, dtype=torch.float32, device=device)
            inv_per_device[device] = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        # Fused: divide and flag inf/nan in one pass, adding 1 to found_inf for a bad tensor.
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, found_per_device[device], inv_per_device[device]
        )

    distributed = dist.is_available() and dist.is_initialized()
    device = _collective_device(group, list(found_per_device)) if distributed else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for f in found_per_device.values():
        found = torch.maximum(found, f.to(device))
    if distributed:
        # MAX, so a rank with no grads (zeros) or clean grads takes the verdict of any rank that overflowed.
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)  # the step's one host sync: the trainer must know whether to step


def _collective_device(group: dist.ProcessGroup | None, grad_devices: list[torch.device]) -> torch.device:
    """Where the found_inf tensor must live for `group`'s backend: CPU for gloo, the current CUDA
    device for nccl (also when the grads are on CPU, as with FSDP2 CPU offload)."""
    backend = str(dist.get_backend(group))
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    # A multi-device backend such as "cpu:gloo,cuda:nccl" takes either; keep the grads' device.
    return grad_devices[0] if grad_devices else torch.device("cpu")


def build_loss_scaler(cfg: TrainConfig) -> LossScaler:
    """NoLossScaler for fp32/bf16; for fp16 a StaticLossScaler when `loss_scale` is set, else a
    DynamicLossScaler starting at 2**initial_scale_power (DeepSpeed's knobs, Megatron's update rule)."""
    if cfg.precision != "fp16":
        return NoLossScaler()
    if cfg.loss_scale is not None:
        return StaticLossScaler(cfg.loss_scale)
    return DynamicLossScaler(
        initial_scale=2.0**cfg.initial_scale_power,
        growth_interval=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis,
        min_scale=cfg.min_loss_scale,
    )
