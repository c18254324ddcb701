"""The hardware a plan is for: a cluster of nodes with devices, from the device table
(metrics/device_table.py), a YAML file describing a custom cluster, or this machine's CPU (measured).

A cluster YAML file (every size in the units its key names):

    name: thetagpu
    device: a100-40gb            # a table device to start from (optional)
    nodes: 8
    devices_per_node: 8
    device_memory_gb: 40         # GiB-sized as vendors sell them: 40 = 40 x 2^30 bytes
    memory_bandwidth_gbps: 1555  # GB/s per device
    intra_node_gbps: 300         # GB/s per device, one direction (NVLink 3: 600 bidirectional)
    inter_node_gbps: 25          # GB/s per device (8 x HDR 200 Gb/s per node / 8 GPUs)
    host_link_gbps: 25           # GB/s device <-> host (PCIe 4.0 x16)
    host_memory_gb: 1024         # per node
    peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, StxWarning
from ..metrics.device_table import PEAK_TFLOPS, DeviceSpec, _normalize_name, lookup_device
from .hardware_profile import HardwareProfile, is_profile_file, load_profile, profile_mismatch, read_yaml
from .memory_model import DEFAULT_MOE_IMBALANCE

GIB = 2**30
# What the CUDA context, NCCL communicators and the caching allocator's fragmentation take of a GPU
# beyond tensors: measured 0.5-1.5 GiB per GPU (context ~500 MiB on A100, NCCL buffers ~300 MiB per
# communicator); we reserve 2 GiB, a stated round figure, not a measurement of the user's GPU.
GPU_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class Cluster:
    """nodes x devices_per_node devices of one kind. Bandwidths in bytes/s, memory in bytes, peaks
    in FLOP/s per dtype. On CPU (`kind == "cpu"`) the rates are measured on this machine by the caller
    (calibrate/this_machine.py `cpu_cluster`), which also hands the planner `gemm_rate`."""

    name: str
    kind: str  # "gpu" or "cpu"
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    peak_flops: dict[str, float]
    host_memory_bytes: int | None
    reserve_bytes: int
    source: str
    # CPU only: measured per-process rates (threads per process, fixed cost of one op in s,
    # gloo all-reduce latency in s); GEMM rates are measured per shape (speed.py)
    threads: int = 1
    op_seconds: float = 0.0
    comm_latency: float = 5e-6
    # CPU only: the share of a core each of the job's threads can expect on a machine others use too:
    # cores / (1-minute load average before the job + the job's threads), at most 1
    cpu_share: float = 1.0
    load_average: float | None = None
    # CPU without a profile: GEMM FLOP/s of (m, k, n, dtype, threads), measured per shape on this machine
    # by the caller that built the cluster (metrics/cpu_rates.py `gemm_rate`, cached); the planner only
    # reads it, so plan/ needs no torch
    gemm_rate: Callable[[int, int, int, str, int], float] | None = field(
        default=None, compare=False, repr=False
    )
    # the measured rates the time model reads (plan/hardware_profile.py): a built-in GPU profile for a
    # table device, a file given with --hardware, or this CPU's rates; None: the rate model's defaults
    profile: HardwareProfile | None = None
    # `stx plan --attention-kernel`: plan the attention core at this kernel's rates instead of the one
    # the engine's SDPA takes for the config (time model only; the memory model keeps the config's)
    attention_kernel: str | None = None
    # `stx plan --moe-imbalance`: the routed tokens' max/mean per expert an MoE model trains at (the
    # busiest expert-parallel rank's activations, GEMMs and all-to-alls); a property of the run, not of
    # the hardware, kept here beside attention_kernel so every prediction of the cluster reads the same
    # (plan/memory_model.py DEFAULT_MOE_IMBALANCE says why 1.25)
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(
                f"{self.device.name} has no {dtype} peak in the table (has {', '.join(self.peak_flops)})"
            )
        return self.peak_flops[dtype]


def table_cluster(
    device: str, nodes: int, devices_per_node: int | None = None, host_memory_gb: float | None = None
) -> Cluster:
    """A cluster of a table device (metrics/device_table.py DEVICE_SPECS and PEAK_TFLOPS)."""
    try:
        spec = lookup_device(device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    key = _normalize_name(device)
    per_node = devices_per_node or spec.devices_per_node
    profile = builtin_profile(key)
    return Cluster(
        name=f"{nodes} x {per_node} {key}",
        kind="gpu",
        nodes=nodes,
        devices_per_node=per_node,
        device=spec,
        peak_flops={k: v * 1e12 for k, v in PEAK_TFLOPS[key].items()},
        host_memory_bytes=int(host_memory_gb * GIB) if host_memory_gb else None,
        reserve_bytes=GPU_RESERVE_BYTES,
        source=spec.source,
        profile=profile,
    )


PROFILES_DIR = Path(__file__).with_name("profiles")
_BUILTIN: dict[str, HardwareProfile | None] = {}


def builtin_profile(device_key: str) -> HardwareProfile | None:
    """The shipped hardware profile of a table device (plan/profiles/<key>.yaml, built from public
    kernel data by benchmarks/build_gpu_profiles.py), or None for a device without one."""
    if device_key not in _BUILTIN:
        path = PROFILES_DIR / f"{device_key}.yaml"
        _BUILTIN[device_key] = load_profile(path) if path.exists() else None
    return _BUILTIN[device_key]


_YAML_KEYS = {
    "name",
    "device",
    "nodes",
    "devices_per_node",
    "device_memory_gb",
    "memory_bandwidth_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
    "host_link_gbps",
    "host_memory_gb",
    "peak_tflops",
    "reserve_gb",
}


def load_cluster(path: str | Path, nodes: int | None = None) -> Cluster:
    """A cluster from a YAML file (module docstring); `nodes` overrides the file's node count."""

    path = Path(path)
    data = read_yaml(path, "hardware file")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {', '.join(sorted(_YAML_KEYS))}")
    unknown = sorted(set(data) - _YAML_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_YAML_KEYS))}"
        )

    def number(key: str, default: float | None = None) -> float | None:
        value = data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{path}: {key} must be a positive number, got {value!r}")
        return float(value)

    base: DeviceSpec | None = None
    peaks: dict[str, float] = {}
    if "device" in data:
        try:
            base = lookup_device(str(data["device"]))
        except ValueError as e:
            raise ConfigError(f"{path}: device: {e}") from None
        peaks = {k: v * 1e12 for k, v in PEAK_TFLOPS[base.name].items()}
    if isinstance(data.get("peak_tflops"), dict):
        for dtype, value in data["peak_tflops"].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{path}: peak_tflops.{dtype} must be a positive number, got {value!r}")
            peaks[str(dtype)] = float(value) * 1e12
    elif "peak_tflops" in data:
        raise ConfigError(f"{path}: peak_tflops must be a mapping like {{bf16: 312, fp32: 19.5}}")
    if not peaks:
        raise ConfigError(f"{path}: give a table device (device: a100-40gb) or peak_tflops")

    def field(key: str, base_value: float | None, scale: float) -> float:
        value = number(key)
        if value is not None:
            return value * scale
        if base_value is None:
            raise ConfigError(f"{path}: {key} is required (no table device to take it from)")
        return base_value

    spec = DeviceSpec(
        name=str(data.get("name") or (base.name if base else path.stem)),
        memory_bytes=int(field("device_memory_gb", base.memory_bytes if base else None, GIB)),
        memory_bandwidth=field("memory_bandwidth_gbps", base.memory_bandwidth if base else None, 1e9),
        intra_node_bandwidth=field("intra_node_gbps", base.intra_node_bandwidth if base else None, 1e9),
        inter_node_bandwidth=field("inter_node_gbps", base.inter_node_bandwidth if base else None, 1e9),
        devices_per_node=int(field("devices_per_node", base.devices_per_node if base else None, 1)),
        host_link_bandwidth=field("host_link_gbps", base.host_link_bandwidth if base else 25e9, 1e9),
        source=f"{path}" + (f" (from {base.name}: {base.source})" if base else ""),
    )
    node_count = nodes if nodes is not None else int(number("nodes", 1) or 1)
    host = number("host_memory_gb")
    return Cluster(
        name=str(data.get("name") or path.stem),
        kind="gpu",
        nodes=node_count,
        devices_per_node=spec.devices_per_node,
        device=spec,
        peak_flops=peaks,
        host_memory_bytes=int(host * GIB) if host else None,
        reserve_bytes=int((number("reserve_gb") or GPU_RESERVE_BYTES / GIB) * GIB),
        source=spec.source,
    )


