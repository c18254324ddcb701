"""Seconds per optimizer step of a layout, by phase and op class (docs/PLANNER.md#the-time-model).

Per layer and micro-batch, forward and backward: every GEMM at its own (M, N, K) on the hardware
profile's efficiency surface; attention by kernel at the profile's attention rate; memory-bound work
(norms, activations, residual adds, dropout, the vocabulary's fp32 log-softmax) as bytes moved at the
achievable bandwidth; a fixed cost per dispatched op, per FSDP unit and per tensor-parallel layer
(DTensor's dispatch); recomputation under activation checkpointing. Then tensor-, data- and
pipeline-parallel collectives from the profile's curves (intra- or inter-node by where the group's
members sit), the data-parallel share hidden behind backward, the pipeline bubble, the optimizer as
bytes moved, offload over the host link.

`profile.corrections[class]` multiplies each class's seconds. A cluster without a profile (a CPU not
calibrated yet, a table device without a built-in profile) reads the same lookups from `_TableRates`.

Legend: b micro-batch, s sequence, h hidden, f MLP inner size, n heads, g key/value groups, d head
dim, v padded vocabulary, t/p/d tensor/pipeline/data-parallel sizes, m micro-batches per step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..config.model_shapes import (
    ModelShape,
    StageParams,
    causal_attention,
    causal_blocks_under_cp,
    expert_tp,
    gated_mlp,
    moe_ffn,
    query_groups,
    stage_params,
    vocab,
)
from ..config.rules import dp_shard_size, head_dim
from ..config.schema import Config
from ..metrics.flops import flops_per_iteration
from .cluster import Cluster
from .memory_model import (
    DEFAULT_MOE_IMBALANCE,
    DTYPE_BYTES,
    activation_model,
    expert_data_ranks,
    expert_local,
    moe_rank_imbalance,
    sharded_numel,
)

# torch ops per transformer layer per micro-batch (counted with torch.profiler on our TransformerBlock:
# forward about 30 dispatched ops, backward about 45); the embedding, head and loss about 60 more.
OPS_FORWARD_PER_LAYER = 30
OPS_BACKWARD_PER_LAYER = 45
OPS_ENDS = 60
# Without a built-in profile (a table device such as h100-pcie): GEMM efficiency
# eff_max * n / (n + n_half) in the smallest dimension, the old rate model's curve.
GPU_EFF_MAX = 0.8
GPU_N_HALF = 192.0
GPU_OP_SECONDS = 4e-6
# A two-socket host's stream bandwidth for CPU Adam under offload, order of magnitude (docs/PLANNER.md)
HOST_BANDWIDTH = 100e9
PHASES = (
    "forward",
    "backward",
    "optimizer",
    "grads_sync",
    "tp_communication",
    "cp_communication",
    "ep_communication",
    "pipeline_bubble",
    "pipeline_p2p",
    "offload",
)
OP_CLASSES = ("gemm", "attention", "memory_bound", "overhead", "communication")


@dataclass(frozen=True)
class StepTime:
    breakdown: dict[str, float]  # seconds per step, by part
    model_flops: float  # per step, all devices (megatron convention)
    hardware_flops: float
    dp_overlapped_seconds: float = 0.0  # data-parallel communication hidden behind compute
    # phase -> op class -> seconds per step (corrections applied); sums to `total`
    classes: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())


# ------------------------------------------------------------------------------------------- rates


class _ProfileRates:
    """The lookups the model makes, from a hardware profile."""

    def __init__(self, cluster: Cluster) -> None:
        assert cluster.profile is not None
        self.cluster, self.profile = cluster, cluster.profile
        mb = self.profile.memory_bound
        self.bandwidth = mb.bandwidth_gbps * 1e9
        # a layer's and the loss's elementwise ops: their own measured rate where the profile has one
        self.activation_bandwidth = (mb.activation_gbps or mb.bandwidth_gbps) * 1e9
        self.op_seconds = self.profile.memory_bound.op_overhead_us * 1e-6
        self.unit_seconds = self.profile.memory_bound.unit_overhead_us * 1e-6
        self.host_link = self.profile.host_link_gbps * 1e9
        self.layer_factor = self.profile.layer_factors.get("layer", 1.0)
        self.head_factor = self.profile.layer_factors.get("head", 1.0)
        self._gemm: dict[tuple, float] = {}
        self._coll: dict[tuple, float] = {}

    def gemm(self, m: int, n: int, k: int, dtype: str) -> float:
        key = (m, n, k, dtype)
        if key not in self._gemm:
            self._gemm[key] = self.profile.gemm_rate(m, n, k, dtype)
        return self._gemm[key]

    def linear(self, m: int, n: int, k: int, dtype: str) -> tuple[float, float, float]:
        """FLOP/s of a linear layer's forward (M, N, K), grad-input (M, K, N) and grad-weight (N, K, M)."""
        return self.gemm(m, n, k, dtype), self.gemm(m, k, n, dtype), self.gemm(n, k, m, dtype)

    def tp_layer(self, tp: int, sp: bool) -> float:
        """Seconds of a tensor-parallel layer's fixed cost per micro-batch (the profile's, at the
        nearest measured group size)."""
        return self.profile.tp_layer_seconds(tp, sp)

    def attention(self, kernel: str, dtype: str, s: int, d: int, causal: bool, pass_: str) -> float | None:
        if not self.profile.attention:
            return None
        key = ("attention", kernel, dtype, s, d, causal, pass_)
        if key not in self._gemm:
            self._gemm[key] = self.profile.attention_rate(kernel, dtype, s, d, causal, pass_)
        return self._gemm[key]

    def collective(self, op: str, ranks: int, nbytes: float, stride: int) -> float:
        """Seconds of one collective of `ranks` ranks `stride` ranks apart (a group that fits in a node
        is intra-node; else the inter-node curve, or the intra-node one with the bandwidth term at
        most the NICs the group's members on one node share). Memoized: a search asks thousands of times."""
        if ranks <= 1:
            return 0.0
        key = (op, ranks, nbytes, stride)
        hit = self._coll.get(key)
        if hit is None:
            hit = self._coll[key] = self._collective(op, ranks, nbytes, stride)
        return hit

    def _collective(self, op: str, ranks: int, nbytes: float, stride: int) -> float:
        per_node = self.cluster.devices_per_node
        if ranks * stride <= per_node or self.cluster.nodes == 1:
            return self.profile.collective_seconds(op, "intra_node", ranks, nbytes)
        local = max(1, min(ranks, per_node // stride))  # the group's members on one node
        topo = self.profile.topology
        share = topo.get("nics_per_node", per_node) * topo.get("nic_gbps", 25.0) * 1e9 / per_node
        if op == "all_to_all":
            # expert parallelism's all-to-all runs on every device of a node at once (each is in an ep
            # group): each sends the share of its buffer bound for other nodes through its share of the
            # node's NICs; no ring or tree lets NVLink carry part of it, as it does for an all-reduce
            scope = (
                "inter_node"
                if any(p.scope == "inter_node" for p in self.profile.collectives)
                else "intra_node"
            )
            curve = self.profile.collective_seconds(op, scope, ranks, nbytes)
            return max(curve, (ranks - local) / ranks * nbytes / share)
        if any(p.scope == "inter_node" for p in self.profile.collectives):
            return self.profile.collective_seconds(op, "inter_node", ranks, nbytes)
        bw = local * share
        factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
        if op == "send_recv":
            factor, bw = 1.0, share
        intra = self.profile.collective_seconds(op, "intra_node", ranks, nbytes)
        return max(intra, factor * nbytes / bw)


class _TableRates(_ProfileRates):
    """Without a profile: a CPU's rates measured here per shape (metrics/cpu_rates.py,
    cached, handed in as `Cluster.gemm_rate`), or a
    table GPU's peak on the old saturating efficiency curve, ring collectives at the table links."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.bandwidth = self.activation_bandwidth = cluster.device.memory_bandwidth
        self.op_seconds = cluster.op_seconds if cluster.kind == "cpu" else GPU_OP_SECONDS
        self.unit_seconds = 0.0
        self.layer_factor = self.head_factor = 1.0
        self.host_link = cluster.device.host_link_bandwidth
        self._gemm = {}
        self._coll = {}

    def tp_layer(self, tp: int, sp: bool) -> float:
        return 0.0  # no measured point: the table rates have no tensor-parallel layer cost

    def gemm(self, m: int, n: int, k: int, dtype: str) -> float:
        key = (m, n, k, dtype)
        if key in self._gemm:
            return self._gemm[key]
        c = self.cluster
        if c.kind == "cpu":
            if c.gemm_rate is None:
                raise ValueError(f"{c.name}: a CPU cluster without a profile needs its measured gemm_rate")
            rate = c.gemm_rate(m, k, n, dtype, c.threads)
            # more processes than cores (each with one thread) time-share them
            rate *= min(1.0, (os.cpu_count() or 1) / (c.devices_per_node * c.threads))
        else:
            small = min(m, n, k)
            rate = c.peak(dtype) * GPU_EFF_MAX * small / (small + GPU_N_HALF)
        self._gemm[key] = rate
        return rate

    def linear(self, m: int, n: int, k: int, dtype: str) -> tuple[float, float, float]:
        if self.cluster.kind != "cpu":
            return super().linear(m, n, k, dtype)
        rate = self.gemm(m, n, k, dtype)  # measured over the layer's three GEMMs together
        return rate, rate, rate

    def attention(self, kernel: str, dtype: str, s: int, d: int, causal: bool, pass_: str) -> float | None:
        return None  # the attention core's GEMMs at the GEMM rate

    def collective(self, op: str, ranks: int, nbytes: float, stride: int) -> float:
        if ranks <= 1:
            return 0.0
        c = self.cluster
        inside = ranks * stride <= c.devices_per_node
        bw = c.device.intra_node_bandwidth if inside else c.device.inter_node_bandwidth
        if op == "send_recv":
            return nbytes / bw + c.comm_latency
        factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
        hops = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
        return factor * nbytes / bw + hops * c.comm_latency


_RATES: dict[int, tuple[Cluster, _ProfileRates]] = {}


def _rates(cluster: Cluster) -> _ProfileRates:
    """The cluster's lookups, kept per cluster object (a search evaluates thousands of layouts on one;
    the entry holds the cluster, so its id cannot be reused while the entry lives)."""
    hit = _RATES.get(id(cluster))
    if hit is None or hit[0] is not cluster:
        if len(_RATES) > 64:
            _RATES.clear()
        rates = _ProfileRates(cluster) if cluster.profile is not None else _TableRates(cluster)
        hit = _RATES[id(cluster)] = (cluster, rates)
    return hit[1]


# ---------------------------------------------------------------------------------- per-layer work


class _Tally:
    """Seconds by (phase, op class), before corrections."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = {}

    def add(self, phase: str, op_class: str, seconds: float) -> None:
        if seconds:
            by_class = self.seconds.setdefault(phase, {})
            by_class[op_class] = by_class.get(op_class, 0.0) + seconds

    def phase(self, phase: str) -> float:
        return sum(self.seconds.get(phase, {}).values())


@dataclass(frozen=True)
class _Shape:
    b: int
    s: int
    h: int
    f: int
    n: int
    g: int
    d: int
    v: int
    tp: int
    e: int  # bytes of an activation element
    dtype: str
    gated: bool
    causal: bool
    kernel: str
    dropout: bool
    attention_dropout: bool  # of the attention probabilities (counted on the math path)
    sp: bool
    fp8: str = "none"  # train.fp8: the blocks' linear layers run float8 GEMMs (torchao)
    cp: int = 1  # context parallel: each rank computes s / cp of the s tokens against all s keys
    masked_cp: bool = False  # cp > 1 under an explicit mask, which computes the masked half too
    # mixture of experts (num_experts 0: a dense model): routed experts, top-k, expert and shared
    # expert MLP sizes, the expert-parallel size, the busiest ep rank's routed tokens over the mean,
    # the tp ranks each expert's f is split over
    num_experts: int = 0
    topk: int = 0
    f_expert: int = 0
    f_shared: int = 0
    ep: int = 1
    imbalance: float = 1.0
    etp: int = 1
    qk_norm: bool = False  # model.qk_norm head or full: norms over q's n d and k's g d features

    @property
    def routed_rows(self) -> float:
        """Token-expert rows the busiest expert-parallel rank runs through its experts per micro-batch."""
        return self.topk * self.tokens * self.imbalance

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch this rank computes (its 1/cp share under context parallelism)."""
        return self.b * self.s // self.cp


def _layer_gemms(sh: _Shape, moe: bool = False) -> list[tuple[int, int, int]]:
    """(M, N, K) of one layer's forward GEMMs on one tensor-parallel rank: qkv, proj, fc1 (gate and up
    as one GEMM when gated), fc2. An MoE layer (`moe`) has instead of fc1 and fc2 the router (h -> E),
    the shared expert's two, and each local expert's two over its share of the busiest rank's routed
    rows (E / ep experts of k x tokens x imbalance rows: the grouped GEMM timed as its GEMMs)."""
    t, tokens = sh.tp, sh.tokens
    qkv = (sh.n + 2 * sh.g) * sh.d
    up = (2 if sh.gated else 1) * sh.f
    attention = [(tokens, qkv // t, sh.h), (tokens, sh.h, sh.n * sh.d // t)]
    if not moe:
        return [*attention, (tokens, up // t, sh.h), (tokens, sh.h, sh.f // t)]
    gemms = [*attention, (tokens, sh.num_experts, sh.h)]
    if sh.f_shared:
        up_s = (2 if sh.gated else 1) * sh.f_shared
        gemms += [(tokens, up_s // t, sh.h), (tokens, sh.h, sh.f_shared // t)]
    local = sh.num_experts // sh.ep
    rows = max(1, round(sh.routed_rows / local))
    up_e = (2 if sh.gated else 1) * sh.f_expert
    return gemms + local * [(rows, up_e // sh.etp, sh.h), (rows, sh.h, sh.f_expert // sh.etp)]


def _gemm_seconds(rates: _ProfileRates, gemms: list[tuple[int, int, int]], dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds: each forward (M, N, K) and its two backward GEMMs, grad-input
    (M, K, N) and grad-weight (N, K, M), each 2 M N K FLOPs at its own rate."""
    fwd = bwd = 0.0
    for m, n, k in gemms:
        flops = 2.0 * m * n * k
        forward, grad_input, grad_weight = rates.linear(m, n, k, dtype)
        fwd += flops / forward
        bwd += flops / grad_input + flops / grad_weight
    return fwd, bwd


