"""A hardware profile: the measured rates the planner's time model (plan/speed.py) reads, one YAML file
per machine (format 1). Written by `stx calibrate` for this machine, shipped for public GPUs
(plan/profiles/*.yaml, built from benchmarks/data/gpu_kernels), refit by `stx plan --calibrate-from`
(`corrections`). docs/PLANNER.md#hardware-profiles describes every key.

    format: 1
    name: "this machine (2 x AMD EPYC, gloo)"
    kind: cpu                  # or gpu
    source: "measured by stx calibrate 2026-11-25T23:50Z"
    fingerprint: {hostname: h, device_name: "AMD EPYC", device_count: 2, cpu_model: "...",
                  torch: "2.13.0", cuda: null, processes: 2, threads_per_process: 1, created: "..."}
    peak_tflops: {fp32: 0.1, bf16: 0.05}      # per device (CPU: per process at its threads)
    device_memory_gb: 11.5
    host_link_gbps: 10.0
    gemm:        [{dtype: fp32, m: 512, n: 1024, k: 256, tflops: 0.08}]
    attention:   [{kernel: math, dtype: fp32, batch: 4, heads: 4, seq_len: 128, head_dim: 64,
                   causal: true, pass: fwd, tflops: 0.03}]
    memory_bound: {bandwidth_gbps: 12.0, op_overhead_us: 9.0}
    collectives: [{op: all_reduce, scope: intra_node, ranks: 2, size_bytes: 1048576, time_us: 900.0,
                   busbw_gbps: 2.2}]
    corrections: {gemm: 1.0, attention: 1.0, memory_bound: 1.0, overhead: 1.0, communication: 1.0}
    corrections_source: null

Optional keys beyond these (GPU profiles use them): `topology: {devices_per_node, nics_per_node,
nic_gbps}` (inter-node links), `memory_bound.unit_overhead_us` (fixed cost of one FSDP unit's
collectives), `memory_bound.tp_layer_overhead_us` / `sp_layer_overhead_us` (fixed cost of a
tensor-parallel layer, without / with sequence parallelism, per micro-batch; the tensor-parallel group
size `stx calibrate` measured it at is the largest of `tp_layers`), `tp_layers: [{ranks,
tp_layer_overhead_us, sp_layer_overhead_us}]` (the same cost per tensor-parallel group size, each
measured with the node's groups of that size side by side), and a `source`
string on any gemm/attention/collectives entry. A CPU calibration adds `memory_bound.activation_gbps`:
the rate of a layer's elementwise ops as the step runs them, and `layer_factors: {layer, head}`: the
model's own transformer layer, and its logits GEMM with the loss, timed forward and backward, over
what the rest of the profile predicts for them.

Units: TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s, GiB for memory, microseconds for times.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..files import write_atomic

FORMAT = 1
KINDS = ("cpu", "gpu")
# SDPA's kernels, and for planning runs of engines that used them: Triton FlashAttention (2022) and
# FlashAttention 1 (flash-attn 0.x, 2022-2023)
ATTENTION_KERNELS = ("flash", "mem_efficient", "math", "cudnn", "triton", "flash1")
PASSES = ("fwd", "bwd")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
SCOPES = ("intra_node", "inter_node")
LAYER_FACTORS = ("layer", "head")
CORRECTION_CLASSES = ("gemm", "attention", "memory_bound", "overhead", "communication")
FINGERPRINT_KEYS = (
    "hostname",
    "device_name",
    "device_count",
    "cpu_model",
    "torch",
    "cuda",
    "processes",
    "threads_per_process",
    "created",
)
# keys compared by profile_mismatch: what changes the rates (not the host name or the date)
_COMPARED = ("device_name", "device_count", "cpu_model", "torch", "cuda", "processes", "threads_per_process")
_TOP_KEYS = (
    "format",
    "name",
    "kind",
    "source",
    "fingerprint",
    "peak_tflops",
    "device_memory_gb",
    "host_link_gbps",
    "gemm",
    "attention",
    "attention_kernel",
    "memory_bound",
    "collectives",
    "tp_layers",
    "corrections",
    "corrections_source",
    "topology",
    "layer_factors",
)
_TOPOLOGY_KEYS = ("devices_per_node", "nics_per_node", "nic_gbps")


@dataclass(frozen=True)
class GemmPoint:
    dtype: str
    m: int
    n: int
    k: int
    tflops: float
    source: str | None = None


@dataclass(frozen=True)
class AttentionPoint:
    kernel: str
    dtype: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    causal: bool
    pass_: str  # "fwd" or "bwd" ("pass" in the file)
    tflops: float  # FLOPs counted as flash-attention does: causal counts only the unmasked half
    source: str | None = None


@dataclass(frozen=True)
class CollectivePoint:
    op: str
    scope: str
    ranks: int
    size_bytes: int
    time_us: float
    busbw_gbps: float
    source: str | None = None


@dataclass(frozen=True)
class MemoryBound:
    bandwidth_gbps: float  # achievable bytes/s of elementwise ops (read + write counted)
    op_overhead_us: float  # fixed cost of one dispatched op (launch / dispatch)
    unit_overhead_us: float = 0.0  # fixed cost per FSDP unit (its gather/scatter bookkeeping)
    # bytes/s of a layer's own elementwise ops (norms, activation, residual adds, dropout, the fp32
    # log-softmax) as a step runs them, in the planner's byte count; None: bandwidth_gbps. On a CPU
    # exp, erf and the dropout RNG run at compute rates, 4-5x below a copy's bandwidth.
    activation_gbps: float | None = None
    # fixed cost of one tensor-parallel layer per micro-batch, forward and backward, beyond its GEMMs
    # at the local shapes and its collectives' bytes: DTensor's dispatch, redistributes, wrappers;
    # with sequence parallelism (its norms and input redistributes on DTensors too)
    tp_layer_overhead_us: float = 0.0
    sp_layer_overhead_us: float = 0.0


@dataclass(frozen=True)
class TpLayerPoint:
    """`MemoryBound.tp_layer_overhead_us` / `sp_layer_overhead_us` measured at one tensor-parallel
    group size, the node's groups of that size running side by side."""

    ranks: int
    tp_layer_overhead_us: float
    sp_layer_overhead_us: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str
    source: str
    fingerprint: dict[str, Any]
    peak_tflops: dict[str, float]
    device_memory_gb: float
    host_link_gbps: float
    gemm: tuple[GemmPoint, ...]
    attention: tuple[AttentionPoint, ...]
    memory_bound: MemoryBound
    collectives: tuple[CollectivePoint, ...]
    corrections: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CORRECTION_CLASSES, 1.0))
    corrections_source: Any = None
    topology: dict[str, float] = field(default_factory=dict)
    # the kernel scaled_dot_product_attention dispatched in calibration (stx calibrate records it):
    # on a GPU the time model times the attention core at this kernel's points; None: flash
    attention_kernel: str | None = None
    tp_layers: tuple[TpLayerPoint, ...] = ()
    # the model's own layer ("layer") and logits GEMM with its loss ("head"), forward and backward,
    # measured over their kernels' sum at this profile's rates (a CPU calibration measures them;
    # the time model multiplies that work by them); absent: 1
    layer_factors: dict[str, float] = field(default_factory=dict)

    def tp_layer_seconds(self, ranks: int, sp: bool) -> float:
        """Fixed cost (s) of one tensor-parallel layer per micro-batch at group size `ranks`: the
        `tp_layers` point of the nearest size (in log; the larger on a tie), else memory_bound's;
        without a sequence-parallel figure, at least the tensor-parallel one."""
        point: Any = self.memory_bound
        if self.tp_layers:
            point = min(self.tp_layers, key=lambda p: (abs(math.log(p.ranks / ranks)), -p.ranks))
        us = (point.sp_layer_overhead_us or point.tp_layer_overhead_us) if sp else point.tp_layer_overhead_us
        return us * 1e-6

    @property
    def attention_kernels(self) -> list[str]:
        """The kernels the profile has attention points of, sorted."""
        return sorted({p.kernel for p in self.attention})

    def correction(self, op_class: str) -> float:
        return float(self.corrections.get(op_class, 1.0))

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one device for dtype."""
        if dtype not in self.peak_tflops:
            raise ConfigError(
                f"hardware profile {self.name!r} has no peak_tflops.{dtype} "
                f"(has {', '.join(sorted(self.peak_tflops))})"
            )
        return self.peak_tflops[dtype] * 1e12

    def gemm_rate(self, m: int, n: int, k: int, dtype: str) -> float:
        """FLOP/s of an (m x k) @ (k x n) GEMM: the measured points of dtype interpolated piecewise
        linearly in log(smallest dimension), clamped at the smallest and largest measured; a dtype
        without points takes another dtype's curve scaled by the ratio of the two peaks."""
        points, scale = _for_dtype(self, self.gemm, dtype, "gemm")
        xs = [math.log(min(p.m, p.n, p.k)) for p in points]
        ys = [p.tflops for p in points]
        return _interp(xs, ys, math.log(max(1, min(m, n, k)))) * 1e12 * scale

    def attention_rate(
        self, kernel: str, dtype: str, seq_len: int, head_dim: int, causal: bool, pass_: str
    ) -> float:
        """FLOP/s of one attention pass (FLOPs as flash-attention counts them: forward 4 b s^2 h d,
        halved when causal; backward 2.5x forward). Points of the kernel (else `math`, else any),
        the dtype (else scaled by peaks), the pass and causality (else the other), the nearest head
        dim, interpolated in log(seq_len) and clamped at the ends."""
        if not self.attention:
            raise ConfigError(f"hardware profile {self.name!r} has no attention points")
        pts: Sequence[AttentionPoint] = [p for p in self.attention if p.kernel == kernel] or [
            p for p in self.attention if p.kernel == "math"
        ]
        pts = pts or list(self.attention)
        pts, scale = _for_dtype(self, pts, dtype, "attention")
        pts = [p for p in pts if p.pass_ == pass_] or pts
        pts = [p for p in pts if p.causal == causal] or pts
        nearest = min(abs(math.log(p.head_dim / head_dim)) for p in pts)
        pts = [p for p in pts if abs(math.log(p.head_dim / head_dim)) == nearest]
        pts = sorted(pts, key=lambda p: p.seq_len)
        xs = [math.log(p.seq_len) for p in pts]
        return _interp(xs, [p.tflops for p in pts], math.log(max(1, seq_len))) * 1e12 * scale

    def collective_seconds(self, op: str, scope: str, ranks: int, size_bytes: float) -> float:
        """Seconds of one collective over `ranks` ranks on a `size_bytes` tensor (the full tensor, as
        nccl-tests count size): the bus bandwidth interpolated by size (log), time = ring factor x
        size / busbw, at least the latency of the smallest measured size; another rank count scales
        the bandwidth term by the ring factor and the latency by the hop count. An op without points
        takes all_reduce's bus bandwidth curve; a scope without points the other scope's."""
        if ranks <= 1 or size_bytes <= 0:
            return 0.0
        pts = _collective_points(self, op, scope)
        n0 = min({p.ranks for p in pts}, key=lambda r: (abs(math.log(r / ranks)), -r))
        pts = sorted((p for p in pts if p.ranks == n0), key=lambda p: p.size_bytes)
        latency = pts[0].time_us * 1e-6  # the smallest measured size: all latency
        busbw = _interp(
            [math.log(p.size_bytes) for p in pts], [p.busbw_gbps for p in pts], math.log(size_bytes)
        )
        at_n0 = max(latency, _ring_factor(op, n0) * size_bytes / (busbw * 1e9))
        if ranks == n0:
            return at_n0
        return latency * _hops(op, ranks) / _hops(op, n0) + (at_n0 - latency) * _ring_factor(
            op, ranks
        ) / _ring_factor(op, n0)