def with_nodes(cluster: Cluster, nodes: int, devices_per_node: int) -> Cluster:
    return dataclasses.replace(cluster, nodes=nodes, devices_per_node=devices_per_node)


def profile_cluster(
    profile: HardwareProfile,
    nodes: int = 1,
    devices_per_node: int | None = None,
    source: str | None = None,
) -> Cluster:
    """A cluster of `nodes` nodes of the device a hardware profile describes (plan/hardware_profile.py).
    Link bandwidths for the memory model and the layout checks come from the profile's largest
    collective points (intra node) and its topology (inter node: NICs per node x NIC bandwidth over
    the devices of a node); the time model reads the profile itself."""
    per_node = int(
        devices_per_node
        or profile.topology.get("devices_per_node")
        or (profile.fingerprint.get("processes") if profile.kind == "cpu" else None)
        or profile.fingerprint.get("device_count")
        or 1
    )

    def largest(scope: str) -> float | None:
        pts = [p for p in profile.collectives if p.scope == scope and p.op != "send_recv"]
        return max(pts, key=lambda p: p.size_bytes).busbw_gbps * 1e9 if pts else None

    memory_bw = profile.memory_bound.bandwidth_gbps * 1e9
    intra = largest("intra_node") or memory_bw
    nics, nic = profile.topology.get("nics_per_node"), profile.topology.get("nic_gbps")
    inter = largest("inter_node") or (nics * nic * 1e9 / per_node if nics and nic else intra)
    where = source or profile.source
    spec = DeviceSpec(
        name=profile.name,
        memory_bytes=int(profile.device_memory_gb * GIB),
        memory_bandwidth=memory_bw,
        intra_node_bandwidth=intra,
        inter_node_bandwidth=inter,
        devices_per_node=per_node,
        host_link_bandwidth=profile.host_link_gbps * 1e9,
        source=where,
    )
    small = [p for p in profile.collectives if p.op == "all_reduce"]
    latency = min(small, key=lambda p: p.size_bytes).time_us * 1e-6 if small else 5e-6
    threads = int(profile.fingerprint.get("threads_per_process") or 1)
    return Cluster(
        name=f"{nodes} x {per_node} {profile.name}",
        kind=profile.kind,
        nodes=nodes,
        devices_per_node=per_node,
        device=spec,
        peak_flops={k: v * 1e12 for k, v in profile.peak_tflops.items()},
        host_memory_bytes=None,
        reserve_bytes=GPU_RESERVE_BYTES if profile.kind == "gpu" else 0,
        source=where,
        threads=threads,
        op_seconds=profile.memory_bound.op_overhead_us * 1e-6,
        comm_latency=latency,
        profile=profile,
    )


def load_hardware(
    path: str | Path, nodes: int | None = None, here: Callable[[], dict[str, Any]] | None = None
) -> Cluster:
    """`--hardware FILE`: a hardware profile (a file with `format:`, plan/hardware_profile.py), used with
    a warning naming each way a CPU profile's fingerprint differs from this machine's (`here()`, from the
    measuring side: calibrate/this_machine.py `fingerprint_here`; None: not compared), or a cluster
    YAML file."""

    if not is_profile_file(path):
        return load_cluster(path, nodes=nodes)
    profile = load_profile(path)
    if profile.kind == "cpu" and here is not None:
        measured = {
            **here(),
            "processes": profile.fingerprint.get("processes"),
            "threads_per_process": profile.fingerprint.get("threads_per_process"),
        }
        differences = profile_mismatch(profile, measured)
        if differences:
            warnings.warn(
                StxWarning(f"{path}: measured on other hardware or software: {'; '.join(differences)}"),
                stacklevel=2,
            )
    return profile_cluster(profile, nodes or 1, source=f"{path} ({profile.source})")