def _float8_cast_bytes(sh: _Shape, gemms: list[tuple[int, int, int]]) -> tuple[float, float]:
    """(forward, backward) bytes that float8 training's casts move on one rank per micro-batch, for the
    blocks' linears (M, N, K): forward, the input's amax (read) and cast (read, write 1 byte) and the
    weight's (from its fp32 master); backward, the output gradient's amax and cast, and the transposed
    float8 copies of the input and the gradient the weight-gradient GEMM reads (read and write 1 byte
    each). The weight gradient and the GEMMs' outputs stay in the compute dtype."""
    fwd = bwd = 0.0
    for m, n, k in gemms:
        fwd += (2 * sh.e + 1) * m * k + (2 * 4 + 1) * n * k
        bwd += (2 * sh.e + 1) * m * n + 2 * (m * k + m * n) + (2 * 4 + 1) * n * k
    return fwd, bwd


def _attention_seconds(rates: _ProfileRates, sh: _Shape) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one layer on one rank: forward
    4 b s^2 (n / t) d FLOPs, halved when causal; backward 2.5x (flash-attention's convention).
    Context parallelism: the rank's b s / cp queries against the s keys, 4 (b s / cp) s (n / t) d,
    halved when causal blocks skip the masked half (`causal_blocks_under_cp`); under an explicit
    mask of global positions (`masked_cp`) not, at the rate of non-causal attention."""
    heads = sh.n / sh.tp
    causal = sh.causal and not sh.masked_cp
    fwd_flops = 4.0 * sh.tokens * sh.s * heads * sh.d * (0.5 if causal else 1.0)
    fwd_rate = rates.attention(sh.kernel, sh.dtype, sh.s, sh.d, causal, "fwd")
    bwd_rate = rates.attention(sh.kernel, sh.dtype, sh.s, sh.d, causal, "bwd")
    if fwd_rate is None or bwd_rate is None:
        # no attention points: the two batched GEMMs (q k^T and p v) at the GEMM rate; the causal
        # mask saves nothing on the math path, and its softmax is memory-bound work (_layer_bytes)
        rate = rates.gemm(sh.s // sh.cp, sh.s, sh.d, sh.dtype)
        full = 4.0 * sh.tokens * sh.s * heads * sh.d
        return full / rate, 2 * full / rate
    return fwd_flops / fwd_rate, 2.5 * fwd_flops / bwd_rate


def _layer_bytes(sh: _Shape, moe: bool = False) -> float:
    """Bytes a layer's memory-bound ops move in forward on one rank (backward: twice, reading the
    gradient and the saved input, writing the input's gradient): two norms in fp32 (read the
    stream, write the normed input), the activation (gated: two inputs), two residual adds (read
    two, write one), two hidden dropouts (read, write, mask), rotary/bias work folded into the
    GEMMs; on the math attention path the softmax over s^2 scores in fp32, the dropout of those
    probabilities when the model has one (read, write, mask), and the copies that split q, k and v
    into heads and merge the output (read, write)."""
    seq_shard = sh.tp if sh.sp else 1
    per_pos = sh.h / seq_shard
    norms = 2 * (4 + sh.e) * per_pos
    if sh.qk_norm:  # read q and k, write them normed, on the rank's heads
        norms += (sh.n + sh.g) * sh.d / sh.tp * (4 + sh.e)
    act = (3 if sh.gated else 2) * sh.e * sh.f / sh.tp
    if moe:
        # an MoE layer: the activations of the routed rows and the shared expert; the softmax and
        # top-k over the fp32 router logits; the sort of the routed copies by expert and its undoing,
        # and the score-weighted combine (read and write of k rows of h each)
        rows = sh.routed_rows / sh.tokens
        act = (3 if sh.gated else 2) * sh.e * (rows * sh.f_expert / sh.etp + sh.f_shared / sh.tp)
        act += 3 * 4 * sh.num_experts + 3 * 2 * sh.e * rows * sh.h
    residual = 2 * 3 * sh.e * per_pos
    dropout = 2 * (2 * sh.e + 1) * per_pos if sh.dropout else 0.0
    softmax = 0.0
    if sh.kernel == "math":
        softmax = (sh.n / sh.tp) * sh.s * 3 * 4  # read scores, write probabilities, fp32
        if sh.attention_dropout:
            softmax += (sh.n / sh.tp) * sh.s * (2 * 4 + 1)
        # the head split of q, k and v for the batched GEMMs and the merge of the output: copies
        softmax += (2 * sh.n + 2 * sh.g) * sh.d / sh.tp * 2 * sh.e
    return sh.tokens * (norms + act + residual + dropout + softmax)


def _loss_bytes(sh: _Shape) -> tuple[float, float]:
    """Bytes the fp32 cross-entropy over the vocabulary moves on one rank per micro-batch. Forward:
    read the logits, write fp32 log-probabilities. Backward without tensor parallelism
    (models.spec._CrossEntropySum): exp and the scaling in place (read + write twice), then the cast
    to a bf16/fp16 logits' dtype; loss_parallel's (tp > 1): read the log-probabilities, write the
    gradient in the logits' dtype."""
    logits = sh.tokens * sh.v / sh.tp
    if sh.tp > 1:
        return logits * (sh.e + 4), logits * (4 + 4 + sh.e)
    cast = 0 if sh.e == 4 else 4 + sh.e
    return logits * (sh.e + 4), logits * (4 + 4 + 4 + 4 + cast)


