"""Peak FLOP/s per device: a measured GEMM peak on CPU, the local GPU detected, and the one function
(`resolve_peak`) that picks between a measured peak and the device table (metrics/device_table.py)
and says where the number came from.

Every GPU figure is the vendor's dense (no 2:4 sparsity) tensor/matrix peak at boost clock, in
TFLOP/s per device as PyTorch sees it, for matmuls with FP32 accumulation where the vendor gives
both (GeForce cards run FP16-accumulate at twice the rate; mixed-precision training accumulates in
FP32). fp32 is the non-tensor FP32 rate on NVIDIA (use "tf32" when TF32 matmuls are enabled) and
the FP32 matrix rate on AMD. A dtype missing from a row is not accelerated on that device.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cache import (
    cache_dir,
    put_json_entry,
    read_json_entries,
)
from .device_table import (
    _DEVICE_PATTERNS,
    PEAK_TFLOPS,
    PeakInfo,
    _normalize_name,
    cpu_model,
    lookup_peak,
    normalize_dtype,
)


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


# What a CPU peak is measured on; part of the cache key, so changing the measurement (v1 was bf16
# torch.mm, 20x below what bf16 training reaches on a CPU without native bf16) invalidates old peaks.
CPU_PEAK_METHOD = "v2: best of the 3 GEMMs of a linear layer (fwd under autocast, 2 bwd)"


def cpu_fingerprint(dtype: str, threads: int | None = None) -> str:
    """Cache key of a CPU peak: measurement method, CPU model, logical cores, torch threads, torch
    version and dtype."""
    import torch

    nthreads = threads if threads is not None else torch.get_num_threads()
    return (
        f"{CPU_PEAK_METHOD} | {cpu_model()} | cores={os.cpu_count()} | threads={nthreads} | "
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

    best = {"forward": 0.0, "grad_input": 0.0, "grad_weight": 0.0}
    try:
        with torch.no_grad(), autocast:
            deadline = time.perf_counter() + budget_seconds

            def timed(kernel: str, n: int, a, b) -> float:
                start = time.perf_counter()
                _linear_gemm(kernel, a, b)
                seconds = time.perf_counter() - start
                best[kernel] = max(best[kernel], 2 * n**3 / seconds)
                return seconds

            sized = {kernel: _sized_operands(kernel, timed, low, gen, deadline) for kernel in best}
            for _ in range(20):
                for kernel, (n, a, b) in sized.items():
                    if time.perf_counter() >= deadline:
                        break
                    timed(kernel, n, a, b)
        return best
    finally:
        torch.set_num_threads(previous_threads)


def _gemm_operands(kernel: str, n: int, low: Any, gen: Any) -> tuple[Any, Any]:
    """Two n x n operands of one of a linear layer's GEMMs (measure_cpu_kernels): fp32 with W a leaf
    that requires grad for the forward (autocast casts it, as in training), else in the low dtype."""
    import torch

    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    if kernel == "forward":
        return a, b.requires_grad_()  # fp32 in; autocast casts, as in training
    return a.to(low), b.to(low)


def _linear_gemm(kernel: str, a: Any, b: Any) -> None:
    """One call of a linear layer's GEMM: the forward F.linear, or a backward matmul."""
    import torch
    import torch.nn.functional as F

    if kernel == "forward":
        F.linear(a, b)
    elif kernel == "grad_input":
        torch.mm(a, b)
    else:
        torch.mm(a.t(), b)


def _sized_operands(
    kernel: str, timed: Callable[[str, int, Any, Any], float], low: Any, gen: Any, deadline: float
) -> tuple[int, Any, Any]:
    """The size a GEMM is timed at and its operands: grown from 256 until one run takes ~10 ms, then
    scaled to ~0.05 s per run (within the budget's deadline), warmed up once at that size."""
    n = 256
    a, b = _gemm_operands(kernel, n, low, gen)
    seconds = timed(kernel, n, a, b)
    # grow until a run is long enough to scale (or the budget is spent: a loaded machine)
    while seconds < 0.01 and n < 4096 and time.perf_counter() < deadline:
        n *= 2
        a, b = _gemm_operands(kernel, n, low, gen)
        seconds = timed(kernel, n, a, b)
    # scale to ~0.05 s per run, in multiples of 256 (a slow kernel stays small)
    target = int(min(4096, max(256, round(n * (0.05 / seconds) ** (1 / 3) / 256) * 256)))
    if target != n and time.perf_counter() < deadline:
        n = target
        a, b = _gemm_operands(kernel, n, low, gen)
    _linear_gemm(kernel, a, b)  # warm-up: the first call at a size pays for packing/dispatch
    return n, a, b


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


def resolve_fp8_peak(device_type: str, device_name: str | None, override_tflops: float | None) -> PeakInfo:
    """The float8 peak FLOP/s of one device, for the second MFU of a train.fp8 run (the first is
    against the bf16 peak, `resolve_peak`); flops_per_second 0.0 when there is none, with the reason
    as its source: a CPU has no float8 matmul unit (torch._scaled_mm runs a reference path there), a
    GPU may have none in the table, and a user's logging.peak_tflops names one dtype's peak only."""
    if override_tflops is not None:
        return PeakInfo(0.0, "none: logging.peak_tflops overrides the bf16 peak only")
    if device_type == "cpu" or (device_name or "").strip().lower() == "cpu":
        return PeakInfo(0.0, "none: a CPU has no float8 matmul unit (float8 GEMMs run a reference path)")
    if device_name is None and device_type == "cuda":
        import torch

        raw = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        device_name = detect_device_name(raw) if raw is not None else None
    if device_name is None:
        return PeakInfo(0.0, "none: the device is not in the peak-FLOPs table (set logging.device_name)")
    key = _normalize_name(device_name)
    try:
        return PeakInfo(lookup_peak(key, "fp8"), f"{key} fp8 dense table")
    except ValueError as err:
        return PeakInfo(0.0, f"none: {err}")


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
