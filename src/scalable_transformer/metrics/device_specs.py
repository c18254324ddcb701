"""Peak FLOP/s per device: a table of dense GPU peaks, a measured GEMM peak on CPU, and the one
function (`resolve_peak`) that picks between them and says where the number came from.

Every GPU figure is the vendor's dense (no 2:4 sparsity) tensor/matrix peak at boost clock, in
TFLOP/s per device as PyTorch sees it, for matmuls with FP32 accumulation where the vendor gives
both (GeForce cards run FP16-accumulate at twice the rate; mixed-precision training accumulates in
FP32). fp32 is the non-tensor FP32 rate on NVIDIA (use "tf32" when TF32 matmuls are enabled) and
the FP32 matrix rate on AMD. A dtype missing from a row is not accelerated on that device.
"""

from __future__ import annotations

import difflib
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..cache import (
    cache_dir,
    put_json_entry,
    read_json_entries,
)

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
}

# TFLOP/s, dense. Sources: NVIDIA datasheets (A100, H100, H200, GH200, V100, A10, A40, L4, L40, L40S,
# T4), the GA102 / Ada whitepapers (RTX A6000, RTX 3090, RTX 4090), AMD Instinct datasheets.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "a100-40gb": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM and PCIe alike
    "a100-80gb": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "h100-sxm": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100-pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "h100-nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "h200-sxm": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h200-nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
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


def detect_device_name(cuda_device_name: str | None = None) -> str | None:
    """Table key for a `torch.cuda.get_device_name()` string (e.g. 'NVIDIA A100-SXM4-80GB' ->
    'a100-80gb'), or None if the device is not in the table. A pure function of the string; with
    no argument it asks torch for the current CUDA device (None without one)."""
    if cuda_device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        cuda_device_name = torch.cuda.get_device_name()
    text = re.sub(r"[-_/]+", " ", cuda_device_name.lower())
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, text):
            return key
    return None


# ----------------------------------------------------------------------------------------- CPU


def cpu_peak_cache_path() -> Path:
    """JSON file holding measured CPU GEMM peaks, one entry per machine/torch/dtype key."""
    return cache_dir() / "cpu_peak.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


# What a CPU peak is measured on; part of the cache key, so changing the measurement (v1 was bf16
# torch.mm, 20x below what bf16 training reaches on a CPU without native bf16) invalidates old peaks.
CPU_PEAK_METHOD = "v2: best of the 3 GEMMs of a linear layer (fwd under autocast, 2 bwd)"


def cpu_fingerprint(dtype: str, threads: int | None = None) -> str:
    """Cache key of a CPU peak: measurement method, CPU model, logical cores, torch threads, torch
    version and dtype."""
    import torch

    nthreads = threads if threads is not None else torch.get_num_threads()
    return (
        f"{CPU_PEAK_METHOD} | {_cpu_model()} | cores={os.cpu_count()} | threads={nthreads} | "
        f"torch={torch.__version__} | {normalize_dtype(dtype)}"
    )


