"""Bytes per device of a layout: model states (ZeRO paper), activations (Korthikanti et al. 2022,
adapted to what our layers save), the schedule's in-flight micro-batches, FSDP2 gathers in flight,
communication buffers and transients. docs/PLANNER.md gives every formula and its source.

Legend: b micro-batch, s sequence, h hidden, a heads, f MLP inner size, v padded vocabulary,
t tensor-parallel size, e bytes of a saved activation element, P parameters held by the rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.model_shapes import (
    StageParams,
    attention_width,
    causal_attention,
    causal_blocks_under_cp,
    expert_tp,
    gated_mlp,
    lm_head_transform,
    moe_ffn,
    qkv_width,
    query_groups,
    stage_params,
    vocab,
)
from ..config.rules import dp_shard_size
from ..config.schema import Config

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Mixture of experts: the busiest expert's tokens over the mean (max/mean tokens per expert), the
# planner's default for `--moe-imbalance`. 1.25: the capacity factor Switch Transformer (Fedus et al.
# 2021) trains its aux-loss-balanced routers at, i.e. the load it budgets the busiest expert over the
# mean; not a measurement of any run: measure yours (the run logs max/mean per step) and pass it.
DEFAULT_MOE_IMBALANCE = 1.25


# ------------------------------------------------------------------------------ expert parallelism


def expert_local(sp_: StageParams, ep: int) -> StageParams:
    """What one expert-parallel rank of the stage holds: its 1/ep of the routed experts, everything
    else whole (the same object when ep = 1)."""
    if ep == 1 or not sp_.experts:
        return sp_
    experts, expert_block = sp_.experts // ep, sp_.expert_block // ep
    return dataclasses.replace(
        sp_,
        blocks=sp_.blocks - sp_.experts + experts,
        block=sp_.block - sp_.expert_block + expert_block,
        experts=experts,
        expert_block=expert_block,
    )


def sharded_numel(local: StageParams, ranks: int, expert_ranks: float) -> float:
    """Elements per rank of the stage's parameters `local` (`expert_local`): the routed experts
    sharded over `expert_ranks` (the expert-data-parallel ranks holding the same experts, dp x cp /
    ep; at least one), everything else over `ranks` data-parallel ranks."""
    return (local.total - local.experts) / ranks + local.experts / max(1.0, expert_ranks)


def expert_data_ranks(cfg: Config) -> float:
    """The ranks the experts' states are sharded over (ZeRO-2/3) and their gradients reduced over:
    dp x cp / ep, all of them also under hybrid sharding (parallel/expert.py shards the experts over
    the whole expert-data-parallel group)."""
    p = cfg.parallel
    return p.dp * p.cp / p.ep


def moe_rank_imbalance(cfg: Config, imbalance: float) -> float:
    """The busiest expert-parallel rank's routed tokens over the mean: `imbalance` (max/mean tokens
    per expert) with ep > 1, an upper bound when a rank holds several experts (their loads average
    out in part); 1 without expert parallelism, where one rank runs every expert's tokens."""
    return imbalance if cfg.parallel.ep > 1 else 1.0


def moe_layer_extra_bytes(cfg: Config, recompute: str, am: ActivationModel, imbalance: float) -> float:
    """Bytes an MoE layer keeps for backward beyond a dense layer's, per micro-batch (full recompute:
    none, both keep their input). Out: what `layer_activation_bytes` counts for the dense MLP (its
    bytes at this f less its bytes at f = 0, so the two counts cannot drift apart). In, as the
    engine's MoELayer saves them (counted tensor by tensor on the CPU, tests/unit/test_plan_moe.py):
    the router's fp32 logits and scores (tokens x E each) and, below fp32, its fp32 copy of the input
    (it routes in fp32); per routed row (k x tokens x the busiest rank's imbalance) three h-wide
    tensors (the sorted input of w_up, w_down's output and the weighted output the combine adds up)
    and the activation's input and output, with the gated activation's gate output besides (up + f,
    + f when gated; f over the expert tensor-parallel ranks); the shared expert's the same per token."""
    if recompute == "full":
        return 0.0
    mc, p = cfg.model, cfg.parallel
    assert mc.ffn_hidden_size is not None
    e, h, t = am.act_bytes, mc.hidden_size, p.tp
    tokens = cfg.train.micro_batch_size * local_seq(cfg)
    up = 2 if gated_mlp(mc) else 1
    fe, fs = moe_ffn(mc), mc.moe_shared_expert_size
    no_mlp = dataclasses.replace(cfg, model=dataclasses.replace(mc, ffn_hidden_size=0))
    dense = config_layer_bytes(cfg, "none", am) - config_layer_bytes(no_mlp, "none", am)
    rows = mc.moe_router_topk * tokens * moe_rank_imbalance(cfg, imbalance)
    gate = fe if gated_mlp(mc) else 0
    routed = rows * e * (3 * h + (up * fe + fe + gate) / expert_tp(t))
    shared = e * tokens * (up * fs + fs + (fs if gated_mlp(mc) else 0)) / t
    router = 2 * 4 * tokens * mc.num_experts + (4 * tokens * h if e != 4 else 0)
    return routed + shared + router - dense