def _shape(
    cfg: Config, kind: str, attention_kernel: str | None = None, imbalance: float = DEFAULT_MOE_IMBALANCE
) -> _Shape:
    mc, p = cfg.model, cfg.parallel
    assert mc.ffn_hidden_size is not None
    am = activation_model(cfg, kind)
    kernel = attention_kernel or ("flash" if am.flash else "math")
    return _Shape(
        b=cfg.train.micro_batch_size,
        s=mc.seq_length,
        h=mc.hidden_size,
        f=mc.ffn_hidden_size,
        n=mc.num_attention_heads,
        g=query_groups(mc),
        d=head_dim(mc),
        v=vocab(mc),
        tp=p.tp,
        e=DTYPE_BYTES[cfg.train.precision],
        dtype=cfg.train.precision,
        gated=gated_mlp(mc),
        causal=causal_attention(mc),
        kernel=kernel,
        dropout=mc.hidden_dropout > 0,
        attention_dropout=mc.attention_dropout > 0,
        sp=p.sequence_parallel,
        fp8=cfg.train.fp8,
        cp=p.cp,
        masked_cp=p.cp > 1 and not causal_blocks_under_cp(mc),
        num_experts=mc.num_experts,
        topk=mc.moe_router_topk if mc.num_experts else 0,
        f_expert=moe_ffn(mc) if mc.num_experts else 0,
        f_shared=mc.moe_shared_expert_size if mc.num_experts else 0,
        ep=p.ep,
        imbalance=moe_rank_imbalance(cfg, imbalance),
        etp=expert_tp(p.tp),
        qk_norm=mc.qk_norm != "none",
    )