_CPU_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def measure_cpu_kernels(
    dtype: str, threads: int | None = None, *, budget_seconds: float = 2.0
) -> dict[str, float]:
    """Best rate in FLOP/s of each GEMM that training runs for a linear layer y = x W^T, in dtype
    (fp32, bf16, fp16), over square sizes:

    - "forward": F.linear(x, W), for bf16/fp16 under torch.autocast("cpu", dtype) with W an fp32
      leaf that requires grad (so autocast casts it once and caches it, as it does a parameter);
    - "grad_input": g @ W and "grad_weight": g^T @ x, plain matmuls in dtype, as autograd runs them on
      the tensors autocast saved.

    The three differ by 20x on a CPU without native bf16 (only one operand layout has a fast
    kernel), which is why the peak is not measured on torch.mm alone. Each GEMM grows until one run
    takes ~10 ms, is scaled to ~0.05 s per run, then the three repeat in turn until budget_seconds
    (total ~2-3 s); the best run counts, because the machine may be shared and noisy. threads sets
    torch's intra-op threads for the measurement (restored afterwards).
    """
    import torch
    import torch.nn.functional as F

    dt = normalize_dtype(dtype)
    if dt not in _CPU_DTYPES:
        raise ValueError(f"CPU peak is measured for {', '.join(_CPU_DTYPES)}, not {dt}")
    low = getattr(torch, _CPU_DTYPES[dt])
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # A private generator: measuring must not move the global RNG, or a run that measures (cache
    # miss) would draw other dropout masks than an identical run that reads the cache.
    gen = torch.Generator().manual_seed(0)
    autocast = torch.autocast("cpu", dtype=low) if dt != "fp32" else torch.autocast("cpu", enabled=False)

    def operands(kernel: str, n: int):
        a = torch.randn(n, n, generator=gen)
        b = torch.randn(n, n, generator=gen)
        if kernel == "forward":
            return a, b.requires_grad_()  # fp32 in; autocast casts, as in training
        return a.to(low), b.to(low)

    def call(kernel: str, a, b) -> None:
        if kernel == "forward":
            F.linear(a, b)
        elif kernel == "grad_input":
            torch.mm(a, b)
        else:
            torch.mm(a.t(), b)

    best = {"forward": 0.0, "grad_input": 0.0, "grad_weight": 0.0}
    try:
        with torch.no_grad(), autocast:
            deadline = time.perf_counter() + budget_seconds

            def timed(kernel: str, n: int, a, b) -> float:
                start = time.perf_counter()
                call(kernel, a, b)
                seconds = time.perf_counter() - start
                best[kernel] = max(best[kernel], 2 * n**3 / seconds)
                return seconds

            sized = {}
            for kernel in best:
                n = 256
                a, b = operands(kernel, n)
                seconds = timed(kernel, n, a, b)
                # grow until a run is long enough to scale (or the budget is spent: a loaded machine)
                while seconds < 0.01 and n < 4096 and time.perf_counter() < deadline:
                    n *= 2
                    a, b = operands(kernel, n)
                    seconds = timed(kernel, n, a, b)
                # scale to ~0.05 s per run, in multiples of 256 (a slow kernel stays small)
                target = int(min(4096, max(256, round(n * (0.05 / seconds) ** (1 / 3) / 256) * 256)))
                if target != n and time.perf_counter() < deadline:
                    n = target
                    a, b = operands(kernel, n)
                call(kernel, a, b)  # warm-up: the first call at a size pays for packing/dispatch
                sized[kernel] = (n, a, b)
            for _ in range(20):
                for kernel, (n, a, b) in sized.items():
                    if time.perf_counter() >= deadline:
                        break
                    timed(kernel, n, a, b)
        return best
    finally:
        torch.set_num_threads(previous_threads)


def measure_cpu_peak(dtype: str, threads: int | None = None, *, budget_seconds: float = 2.0) -> float:
    """Peak of this CPU in FLOP/s for dtype: the best of the GEMMs training runs (see
    `measure_cpu_kernels`), so a training step can never beat it."""
    return max(measure_cpu_kernels(dtype, threads, budget_seconds=budget_seconds).values())


def _cpu_peak_entry(
    dtype: str, threads: int | None = None, refresh: bool = False
) -> tuple[float, Path, bool]:
    """(FLOP/s, cache file, read from cache?) for the measured CPU peak of dtype."""
    path = cpu_peak_cache_path()
    key = cpu_fingerprint(dtype, threads)
    entry = read_json_entries(path.name).get(key)
    cached = (
        float(entry["flops_per_second"])
        if isinstance(entry, dict)
        and isinstance(entry.get("flops_per_second"), (int, float))
        and entry["flops_per_second"] > 0
        else None
    )
    if cached is not None and not refresh:
        return cached, path, True
    # A peak is the best rate the machine can reach: a re-measurement under load must not lower it.
    value = max(measure_cpu_peak(dtype, threads), cached or 0.0)
    put_json_entry(path.name, key, {"flops_per_second": value})  # re-reads: others may have added entries
    return value, path, False