def optimizer_bytes_per_param(cfg: Config) -> int:
    """State bytes per parameter of our optimizers (torch.optim, fp32 state): Adam/AdamW exp_avg
    and exp_avg_sq (8), SGD momentum buffer (4, none without momentum)."""
    o = cfg.optim
    if o.optimizer in ("adam", "adamw"):
        return 8
    return 4 if o.sgd_momentum > 0 else 0


# ------------------------------------------------------------------------------------------ ZeRO


def zero_paper_model_states(psi: float, k: float, nd: int, stage: int) -> float:
    """Rajbhandari et al. 2019, section 3 / Figure 1: bytes per device of mixed-precision Adam
    training (2 Psi fp16 params + 2 Psi fp16 grads + K Psi optimizer state, K = 12) under ZeRO
    stage 0 (baseline), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p) over Nd data-parallel devices."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / nd
    if stage == 2:
        return 2 * psi + (2 + k) * psi / nd
    if stage == 3:
        return (2 + 2 + k) * psi / nd
    raise ValueError(f"ZeRO stage must be 0-3, got {stage}")


def largest_param_group(cfg: Config, sp_: StageParams) -> int:
    """Elements of the largest optimizer parameter group on this rank (before ZeRO sharding):
    foreach AdamW makes its `sqrt(exp_avg_sq)` temporary for one group at a time. The engine's groups
    (train/optim.py) are decay / no-decay, each split by tensor kind: plain tensors (and FSDP2's 1-D
    DTensors) stay one decay group, about every parameter (the no-decay biases and norms are under
    0.1%); with tensor parallelism every weight kind is its own group (qkv, proj, up, down of all the
    rank's layers; the word embedding; the output matrix), as a dry run lists them."""
    mc, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return sp_.total
    assert mc.ffn_hidden_size is not None
    h, f = mc.hidden_size, mc.ffn_hidden_size
    up = 2 * f if gated_mlp(mc) else f
    largest = sp_.layers * max(h * qkv_width(mc), h * h, h * up, f * h) // tp
    if sp_.experts:  # the rank's w_up (the larger of the experts' two weights) of all its MoE layers
        fe = moe_ffn(mc)
        largest = max(
            largest, sp_.experts * (2 if gated_mlp(mc) else 1) * fe // ((2 if gated_mlp(mc) else 1) * fe + fe)
        )
    if sp_.first or sp_.last:
        largest = max(largest, vocab(mc) * h // tp)
    return largest


# ------------------------------------------------------------------------------------ activations


@dataclass(frozen=True)
class ActivationModel:
    """What one transformer layer saves for backward, as element counts and bytes.

    act_bytes      bytes of a saved activation element (4 in fp32; 2 under bf16/fp16 autocast for
                   the GEMM inputs; norms and softmax run in fp32 under CPU autocast, see docs)
    mask_bytes     bytes of a dropout mask element: 1 on CUDA (bool from the fused kernel), e on CPU
                   (torch's unfused dropout saves the scaled noise tensor in the input dtype)
    flash          the attention core saves no s^2 tensor (SDPA's flash / memory-efficient kernel:
                   q, k, v, output and the fp32 log-sum-exp); false = the math path (attention
                   dropout > 0 on CPU, or the paper's unfused kernel): softmax output, dropout mask
                   and dropout output, each a x s x s per sample
    With sequence parallelism every per-position tensor a layer keeps is 1/t per rank, as in the
    paper: the norm inputs and hidden-dropout masks run on the sequence shard, and the gathered
    inputs of qkv and up are kept as 1/t slices and gathered again in backward
    (parallel/tensor.py SavedShards; before it, DTensor's gathered copy was saved whole).
    norm_bytes     bytes of a saved norm input (None: act_bytes): 4 under autocast (norms in fp32)
    stream_bytes   bytes of the residual stream (None: act_bytes): 4 with fp32 parameters under
                   autocast, FSDP2's param_dtype bytes otherwise
    math_bytes     the math path's q, k, v and its a s^2 tensors (softmax output, dropout mask and
                   output) in these bytes (None: e, and m for the mask): CPU autocast runs the math
                   path in fp32 (4; measured by dry run at gpt-13b shapes)
    """

    act_bytes: int
    mask_bytes: int
    flash: bool
    norm_bytes: int | None = None
    stream_bytes: int | None = None
    math_bytes: int | None = None

    @property
    def norm_input_bytes(self) -> int:
        """Bytes of a saved norm input: autocast runs LayerNorm/RMSNorm in fp32, so the norm saves an
        fp32 tensor (the fp32 residual stream itself, or autocast's fp32 copy of a bf16/fp16 one)."""
        return self.act_bytes if self.norm_bytes is None else self.norm_bytes

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residual stream between blocks: the parameters' dtype in the forward (fp32,
        or FSDP2's param_dtype), since `x + f(x)` with an fp32 x stays fp32 under autocast."""
        return self.act_bytes if self.stream_bytes is None else self.stream_bytes


def layer_activation_bytes(
    b: int,
    s: int,
    h: int,
    a: int,
    f: int,
    t: int,
    sp: bool,
    recompute: str,
    am: ActivationModel,
    gated: bool = False,
    kv_ratio: float = 1.0,
    parallel_residual: bool = False,
    key_seq: int | None = None,
    attn_width: int | None = None,
    qk_norm: str = "none",
) -> float:
    """Bytes one layer keeps for backward for one micro-batch (Korthikanti et al. 2022 section 4,
    generalised). With am = (2, 1, flash=False) this is the paper's exactly:
    sbh(34 + 5as/h) without TP, sbh(10 + 24/t + 5as/(ht)) with TP, sbh/t(34 + 5as/h) with TP + SP,
    sbh 34/t (TP + SP + selective); full recompute keeps the layer input, 2sbh (/t with SP).
    kv_ratio: key/value heads per query head (grouped-query attention saves smaller k and v).
    parallel_residual (GPT-J/NeoX blocks): both norms read the block input, one saved tensor when it
    is the fp32 stream itself (measured by the dry run: 4 sbh bytes less per layer in fp32).
    key_seq (context parallelism): s is this rank's share of the sequence and key_seq the whole of it,
    whose keys and values every layer gathers and keeps for backward; scores are s x key_seq.
    attn_width (model.kv_channels): the query heads' features n d when not h; q, k, v and the attention
    output scale with it. qk_norm (model.qk_norm, head or full): q and k are kept in the norms' dtype
    ((1 + kv_ratio) s b n d / t each time) as the norm's input and normalised output, and once more on
    the flash path, plus one copy of q in the activation dtype. Measured by the dry run (2 x 1024 tokens,
    8 heads in 2 groups, bytes per q element): fake CUDA bf16 17.0 (head and full) against 17.0
    predicted; CPU fp32 head 19.0 of 19.0, full 10.0; CPU bf16 head 12.0, full 10.0 of 17.0 (over)."""
    e, m = am.act_bytes, am.mask_bytes
    sbh = s * b * h
    sba = s * b * (h if attn_width is None else attn_width)
    key_seq = s if key_seq is None else key_seq
    seq_shard = t if sp else 1
    up = 2 * f if gated else f
    if recompute == "full":
        return am.residual_bytes * sbh / seq_shard
    # norm inputs (2, saved in fp32 under autocast) and the two hidden-dropout masks: sequence-sharded
    # with SP, else replicated
    norm_inputs = 1 if parallel_residual and am.norm_input_bytes == am.residual_bytes else 2
    replicated = (norm_inputs * am.norm_input_bytes + 2 * m) * sbh / seq_shard
    # qkv and up inputs: the norm outputs (with SP, kept as 1/t slices)
    inputs = 2 * e * sbh / seq_shard
    # q, k, v (1 + 2 kv_ratio), attention output into proj (1), MLP activation input and output (gated:
    # the up projection's output, the activated gate, which the product keeps, and the product); the
    # math path keeps its own (fp32 on CPU) copies of q, k, v unless selective recompute drops the core's
    math_copies = not am.flash and recompute != "selective" and am.math_bytes is not None
    qkv_e = am.math_bytes if math_copies and am.math_bytes else e
    # q, and k and v of every key (all of the sequence's under context parallelism)
    qkv = sba * qkv_e + 2 * kv_ratio * key_seq * sba / s * qkv_e
    if qk_norm != "none":
        qkv += (1 + kv_ratio) * sba * (3 if am.flash else 2) * am.norm_input_bytes + sba * e
    mlp = up + 2 * f if gated else up + f
    sharded = (qkv + sba * e + e * sbh * mlp / h) / t
    core = 0.0
    if recompute != "selective":
        # flash: the fp32 log-sum-exp per (sample, head, position); math path: softmax output,
        # dropout mask and dropout output
        math = (2 * e + m) if am.math_bytes is None else 3 * am.math_bytes
        core = 4 * b * a * s / t if am.flash else math * b * a * s * key_seq / t
    # LayerNorm mean and rstd (fp32 per position, two norms)
    stats = 2 * 2 * 4 * s * b / seq_shard
    return replicated + inputs + sharded + core + stats


def config_layer_bytes(cfg: Config, recompute: str, am: ActivationModel) -> float:
    """`layer_activation_bytes` of cfg's layer (its micro-batch, shape and tensor/sequence
    parallelism) under the recompute mode `recompute`, in bytes per micro-batch."""
    mc, p = cfg.model, cfg.parallel
    assert mc.ffn_hidden_size is not None
    return layer_activation_bytes(
        cfg.train.micro_batch_size,
        local_seq(cfg),
        mc.hidden_size,
        mc.num_attention_heads,
        mc.ffn_hidden_size,
        p.tp,
        p.sequence_parallel,
        recompute,
        am,
        gated_mlp(mc),
        query_groups(mc) / mc.num_attention_heads,
        mc.parallel_residual,
        key_seq=mc.seq_length,
        attn_width=attention_width(mc),
        qk_norm=mc.qk_norm,
    )


def local_seq(cfg: Config) -> int:
    """Tokens of each sequence one rank computes: model.seq_length, or its 1/cp share under context
    parallelism (two load-balanced chunks)."""
    return cfg.model.seq_length // cfg.parallel.cp


def context_parallel_mask_bytes(cfg: Config, device_kind: str) -> tuple[float, float, float]:
    """(bytes kept for the whole run, per micro-batch until its backward, per layer and micro-batch) of
    a context-parallel rank's attention masks (models/layers.py, models/context_parallel.py):

    - causal blocks (`causal_blocks_under_cp`): on a GPU none (torch's lower-right causal bias is no
      tensor); on a CPU the additive masks of the rank's chunks past the first, made once and shared
      by every layer and step (`ContextParallel.lower_right_mask`): at most c^2 (2cp + 1) elements in
      the attention dtype;
    - the mask of global positions, boolean [1, 1, s, S] (per sample [b, 1, s, S] with packed
      documents or BERT's padding): SDPA converts it to an additive mask in the attention dtype at each
      layer and keeps that copy (measured on the CPU: an fp32 leaf per layer); ALiBi's bias [1 or b,
      n/tp, s, S] is made once per micro-batch in the attention dtype and every layer keeps the same.
    (0, 0, 0) without cp."""
    mc, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0, 0.0
    am = activation_model(cfg, device_kind)
    if causal_blocks_under_cp(mc):
        c = mc.seq_length // (2 * p.cp)
        return (c * c * (2 * p.cp + 1) * am.act_bytes if device_kind == "cpu" else 0.0), 0.0, 0.0
    per_sample = mc.reset_attention_mask or not causal_attention(mc)  # BERT: its padding mask
    rows = (cfg.train.micro_batch_size if per_sample else 1) * local_seq(cfg) * mc.seq_length
    if mc.position_embedding_type == "alibi":
        return 0.0, rows * mc.num_attention_heads / p.tp * am.act_bytes, 0.0
    return 0.0, 0.0, float(rows * (4 if device_kind == "cpu" else am.act_bytes))


def korthikanti(
    b: int, s: int, h: int, a: int, t: int = 1, sp: bool = False, selective: bool = False
) -> float:
    """The paper's per-layer bytes (16-bit activations, 1-byte masks, unfused attention)."""
    paper = ActivationModel(act_bytes=2, mask_bytes=1, flash=False)
    return layer_activation_bytes(b, s, h, a, 4 * h, t, sp, "selective" if selective else "none", paper) - (
        2 * 2 * 4 * s * b / (t if sp else 1)
    )


def activation_model(cfg: Config, device_kind: str) -> ActivationModel:
    m, p = cfg.model, cfg.train.precision
    on_cpu = device_kind == "cpu"
    e = DTYPE_BYTES[p]
    # On CPU, SDPA takes its fused (flash) kernel without attention dropout; with dropout the math
    # path. On CUDA, flash / memory-efficient kernels support dropout.
    flash = (not on_cpu) or m.attention_dropout == 0
    mask = e if on_cpu else 1
    if m.hidden_dropout == 0:
        mask = 0
    mixed = p != "fp32"
    fsdp_low = cfg.parallel.zero_stage >= 2 and mixed and cfg.parallel.fsdp_param_dtype == "auto"
    return ActivationModel(
        act_bytes=e,
        mask_bytes=mask,
        flash=flash,
        math_bytes=4 if on_cpu and not flash else None,
        norm_bytes=4,
        stream_bytes=e if fsdp_low or not mixed else 4,
    )


def inflight_microbatches(
    schedule: str, pp: int, virtual: int, m: int, pp_rank: int, later: bool = False
) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the rank's
    whole layers (an interleaved chunk is 1/v of them), as torch.distributed.pipelining runs the
    schedule: GPipe and looped-BFS all m (all forwards first); 1F1B min(m, pp - rank);
    interleaved 1F1B ((pp - 1 - rank) x 2 + (v - 1) x pp + 1 warm-up chunks, as
    ScheduleInterleaved1F1B computes warmup_ops) / v; zbv 2 chunks per micro-batch, like 1F1B.
    Zero-bubble (ScheduleInterleavedZeroBubble) splits each backward into an input pass and a weight
    pass, and the input pass keeps the chunk's autograd graph (its saved activations) for the weight
    pass: a chunk's activations live from its forward to its weight pass, and that schedule has up to
    v x (micro-batches per round) of them, m // max(1, m // pp) per round, on every rank alike.
    `later`: at the second micro-batch's backward instead of the first (GPipe: one fewer)."""
    if pp == 1:
        return 1.0
    if schedule in ("gpipe", "looped-bfs"):
        # all forwards first; at the second backward (`later`) one micro-batch is done
        return float(max(1, m - 1) if later else m)
    if schedule == "1f1b":
        return float(min(m, pp - pp_rank))
    if schedule == "zbv":
        return float(min(m, pp - pp_rank))
    if schedule == "zero-bubble":
        return float(m // max(1, m // pp))
    chunks = min(m * virtual, (pp - 1 - pp_rank) * 2 + (virtual - 1) * pp + 1)
    return chunks / virtual


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of pipeline rank `pp_rank` at its peak (breakdown keys as --json prints
    them), which phase of the step the peak is in, and the host bytes of offloaded states."""

    pp_rank: int
    breakdown: dict[str, int]
    host_bytes: int
    phase: str = "backward"

    @property
    def total(self) -> int:
        return sum(self.breakdown.values())


def stage_memory(
    cfg: Config,
    pp_rank: int,
    device_kind: str,
    reserve_bytes: int,
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE,
) -> StageMemory:
    """Peak bytes on a device of pipeline rank pp_rank for a resolved-enough cfg (dp, accumulation
    and ffn_hidden_size filled): the larger of two moments of a step,

    backward  the first backward of the loss (the largest activation footprint: every in-flight
              micro-batch's activations, the logits and the loss's buffers), with the gradients that
              exist then (none without accumulation: zero_grad(set_to_none=True) freed them; the
              accumulated ones otherwise);
    optimizer the optimizer step: parameters, all gradients, optimizer state and the foreach
              temporaries, activations freed.
    Under expert parallelism the rank holds 1/ep of the routed experts (`expert_local`), their states
    sharded over the expert-data-parallel ranks; `moe_imbalance` (max/mean tokens per expert) sizes
    the busiest rank's routed activations.
    """
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    assert mc.ffn_hidden_size is not None and t.gradient_accumulation_steps is not None
    sp_ = expert_local(
        stage_params(
            mc, p.tp, p.pp, pp_rank, p.virtual_pipeline_stages, p.pipeline_schedule, p.pipeline_layers
        ),
        p.ep,
    )
    e = DTYPE_BYTES[t.precision]
    common = {
        "batch": int(t.gradient_accumulation_steps * t.micro_batch_size * mc.seq_length * 8 * 3),
        "reserve": reserve_bytes,
    }
    if p.zero_stage < 2:
        backward, optimizer = _replicated_states(cfg, sp_)
        host = 0
    else:
        backward, optimizer, host = _sharded_states(cfg, sp_, device_kind)
    backward = _backward_peak(cfg, sp_, pp_rank, device_kind, backward, moe_imbalance)
    host += int(host_checkpoint_bytes(cfg, sp_, pp_rank, device_kind))
    if optimizer and sp_.last and p.pp == 1:
        # the trainer still holds the last micro-batch's outputs (logits) during the step
        optimizer["logits_and_loss"] = int(t.micro_batch_size * local_seq(cfg) * vocab(mc) / p.tp * e)
    backward.update(common)
    optimizer.update(common)
    if sum(optimizer.values()) > sum(backward.values()):
        return StageMemory(pp_rank, optimizer, host, "optimizer")
    return StageMemory(pp_rank, backward, host, "backward")


def _gather_bytes(cfg: Config) -> int:
    """Bytes per element of a gathered (unsharded) FSDP parameter: its compute dtype under mixed precision."""
    return 2 if (cfg.train.precision != "fp32" and cfg.parallel.fsdp_param_dtype == "auto") else 4


def _replicated_states(cfg: Config, sp_: StageParams) -> tuple[dict[str, int], dict[str, int]]:
    """ZeRO-0/1 (DDP, or FSDP2's `replicate` with tp > 1): the model states at the loss's backward and
    at the optimizer step, every parameter and gradient whole on each rank."""
    p, t = cfg.parallel, cfg.train
    assert t.gradient_accumulation_steps is not None
    # gradients reduced (ZeRO-1: optimizer state sharded) over dp x cp: cp ranks hold the same parameters
    P, dp, zero = sp_.total, p.dp * p.cp, p.zero_stage
    e = DTYPE_BYTES[t.precision]
    k = optimizer_bytes_per_param(cfg)
    precision = t.precision
    accumulating = t.gradient_accumulation_steps > 1
    params = 4 * P
    grads = 4 * P
    # ZeRO-1 shards the experts' states over the expert-data-parallel ranks (dp x cp / ep)
    stepped = sharded_numel(sp_, dp, expert_data_ranks(cfg)) if zero == 1 else P
    states = int(k * stepped)
    # DDP (tp = 1, dp > 1): its all-reduce buckets, allocated when DDP is built, hold the
    # gradients (gradient_as_bucket_view=True): .grad are views into them, no second copy
    # ZeRO-0 with tp > 1 (or expert parallelism) replicates through FSDP2's `replicate`
    # (parallel/apply.py), which keeps a separate unsharded copy of every parameter (fp32: its policy
    # sets no param_dtype) from the forward until the backward is done (not resharded after
    # forward), freed before the step
    fsdp_replicate = p.tp > 1 or p.ep > 1
    buckets = 4 * P if dp > 1 and not fsdp_replicate else 0
    replicated = 4 * P if dp > 1 and fsdp_replicate else 0
    # with accumulation the gradients exist, but an interleaved rank peaks in the backward of its
    # first chunk to go back (its warm-up holds the most chunks): only that chunk's (1/v) exist
    accumulated = grads / p.virtual_pipeline_stages if p.pp > 1 else grads
    backward = {
        "parameters": params,
        "gradients": int(accumulated) if accumulating and not buckets else 0,
        "optimizer_state": states,
        "communication_buffers": buckets,
        "gathered_parameters": replicated,
        # autocast caches each weight's compute-dtype copy for the step (saved for backward)
        "compute_dtype_weights": e * P if precision != "fp32" else 0,
    }
    # foreach AdamW's sqrt(exp_avg_sq), one parameter group at a time, on the stepped shard
    share = stepped / P if sp_.experts else 1 / (dp if zero == 1 else 1)
    temporaries = int(4 * largest_param_group(cfg, sp_) * share) if k else 0
    optimizer = {
        "parameters": params,
        "gradients": 0 if buckets else grads,
        "optimizer_state": states,
        "communication_buffers": buckets,
        "optimizer_temporaries": temporaries,
    }
    return backward, optimizer


def _sharded_states(
    cfg: Config, sp_: StageParams, device_kind: str
) -> tuple[dict[str, int], dict[str, int], int]:
    """ZeRO-2/3 (FSDP2): the model states at the loss's backward and at the optimizer step, and the
    bytes offloading keeps on the host."""
    p, t = cfg.parallel, cfg.train
    assert t.gradient_accumulation_steps is not None
    # sharded over dp_shard ranks: all of dp, or (hybrid sharding) each replica's shard group; x cp
    # under context parallelism (torchtitan's dp_shard_cp)
    P, dp, zero = sp_.total, dp_shard_size(p) * p.cp, p.zero_stage
    k = optimizer_bytes_per_param(cfg)
    offload = p.offload_optimizer or p.offload_param
    gather_bytes = _gather_bytes(cfg)
    accumulating = t.gradient_accumulation_steps > 1
    host = 0
    # the experts over the expert-data-parallel ranks (torchtitan's dp_shard_mod_ep), all of them
    shard = sharded_numel(sp_, dp, expert_data_ranks(cfg))
    sharded = int(4 * shard)
    states = int(k * shard)
    # ZeRO-2 (reshard_after_forward=False): every unit stays gathered from its forward to its
    # backward; ZeRO-3: at the loss's backward every block is resharded but the last, and without
    # pipeline stages the root (embedding, head) stays gathered too (parallel/apply.py): both
    # are the first units the backward needs. A pipeline stage reshards both.
    kept_units = sp_.block + sp_.root if p.pp == 1 else sp_.block
    gathered = gather_bytes * P if zero == 2 else gather_bytes * kept_units
    # unsharded gradients (gathered dtype) accumulate over micro-batches without gradient sync
    # (set_requires_gradient_sync(False)); without accumulation no block's backward has started
    # at the loss's backward: no gradient and no reduce-scatter buffer yet
    # (FSDP2 accumulates them in its reduce dtype when that differs from param_dtype:
    # `unsharded_accumulated_grad`, fp32 by default)
    accumulate_bytes = DTYPE_BYTES[p.grad_reduce_dtype] if gather_bytes != 4 else gather_bytes
    # parallel.reduce_each_micro_batch: every micro-batch is reduce-scattered into the sharded
    # fp32 gradients (DeepSpeed's way), so no unsharded gradient outlives its unit's backward
    reduce_each = accumulating and p.reduce_each_micro_batch
    unsharded_grads = accumulate_bytes * P if accumulating and not reduce_each else 0
    sharded_grads = sharded if reduce_each and not offload else 0
    reduce_buffer = DTYPE_BYTES[p.grad_reduce_dtype] * sp_.block if accumulating else 0
    if offload:
        host = 2 * sharded + states
    if offload and device_kind != "cpu":
        # FSDP2 copies each unit's shard to the device before gathering it
        backward = {"communication_buffers": int(4 * sp_.block / dp + reduce_buffer)}
        optimizer = {}
    else:
        # without offload, or "offloading" to the host a CPU rank already runs on, which moves
        # nothing: the states stay in the same memory (measured: the same live tensor bytes)
        backward = {
            "parameters": sharded,
            "optimizer_state": states,
            "communication_buffers": int(reduce_buffer),
        }
        optimizer = {
            "parameters": sharded,
            "gradients": sharded,
            "optimizer_state": states,
            "optimizer_temporaries": int(
                4 * largest_param_group(cfg, sp_) * (shard / P if sp_.experts else 1 / dp)
            )
            if k
            else 0,
        }
    backward["gathered_parameters"] = int(gathered)
    backward["gradients"] = int(unsharded_grads + sharded_grads)
    return backward, optimizer, host


def _backward_peak(
    cfg: Config,
    sp_: StageParams,
    pp_rank: int,
    device_kind: str,
    backward: dict[str, int],
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE,
) -> dict[str, int]:
    """The loss's backward moment: the model states with the activations in flight and the logits
    and loss buffers (or the recompute workspace, whichever is larger)."""
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    assert t.gradient_accumulation_steps is not None
    fsdp = p.zero_stage >= 2
    offload = p.offload_optimizer or p.offload_param
    gather_bytes = _gather_bytes(cfg)
    accumulating = t.gradient_accumulation_steps > 1
    # The first micro-batch's backward has no gradient yet; a later one (with accumulation) has the
    # accumulated gradients but, under GPipe, one micro-batch fewer in flight: the larger counts.
    variants = []
    for later in (False, True) if accumulating else (False,):
        moment = dict(backward)
        if not later and accumulating:
            moment["gradients"] = 0
            if fsdp and not offload:
                moment["communication_buffers"] = 0
        moment["activations"] = int(activation_bytes(cfg, sp_, pp_rank, device_kind, later, moe_imbalance))
        # the head's weight gradient is made afresh at its backward, in the parameters' dtype, even
        # where a gradient exists (accumulated, or a view into DDP's buckets): added to it, then freed
        head_grad = (gather_bytes if fsdp else 4) * vocab(mc) * mc.hidden_size / p.tp
        loss_buffers = logits_bytes(cfg, sp_, pp_rank, later, head_grad)
        recompute = recompute_bytes(cfg, sp_, device_kind, moe_imbalance)
        if recompute > loss_buffers:
            moment["recompute_workspace"] = int(recompute)
        else:
            moment["logits_and_loss"] = int(loss_buffers)
        pending = weight_pass_bytes(cfg, sp_, pp_rank)
        if pending:
            moment["weight_pass_gradients"] = int(pending)
        variants.append(moment)
    return max(variants, key=lambda d: sum(d.values()))


def weight_pass_bytes(cfg: Config, sp_: StageParams, pp_rank: int) -> float:
    """Zero-bubble's gradients waiting for their weight pass: torch's ScheduleInterleavedZeroBubble runs
    a chunk's input pass (the gradient of its input) and, later, its weight pass, which needs the
    gradient of every weight op's output; those wait on the device in between. At a rank's peak
    pp_rank + 1 chunks wait (torch's action lists, checked in tests/unit/test_plan.py), on the last
    rank all of them chunks of the model's last stage, which also hold the head's output gradient
    [b, s, v/t]. Per layer: the gradients of the qkv and MLP-up outputs (sharded over tp), of the
    attention and MLP-down outputs ([b, s, h], sequence-sharded under SP) in the compute dtype, and of
    the two norms' outputs in fp32 (measured on the dry run: gpt-125m, pp 4 x v 3, 36-46 MiB per layer
    against 39 here)."""
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    if p.pp == 1 or p.pipeline_schedule != "zero-bubble":
        return 0.0
    e = DTYPE_BYTES[t.precision]
    tokens = t.micro_batch_size * local_seq(cfg)
    h, v = mc.hidden_size, p.virtual_pipeline_stages
    assert mc.ffn_hidden_size is not None
    up = mc.ffn_hidden_size * (2 if gated_mlp(mc) else 1)
    sharded_h = h / (p.tp if p.sequence_parallel else 1)
    per_layer = tokens * ((qkv_width(mc) + up) / p.tp * e + 2 * sharded_h * e + 2 * sharded_h * 4)
    chunks = min(pp_rank + 1, (t.gradient_accumulation_steps or 1) * v)
    head = tokens * vocab(mc) / p.tp * e if sp_.last else 0.0
    return chunks * (per_layer * sp_.layers / v + head)


def kept_input_fraction(cfg: Config, device_kind: str) -> float:
    """The share of each checkpointed layer input full recompute keeps on the device: 1/tp with
    parallel.distribute_saved_activations, 0 with cpu_checkpointing on a GPU (host memory; on a CPU
    the host is the device), else 1."""
    p = cfg.parallel
    if p.activation_checkpointing != "full":
        return 1.0
    if p.cpu_checkpointing and device_kind != "cpu":
        return 0.0
    return 1.0 / p.tp if p.distribute_saved_activations else 1.0


def host_checkpoint_bytes(cfg: Config, sp_: StageParams, pp_rank: int, device_kind: str) -> float:
    """Host bytes of the checkpointed layer inputs under cpu_checkpointing on a GPU (per device), for the
    rank's in-flight micro-batches: whole, or 1/tp with distribute_saved_activations."""
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    if p.activation_checkpointing != "full" or not p.cpu_checkpointing or device_kind == "cpu":
        return 0.0
    assert t.gradient_accumulation_steps is not None
    seq_shard = p.tp if p.sequence_parallel else 1
    sliced = seq_shard * (p.tp if p.distribute_saved_activations else 1)
    bsh = t.micro_batch_size * local_seq(cfg) * mc.hidden_size
    per_layer = activation_model(cfg, device_kind).residual_bytes * bsh / sliced
    inflight = inflight_microbatches(
        p.pipeline_schedule, p.pp, p.virtual_pipeline_stages, t.gradient_accumulation_steps, pp_rank
    )
    return per_layer * sp_.layers / p.checkpoint_num_layers * inflight


def recompute_bytes(
    cfg: Config, sp_: StageParams, device_kind: str, moe_imbalance: float = DEFAULT_MOE_IMBALANCE
) -> float:
    """What recomputation adds during backward: the activations of the chunk being recomputed (full:
    checkpoint_num_layers layers, MoE ones where the rank has them), or of one attention core
    (selective). This happens after the loss's backward has freed the logits buffers, so the peak
    holds the larger of the two."""
    p = cfg.parallel
    mode = p.activation_checkpointing
    if mode == "none" or not sp_.layers:
        return 0.0
    am = activation_model(cfg, device_kind)
    full_layer = config_layer_bytes(cfg, "none", am)
    if sp_.moe_layers:
        full_layer += moe_layer_extra_bytes(cfg, "none", am, moe_imbalance)
    if mode == "full":
        # a distributed or host-kept input is rebuilt whole on the device for the recomputation
        rebuilt = config_layer_bytes(cfg, "full", am) * (1 - kept_input_fraction(cfg, device_kind))
        return full_layer * min(p.checkpoint_num_layers, sp_.layers) + rebuilt
    return full_layer - config_layer_bytes(cfg, mode, am)


def activation_bytes(
    cfg: Config,
    sp_: StageParams,
    pp_rank: int,
    device_kind: str,
    later: bool = False,
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE,
) -> float:
    """Saved activations of the rank's layers for its in-flight micro-batches (what recomputation
    keeps, when on; MoE layers their routed tokens, `moe_layer_extra_bytes`), plus the embedding's
    and the pipeline boundaries' tensors."""
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    assert mc.ffn_hidden_size is not None and t.gradient_accumulation_steps is not None
    am = activation_model(cfg, device_kind)
    mode = p.activation_checkpointing
    per_layer = config_layer_bytes(cfg, mode, am)
    inflight = inflight_microbatches(
        p.pipeline_schedule, p.pp, p.virtual_pipeline_stages, t.gradient_accumulation_steps, pp_rank, later
    )
    layers = sp_.layers
    if mode == "full":
        per_layer = per_layer * kept_input_fraction(cfg, device_kind) / p.checkpoint_num_layers
    total = per_layer * layers * inflight
    if sp_.moe_layers:
        total += moe_layer_extra_bytes(cfg, mode, am, moe_imbalance) * sp_.moe_layers * inflight
    if layers:
        kept, shared, per_layer_mask = context_parallel_mask_bytes(cfg, device_kind)
        # selective and full recompute rerun the attention core in backward: its masks are not kept
        total += kept + (shared + (per_layer_mask * layers if mode == "none" else 0.0)) * inflight
    # the embedding's dropout mask (its output is the first block's input, counted there)
    seq_shard = p.tp if p.sequence_parallel else 1
    bsh = t.micro_batch_size * local_seq(cfg) * mc.hidden_size
    if sp_.first:
        total += am.mask_bytes * bsh * inflight
    if p.pp > 1:
        # torch.distributed.pipelining allocates, once, a receive buffer per micro-batch and chunk:
        # the stage input (forward, not on the first chunk) and the gradient of its output (backward,
        # not on the last chunk), in the residual stream's dtype; and it keeps each in-flight chunk's
        # output for its backward (not the loss chunk's)
        v = p.virtual_pipeline_stages
        m = t.gradient_accumulation_steps
        boundary = am.residual_bytes * bsh / seq_shard
        receive = 2 * v * m - (m if sp_.first else 0) - (m if sp_.last else 0)
        chunks = inflight * v
        outputs = chunks * (v - 1) / v if sp_.last else chunks
        total += boundary * (receive + outputs)
    return total


def logits_bytes(
    cfg: Config, sp_: StageParams, pp_rank: int, later: bool = False, head_grad_bytes: float = 0.0
) -> float:
    """The head's saved tensors and the loss's buffers on the last stage, the larger of two moments.

    At the loss's backward: logits [b, s, v/t] in the compute dtype (the trainer still holds the
    model's outputs) and the fp32 log-softmax the cross-entropy saved. Without tensor parallelism the
    log-softmax of fp32 logits is written over them (one buffer for both), the loss's backward writes
    its gradient into that log-softmax in place and adds only its cast to the logits' dtype under
    bf16/fp16 (models.spec._CrossEntropySum); loss_parallel's (tp > 1) makes the NLL's gradient and
    log-softmax's gradient, two more fp32 buffers.
    At the head's backward, next: the log-softmax is gone or has become the logits' gradient, and the
    head's weight gradient [v/t, h] is made, `head_grad_bytes`. With fp32 logits this is the larger
    (measured at the plan_accuracy shape, BERT on one process and GPT on two: 17 MiB above the loss's
    moment, the tied embedding's gradient)."""
    if not sp_.last:
        return 0.0
    mc, p, t = cfg.model, cfg.parallel, cfg.train
    e = DTYPE_BYTES[t.precision]
    b, s, h = t.micro_batch_size, local_seq(cfg), mc.hidden_size
    v = vocab(mc)
    logits = b * s * v / p.tp
    # BERT's head saves the dense input, gelu input, norm input (fp32 under autocast) and logits input;
    # GPT its final norm's input (fp32 under autocast) and the logits input
    head = ((3 * e + 4) if lm_head_transform(mc) else (4 + e)) * b * s * h
    # kept per micro-batch until its backward: the logits (the trainer's outputs, or the pipeline
    # stage's cached output) and the saved fp32 log-softmax (the loss's fp32 copy of the logits is
    # log_softmax's input, which it does not save: freed after the forward), one buffer when the
    # log-softmax overwrites fp32 logits; then, for the micro-batch in backward, the two gradients
    own = 0 if (p.tp == 1 and e == 4) else e  # the logits' own buffer beside the log-softmax
    kept = own + 4
    if p.tp > 1:
        kept += 4  # loss_parallel's cross-entropy keeps one more vocabulary-sharded fp32 buffer (measured)
    # the last stage computes the loss in its forward: GPipe and looped-BFS run every forward first
    # (all m in flight, m - 1 at the second backward); the 1F1B family backs each micro-batch up right
    # after the last stage's forward (measured on interleaved 1F1B too): one
    micro = 1
    if p.pp > 1 and p.pipeline_schedule in ("gpipe", "looped-bfs"):
        m = t.gradient_accumulation_steps or 1
        micro = max(1, m - 1) if later else m
    gradients = 4 + 4 if p.tp > 1 else (0 if e == 4 else e)
    at_loss = logits * (kept * micro + gradients) + head * micro
    # the backward micro-batch's log-softmax (and loss_parallel's extra buffer) and gradients give way
    # to the logits' gradient: the log-softmax itself with fp32 logits, else its cast
    logits_grad = 4 if (p.tp == 1 and e == 4) else e
    at_head = at_loss - logits * (kept - own + gradients - logits_grad) + head_grad_bytes
    return max(at_loss, at_head)