def _layer_compute(
    rates: _ProfileRates, sh: _Shape, recompute: str, moe: bool = False
) -> dict[str, dict[str, float]]:
    """Seconds of one layer (an MoE layer with `moe`) on one rank for one micro-batch:
    {"forward"|"backward": {class: s}}; the recomputed forward (full: the whole layer; selective: the
    attention core) counts in backward. The layer's own work is scaled by the profile's measured
    layer factor (`layer_factors.layer`: the model's real layer over the sum of its kernels), the
    tensor-parallel layer's fixed cost not."""
    gemms = _layer_gemms(sh, moe)
    g_f, g_b = _gemm_seconds(rates, gemms, "fp8" if sh.fp8 != "none" else sh.dtype)
    a_f, a_b = _attention_seconds(rates, sh)
    mem = _layer_bytes(sh, moe) / rates.activation_bandwidth
    cast_f, cast_b = _float8_cast_bytes(sh, gemms) if sh.fp8 != "none" else (0.0, 0.0)
    # a tensor-parallel layer's DTensor dispatch (the profile's measured cost per layer and
    # micro-batch), shared between the passes as their op counts
    tp_layer = rates.tp_layer(sh.tp, sh.sp) if sh.tp > 1 else 0.0
    share = OPS_FORWARD_PER_LAYER / (OPS_FORWARD_PER_LAYER + OPS_BACKWARD_PER_LAYER)
    fwd = {
        "gemm": g_f,
        "attention": a_f,
        "memory_bound": mem + cast_f / rates.activation_bandwidth,
        "overhead": OPS_FORWARD_PER_LAYER * rates.op_seconds,
    }
    bwd = {
        "gemm": g_b,
        "attention": a_b,
        "memory_bound": 2 * mem + cast_b / rates.activation_bandwidth,
        "overhead": OPS_BACKWARD_PER_LAYER * rates.op_seconds,
    }
    fwd, bwd = ({c: rates.layer_factor * s for c, s in pass_.items()} for pass_ in (fwd, bwd))
    fwd["overhead"] += share * tp_layer
    bwd["overhead"] += (1 - share) * tp_layer
    if recompute == "full":
        for k, v in fwd.items():
            bwd[k] += v
    elif recompute == "selective":
        bwd["attention"] += fwd["attention"]
    return {"forward": fwd, "backward": bwd}


