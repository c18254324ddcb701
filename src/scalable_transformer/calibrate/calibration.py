"""`stx calibrate`: measure the constants of the planner's op-class time model on this machine.

Every rank of the job measures at once (as training runs them), in seven sections, each with a time
budget: GEMMs at the config's layer shapes, attention forward and backward for every SDPA kernel
this device offers, memory-bound kernels (bandwidth, fixed cost per op), on a CPU the model's own
layer and head against the sum of their kernels (`measure_model_layer`, `layer_factors`), the
collectives between the ranks (world > 1), the fixed cost of an FSDP unit's collective beyond its
bytes (world > 1: `measure_fsdp_unit`, `unit_overhead_us`) and of a tensor-parallel layer (world >
1: `measure_tp_layer`, `tp_layer_overhead_us`). Rank 0 gathers the results into a hardware profile
(plan/hardware_profile.py's format 1) that `stx plan --hardware` reads.

Timing: CUDA events around each call on a GPU, `time.perf_counter` on a CPU; each point keeps the
median of its repeats after a warm-up call, and the ranks' figures are averaged (compute) or the
slowest taken (collectives, which end together). The median, not the fastest: the planner predicts
the median step a run measures (`median_iteration_seconds`); on this project's shared 2-core CPU the
time model's median |error| over 15 layouts was 20.5% with fastest-repeat profiles and 17.3% with
median-repeat ones taken right after them (benchmarks/results/plan_accuracy_profile.md).
Before every point the ranks agree whether the section's budget allows it, so they always call
the same collectives in the same order, and a section over budget stops early instead of running on.

FLOP conventions (what the `tflops` figures mean):
- a GEMM (M, N, K): 2 M N K;
- attention forward: 4 b n s^2 d (q k^T and p v), half that when causal; backward 2.5 x forward
  (five matmuls of the same size: the FlashAttention-2 paper's count).
Bus bandwidth of a collective (nccl-tests' definitions, size = the whole tensor): all-reduce
2 (n-1)/n size / t; all-gather and reduce-scatter (n-1)/n size / t; send/recv size / t.

Shape legend: m, n, k GEMM dims (out = [m, k] @ [k, n]); b micro-batch, s sequence, h hidden,
f ffn, v padded vocabulary, n heads, d head dim.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config.rules import physical_memory_bytes
from ..config.schema import Config
from ..metrics.device_specs import detect_device_name
from ..metrics.device_table import PEAK_TFLOPS, lookup_peak
from ..plan.hardware_profile import CORRECTION_CLASSES, FORMAT, profile_from_dict
from .collective_rates import host_link_gbps, measure_collectives
from .kernels import (
    attention_cases,
    dispatched_kernel,
    gemm_shapes,
    measure_attention,
    measure_gemm,
    measure_memory_bound,
)
from .layer_factor import measure_model_layer
from .parallel_overheads import measure_fsdp_unit, measure_tp_layer, tp_layer_overhead_us, unit_overhead_us
from .this_machine import fingerprint_here
from .timing import Job, _figure


def calibrate(cfg: Config, job: Job, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every section at the config's shapes and dtype; returns the hardware profile as a mapping
    (plan/hardware_profile.py format 1), the same on every rank. Collective: every rank calls it."""
    dtype = cfg.train.precision
    start = time.perf_counter()
    gemm = measure_gemm(job, gemm_shapes(cfg, job.quick), dtype, say)
    attention = measure_attention(job, attention_cases(cfg, job.quick), dtype, say)
    memory = measure_memory_bound(job, cfg, say)
    mapping = profile_mapping(job, dtype, gemm, attention, memory, [])  # what model_layer plans with
    factors = measure_model_layer(job, cfg, mapping, say)
    collectives = measure_collectives(job, say)
    fsdp = measure_fsdp_unit(job, cfg, say)
    tp = measure_tp_layer(job, cfg, say)
    mapping["collectives"] = collectives
    if factors:
        mapping["layer_factors"] = factors
    dispatched = dispatched_kernel(job, cfg, dtype)
    if dispatched is not None:
        mapping["attention_kernel"] = dispatched
        say(
            f"calibrate: attention: scaled_dot_product_attention dispatches the config's call to {dispatched}"
        )
    if collectives:
        profile = profile_from_dict(mapping)
        if fsdp is not None:
            unit_us = unit_overhead_us(profile, fsdp, job.world)
            mapping["memory_bound"]["unit_overhead_us"] = _figure(unit_us)
            say(f"calibrate: fsdp_unit: {unit_us / 1e3:.2f} ms per unit collective beyond its bytes")
        for timing in tp:
            overheads = {key: _figure(us) for key, us in tp_layer_overhead_us(profile, timing).items()}
            mapping.setdefault("tp_layers", []).append({"ranks": timing.ranks, **overheads})
            mapping["memory_bound"].update(overheads)  # the largest group size's, last
            for key, us in overheads.items():
                say(f"calibrate: {key.removesuffix('_overhead_us')}: {timing.ranks} ranks: {us / 1e3:.2f} ms "
                    "per layer and micro-batch beyond its GEMMs and collectives")  # fmt: skip
    say(f"calibrate: all sections in {time.perf_counter() - start:.1f} s")
    return mapping


