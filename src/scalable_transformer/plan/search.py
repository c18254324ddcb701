"""Predict one layout (`predict`), the config's own (`plan_config`), or every valid layout of a
cluster for the config's global batch (`search_layouts`), ranked by predicted throughput."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from ..config import rules
from ..config.model_shapes import default_ffn_hidden_size, family_options, total_params
from ..config.schedule import check_schedule
from ..config.schema import Config
from ..config.validate import batch_sizes
from ..errors import ConfigError
from .cluster import Cluster
from .layout import Layout
from .memory_model import StageMemory, stage_memory
from .probe import ProbeError, probe_step_time
from .speed import StepTime, attention_kernel, step_time
from .validation_error import expected_error

RATE_MODEL = "time model by op class (plan/speed.py)"


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    fits: bool
    reason: str | None
    stages: list[StageMemory]
    host_memory_bytes: int | None
    time: StepTime
    samples_per_second: float
    tokens_per_second: float
    tflops_per_device: float
    mfu: float
    peak_flops: float
    dtype: str
    # how the step time was obtained: the rate model, or measured (plan/probe.py) on a CPU
    time_method: str = RATE_MODEL
    # `--dry-run`: the engine on fake tensors at this world size (dryrun/dry_run.py), or {"error": ...}
    dry_run: dict[str, Any] | None = None
    # how far the time model was off on published runs of this class of layout (plan/validation_error.py)
    expected_error: dict[str, Any] | None = None
    # train.fp8: MFU against the device's fp8 peak too (None without fp8, or a device with no fp8 peak)
    fp8: str = "none"
    mfu_fp8: float | None = None
    peak_flops_fp8: float | None = None

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total)

    @property
    def peak_memory_bytes(self) -> int:
        return self.peak_stage.total

    def to_dict(self) -> dict[str, Any]:
        """The object `stx plan --json` prints per layout (issue 13's shape), plus per-stage totals
        and the memory options beside "layout" (sequence parallelism, where gradients and checkpointed
        inputs are kept)."""
        layout = self.layout.to_dict()
        extra = {k: layout.pop(k) for k in MEMORY_OPTIONS}
        return {
            "layout": layout,
            **extra,
            "label": self.layout.label(),
            "fits": self.fits,
            "reason": self.reason,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_breakdown_bytes": dict(self.peak_stage.breakdown),
            "host_memory_bytes": self.host_memory_bytes,
            "step_seconds": self.time.total,
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            **(
                {"fp8": self.fp8, "mfu_fp8": self.mfu_fp8, "peak_flops_fp8": self.peak_flops_fp8}
                if self.fp8 != "none"
                else {}
            ),
            "time_breakdown_seconds": {
                **self.time.breakdown,
                "dp_overlapped": self.time.dp_overlapped_seconds,
            },
            # phase -> op class -> seconds (plan/speed.py), for comparing with measured phase timers
            "time_classes_seconds": self.time.classes,
            "stage_peak_memory_bytes": [st.total for st in self.stages],
            "time_method": self.time_method,
            "expected_error": self.expected_error,
            **({"dry_run": self.dry_run} if self.dry_run is not None else {}),
        }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def predict(
    cfg: Config, cluster: Cluster, every_stage: bool = True, probe: bool = False, remeasure: bool = False
) -> Prediction:
    """Memory, fit and speed of the layout cfg describes (dp, accumulation, ffn_hidden_size filled;
    the layout rules already checked). every_stage=False (the search) computes the first and last
    pipeline ranks only: with an even split a middle rank holds no more layers than the first and
    fewer in-flight micro-batches, so it never holds the peak. probe=True on a CPU cluster measures
    the step time with two short runs of the engine at reduced depth (plan/probe.py; `remeasure`
    ignores their cache); a probe that fails leaves the rate model's figure and says why."""
    layout = Layout.from_config(cfg)
    p = cfg.parallel
    ranks = range(p.pp) if every_stage or p.pipeline_layers else sorted({0, p.pp - 1})
    stages = [stage_memory(cfg, r, cluster.kind, cluster.reserve_bytes, cluster.moe_imbalance) for r in ranks]
    peak = max(stages, key=lambda st: st.total)
    capacity = cluster.device.memory_bytes
    reasons = []
    if peak.total > capacity:
        top = sorted(peak.breakdown.items(), key=lambda kv: -kv[1])[:3]
        what = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in top)
        where = f" on pipeline rank {peak.pp_rank}" if p.pp > 1 else ""
        reasons.append(
            f"OOM: {_gib(peak.total)} per device{where} > {_gib(capacity)} {cluster.device.name} "
            f"(largest: {what})"
        )
    host_total: int | None = None
    if any(st.host_bytes for st in stages):  # offloaded states, host-kept checkpointed inputs
        per_node = min(cluster.devices_per_node, layout.world_size)
        host_total = int(max(st.host_bytes for st in stages) * per_node)
        if cluster.host_memory_bytes is not None and host_total > cluster.host_memory_bytes:
            reasons.append(
                f"host OOM: offloaded states {_gib(host_total)} per node > {_gib(cluster.host_memory_bytes)}"
            )
    st = step_time(cfg, cluster)
    method = RATE_MODEL + (
        f", hardware profile {cluster.profile.name}" if cluster.profile is not None else ""
    )
    kernel = attention_kernel(cluster)
    if kernel is not None:  # not the config's own choice: say which kernel the attention core is timed at
        method += f", attention kernel {kernel}"
    if probe and cluster.kind == "cpu":
        try:
            measured = probe_step_time(cfg, cluster.world_size, remeasure=remeasure)
            st = dataclasses.replace(st, breakdown=measured.breakdown, dp_overlapped_seconds=0.0)
            method = measured.method
        except ProbeError as e:
            method = f"{method}; the probe failed: {e}"
    seconds = st.total
    gbs = layout.global_batch_size
    known = _expected_error(cfg, cluster, layout) if method.startswith(RATE_MODEL) else None
    peak_flops = cluster.peak(cfg.train.precision)
    tflops = st.model_flops / seconds / layout.world_size
    peak_fp8 = cluster.peak_flops.get("fp8") if cfg.train.fp8 != "none" else None
    return Prediction(
        layout=layout,
        fits=not reasons,
        reason="; ".join(reasons) or None,
        stages=stages,
        host_memory_bytes=host_total,
        time=st,
        samples_per_second=gbs / seconds,
        tokens_per_second=gbs * cfg.model.seq_length / seconds,
        tflops_per_device=tflops / 1e12,
        mfu=tflops / peak_flops,
        peak_flops=peak_flops,
        dtype=cfg.train.precision,
        time_method=method,
        expected_error=known,
        fp8=cfg.train.fp8,
        mfu_fp8=tflops / peak_fp8 if peak_fp8 else None,
        peak_flops_fp8=peak_fp8,
    )