def _head_seconds(rates: _ProfileRates, sh: _Shape) -> dict[str, dict[str, float]]:
    """The logits GEMM and the fp32 cross-entropy over the vocabulary on one rank per micro-batch,
    {"forward"|"backward": {class: s}}, scaled by the profile's measured `layer_factors.head`."""
    g_f, g_b = _gemm_seconds(rates, [(sh.tokens, sh.v // sh.tp, sh.h)], sh.dtype)
    loss_f, loss_b = (b / rates.activation_bandwidth for b in _loss_bytes(sh))
    x = rates.head_factor
    return {
        "forward": {"gemm": x * g_f, "memory_bound": x * loss_f},
        "backward": {"gemm": x * g_b, "memory_bound": x * loss_b},
    }


def model_layer_seconds(cluster: Cluster, sh: _Shape) -> tuple[float, float]:
    """(one layer, the logits GEMM with the loss): forward + backward seconds per micro-batch on one
    rank without recomputation, as the time model predicts them: what `stx calibrate` measures the
    model's own layer and head against (calibrate/layer_factor.py `measure_model_layer`)."""
    rates = _rates(cluster)
    layer = _layer_compute(rates, sh, "none")
    head = _head_seconds(rates, sh)
    return (
        sum(s for by_class in layer.values() for s in by_class.values()),
        sum(s for by_class in head.values() for s in by_class.values()),
    )


def _ends_compute(rates: _ProfileRates, sh: _Shape, first: bool, last: bool) -> dict[str, dict[str, float]]:
    """The embedding (first stage: a gather, memory-bound) and the logits GEMM with the fp32
    log-softmax over the vocabulary (last stage, `_head_seconds`), per micro-batch."""
    fwd = dict.fromkeys(OP_CLASSES[:4], 0.0)
    bwd = dict.fromkeys(OP_CLASSES[:4], 0.0)
    if first:
        fwd["memory_bound"] += sh.tokens * sh.h * sh.e * 2 / rates.activation_bandwidth
        bwd["memory_bound"] += sh.tokens * sh.h * (sh.e + 4) / rates.activation_bandwidth
    if last:
        head = _head_seconds(rates, sh)
        for c in ("gemm", "memory_bound"):
            fwd[c] += head["forward"][c]
            bwd[c] += head["backward"][c]
    fwd["overhead"] += OPS_ENDS / 2 * rates.op_seconds
    bwd["overhead"] += OPS_ENDS / 2 * rates.op_seconds
    return {"forward": fwd, "backward": bwd}


# ------------------------------------------------------------------------------------- the step


def _stage_compute(cfg: Config, rates: _ProfileRates, sh: _Shape) -> tuple[dict[str, dict[str, float]], Any]:
    """Per-micro-batch forward/backward seconds by class of the slowest pipeline rank, and its
    StageParams (the parameters it holds, for the data-parallel collectives)."""
    mc, p = cfg.model, cfg.parallel
    layer = _layer_compute(rates, sh, p.activation_checkpointing)
    moe = _layer_compute(rates, sh, p.activation_checkpointing, moe=True) if mc.num_experts else layer
    best: tuple[float, dict[str, dict[str, float]], Any] | None = None
    # the MoE layers need not sit evenly over the stages: every rank is a candidate for the slowest
    ranks = range(p.pp) if p.pipeline_layers or mc.num_experts else sorted({0, p.pp - 1})
    for r in ranks:
        sp_ = stage_params(
            mc, p.tp, p.pp, r, p.virtual_pipeline_stages, p.pipeline_schedule, p.pipeline_layers
        )
        ends = _ends_compute(rates, sh, sp_.first, sp_.last)
        dense = sp_.layers - sp_.moe_layers
        work = {
            ph: {c: layer[ph][c] * dense + moe[ph][c] * sp_.moe_layers + ends[ph][c] for c in layer[ph]}
            for ph in ("forward", "backward")
        }
        total = sum(sum(v.values()) for v in work.values())
        if best is None or total > best[0]:
            best = (total, work, sp_)
    assert best is not None
    return best[1], best[2]


def tp_layer_collectives(sp: bool, full: bool) -> list[tuple[str, int]]:
    """(op, count) of one layer's tensor-parallel collectives per micro-batch on a b s h tensor: 2
    all-reduces forward and 2 backward (sequence parallel: an all-gather and a reduce-scatter for
    each, and the backward's re-gathers of the qkv and up inputs), forward's again under full
    recompute (which re-gathers anyway). `stx calibrate` takes the same out of its tp_layer point."""
    n = 4 + (2 if full else 0)
    if sp:
        return [("all_gather", n // 2 + (0 if full else 2)), ("reduce_scatter", n // 2)]
    return [("all_reduce", n)]


def _tp_seconds(cfg: Config, rates: _ProfileRates, sh: _Shape, layers: int) -> float:
    """Tensor-parallel collectives of one rank per micro-batch: 2 all-reduces forward and 2 backward
    per layer (sequence parallel: all-gather + reduce-scatter, the same bytes), 2 more for the
    embedding and logits, forward's again under full recompute; SP's backward re-gathers of the qkv
    and up inputs; gathers of distributed checkpointed inputs."""
    p = cfg.parallel
    if p.tp <= 1:
        return 0.0
    per = sh.tokens * sh.h * sh.e
    full = p.activation_checkpointing == "full"
    layer = tp_layer_collectives(p.sequence_parallel, full)
    ends = [("all_gather", 1), ("reduce_scatter", 1)] if p.sequence_parallel else [("all_reduce", 2)]
    seconds = sum(
        n * count * rates.collective(op, p.tp, per, 1)
        for n, ops in ((layers, layer), (1, ends))
        for op, count in ops
    )
    if full and p.distribute_saved_activations:
        am = activation_model(cfg, rates.cluster.kind)
        whole = am.residual_bytes * sh.tokens * sh.h
        seconds += layers / p.checkpoint_num_layers * rates.collective("all_gather", p.tp, whole, 1)
    return seconds


def _cp_seconds(cfg: Config, rates: _ProfileRates, sh: _Shape, layers: int) -> float:
    """Context-parallel collectives of one rank per micro-batch, none hidden (parallel/context.py
    gathers in the attention's critical path): each layer all-gathers the keys and values of the whole
    sequence (b s 2 g/t d elements over the cp ranks, which sit tp apart) and its backward
    reduce-scatters their gradients; full recompute gathers again."""
    p = cfg.parallel
    if p.cp <= 1:
        return 0.0
    kv = sh.b * sh.s * 2 * sh.g / sh.tp * sh.d * sh.e
    gathers = 2 if p.activation_checkpointing == "full" else 1
    per_layer = gathers * rates.collective("all_gather", p.cp, kv, p.tp)
    per_layer += rates.collective("reduce_scatter", p.cp, kv, p.tp)
    return layers * per_layer


def _ep_seconds(cfg: Config, rates: _ProfileRates, sh: _Shape, moe_layers: int) -> float:
    """Expert-parallel all-to-alls of one rank per micro-batch, none hidden: each MoE layer sends its
    k x tokens routed rows (h wide, the activations' dtype) to their experts' ranks and takes them back
    (dispatch and combine) in forward, and the same two in backward; full recompute dispatches and
    combines again. The busiest rank's rows (x imbalance) set the size. The ep ranks are consecutive in
    the flattened dp x cp order (cp inner; parallel/dims.py), stride tp, so the group crosses nodes
    once ep x tp exceeds a node."""
    p = cfg.parallel
    if p.ep <= 1 or not moe_layers:
        return 0.0
    nbytes = sh.routed_rows * sh.h * sh.e
    count = 4 + (2 if p.activation_checkpointing == "full" else 0)
    return moe_layers * count * rates.collective("all_to_all", p.ep, nbytes, p.tp)


def _expert_split(sp_: StageParams, ep: int) -> tuple[StageParams, StageParams | None]:
    """(everything but the routed experts, the rank's 1/ep of the experts as units of their own), for
    the data-parallel collectives under expert parallelism: the experts' gradients are reduced over the
    expert-data-parallel ranks only. (sp_, None) without expert parallelism."""
    if ep == 1 or not sp_.experts:
        return sp_, None
    local = expert_local(sp_, ep)
    dense = StageParams(
        local.blocks - local.experts,
        local.block - local.expert_block,
        local.layers,
        local.root,
        local.first,
        local.last,
    )
    experts = StageParams(local.experts, local.expert_block, local.moe_layers, 0, False, False)
    return dense, experts


def _dp_seconds(cfg: Config, rates: _ProfileRates, sp_: Any, group: int = 1) -> tuple[float, float]:
    """(seconds of the step's data-parallel collectives, of them overlappable with compute): DDP's
    gradient all-reduce (ZeRO-1 adds the parameters' broadcast); FSDP's per-unit reduce-scatter
    (each micro-batch with reduce_each_micro_batch) and all-gathers (forward; ZeRO-3 backward too),
    one collective per unit (a block, plus the root parameters) so each pays its latency.
    group = ep for the routed experts: reduced over the dp x cp / ep expert-data-parallel ranks, which
    sit ep apart in dp order."""
    p, t = cfg.parallel, cfg.train
    assert t.gradient_accumulation_steps is not None
    # gradients are reduced over dp x cp (context-parallel ranks hold the same parameters)
    dp, m, stride = p.dp * p.cp // group, t.gradient_accumulation_steps, p.tp * p.pp * group
    if dp <= 1:
        return 0.0, 0.0
    grad_e = DTYPE_BYTES[p.grad_reduce_dtype]
    gather_e = 2 if t.precision != "fp32" and p.fsdp_param_dtype == "auto" else 4
    # float8 tensorwise under FSDP2: the blocks' weights are all-gathered in float8 (1 byte; their
    # norms' few parameters are left out), the root's in the compute dtype
    block_e = 1 if t.fp8 == "tensorwise" else gather_e
    total = sp_.total
    if p.zero_stage <= 1:
        comm = rates.collective("all_reduce", dp, grad_e * total, stride)
        if p.zero_stage == 1:
            comm += rates.collective("all_gather", dp, 4 * total, stride)
        # the last bucket's all-reduce waits for the end of backward: ~ one block's gradients
        last = rates.collective("all_reduce", dp, grad_e * max(sp_.block, sp_.root), stride)
        return comm, max(0.0, comm - last)
    units = [(sp_.block, sp_.layers)] + ([(sp_.root, 1)] if sp_.root else [])
    scatters = m if p.reduce_each_micro_batch else 1
    # hybrid sharding: gathers and reduce-scatters within the dp_shard ranks (adjacent in dp), then
    # each unit's gradient shard all-reduced across the dp / dp_shard replicas (FSDP2 HSDP)
    # the experts (group = ep): sharded over all their dp x cp / ep ranks, hybrid sharding or not
    shard = dp if group > 1 else dp_shard_size(p) * p.cp
    replicas, dp = dp // shard, shard
    across = [rates.collective("all_reduce", replicas, grad_e * u / dp, stride * dp) for u, _ in units]
    unit_e = [block_e, gather_e][: len(units)]  # the blocks', then the root's
    gather = sum(
        n * rates.collective("all_gather", dp, e * u, stride) for (u, n), e in zip(units, unit_e, strict=True)
    )
    scatter = sum(n * rates.collective("reduce_scatter", dp, grad_e * u, stride) for u, n in units)
    count = sum(n for _, n in units)
    forward_gathers = count
    backward_gather, backward_gathers = 0.0, 0
    if p.zero_stage == 3:  # gathered again in backward, except the last block of a one-stage model,
        kept = p.pp == 1 and sp_.layers > 0  # which stays gathered from its forward (apply_fsdp)
        backward_gather = gather - (
            rates.collective("all_gather", dp, block_e * sp_.block, stride) if kept else 0.0
        )
        backward_gathers = count - int(kept)
    collectives = m * (forward_gathers + backward_gathers) + scatters * count  # each pays unit_seconds
    comm = m * (gather + backward_gather) + scatters * scatter + collectives * rates.unit_seconds
    if replicas > 1:
        comm += scatters * sum(n * a for (_, n), a in zip(units, across, strict=True))
    # the first unit's gather of each micro-batch and the last unit's reduce-scatter are exposed whole,
    # every other collective its latency (its time at one byte: the ring's hops, n - 1 per gather or
    # scatter): only the bandwidth part hides behind compute (docs/PLANNER.md#fsdp-collective-latency)
    first = rates.collective("all_gather", dp, block_e * units[0][0], stride)
    exposed = m * first + rates.collective("reduce_scatter", dp, grad_e * units[-1][0], stride)
    others = m * (forward_gathers + backward_gathers - 1)
    exposed += others * rates.collective("all_gather", dp, 1.0, stride)
    exposed += (scatters * count - 1) * rates.collective("reduce_scatter", dp, 1.0, stride)
    if replicas > 1:  # the last unit's all-reduce waits for its reduce-scatter; the others' latency
        exposed += across[-1] + (scatters * count - 1) * rates.collective(
            "all_reduce", replicas, 1.0, stride * dp
        )
    return comm, max(0.0, comm - exposed)


# Bytes read + written per parameter by torch.optim's foreach step (fp32 state; torch 2.13's
# `_multi_tensor_adam`, which AdamW runs): mul_ (decay) 8, lerp_ (exp_avg) 12, mul_ (exp_avg_sq) 8,
# addcmul_ 12, sqrt 8, div_ 8, add_ (eps) 8, addcdiv_ (param) 16. SGD: momentum mul_ 8 + add_ 12,
# then param add_ 12; without momentum the add_ alone. The gradient norm reads every gradient once
# and clipping scales it (read + write). An H100 trace of gpt-7b at 4 layers (1.02e9 parameters) ran
# its optimizer kernels in 31.5 ms: 91 bytes per parameter at the measured 2950 GB/s, against 92 here
# (benchmarks/results/gpu_check-h100.md).
ADAM_STEP_BYTES = 80
SGD_STEP_BYTES = {True: 32, False: 12}
CLIP_BYTES = 4 + 8


def optimizer_step_bytes(cfg: Config) -> int:
    """Bytes per parameter that one optimizer step moves, with the gradient norm and clipping."""
    o = cfg.optim
    step = ADAM_STEP_BYTES if o.optimizer in ("adam", "adamw") else SGD_STEP_BYTES[o.sgd_momentum > 0]
    return step + CLIP_BYTES


def _optimizer_seconds(cfg: Config, rates: _ProfileRates, sp_: StageParams) -> dict[str, dict[str, float]]:
    """The optimizer over the shard this rank steps, as the bytes its foreach passes move
    (`optimizer_step_bytes`); on the host under offload (HOST_BANDWIDTH), with the transfers over
    the host link. Under expert parallelism the rank holds 1/ep of the experts, sharded over 1/ep
    as many ranks."""
    p, t = cfg.parallel, cfg.train
    assert t.gradient_accumulation_steps is not None
    sharded_over = {0: 1, 1: p.dp * p.cp}.get(p.zero_stage, dp_shard_size(p) * p.cp)
    expert_ranks = expert_data_ranks(cfg) if sharded_over > 1 else 1
    shard = sharded_numel(expert_local(sp_, p.ep), sharded_over, expert_ranks)
    opt_bytes = shard * optimizer_step_bytes(cfg)
    offload = p.offload_optimizer or p.offload_param
    out: dict[str, dict[str, float]] = {}
    if offload and rates.cluster.kind == "gpu":
        out["optimizer"] = {"memory_bound": opt_bytes / HOST_BANDWIDTH}
        transfers = 4 * shard * 2 + (
            4 * shard * 2 * t.gradient_accumulation_steps if p.zero_stage == 3 else 0
        )
        out["offload"] = {"communication": transfers / rates.host_link}
    else:
        out["optimizer"] = {"memory_bound": opt_bytes / rates.bandwidth, "overhead": 40 * rates.op_seconds}
        if offload:  # CPU "offload" copies the shards between the same memory
            out["offload"] = {"memory_bound": 2 * 4 * shard * 2 / rates.bandwidth}
    return out


def _checkpoint_transfer_seconds(cfg: Config, rates: _ProfileRates, sh: _Shape, layers: int) -> float:
    """Full recompute with cpu_checkpointing: each checkpointed input to the host in forward and back
    before its recomputation, over the host link, per micro-batch."""
    p = cfg.parallel
    if not (p.activation_checkpointing == "full" and p.cpu_checkpointing and rates.cluster.kind == "gpu"):
        return 0.0
    am = activation_model(cfg, rates.cluster.kind)
    shard = p.tp if p.sequence_parallel or p.distribute_saved_activations else 1
    kept = am.residual_bytes * sh.tokens * sh.h / shard
    return 2 * layers / p.checkpoint_num_layers * kept / rates.host_link


def attention_kernel(cluster: Cluster) -> str | None:
    """The kernel the attention core is timed at: `--attention-kernel`'s, else on a GPU the one SDPA
    dispatched when the profile was calibrated, else None (flash, or on a CPU as the config decides)."""
    if cluster.attention_kernel is not None:
        return cluster.attention_kernel
    profile = cluster.profile
    if cluster.kind != "gpu" or profile is None or profile.attention_kernel not in profile.attention_kernels:
        return None
    return profile.attention_kernel


def step_time(cfg: Config, cluster: Cluster) -> StepTime:
    """Predicted seconds per optimizer step of cfg's layout on `cluster`, by part and by phase/class
    (an MoE model's busiest expert-parallel rank at the cluster's `moe_imbalance`)."""
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    assert mc.ffn_hidden_size is not None and t.gradient_accumulation_steps is not None
    m, v = t.gradient_accumulation_steps, p.virtual_pipeline_stages
    flops = flops_per_iteration(
        ModelShape.from_config(mc), t.global_batch_size or t.micro_batch_size * m * p.dp, "megatron",
        p.activation_checkpointing,
    )  # fmt: skip
    rates = _rates(cluster)
    sh = _shape(cfg, cluster.kind, attention_kernel(cluster), cluster.moe_imbalance)
    per_micro, sp_ = _stage_compute(cfg, rates, sh)
    tally = _Tally()
    for phase, by_class in per_micro.items():
        for c, sec in by_class.items():
            tally.add(phase, c, sec * m)
    tally.add("tp_communication", "communication", _tp_seconds(cfg, rates, sh, sp_.layers) * m)
    tally.add("cp_communication", "communication", _cp_seconds(cfg, rates, sh, sp_.layers) * m)
    tally.add("ep_communication", "communication", _ep_seconds(cfg, rates, sh, sp_.moe_layers) * m)
    # host-kept checkpointed inputs: phase "offload", breakdown part "checkpoint_transfers"
    tally.add(
        "checkpoint_offload", "communication", _checkpoint_transfer_seconds(cfg, rates, sh, sp_.layers) * m
    )
    dense, experts = _expert_split(sp_, p.ep)
    dp_comm, dp_hideable = _dp_seconds(cfg, rates, dense)
    if experts is not None:
        comm, hideable = _dp_seconds(cfg, rates, experts, group=p.ep)
        dp_comm, dp_hideable = dp_comm + comm, dp_hideable + hideable
    for phase, by_class in _optimizer_seconds(cfg, rates, sp_).items():
        for c, sec in by_class.items():
            tally.add(phase, c, sec)
    if p.pp > 1:
        seq_shard = p.tp if p.sequence_parallel else 1
        one = rates.collective("send_recv", 2, sh.tokens * sh.h * sh.e / seq_shard, p.tp)
        tally.add("pipeline_p2p", "communication", 2 * one * m * v)
        for c, sec in per_micro["forward"].items():
            tally.add("pipeline_bubble", c, (p.pp - 1) / v * (sec + per_micro["backward"][c]))
    return _assemble(cfg, cluster, tally, dp_comm, dp_hideable, flops)


def _assemble(
    cfg: Config, cluster: Cluster, tally: _Tally, dp_comm: float, dp_hideable: float, flops
) -> StepTime:
    """Apply the corrections, hide the data-parallel share the backward compute can cover, and sum
    the classes into the breakdown's parts (and a shared CPU's slowdown into both)."""
    prof = cluster.profile
    corr = {c: (prof.correction(c) if prof is not None else 1.0) for c in OP_CLASSES}
    classes = {ph: {c: s * corr[c] for c, s in by.items()} for ph, by in tally.seconds.items()}
    hidden = 0.0
    if dp_comm:
        dp_comm *= corr["communication"]
        if cluster.kind == "gpu":
            # gloo on a CPU shares the cores with compute: no overlap; NCCL overlaps with backward
            # (DDP buckets) or the neighbouring units' compute (FSDP prefetch), bounded by that compute
            compute = sum(classes.get("backward", {}).values())
            if cfg.parallel.zero_stage >= 2:
                compute += sum(classes.get("forward", {}).values())
            hidden = min(dp_hideable * corr["communication"], compute)
        classes["grads_sync"] = {"communication": dp_comm - hidden}
    share = cluster.cpu_share if cluster.kind == "cpu" else 1.0
    if share < 1.0:
        # a shared machine: every part runs on cores the job gets only a share of
        classes = {ph: {c: s / share for c, s in by.items()} for ph, by in classes.items()}
        hidden /= share
    parts: dict[str, float] = {}
    names = {
        "forward": "compute",
        "backward": "compute",
        "tp_communication": "tp_communication",
        "cp_communication": "cp_communication",
        "ep_communication": "ep_communication",
        "grads_sync": "dp_communication",
        "pipeline_p2p": "pipeline_p2p",
        "pipeline_bubble": "pipeline_bubble",
        "optimizer": "optimizer",
        "offload": "offload_transfers",
        "checkpoint_offload": "checkpoint_transfers",
    }
    for ph in (*PHASES, "checkpoint_offload"):
        if ph in classes:
            parts[names[ph]] = parts.get(names[ph], 0.0) + sum(classes[ph].values())
    if "checkpoint_offload" in classes:
        offload = classes.setdefault("offload", {})
        for c, sec in classes.pop("checkpoint_offload").items():
            offload[c] = offload.get(c, 0.0) + sec
    return StepTime(parts, flops.model_flops, flops.hardware_flops, hidden, classes)


def samples_per_second(cfg: Config, seconds: float) -> float:
    assert cfg.train.global_batch_size is not None
    return cfg.train.global_batch_size / seconds if seconds > 0 else math.inf