def _ring_factor(op: str, n: int) -> float:
    """Bytes each rank sends per byte of the tensor (nccl-tests' busbw / algbw)."""
    if op == "send_recv" or n <= 1:
        return 1.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _hops(op: str, n: int) -> int:
    if op == "send_recv":
        return 1
    return max(1, 2 * (n - 1) if op == "all_reduce" else n - 1)


def _collective_points(profile: HardwareProfile, op: str, scope: str) -> list[CollectivePoint]:
    if not profile.collectives:
        raise ConfigError(f"hardware profile {profile.name!r} has no collectives points")
    for want_scope in (scope, *[s for s in SCOPES if s != scope]):
        for want_op in (op, "all_reduce", *COLLECTIVE_OPS):
            pts = [p for p in profile.collectives if p.op == want_op and p.scope == want_scope]
            if pts:
                return pts
    return list(profile.collectives)


def _for_dtype(profile: HardwareProfile, points: Sequence[Any], dtype: str, what: str) -> tuple[list, float]:
    """The points of dtype (scale 1), else another dtype's points and the ratio of the peaks."""
    if not points:
        raise ConfigError(f"hardware profile {profile.name!r} has no {what} points")
    mine = [p for p in points if p.dtype == dtype]
    if mine:
        return sorted(
            mine, key=lambda p: min(getattr(p, "m", 0), getattr(p, "n", 0), getattr(p, "k", 0))
        ), 1.0
    for other in sorted({p.dtype for p in points}):
        if dtype in profile.peak_tflops and other in profile.peak_tflops:
            theirs = [p for p in points if p.dtype == other]
            theirs.sort(key=lambda p: min(getattr(p, "m", 0), getattr(p, "n", 0), getattr(p, "k", 0)))
            return theirs, profile.peak_tflops[dtype] / profile.peak_tflops[other]
    raise ConfigError(
        f"hardware profile {profile.name!r} has no {what} points for {dtype} and no peak_tflops pair to "
        f"scale another dtype's (has points for {', '.join(sorted({p.dtype for p in points}))})"
    )


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points (xs ascending; equal xs averaged), clamped at the ends."""
    merged: dict[float, list[float]] = {}
    for xi, yi in zip(xs, ys, strict=True):
        merged.setdefault(xi, []).append(yi)
    kx = sorted(merged)
    ky = [sum(merged[v]) / len(merged[v]) for v in kx]
    if x <= kx[0]:
        return ky[0]
    if x >= kx[-1]:
        return ky[-1]
    i = bisect.bisect_right(kx, x)
    w = (x - kx[i - 1]) / (kx[i] - kx[i - 1])
    return ky[i - 1] + w * (ky[i] - ky[i - 1])


# ---------------------------------------------------------------------------------------- loading


class _Reader:
    """Checks one mapping of a profile file, naming the file and the key path in every error."""

    def __init__(self, path: str, where: str, data: Any, allowed: Sequence[str]) -> None:
        self.path, self.where = path, where
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: {where or 'the file'} must be a mapping, got {data!r}")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(
                f"{path}: unknown key(s) {', '.join(map(str, unknown))}"
                f"{' in ' + where if where else ''}; valid: {', '.join(allowed)}"
            )
        self.data = data

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def fail(self, name: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.path}: {self.key(name)} must be {what}, got {value!r}")

    def get(self, name: str, check: Callable[[Any], bool], what: str, default: Any = ...) -> Any:
        if name not in self.data:
            if default is ...:
                raise ConfigError(f"{self.path}: {self.key(name)} is required ({what})")
            return default
        value = self.data[name]
        if not check(value):
            raise self.fail(name, what, value)
        return value

    def number(self, name: str, default: Any = ..., zero: bool = False) -> Any:
        """float, or `default` (None allowed) when the key is absent."""
        ok = (lambda v: v >= 0) if zero else (lambda v: v > 0)
        what = "a non-negative number" if zero else "a positive number"
        value = self.get(name, lambda v: _is_number(v) and math.isfinite(v) and ok(v), what, default)
        return float(value) if value is not None else value

    def integer(self, name: str) -> int:
        return int(
            self.get(
                name, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"
            )
        )

    def choice(self, name: str, valid: Sequence[str]) -> str:
        return str(self.get(name, lambda v: v in valid, f"one of {', '.join(valid)}"))

    def text(self, name: str, default: Any = ...) -> Any:
        return self.get(name, lambda v: v is None or isinstance(v, str), "a string", default)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entries(path: str, data: dict, key: str, required: bool = True) -> list[Any]:
    items = data.get(key, [] if not required else None)
    if items is None or not isinstance(items, list) or (required and not items):
        raise ConfigError(f"{path}: {key} must be a non-empty list of measured points, got {items!r}")
    return items


def _gemm(path: str, i: int, item: Any) -> GemmPoint:
    r = _Reader(path, f"gemm[{i}]", item, ("dtype", "m", "n", "k", "tflops", "source"))
    return GemmPoint(
        str(r.get("dtype", lambda v: isinstance(v, str), "a dtype name like fp32 or bf16")),
        r.integer("m"),
        r.integer("n"),
        r.integer("k"),
        r.number("tflops"),
        r.text("source", None),
    )


def _attention(path: str, i: int, item: Any) -> AttentionPoint:
    keys = ("kernel", "dtype", "batch", "heads", "seq_len", "head_dim", "causal", "pass", "tflops", "source")
    r = _Reader(path, f"attention[{i}]", item, keys)
    return AttentionPoint(
        r.choice("kernel", ATTENTION_KERNELS),
        str(r.get("dtype", lambda v: isinstance(v, str), "a dtype name like fp32 or bf16")),
        r.integer("batch"),
        r.integer("heads"),
        r.integer("seq_len"),
        r.integer("head_dim"),
        bool(r.get("causal", lambda v: isinstance(v, bool), "true or false")),
        r.choice("pass", PASSES),
        r.number("tflops"),
        r.text("source", None),
    )


def _collective(path: str, i: int, item: Any) -> CollectivePoint:
    keys = ("op", "scope", "ranks", "size_bytes", "time_us", "busbw_gbps", "source")
    r = _Reader(path, f"collectives[{i}]", item, keys)
    op, ranks, size = r.choice("op", COLLECTIVE_OPS), r.integer("ranks"), r.integer("size_bytes")
    time_us, busbw = r.number("time_us", None), r.number("busbw_gbps", None)
    if time_us is None and busbw is None:
        raise ConfigError(f"{path}: collectives[{i}] needs time_us or busbw_gbps (or both)")
    if busbw is None:
        busbw = _ring_factor(op, ranks) * size / (time_us * 1e-6) / 1e9
    if time_us is None:
        time_us = _ring_factor(op, ranks) * size / (busbw * 1e9) * 1e6
    return CollectivePoint(op, r.choice("scope", SCOPES), ranks, size, time_us, busbw, r.text("source", None))


def _tp_layer(path: str, i: int, item: Any) -> TpLayerPoint:
    r = _Reader(path, f"tp_layers[{i}]", item, ("ranks", "tp_layer_overhead_us", "sp_layer_overhead_us"))
    ranks = r.integer("ranks")
    if ranks < 2:
        raise r.fail("ranks", "a tensor-parallel group size of 2 or more", ranks)
    return TpLayerPoint(
        ranks, r.number("tp_layer_overhead_us", zero=True), r.number("sp_layer_overhead_us", 0.0, zero=True)
    )


def _number_map(
    path: str,
    key: str,
    value: Any,
    allowed: Sequence[str] | None = None,
    like: str = "{fp32: 0.1, bf16: 0.05}",
) -> dict[str, float]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{path}: {key} must be a mapping like {like}, got {value!r}")
    out = {}
    for name, v in value.items():
        if allowed is not None and name not in allowed:
            raise ConfigError(f"{path}: unknown key {key}.{name}; valid: {', '.join(allowed)}")
        if not _is_number(v) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{path}: {key}.{name} must be a positive number, got {v!r}")
        out[str(name)] = float(v)
    return out


def _layer_factors(path: str, value: Any) -> dict[str, float]:
    if value is None:
        return {}
    return _number_map(path, "layer_factors", value, LAYER_FACTORS, "{layer: 1.2, head: 1.1}")


def profile_from_dict(data: Any, path: str = "<profile>") -> HardwareProfile:
    """A profile from the parsed YAML mapping; every error names `path` and the key."""
    top = _Reader(path, "", data, _TOP_KEYS)
    if data.get("format") != FORMAT:
        raise ConfigError(f"{path}: format must be {FORMAT}, got {data.get('format')!r}")
    fp = top.get("fingerprint", lambda v: isinstance(v, dict), "a mapping", {}) or {}
    _Reader(path, "fingerprint", fp, FINGERPRINT_KEYS)
    mb = _Reader(
        path,
        "memory_bound",
        data.get("memory_bound"),
        (
            "bandwidth_gbps",
            "op_overhead_us",
            "unit_overhead_us",
            "activation_gbps",
            "tp_layer_overhead_us",
            "sp_layer_overhead_us",
        ),
    )
    corrections = dict.fromkeys(CORRECTION_CLASSES, 1.0)
    if data.get("corrections") is not None:
        corrections.update(_number_map(path, "corrections", data["corrections"], CORRECTION_CLASSES))
    topology = data.get("topology") or {}
    topology = _number_map(path, "topology", topology, _TOPOLOGY_KEYS) if topology else {}
    cs = data.get("corrections_source")
    if cs is not None and not isinstance(cs, (str, dict)):
        raise ConfigError(f"{path}: corrections_source must be null, a string or a mapping, got {cs!r}")
    return HardwareProfile(
        name=str(top.get("name", lambda v: isinstance(v, str) and v != "", "a non-empty string")),
        kind=top.choice("kind", KINDS),
        source=str(
            top.get("source", lambda v: isinstance(v, str), "a string saying where the rates come from")
        ),
        fingerprint=dict(fp),
        peak_tflops=_number_map(path, "peak_tflops", data.get("peak_tflops")),
        device_memory_gb=top.number("device_memory_gb"),
        host_link_gbps=top.number("host_link_gbps"),
        gemm=tuple(_gemm(path, i, x) for i, x in enumerate(_entries(path, data, "gemm"))),
        attention=tuple(
            _attention(path, i, x) for i, x in enumerate(_entries(path, data, "attention", False))
        ),
        memory_bound=MemoryBound(
            mb.number("bandwidth_gbps"),
            mb.number("op_overhead_us", zero=True),
            mb.number("unit_overhead_us", 0.0, zero=True),
            mb.number("activation_gbps", None),
            mb.number("tp_layer_overhead_us", 0.0, zero=True),
            mb.number("sp_layer_overhead_us", 0.0, zero=True),
        ),
        collectives=tuple(
            _collective(path, i, x) for i, x in enumerate(_entries(path, data, "collectives", False))
        ),
        tp_layers=tuple(
            _tp_layer(path, i, x) for i, x in enumerate(_entries(path, data, "tp_layers", False))
        ),
        corrections=corrections,
        corrections_source=cs,
        topology=topology,
        layer_factors=_layer_factors(path, data.get("layer_factors")),
        attention_kernel=top.get(
            "attention_kernel",
            lambda v: v is None or v in ATTENTION_KERNELS,
            f"null or one of {', '.join(ATTENTION_KERNELS)}",
            None,
        ),
    )


def load_profile(path: str | Path) -> HardwareProfile:
    """A hardware profile from a YAML file; a malformed file is a ConfigError naming the file and key."""
    return profile_from_dict(read_yaml(path, "hardware profile"), str(path))


def read_yaml(path: str | Path, what: str) -> Any:
    """A hardware YAML file's contents; an unreadable or invalid file is a ConfigError naming it as `what`."""

    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None


