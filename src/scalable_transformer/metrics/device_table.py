"""The device table, torch-free data the planner reads: memory, bandwidths and dense peak FLOP/s of
each known GPU, their lookups, and this CPU's model name. Measuring a CPU's peak and detecting the
local GPU (both need torch) are metrics/device_specs.py's.

Every GPU figure is the vendor's dense (no 2:4 sparsity) tensor/matrix peak at boost clock, in
TFLOP/s per device as PyTorch sees it, for matmuls with FP32 accumulation where the vendor gives
both (GeForce cards run FP16-accumulate at twice the rate; mixed-precision training accumulates in
FP32). fp32 is the non-tensor FP32 rate on NVIDIA (use "tf32" when TF32 matmuls are enabled) and
the FP32 matrix rate on AMD. A dtype missing from a row is not accelerated on that device.
"""

from __future__ import annotations

import difflib
import platform
import re
from dataclasses import dataclass

DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")


_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "tf32": "tf32",
    "tensorfloat32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    # the float8 tensor-core rate (e4m3/e5m2 inputs): MFU of a train.fp8 run beside the bf16 one;
    # not a compute dtype of --dtype, so not in DTYPES
    "fp8": "fp8",
    "float8": "fp8",
}


# TFLOP/s, dense. Sources: NVIDIA datasheets (A100, H100, H200, GH200, V100, A10, A40, L4, L40, L40S,
# T4), the GA102 / Ada whitepapers (RTX A6000, RTX 3090, RTX 4090), AMD Instinct datasheets. fp8: the
# dense float8 tensor-core rate (half the datasheets' "with sparsity" figure), Hopper only so far.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "a100-40gb": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM and PCIe alike
    "a100-80gb": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "h100-sxm": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp8": 1978.9},
    "h100-pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0},
    "h100-nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5},
    "h200-sxm": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp8": 1978.9},
    "h200-nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp8": 1978.9},
    "v100-16gb": {"fp16": 125.0, "fp32": 15.7},  # SXM2
    "v100-32gb": {"fp16": 125.0, "fp32": 15.7},  # SXM2
    "v100-pcie": {"fp16": 112.0, "fp32": 14.0},
    "v100s-pcie": {"fp16": 130.0, "fp32": 16.4},
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "a40": {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "rtx-a6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "l40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "t4": {"fp16": 65.0, "fp32": 8.1},
    "rtx-3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "rtx-4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    # PyTorch sees each of the two dies (GCDs) of an MI250X as one device: half the 383 / 95.7
    # TFLOP/s of the package.
    "mi250x": {"bf16": 191.5, "fp16": 191.5, "fp32": 47.85},
    "mi300x": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner needs of one device model besides its peak: memory (bytes), memory bandwidth
    (bytes/s), the intra-node link per device (bytes/s, one direction, as a ring sees it), the
    inter-node bandwidth per device (bytes/s) and how many devices a node usually holds."""

    name: str
    memory_bytes: int
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    host_link_bandwidth: float  # device <-> host (PCIe), bytes/s one direction
    source: str


_GB, _GIB = 1e9, 2**30


# Sources: NVIDIA A100 datasheet (40/80 GB HBM2/HBM2e, 1,555 / 2,039 GB/s SXM; NVLink 3: 600 GB/s
# bidirectional per GPU = 300 GB/s each way), DGX A100 user guide (8 GPUs, 8 x 200 Gb/s HDR per node
# = 25 GB/s per GPU), NVIDIA H100 datasheet (SXM 80 GB 3.35 TB/s, NVLink 4 900 GB/s bidirectional;
# PCIe 80 GB 2 TB/s, NVLink bridge 600 GB/s; DGX H100: 8 x 400 Gb/s NDR = 50 GB/s per GPU), NVIDIA
# H200 datasheet (141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s). PCIe 4.0 x16 = 32 GB/s nominal per
# direction (about 25 GB/s reached), PCIe 5.0 x16 = 64 GB/s nominal (about 50 GB/s).
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec(
        "a100-40gb",
        40 * _GIB,
        1555 * _GB,
        300 * _GB,
        25 * _GB,
        8,
        25 * _GB,
        "NVIDIA A100 datasheet (SXM4 40 GB, NVLink 3); DGX A100: 8 x HDR 200 Gb/s per node",
    ),
    "a100-80gb": DeviceSpec(
        "a100-80gb",
        80 * _GIB,
        2039 * _GB,
        300 * _GB,
        25 * _GB,
        8,
        25 * _GB,
        "NVIDIA A100 datasheet (SXM4 80 GB, NVLink 3); DGX A100: 8 x HDR 200 Gb/s per node",
    ),
    "h100-sxm": DeviceSpec(
        "h100-sxm",
        80 * _GIB,
        3350 * _GB,
        450 * _GB,
        50 * _GB,
        8,
        50 * _GB,
        "NVIDIA H100 datasheet (SXM5 80 GB, NVLink 4); DGX H100: 8 x NDR 400 Gb/s per node",
    ),
    "h100-pcie": DeviceSpec(
        "h100-pcie",
        80 * _GIB,
        2000 * _GB,
        300 * _GB,
        25 * _GB,
        8,
        50 * _GB,
        "NVIDIA H100 datasheet (PCIe 80 GB, NVLink bridge 600 GB/s); 200 Gb/s NIC per GPU assumed",
    ),
    "h200-sxm": DeviceSpec(
        "h200-sxm",
        int(141 * _GB),
        4800 * _GB,
        450 * _GB,
        50 * _GB,
        8,
        50 * _GB,
        "NVIDIA H200 datasheet (141 GB HBM3e, NVLink 4); 8 x NDR 400 Gb/s per node",
    ),
}


_NAME_ALIASES = {
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",  # as a100-80gb names the A100 by its memory; the SXM part is the common one
    "h200": "h200-sxm",
    "a6000": "rtx-a6000",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
}


# (pattern on the lower-cased torch.cuda.get_device_name(), table key); first match wins, so more
# specific names come first ("gh200" before "h200", "a100" before "a10", "l40s" before "l40").
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bgh200\b", "gh200"),
    (r"\bh200\b.*\bnvl\b", "h200-nvl"),
    (r"\bh200\b", "h200-sxm"),
    (r"\bh100\b.*\bnvl\b", "h100-nvl"),
    (r"\bh100\b.*(\bpcie\b|\bhbm2e\b)", "h100-pcie"),
    (r"\bh100\b", "h100-sxm"),
    (r"\ba100\b.*\b80gb\b", "a100-80gb"),
    (r"\ba100\b", "a100-40gb"),
    (r"\bv100s\b", "v100s-pcie"),
    (r"\bv100\b.*\bpcie\b", "v100-pcie"),
    (r"\bv100\b.*\b32gb\b", "v100-32gb"),
    (r"\bv100\b", "v100-16gb"),
    (r"\ba10\b", "a10"),
    (r"\ba40\b", "a40"),
    (r"\brtx a6000\b", "rtx-a6000"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
    (r"\brtx 3090\b(?! ti)", "rtx-3090"),
    (r"\brtx 4090\b(?! d\b)", "rtx-4090"),
    (r"\bmi250x\b", "mi250x"),
    (r"\bmi300x\b", "mi300x"),
)


@dataclass(frozen=True)
class PeakInfo:
    """Peak of one device in FLOP/s, and a human string naming where it came from (printed next to
    every MFU)."""

    flops_per_second: float
    source: str
    # a train.fp8 run's second MFU: the float8 peak (0.0: none, `fp8_source` says why)
    fp8_flops_per_second: float = 0.0
    fp8_source: str = ""


def lookup_device(device_name: str) -> DeviceSpec:
    """The memory/bandwidth spec of a table device; ValueError naming the valid ones otherwise."""
    key = _normalize_name(device_name)
    if key not in DEVICE_SPECS:
        close = difflib.get_close_matches(key, list(DEVICE_SPECS), n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"no memory/bandwidth spec for device {device_name!r}.{hint} Known: {', '.join(DEVICE_SPECS)}; "
            "or describe it in a cluster YAML file (--hardware)"
        )
    return DEVICE_SPECS[key]


def normalize_dtype(dtype: str) -> str:
    """'bfloat16' / 'torch.bfloat16' / 'bf16' -> 'bf16', and so on; ValueError for anything else."""
    key = str(dtype).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def _normalize_name(device_name: str) -> str:
    key = re.sub(r"[\s_]+", "-", device_name.strip().lower())
    return _NAME_ALIASES.get(key, key)


def lookup_peak(device_name: str, dtype: str) -> float:
    """Dense peak of a table device for a dtype, in FLOP/s (not TFLOP/s).

    Raises ValueError naming the valid devices (with the nearest match) or the dtypes the device has.
    """
    key = _normalize_name(device_name)
    if key not in PEAK_TFLOPS:
        close = difflib.get_close_matches(key, list(PEAK_TFLOPS) + list(_NAME_ALIASES), n=1, cutoff=0.5)
        hint = f" Did you mean {_NAME_ALIASES.get(close[0], close[0])!r}?" if close else ""
        raise ValueError(
            f"unknown device {device_name!r} for the peak-FLOPs table.{hint} Valid names: "
            f"{', '.join(PEAK_TFLOPS)}. Or give the peak directly (logging.peak_tflops / "
            "--peak-tflops)."
        )
    dt = normalize_dtype(dtype)
    row = PEAK_TFLOPS[key]
    if dt not in row:
        raise ValueError(
            f"{key} has no accelerated {dt} matmul in the peak table; its dtypes: {', '.join(row)}"
        )
    return row[dt] * 1e12


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"