def cpu_peak(dtype: str, threads: int | None = None, *, refresh: bool = False) -> float:
    """Measured GEMM peak of this CPU for dtype in FLOP/s, cached per machine in
    `cpu_peak_cache_path()` (keyed by `cpu_fingerprint`); measures (~2-3 s) only on a cache miss,
    or with refresh=True (which keeps the higher of the old and new values)."""
    return _cpu_peak_entry(dtype, threads, refresh)[0]


def resolve_peak(
    device_type: str, dtype: str, device_name: str | None, override_tflops: float | None
) -> PeakInfo:
    """Peak FLOP/s of one device for MFU/HFU, and the source to print next to them.

    Priority: override_tflops (TFLOP/s per device) > the table entry of device_name (or, on CUDA,
    of the detected device) > on CPU the measured, cached GEMM peak of dtype.
    """
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"peak_tflops override must be > 0 TFLOP/s, got {override_tflops}")
        return PeakInfo(override_tflops * 1e12, f"user override ({override_tflops:g} TFLOP/s per device)")
    dt = normalize_dtype(dtype)
    if device_name is not None and device_name.strip().lower() != "cpu":
        key = _normalize_name(device_name)
        return PeakInfo(lookup_peak(key, dt), f"{key} {dt} dense table")
    if device_type == "cpu" or (device_name or "").strip().lower() == "cpu":
        value, path, cached = _cpu_peak_entry(dt)
        how = f"cached {path}" if cached else f"measured now, cached to {path}"
        return PeakInfo(
            value, f"measured CPU {dt} GEMM peak (best linear-layer GEMM, as training runs it; {how})"
        )
    if device_type == "cuda":
        import torch

        raw = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        detected = detect_device_name(raw) if raw is not None else None
        if detected is None:
            what = (
                "no CUDA device is visible" if raw is None else f"GPU {raw!r} is not in the peak-FLOPs table"
            )
            raise ValueError(
                f"{what}; set logging.device_name to one of "
                f"{', '.join(PEAK_TFLOPS)} or logging.peak_tflops to its dense peak"
            )
        return PeakInfo(lookup_peak(detected, dt), f"{detected} {dt} dense table (detected from {raw!r})")
    raise ValueError(f"no peak FLOPs for device type {device_type!r}: set logging.peak_tflops")


# x86 /proc/cpuinfo flags of matmul units that compute the dtype natively (named in the warning).
_NATIVE_FLAGS = {"bf16": ("amx_bf16", "avx512_bf16"), "fp16": ("amx_fp16", "avx512_fp16")}


def _cpu_flags() -> set[str] | None:
    """The x86 feature flags of this CPU, or None where /proc/cpuinfo has no "flags" line."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_precision_warning(dtype: str, threads: int | None = None) -> str | None:
    """One line for the start of a CPU run in bf16/fp16 whose matmuls this CPU runs clearly (> 1.5x)
    slower than fp32 ones, with the measured peaks of both dtypes; None for fp32 or when the dtype is
    not slower. Measures (and caches) the two peaks if needed (~2 s each)."""
    dt = normalize_dtype(dtype)
    if dt == "fp32":
        return None
    import torch

    nthreads = threads if threads is not None else torch.get_num_threads()
    low, full = cpu_peak(dt, nthreads), cpu_peak("fp32", nthreads)
    if low * 1.5 >= full:  # 1.5: two peaks measured under load differ by that much without meaning it
        return None
    flags, native = _cpu_flags(), _NATIVE_FLAGS[dt]
    if flags is None:
        why = f"this CPU has no fast {dt} matmul"
    elif not flags & set(native):
        why = f"this CPU has no native {dt} (no {'/'.join(native)})"
    else:
        have = "/".join(sorted(flags & set(native)))
        why = f"this CPU's {dt} matmuls are slower than its fp32 ones despite {have}"
    return (
        f"{dt} runs at {low / 1e9:.0f} GFLOP/s here vs fp32 {full / 1e9:.0f} GFLOP/s (best linear-layer "
        f"GEMM, {nthreads} threads): {why}; expect steps up to about {full / low:.0f}x slower than in "
        "fp32 (train.precision=fp32)"
    )