def is_profile_file(path: str | Path) -> bool:
    """Whether a hardware YAML file is a profile (it has `format:`) rather than a cluster file."""

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # the cluster loader reports the error
    return isinstance(data, dict) and "format" in data


def profile_to_dict(profile: HardwareProfile) -> dict[str, Any]:
    """The YAML mapping of a profile (the inverse of `profile_from_dict`)."""

    def clean(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if not (k == "source" and v is None)}

    out: dict[str, Any] = {
        "format": FORMAT,
        "name": profile.name,
        "kind": profile.kind,
        "source": profile.source,
        "fingerprint": dict(profile.fingerprint),
        "peak_tflops": dict(profile.peak_tflops),
        "device_memory_gb": profile.device_memory_gb,
        "host_link_gbps": profile.host_link_gbps,
        "gemm": [clean(vars(p).copy()) for p in profile.gemm],
        "attention": [
            clean({("pass" if k == "pass_" else k): v for k, v in vars(p).items()}) for p in profile.attention
        ],
        "memory_bound": {
            "bandwidth_gbps": profile.memory_bound.bandwidth_gbps,
            "op_overhead_us": profile.memory_bound.op_overhead_us,
        },
        "collectives": [clean(vars(p).copy()) for p in profile.collectives],
        "corrections": dict(profile.corrections),
        "corrections_source": profile.corrections_source,
    }
    if profile.attention_kernel is not None:
        out["attention_kernel"] = profile.attention_kernel
    if profile.memory_bound.unit_overhead_us:
        out["memory_bound"]["unit_overhead_us"] = profile.memory_bound.unit_overhead_us
    if profile.memory_bound.activation_gbps is not None:
        out["memory_bound"]["activation_gbps"] = profile.memory_bound.activation_gbps
    for key in ("tp_layer_overhead_us", "sp_layer_overhead_us"):
        if getattr(profile.memory_bound, key):
            out["memory_bound"][key] = getattr(profile.memory_bound, key)
    if profile.tp_layers:
        out["tp_layers"] = [vars(p).copy() for p in profile.tp_layers]
    if profile.topology:
        out["topology"] = dict(profile.topology)
    if profile.layer_factors:
        out["layer_factors"] = dict(profile.layer_factors)
    return out


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    """Write a profile as YAML, atomically (a reader sees the old file or the new one)."""

    path = Path(path)
    text = yaml.safe_dump(profile_to_dict(profile), sort_keys=False, default_flow_style=None, width=110)
    write_atomic(path, text)


# ----------------------------------------------------------------------------------- fingerprints


def profile_mismatch(profile: HardwareProfile, here: dict[str, Any]) -> list[str]:
    """Each way the profile's fingerprint differs from this machine (`here`: calibrate/this_machine.py
    `fingerprint_here()`): device, device count, CPU model, torch and CUDA versions, processes and
    threads per process. Keys the profile leaves out or null are not compared."""
    out = []
    for key in _COMPARED:
        theirs = profile.fingerprint.get(key)
        if theirs is None or key not in here:
            continue
        if str(theirs) != str(here[key]):
            out.append(f"{key}: profile {theirs!r}, here {here[key]!r}")
    return out