def profile_mapping(
    job: Job, dtype: str, gemm: list[dict], attention: list[dict], memory: dict, collectives: list[dict]
) -> dict[str, Any]:
    """The measured sections with what identifies the machine: the profile's YAML mapping."""

    now = dt.datetime.now(dt.timezone.utc)
    fingerprint = fingerprint_here(processes=job.world, threads_per_process=torch.get_num_threads())
    fingerprint["hostname"] = job.hosts[0] if job.hosts else socket.gethostname()  # rank 0's
    device_name = str(fingerprint["device_name"])
    per_node = job.hosts.count(job.hosts[0]) if job.hosts else 1
    if job.cuda:
        memory_gb = torch.cuda.get_device_properties(job.device).total_memory / 2**30
    else:
        memory_gb = (physical_memory_bytes() or 0) / per_node / 2**30
    backend = "nccl" if job.cuda else "gloo"
    threads = f", {fingerprint['threads_per_process']} thread(s) per process" if not job.cuda else ""
    return {
        "format": FORMAT,
        "name": f"{fingerprint['hostname']} {device_name} ({backend}{threads})",
        "kind": "gpu" if job.cuda else "cpu",
        "source": f"measured by stx calibrate {now:%Y-%m-%dT%H:%MZ}",
        "fingerprint": fingerprint,
        "peak_tflops": _peak_tflops_by_dtype(job, dtype, gemm),
        "device_memory_gb": _figure(memory_gb),
        "host_link_gbps": host_link_gbps(job) if job.cuda else memory["bandwidth_gbps"],
        "gemm": gemm,
        "attention": attention,
        "memory_bound": memory,
        "collectives": collectives,
        "corrections": dict.fromkeys(CORRECTION_CLASSES, 1.0),
        "corrections_source": None,
    }


def _peak_tflops_by_dtype(job: Job, dtype: str, gemm: list[dict]) -> dict[str, float]:
    """The measured dtype's peak (`_peak_tflops`) and, on a GPU of the device table, the table's peak of
    every other dtype it lists: the profile then scales its measured points to a run in another
    dtype (fp16 from bf16 points), where with one peak `stx plan` refused (an H200 profile measured
    in bf16 could not plan an fp16 run)."""
    peaks = {dtype: _peak_tflops(job, dtype, gemm)}
    if job.cuda:
        name = detect_device_name(torch.cuda.get_device_name(job.device))
        for other, tflops in PEAK_TFLOPS.get(name or "", {}).items():
            peaks.setdefault(other, float(tflops))
    return peaks


def _peak_tflops(job: Job, dtype: str, gemm: list[dict]) -> float:
    """A GPU's datasheet peak when the device table knows it (MFU's convention), else the fastest
    GEMM measured here (a CPU: per process at its threads)."""
    measured = max((p["tflops"] for p in gemm), default=0.0)
    if job.cuda:
        name = detect_device_name(torch.cuda.get_device_name(job.device))
        if name is not None:
            with contextlib.suppress(ValueError, KeyError):
                return lookup_peak(name, dtype) / 1e12
    return measured
