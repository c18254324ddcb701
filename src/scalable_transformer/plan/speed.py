"""Seconds per optimizer step of a layout, by part: compute (GEMMs at a size-dependent efficiency,
memory-bound elementwise work, per-op overhead), tensor-parallel collectives, data-parallel/FSDP
collectives and how much of them overlaps, the pipeline bubble and point-to-point sends, the
optimizer, offload transfers. docs/PLANNER.md gives every formula and its source.

Legend as memory_model.py; m micro-batches per step, d data-parallel size, B bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.model_shapes import ModelShape, stage_params
from ..config.schema import Config
from ..metrics.flops import flops_per_iteration
from .cluster import Cluster
from .memory_model import DTYPE_BYTES, activation_model, config_layer_bytes, optimizer_bytes_per_param

# torch ops per transformer layer per micro-batch (counted with torch.profiler on our TransformerBlock:
# forward about 30 dispatched ops, backward about 45); the embedding, head and loss about 60 more.
OPS_FORWARD_PER_LAYER = 30
OPS_BACKWARD_PER_LAYER = 45
OPS_ENDS = 60
# GPU GEMM efficiency: eff_max * n / (n + n_half) with n the smallest GEMM dimension (rows b*s or
# the sharded output columns). 0.8 and 192 fit the A100 cuBLAS bf16 curve (NVIDIA's "Matrix
# multiplication background" guide: ~75-85% of peak from ~1k, half rate near 128-256).
GPU_EFF_MAX = 0.8
GPU_N_HALF = 192.0
# Launch/dispatch cost of one kernel on a GPU (host side, mostly hidden behind the queue).
GPU_OP_SECONDS = 4e-6
# Share of a data-parallel collective that a GPU overlaps with backward (buckets) or the next
# unit's compute (FSDP2 prefetch); gloo on a CPU shares the cores with compute: no overlap.
GPU_OVERLAP = 0.85


@dataclass(frozen=True)
class StepTime:
    breakdown: dict[str, float]  # seconds per step, by part
    model_flops: float  # per step, all devices (megatron convention)
    hardware_flops: float
    dp_overlapped_seconds: float = 0.0  # data-parallel communication hidden behind compute

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())


def _ring(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring collective time: all-reduce 2 (n-1)/n B / bw, reduce-scatter and all-gather (n-1)/n B / bw
    (B = the full tensor's bytes), plus (n - 1) latency hops (2 (n - 1) for all-reduce)."""
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    hops = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return factor * nbytes / bandwidth + hops * latency


def _link(cluster: Cluster, group: int, stride: int) -> float:
    """Bandwidth of a group of `group` ranks whose members are `stride` ranks apart: intra-node
    while the group fits in a node, else the inter-node bandwidth (the slowest link crossed)."""
    return (
        cluster.device.intra_node_bandwidth
        if group * stride <= cluster.devices_per_node
        else (cluster.device.inter_node_bandwidth)
    )


def _gemm_rate(cluster: Cluster, rows: int, k: int, cols: int, dtype: str) -> float:
    if cluster.kind == "cpu":
        import os

        from ..metrics.cpu_rates import gemm_rate

        rate = gemm_rate(rows, k, cols, dtype, cluster.threads)
        cores = os.cpu_count() or 1
        # more processes than cores (each with one thread) time-share them
        return rate * min(1.0, cores / (cluster.devices_per_node * cluster.threads))
    n = min(rows, cols, k)
    return cluster.peak(dtype) * GPU_EFF_MAX * n / (n + GPU_N_HALF)


