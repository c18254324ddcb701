"""Peak memory per device, measured rather than estimated.

On CUDA the caching allocator counts every tensor byte (allocated) and every byte it holds from the
driver (reserved). On CPU there is no allocator counter, so the peak is the process resident-set
high-water mark (VmHWM): it includes the Python runtime, libraries and anything else the process
touched, so it is an upper bound on the training state, not a tensor count.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..parallel.torch_compat import wrapped_tensor

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


@dataclass(frozen=True)
class MemoryStats:
    """Peak bytes since the last reset, and how they were measured (one human string)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    method: str


def _status_bytes(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _vm_hwm_bytes() -> int | None:
    return _status_bytes("VmHWM")


def process_rss_bytes() -> int:
    """This process's resident set size now, in bytes (VmRSS; 0 where /proc is unavailable)."""
    return _status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark in bytes since start or the last `reset_peak_rss`."""
    hwm = _vm_hwm_bytes()
    return hwm if hwm is not None else _ru_maxrss_bytes()


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark to its current RSS; False if the kernel refuses."""
    return _reset_hwm()


def _ru_maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, kB on Linux


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write '5' to clear_refs); False if unavailable."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryTracker:
    """Peak memory of one device: `reset_peak()` at the start of an interval, `peak()` at its end.

    On CPU the high-water mark belongs to the process: a reset by any tracker resets it for all.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"MemoryTracker supports cuda and cpu devices, not {self.device.type!r}")
        self._hwm_reset: bool | None = None  # None: never reset; False: the kernel refused the reset
        self._run_peak = 0  # the largest interval peak folded in before a reset discarded it

    def reset_peak(self) -> None:
        """Start a new peak interval. The interval's peak is kept for `run_peak` first."""
        self._run_peak = max(self._run_peak, self.peak().peak_allocated_bytes)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._hwm_reset = _reset_hwm()

    def peak(self) -> MemoryStats:
        """Peak allocated / reserved bytes since the last reset_peak (or since start)."""
        if self.device.type == "cuda":
            return MemoryStats(
                peak_allocated_bytes=int(torch.cuda.max_memory_allocated(self.device)),
                peak_reserved_bytes=int(torch.cuda.max_memory_reserved(self.device)),
                method="cuda: torch.cuda.max_memory_allocated / max_memory_reserved since last reset",
            )
        hwm = _vm_hwm_bytes()
        if hwm is not None:
            since = {
                True: "since last reset",
                False: "since process start (reset unavailable)",
                None: "since process start (no reset_peak yet)",
            }[self._hwm_reset]
            value, method = (
                hwm,
                f"cpu: process RSS high-water mark (VmHWM) {since}, includes the Python runtime",
            )
        else:
            value = _ru_maxrss_bytes()
            method = "cpu: getrusage ru_maxrss, peak RSS since process start, includes the Python runtime"
        # On CPU every resident byte is both "allocated" and "reserved": there is no caching allocator
        # between tensors and the OS that could hold memory back.
        return MemoryStats(peak_allocated_bytes=value, peak_reserved_bytes=value, method=method)

    def run_peak(self) -> MemoryStats:
        """Peak bytes over the whole run: since process start (CPU; CUDA: since the first use of the
        device), including model construction and initialization before the first interval, however
        often `reset_peak` was called."""
        current = self.peak()
        value = max(self._run_peak, current.peak_allocated_bytes)
        reserved = value if self.device.type == "cpu" else max(value, current.peak_reserved_bytes)
        if self.device.type == "cuda":
            method = "cuda: torch.cuda.max_memory_allocated over the whole run"
        else:
            method = (
                "cpu: process RSS high-water mark over the whole run (VmHWM), includes the Python runtime"
            )
        return MemoryStats(peak_allocated_bytes=value, peak_reserved_bytes=reserved, method=method)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor as it is; a wrapper
    subclass (torchao's float8 weight under FSDP2, train.fp8) is its inner tensor, which holds the
    storage (the wrapper's own storage is not one)."""
    to_local = getattr(t, "to_local", None)
    return wrapped_tensor(to_local() if callable(to_local) else t)


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's model states as they are now: parameters, gradients, optimizer state.

    Counted by storage, each storage once (tied weights, views into one flat buffer), so a gradient
    that is a view into DDP's bucket counts the bucket. What Python cannot reach is not counted: DDP's
    own gradient buckets when gradients are separate tensors, FSDP2's unsharded parameters between
    gathers, allocator slack. `torch.distributed.optim.ZeroRedundancyOptimizer` keeps its shard's
    state in its `optim`.
    """
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor]) -> int:
        n = 0
        for t in tensors:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            n += storage.nbytes()
        return n

    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)
    # Adam's per-parameter step counter is a one-element tensor, not optimizer state in the ZeRO sense
    state = [
        v for s in inner.state.values() for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step"
    ]
    return {
        "parameters": total(params),
        "gradients": total([p.grad for p in params if p.grad is not None]),
        "optimizer": total(state),
    }