def _expected_error(cfg: Config, cluster: Cluster, layout: Layout) -> dict[str, Any] | None:
    """How far the time model was off on published runs of the layout's class (a GPU with a profile;
    a built-in profile's name is its device key, a calibrated one's is not in the table)."""
    if cluster.kind != "gpu" or cluster.profile is None:
        return None
    moe = cfg.model.num_experts > 0
    params = total_params(cfg.model)
    return expected_error(cluster.profile.name, params, layout.world_size, cluster.devices_per_node, moe)


def prepare(cfg: Config, world_size: int) -> Config:
    """Fill what resolve would without the tokenizer or the data checks: dp, accumulation, ffn size,
    max positions, vocabulary (the config's or the embedded tokenizer's size); check the layout."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    model = dataclasses.replace(
        family_options(m),
        ffn_hidden_size=m.ffn_hidden_size or default_ffn_hidden_size(m),  # resolve's: 2/3 of it with swiglu
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
        vocab_size=m.vocab_size or cfg.data.tokenizer_vocab_size,
    )
    rules.check_model(model)
    cfg = dataclasses.replace(cfg, model=model)
    dp = rules.infer_dp(cfg, world_size)
    train = batch_sizes(t, dp)  # as resolve decides them (a DeepSpeed file may derive the micro batch)
    check_schedule(cfg.optim, train.train_iters)  # as resolve checks it: plan refuses what train refuses
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp), train=train)
    rules.check_layout(cfg, world_size)
    return cfg


def plan_config(cfg: Config, cluster: Cluster, probe: bool = False, remeasure: bool = False) -> Prediction:
    """The prediction for the config's own layout on the whole cluster (`probe`: see `predict`)."""
    return predict(prepare(cfg, cluster.world_size), cluster, probe=probe, remeasure=remeasure)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    cfg: Config, world_size: int, global_batch: int, devices_per_node: int | None = None
) -> list[Layout]:
    """Every layout of world_size devices for this global batch: tp (powers of two dividing the
    heads), cp (`context_parallel_sizes`), pp (divisors of the layers), dp the rest; ZeRO 0-3 with
    the offload variants; micro-batch sizes dividing the per-replica batch; recompute
    none/selective/full; schedules with 2 and 4 virtual stages for the interleaved ones; sequence
    parallel with tp > 1; for ZeRO-2/3 whose dp spans nodes, hybrid sharding within a node
    (dp_shard = devices_per_node / tp); for an MoE model every expert-parallel size ep dividing both
    num_experts and dp x cp (`expert_parallel_sizes`). Invalid ones are dropped by
    config.rules.check_layout."""
    m = cfg.model
    out: list[Layout] = []
    tps = [t for t in _divisors(world_size) if t & (t - 1) == 0 and m.num_attention_heads % t == 0]
    for tp, cp in itertools.product(tps, context_parallel_sizes(m.seq_length, world_size)):
        if world_size % (tp * cp):
            continue
        for pp in _divisors(world_size // (tp * cp)):
            if m.num_layers % pp:
                continue
            dp = world_size // (tp * cp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            micro_sizes = [b for b in _divisors(per_replica) if b & (b - 1) == 0 and b <= 64]
            schedules: list[tuple[str, int]] = [("1f1b", 1)]
            if pp > 1:
                schedules = [("1f1b", 1), ("gpipe", 1)] + [
                    ("interleaved-1f1b", vs) for vs in (2, 4) if m.num_layers % (pp * vs) == 0
                ]
            zeros: list[tuple[int, bool, bool]] = [(0, False, False), (1, False, False), (2, False, False)]
            zeros += [(3, False, False), (2, True, False), (3, True, False), (3, True, True)]
            for (zero, off_opt, off_par), mb, (sched, vs), ac, sp, ep in itertools.product(
                zeros,
                micro_sizes,
                schedules,
                ("none", "selective", "full"),
                (False, True),
                expert_parallel_sizes(m.num_experts, dp * cp),
            ):
                if sp and tp == 1:
                    continue
                if (dp == 1 and zero in (1, 2)) or (dp == 1 and zero == 3 and not off_opt):
                    continue  # nothing to shard
                acc = per_replica // mb
                layout = Layout(tp, pp, dp, zero, off_opt, off_par, mb, acc, ac, sched, vs, sp, cp=cp, ep=ep)
                out += _memory_variants(layout)
                node_shard = (devices_per_node or 0) // tp
                if zero >= 2 and 1 < node_shard < dp and dp % node_shard == 0:
                    out += _memory_variants(dataclasses.replace(layout, dp_shard=node_shard))
    return out


def expert_parallel_sizes(num_experts: int, dp_cp: int) -> list[int]:
    """ep sizes the search tries: the divisors of both num_experts and dp x cp (the rule
    config.rules.check_expert_parallel checks); [1] for a dense model."""
    return [d for d in _divisors(dp_cp) if num_experts % d == 0] if num_experts else [1]


# Below this many tokens per rank, context parallelism is not searched: its per-layer key/value
# gathers then cost more than the attention they split (Llama 3 used it from 8k tokens up, 16-way at 128k)
MIN_CONTEXT_PARALLEL_TOKENS = 4096


def context_parallel_sizes(seq_length: int, world_size: int) -> list[int]:
    """cp sizes the search tries: 1, and the powers of two that split a long sequence into two
    load-balanced chunks per rank of at least MIN_CONTEXT_PARALLEL_TOKENS / 2 tokens each."""
    sizes = [1]
    cp = 2
    while cp <= world_size and seq_length % (2 * cp) == 0 and seq_length // cp >= MIN_CONTEXT_PARALLEL_TOKENS:
        sizes.append(cp)
        cp *= 2
    return sizes


# Layout fields printed beside --json's "layout" object (whose keys issue 13 fixed)
MEMORY_OPTIONS = (
    "cp",
    "ep",
    "dp_shard",
    "sequence_parallel",
    "reduce_each_micro_batch",
    "distribute_saved_activations",
    "cpu_checkpointing",
)


def _memory_variants(layout: Layout) -> list[Layout]:
    """The layout with each memory option that changes something in it: per-micro-batch
    reduce-scatter (ZeRO-2/3 with accumulation, no pipeline), and for full recompute the checkpointed
    inputs distributed over tp (without SP) and/or kept in host memory."""
    out = [layout]
    if layout.zero_stage >= 2 and layout.gradient_accumulation_steps > 1 and layout.pp == 1:
        out += [dataclasses.replace(v, reduce_each_micro_batch=True) for v in out]
    if layout.activation_checkpointing == "full":
        if layout.tp > 1 and not layout.sequence_parallel:
            out += [dataclasses.replace(v, distribute_saved_activations=True) for v in out]
        out += [dataclasses.replace(v, cpu_checkpointing=True) for v in out]
    return out


def search_layouts(cfg: Config, cluster: Cluster, global_batch: int | None = None) -> list[Prediction]:
    """Every valid layout's prediction: the ones that fit first, by predicted samples/s (best
    first), then the ones that do not, by how far over memory they are."""
    base = prepare(cfg, cluster.world_size) if global_batch is None else cfg
    gbs = global_batch or base.train.global_batch_size
    assert gbs is not None
    results: list[Prediction] = []
    for layout in candidate_layouts(base, cluster.world_size, gbs, cluster.devices_per_node):
        if layout.cpu_checkpointing and cluster.kind == "cpu":
            continue  # the host is the device: nothing moves
        candidate = layout.apply(base)
        try:
            rules.check_layout(candidate, cluster.world_size)
        except ConfigError:
            continue
        results.append(predict(candidate, cluster, every_stage=False))
    fit = sorted((r for r in results if r.fits), key=lambda r: -r.samples_per_second)
    oom = sorted((r for r in results if not r.fits), key=lambda r: r.peak_memory_bytes)
    return fit + oom