def step_time(cfg: Config, cluster: Cluster) -> StepTime:
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    assert mc.ffn_hidden_size is not None and t.gradient_accumulation_steps is not None
    dtype = t.precision
    e = DTYPE_BYTES[dtype]
    b, s, h, f = t.micro_batch_size, mc.seq_length, mc.hidden_size, mc.ffn_hidden_size
    tp, pp, dp, m, v = p.tp, p.pp, p.dp, t.gradient_accumulation_steps, p.virtual_pipeline_stages
    world = tp * pp * dp
    flops = flops_per_iteration(
        ModelShape.from_config(mc), t.global_batch_size or b * m * dp, "megatron", p.activation_checkpointing
    )
    hw_per_device = flops.hardware_flops / world
    rate = _gemm_rate(cluster, b * s, h, f // tp, dtype)
    compute_gemm = hw_per_device / rate

    # memory-bound work: every saved byte is written in forward and read (and its gradient written)
    # in backward, about 3 passes over the activations
    am = activation_model(cfg, cluster.kind)
    layers_per_rank = mc.num_layers / pp
    act_layer = config_layer_bytes(cfg, "none", am)
    recompute_pass = 1.0 if p.activation_checkpointing == "full" else 0.0
    elementwise = (3 + recompute_pass) * act_layer * layers_per_rank * m / cluster.device.memory_bandwidth
    op_seconds = cluster.op_seconds if cluster.kind == "cpu" else GPU_OP_SECONDS
    ops = (OPS_FORWARD_PER_LAYER * (1 + recompute_pass) + OPS_BACKWARD_PER_LAYER) * layers_per_rank + OPS_ENDS
    overhead = ops * m * op_seconds
    compute = compute_gemm + elementwise + overhead

    parts: dict[str, float] = {"compute": compute}
    lat = cluster.comm_latency
    # tensor parallel: 2 all-reduces forward and 2 backward per layer (SP: all-gather + reduce-scatter,
    # the same bytes), more for the embedding and the logits; a forward more under full recompute
    if tp > 1:
        bw = _link(cluster, tp, 1)
        per = b * s * h * e
        n_coll = (4 + 2 * recompute_pass) * layers_per_rank + 2
        if p.sequence_parallel:
            one = _ring("all-gather", per, tp, bw, lat) + _ring("reduce-scatter", per, tp, bw, lat)
            parts["tp_communication"] = n_coll / 2 * one * m
            if p.activation_checkpointing != "full":
                # the qkv and up inputs, kept as 1/t slices, gathered again in backward
                again = 2 * layers_per_rank * _ring("all-gather", per, tp, bw, lat) * m
                parts["tp_communication"] += again
        else:
            parts["tp_communication"] = n_coll * _ring("all-reduce", per, tp, bw, lat) * m
        if p.activation_checkpointing == "full" and p.distribute_saved_activations:
            # each checkpointed input gathered from its 1/t slices before the recomputation
            inputs = layers_per_rank / p.checkpoint_num_layers
            whole = am.residual_bytes * b * s * h
            parts["tp_communication"] += inputs * _ring("all-gather", whole, tp, bw, lat) * m
    if p.activation_checkpointing == "full" and p.cpu_checkpointing and cluster.kind == "gpu":
        # each checkpointed input to the host in forward and back before its recomputation
        inputs = layers_per_rank / p.checkpoint_num_layers
        kept = (
            am.residual_bytes
            * b
            * s
            * h
            / (tp if p.sequence_parallel or p.distribute_saved_activations else 1)
        )
        parts["checkpoint_transfers"] = 2 * inputs * kept * m / cluster.device.host_link_bandwidth
    # data parallel: gradients once per step; FSDP2 gathers parameters every micro-batch
    stage = max(
        (
            stage_params(mc, tp, pp, r, v, p.pipeline_schedule, p.pipeline_layers)
            for r in (range(pp) if p.pipeline_layers else {0, pp - 1})
        ),
        key=lambda sp_: sp_.total,
    )
    P = stage.total
    if dp > 1:
        bw = _link(cluster, dp, tp * pp)
        grad_bytes = DTYPE_BYTES[p.grad_reduce_dtype] * P
        gather = (2 if dtype != "fp32" and p.fsdp_param_dtype == "auto" else 4) * P
        if p.zero_stage <= 1:
            comm = _ring("all-reduce", grad_bytes, dp, bw, lat)
            if p.zero_stage == 1:
                comm += _ring("all-gather", 4 * P, dp, bw, lat)  # ZeroRedundancyOptimizer's broadcast
        else:
            gathers = m * (2 if p.zero_stage == 3 else 1)
            scatters = m if p.reduce_each_micro_batch else 1
            comm = scatters * _ring("reduce-scatter", grad_bytes, dp, bw, lat) + gathers * _ring(
                "all-gather", gather, dp, bw, lat
            )
        overlap = GPU_OVERLAP if cluster.kind == "gpu" else 0.0
        hidden = min(comm * overlap, compute * 0.9)
        parts["dp_communication"] = comm - hidden
        parts["_dp_hidden"] = hidden
    if pp > 1:
        bw = _link(cluster, pp, tp)
        seq_shard = tp if p.sequence_parallel else 1
        p2p = 2 * (b * s * h * e / seq_shard / bw + lat) * m * v
        parts["pipeline_p2p"] = p2p
        per_micro = compute / m
        parts["pipeline_bubble"] = (pp - 1) / v * per_micro
    # optimizer: foreach Adam reads param, grad, 2 states and writes param + 2 states (fp32), on the
    # shard this rank steps; plus the gradient norm (one read) and clipping (read + write)
    shard = P / (dp if p.zero_stage >= 1 else 1)
    k = optimizer_bytes_per_param(cfg)
    opt_bytes = shard * (4 + 4 + 2 * k + 4 + 2 * 4 + 4 * 3)
    offload = p.offload_optimizer or p.offload_param
    if offload and cluster.kind == "gpu":
        host_bw = 100e9  # a two-socket host's stream bandwidth, order of magnitude (docs/PLANNER.md)
        parts["optimizer"] = opt_bytes / host_bw
        link = cluster.device.host_link_bandwidth
        transfers = 4 * shard * 2 + (4 * shard * 2 * m if p.zero_stage == 3 else 0)
        parts["offload_transfers"] = transfers / link
    else:
        parts["optimizer"] = opt_bytes / cluster.device.memory_bandwidth + 40 * op_seconds
        if offload:
            # CPU "offload" copies the shards between the same memory: parameters and gradients
            parts["offload_transfers"] = 2 * 4 * shard * 2 / cluster.device.memory_bandwidth
    hidden = parts.pop("_dp_hidden", 0.0)
    if cluster.kind == "cpu" and cluster.cpu_share < 1.0:
        # a shared machine: every part (compute, gloo's copies and reductions, the optimizer) runs on
        # cores the job gets only a share of (the CPU rates were measured at their best)
        parts = {k: v / cluster.cpu_share for k, v in parts.items()}
        hidden /= cluster.cpu_share
    return StepTime(parts, flops.model_flops, flops.hardware_flops, hidden)


def samples_per_second(cfg: Config, seconds: float) -> float:
    assert cfg.train.global_batch_size is not None
    return cfg.train.global_batch_size / seconds if seconds > 0 else math.inf
