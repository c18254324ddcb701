"""Peak memory per device, measured rather than estimated.

On CUDA the caching allocator counts every tensor byte (allocated) and every byte it holds from the
driver (reserved). On CPU there is no allocator counter, so the peak is the process resident-set
high-water mark (VmHWM): it includes the Python runtime, libraries and anything else the process
touched, so it is an upper bound on the training state, not a tensor count.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


@dataclass(frozen=True)
class MemoryStats:
    """Peak bytes since the last reset, and how they were measured (one human string)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    method: str


def _vm_hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


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

    def reset_peak(self) -> None:
        """Start a new peak interval."""
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
