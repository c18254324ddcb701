"""Cross-section rules: what the model, the parallel layout and the batch sizes demand of each other.

Torch-free and model-free (this module imports only the schema and the errors), so that the planner
can check thousands of candidate layouts in milliseconds and `stx config validate` rejects exactly
what `stx train` rejects. Field-level rules (types, choices) are applied by the loader from the
schema; `config.validate.resolve` fills derived values and then calls `check_layout` here.

Every error names the keys involved and what would be valid.
"""

from __future__ import annotations

import math
import os
import re

from ..errors import ConfigError
from .schema import CheckpointConfig, Config, DataConfig, ModelConfig, OptimConfig, ParallelConfig

INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zero-bubble")
V_SHAPED_SCHEDULES = ("zbv",)
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


def head_dim(m: ModelConfig) -> int:
    """d: the attention head size, model.kv_channels or else hidden_size / num_attention_heads."""
    return m.kv_channels if m.kv_channels is not None else m.hidden_size // m.num_attention_heads


def _check_architecture(m: ModelConfig) -> None:
    """The settings of GPT-J/NeoX, Mistral and BLOOM-style models (partial rotary, parallel residual,
    sliding window, ALiBi) where they need each other."""
    d = head_dim(m)
    if m.rotary_percent != 1.0 and m.position_embedding_type != "rotary":
        raise ConfigError(
            f"model.rotary_percent ({m.rotary_percent}) is the rotated share of each head under rotary "
            f"positions; model.position_embedding_type is {m.position_embedding_type}: set it to rotary "
            "or rotary_percent to 1"
        )
    rotated = int(d * m.rotary_percent)
    if m.position_embedding_type == "rotary" and (rotated % 2 or rotated == 0):
        raise ConfigError(
            f"rotary position embeddings rotate channel pairs: int(head dim {d} x "
            f"model.rotary_percent {m.rotary_percent}) = {rotated} must be even and positive"
        )
    if m.parallel_residual and m.apply_residual_connection_post_layernorm:
        raise ConfigError(
            "model.parallel_residual (GPT-J/NeoX blocks) is pre-LN: set "
            "model.apply_residual_connection_post_layernorm to false"
        )
    for key, named in (
        ("sliding_window", m.sliding_window is not None),
        ("position_embedding_type", m.position_embedding_type == "alibi"),
        ("reset_position_ids", m.reset_position_ids),
        ("reset_attention_mask", m.reset_attention_mask),
    ):
        if named and m.type != "gpt":
            raise ConfigError(
                f"model.{key} = {getattr(m, key)} is built for causal GPT models only; model.type is {m.type}"
            )


def check_model(m: ModelConfig) -> None:
    """The model's sizes agree with each other (derived sizes filled). The one place these rules live:
    models/ builds only from resolved configs."""
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({m.num_attention_heads}), or model.kv_channels must set the head "
            "size"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise ConfigError(
            f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
            f"model.num_query_groups ({groups}): every key/value group serves the same number of query heads"
        )
    if m.rope_scaling and m.position_embedding_type != "rotary":
        raise ConfigError(
            f"model.rope_scaling scales rotary frequencies; model.position_embedding_type is "
            f"{m.position_embedding_type}, set it to rotary or rope_scaling to false"
        )
    _check_architecture(m)
    if m.position_embedding_type == "sinusoidal" and m.hidden_size % 2:
        raise ConfigError(f"sinusoidal positions need an even model.hidden_size, got {m.hidden_size}")
    if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) must be <= model.max_position_embeddings "
            f"({m.max_position_embeddings})"
        )
    _check_moe(m)
    if m.type == "bert" and m.seq_length < 8:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) is too short for BERT samples ([CLS] A [SEP] B "
            "[SEP] needs at least 8)"
        )


def _check_moe(m: ModelConfig) -> None:
    """The mixture-of-experts settings agree with each other and with the model."""
    moe_keys = ("moe_capacity_factor", "moe_shared_expert_size")
    if m.num_experts == 0:
        set_keys = [k for k in moe_keys if getattr(m, k) not in (None, 0)]
        if set_keys:
            raise ConfigError(
                f"model.{set_keys[0]} = {getattr(m, set_keys[0])} configures mixture-of-experts layers, and "
                "model.num_experts is 0 (a dense model): set model.num_experts > 0 or leave it unset"
            )
        return
    if m.type != "gpt":
        raise ConfigError(
            f"model.num_experts = {m.num_experts}: mixture-of-experts layers are built for GPT models only; "
            f"model.type is {m.type}"
        )
    if m.moe_router_topk > m.num_experts:
        raise ConfigError(
            f"model.moe_router_topk ({m.moe_router_topk}) must be <= model.num_experts ({m.num_experts}); "
            f"valid: 1..{m.num_experts}"
        )
    if not any(i >= m.moe_first_k_dense and i % m.moe_layer_freq == 0 for i in range(m.num_layers)):
        raise ConfigError(
            f"model.num_experts = {m.num_experts} but no layer is an MoE layer: model.moe_first_k_dense "
            f"({m.moe_first_k_dense}) and model.moe_layer_freq ({m.moe_layer_freq}) leave all "
            f"{m.num_layers} layers dense"
        )


def parse_split(split: str) -> tuple[float, float, float]:
    """Normalised train/valid/test weights from Megatron's split string ("949,50,1", "98/2", "1,0,0");
    missing trailing weights are 0. Here (pure string parsing) so that `stx config validate` rejects
    a bad split as `stx train` does; data/ uses the same function."""
    try:
        weights = [float(w) for w in re.split(r"[,/]", split.strip()) if w.strip()]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.split must be 1-3 non-negative weights like '949,50,1' with a positive sum, got {split!r}"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def parse_blend(text: str, key: str = "data.path") -> list[tuple[float, str]]:
    """(weight, prefix) pairs of a single prefix ("PREFIX", weight 1) or a Megatron blend
    ("W1 PREFIX1 W2 PREFIX2 ..."), weights normalised to sum to 1. Raises ConfigError naming the bad
    token otherwise; `key` names the setting in messages."""
    tokens = text.split()
    if not tokens:
        raise ConfigError(f"{key} is empty: expected a dataset prefix or 'WEIGHT PREFIX WEIGHT PREFIX ...'")
    if len(tokens) == 1:
        return [(1.0, tokens[0])]
    pairs: list[tuple[float, str]] = []
    for i in range(0, len(tokens), 2):
        word = tokens[i]
        try:
            weight = float(word)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(
                f"{word!r} in {key} is not a positive number: a blend is 'WEIGHT PREFIX WEIGHT PREFIX ...' "
                f"(got {text!r})"
            )
        if i + 1 == len(tokens):
            raise ConfigError(f"weight {word!r} in {key} has no dataset prefix after it (got {text!r})")
        pairs.append((weight, tokens[i + 1]))
    total = sum(w for w, _ in pairs)
    return [(w / total, prefix) for w, prefix in pairs]


def check_data(d: DataConfig) -> None:
    """The data strings parse (the files themselves are checked when the run opens them)."""
    parse_split(d.split)
    if d.path is not None:
        parse_blend(d.path)


# Bytes of sample index per training sample: a BERT samples-mapping row is 4 x int64; GPT's sample_idx
# (2 x int64) and shuffle_idx (up to int64) take 24. The data layer builds it in memory at startup.
INDEX_BYTES_PER_SAMPLE = 32


def physical_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say (then the check below is skipped)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_sample_index(cfg: Config, memory_bytes: int | None = None) -> None:
    """The run's sample index (train_iters x global batch samples) fits in this machine's memory.
    Without this, an absurd micro-batch dies in numpy with a memory traceback minutes into startup."""
    memory_bytes = physical_memory_bytes() if memory_bytes is None else memory_bytes
    t = cfg.train
    if memory_bytes is None or t.global_batch_size is None:
        return
    samples = t.train_iters * t.global_batch_size
    need = samples * INDEX_BYTES_PER_SAMPLE
    if need > memory_bytes:
        raise ConfigError(
            f"train.train_iters ({t.train_iters}) x global batch ({t.global_batch_size}: micro_batch_size "
            f"{t.micro_batch_size} x accumulation x dp) = {samples:,} samples, whose sample index needs "
            f"about {need / 2**30:,.0f} GiB, more than this machine's {memory_bytes / 2**30:.0f} GiB; "
            "lower train.micro_batch_size, train.global_batch_size or train.train_iters"
        )


def check_optim(o: OptimConfig) -> None:
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")


def profile_ranks(text: str, world_size: int) -> list[int]:
    """logging.profile_ranks ('0', '0,3' or 'all') as rank numbers; ConfigError when one is invalid."""
    if text.strip().lower() == "all":
        return list(range(world_size))
    ranks = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= world_size:
            raise ConfigError(
                f"logging.profile_ranks = {text!r}: {part!r} is not a rank of this run "
                f"(0..{world_size - 1}); "
                "give rank numbers separated by commas, or 'all'"
            )
        ranks.append(int(part))
    return sorted(set(ranks))


def check_profile(cfg: Config, world_size: int) -> None:
    lg = cfg.logging
    if lg.profile_start_step is None:
        if lg.profile_end_step is not None:
            raise ConfigError("logging.profile_end_step is set without logging.profile_start_step")
        return
    end = lg.profile_end_step or lg.profile_start_step
    if end < lg.profile_start_step:
        raise ConfigError(
            f"logging.profile_end_step ({end}) is before logging.profile_start_step "
            f"({lg.profile_start_step}): the window is start..end, inclusive"
        )
    if end > cfg.train.train_iters:
        raise ConfigError(
            f"logging.profile_end_step ({end}) is after the last iteration (train.train_iters = "
            f"{cfg.train.train_iters})"
        )
    profile_ranks(lg.profile_ranks, world_size)


def check_checkpoint(c: CheckpointConfig) -> None:
    if c.save_interval is not None and not c.save:
        raise ConfigError("checkpoint.save_interval is set without checkpoint.save: set the save directory")
    if c.load == "auto" and not c.save:
        raise ConfigError("checkpoint.load = auto resumes from checkpoint.save: set checkpoint.save too")
    if c.finetune and not c.load:
        raise ConfigError("checkpoint.finetune loads weights from checkpoint.load: set checkpoint.load")
    if c.init_from_hf and c.load:
        raise ConfigError(
            "checkpoint.init_from_hf and checkpoint.load both set the starting weights: keep one "
            "(init_from_hf for a Hugging Face model, load to resume or finetune one of ours)"
        )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's padding: vocab_size rounded up to a multiple of divisible_by * tp (in tokens)."""
    if vocab_size < 1 or divisible_by < 1 or tp < 1:
        raise ValueError(
            f"padded_vocab_size needs positive ints, got vocab_size={vocab_size}, "
            f"divisible_by={divisible_by}, tp={tp}"
        )
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_layer_counts(num_layers: int, num_stages: int, explicit: str | None) -> list[int]:
    """Transformer layers of each pipeline stage: `explicit` ('3,5') or an even split."""
    if explicit is not None:
        try:
            counts = [int(x) for x in explicit.split(",")]
        except ValueError:
            raise ConfigError(
                f"parallel.pipeline_layers = {explicit!r}: expected comma-separated integers, e.g. '3,5'"
            ) from None
        if len(counts) != num_stages:
            raise ConfigError(
                f"parallel.pipeline_layers = {explicit!r} names {len(counts)} stages; the layout has "
                f"pp x virtual_pipeline_stages = {num_stages}"
            )
        if any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ConfigError(
                f"parallel.pipeline_layers = {explicit!r}: every stage needs >= 1 layer and the counts "
                f"must add up to model.num_layers ({num_layers})"
            )
        return counts
    if num_layers % num_stages:
        raise ConfigError(
            f"model.num_layers ({num_layers}) is not divisible by the {num_stages} pipeline stages "
            "(parallel.pp x virtual_pipeline_stages); change the sizes or set parallel.pipeline_layers"
        )
    return [num_layers // num_stages] * num_stages


def stage_ids(pp: int, pp_rank: int, virtual: int, schedule: str) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank`, in model order.

    Loop placement (r, r + pp, r + 2 pp, ...) for every schedule but zbv, whose V places stages
    r and 2 pp - 1 - r on rank r (so rank 0 holds both the first and the last stage)."""
    if not 0 <= pp_rank < pp or virtual < 1:
        raise ValueError(
            f"stage_ids: need 0 <= pp_rank < pp and virtual >= 1, got {pp_rank}, {pp}, {virtual}"
        )
    if schedule in V_SHAPED_SCHEDULES:
        if virtual != 2:
            raise ValueError(
                f"pipeline_schedule = {schedule} places exactly 2 stages per rank, got {virtual}"
            )
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_rank(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pipeline rank holding global stage `stage` (the inverse of `stage_ids`)."""
    for rank in range(pp):
        if stage in stage_ids(pp, rank, virtual, schedule):
            return rank
    raise ValueError(f"stage {stage} is not in a pipeline of {pp} x {virtual} stages")


def layout_label(cfg: Config, with_dp: bool = True) -> str:
    """'dp=2 tp=1 pp=1 zero3+offload recompute full': THE layout label of a run, a checkpoint, a sweep
    member and a report row (one function, so stored results and console lines always agree). A sweep
    row leaves dp out (`with_dp=False`): there dp follows the process count, which is a column."""
    p = cfg.parallel
    parts = [f"dp={p.dp}"] if with_dp else []
    parts += [f"cp={p.cp}"] if p.cp > 1 else []
    parts += [f"ep={p.ep}"] if p.ep > 1 else []
    parts += [f"tp={p.tp}", f"pp={p.pp}", f"zero{p.zero_stage}"]
    if dp_shard_size(p) < p.dp:  # hybrid sharding: replicas of dp_shard-way shards
        parts.append(f"dp_shard={p.dp_shard}")
    if p.offload_optimizer or p.offload_param:
        parts[-1] += "+offload"
    if p.sequence_parallel:
        parts.append("sequence-parallel")
    if p.pp > 1:
        parts.append(
            f"schedule {p.pipeline_schedule}"
            + (f" x{p.virtual_pipeline_stages}" if p.virtual_pipeline_stages > 1 else "")
        )
    if p.activation_checkpointing != "none":
        parts.append(f"recompute {p.activation_checkpointing}")
    return " ".join(parts)


def pipeline_bubble_fraction(pp: int, virtual: int, microbatches: int) -> float | None:
    """Idle share of a pipeline step, in theory: (pp - 1) / (v * m + pp - 1) for m micro-batches and
    v stages per rank (GPipe and 1F1B: v = 1; Narayanan et al. 2021); None without pipelining. The
    zero-bubble schedules fill most of it, so this is their upper bound."""
    if pp == 1:
        return None
    return (pp - 1) / (virtual * microbatches + pp - 1)


def check_layout(cfg: Config, world_size: int) -> None:
    """Every rule the layout imposes on the model and batch sizes; raises ConfigError naming the keys.

    Expects cfg.parallel.dp resolved and the model's derived sizes (ffn_hidden_size) filled.
    """
    p, t = cfg.parallel, cfg.train
    check_world_size(cfg, world_size)
    if p.virtual_pipeline_stages < 1:
        raise ConfigError(f"parallel.virtual_pipeline_stages must be >= 1, got {p.virtual_pipeline_stages}")
    _check_zero(cfg)
    _check_tensor_parallel(cfg)
    check_context_parallel(cfg)
    check_expert_parallel(cfg)
    _check_recompute(cfg)
    check_fp8(cfg)
    if p.pp > 1:
        _check_pipeline(cfg, t.gradient_accumulation_steps or 1)
    elif p.virtual_pipeline_stages != 1 or p.pipeline_layers is not None:
        raise ConfigError(
            "parallel.virtual_pipeline_stages / pipeline_layers need pipeline parallelism (parallel.pp > 1)"
        )
    if p.timeout_minutes <= 0:
        raise ConfigError(f"parallel.timeout_minutes must be > 0, got {p.timeout_minutes}")


def infer_dp(cfg: Config, world_size: int) -> int:
    """parallel.dp, inferred from the world size when it is -1."""
    p = cfg.parallel
    for key, value in [("parallel.cp", p.cp), ("parallel.tp", p.tp), ("parallel.pp", p.pp)]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if world_size < 1:
        raise ConfigError(f"the world size must be >= 1 process, got {world_size}")
    if p.dp != -1:
        return p.dp
    model_parallel = p.cp * p.tp * p.pp
    if world_size % model_parallel:
        raise ConfigError(
            f"the world size ({world_size} processes) is not divisible by parallel.cp ({p.cp}) x "
            f"parallel.tp ({p.tp}) x parallel.pp ({p.pp}) = {model_parallel}"
        )
    return world_size // model_parallel


def dp_shard_size(p: ParallelConfig) -> int:
    """The ranks a ZeRO-2/3 parameter is sharded over: parallel.dp_shard, -1 meaning all of dp."""
    return p.dp if p.dp_shard == -1 else p.dp_shard


def check_world_size(cfg: Config, world_size: int) -> None:
    """dp x cp x tp x pp must be the number of processes."""
    p = cfg.parallel
    pairs = [("parallel.cp", p.cp), ("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.dp", p.dp)]
    for key, value in pairs:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1 (or dp = -1 to infer it), got {value}")
    ranks = p.dp * p.cp * p.tp * p.pp
    if ranks != world_size:
        raise ConfigError(
            f"parallel.dp ({p.dp}) x cp ({p.cp}) x tp ({p.tp}) x pp ({p.pp}) = {ranks} must equal the "
            f"world size ({world_size} processes)"
        )


def _check_zero(cfg: Config) -> None:
    p = cfg.parallel
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {p.zero_stage}")
    if p.offload_param and p.zero_stage != 3:
        raise ConfigError(
            f"parallel.offload_param needs parallel.zero_stage = 3 (got {p.zero_stage}): only ZeRO-3 "
            "shards parameters, as in DeepSpeed"
        )
    if p.offload_optimizer and p.zero_stage < 2:
        raise ConfigError(
            f"parallel.offload_optimizer needs parallel.zero_stage 2 or 3 (got {p.zero_stage}): the "
            "offload is FSDP2's CPUOffloadPolicy, which moves sharded parameters, gradients and optimizer "
            "state together; ZeRO-0/1 keep them unsharded on the device"
        )
    if p.reduce_each_micro_batch and p.zero_stage < 2:
        raise ConfigError(
            f"parallel.reduce_each_micro_batch needs parallel.zero_stage 2 or 3 (got {p.zero_stage}): "
            "ZeRO-0/1 keep whole gradients on every rank, so there is no sharded gradient to reduce into"
        )
    if p.reduce_each_micro_batch and p.pp > 1:
        raise ConfigError(
            "parallel.reduce_each_micro_batch with pipeline parallel (parallel.pp > 1): "
            "torch.distributed.pipelining accumulates a stage's gradients unsharded until its last "
            "micro-batch; set parallel.reduce_each_micro_batch = false"
        )
    if p.dp_shard != -1 and (p.dp_shard < 1 or p.dp % p.dp_shard):
        raise ConfigError(
            f"parallel.dp_shard = {p.dp_shard} must divide parallel.dp ({p.dp}) (or be -1: shard over "
            f"all of dp); valid: {', '.join(str(d) for d in range(1, p.dp + 1) if p.dp % d == 0)}"
        )
    if dp_shard_size(p) < p.dp and p.zero_stage < 2:
        raise ConfigError(
            f"parallel.dp_shard = {p.dp_shard} < dp = {p.dp} (hybrid sharding) needs parallel.zero_stage "
            f"2 or 3 (got {p.zero_stage}): it is FSDP2 on a replicate x shard mesh; ZeRO-0/1 shard no "
            "parameters or gradients"
        )
    if p.zero_stage == 1 and p.dp > 1 and p.tp > 1:
        raise ConfigError(
            f"parallel.zero_stage = 1 with dp = {p.dp} and tp = {p.tp}: ZeroRedundancyOptimizer cannot "
            "shard tensor-parallel (DTensor) parameters; use parallel.zero_stage = 2 (same optimizer-state "
            "sharding as ZeRO-1, gradients sharded too), 3, or 0"
        )
    if p.zero_stage == 1 and p.pp > 1 and p.dp > 1:
        raise ConfigError(
            "parallel.zero_stage = 1 with pipeline parallel: ZeroRedundancyOptimizer over pipeline stage "
            "modules is not supported; use parallel.zero_stage = 2 or 3 (FSDP2 composes with pipelining)"
        )


def cp_sequence_multiple(p: ParallelConfig) -> int:
    """What model.seq_length must be a multiple of under context parallelism: 2 cp load-balanced
    chunks, each split again over tp under sequence parallelism (1 without cp)."""
    if p.cp == 1:
        return 1
    return 2 * p.cp * (p.tp if p.sequence_parallel else 1)


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp: the sequence splits into 2 cp equal chunks (tp more under sequence parallelism),
    and only the layouts whose equivalence with the single process is tested compose with it (all
    but compile)."""
    p, m = cfg.parallel, cfg.model
    if p.cp < 1:
        raise ConfigError(f"parallel.cp must be >= 1, got {p.cp}")
    if p.cp == 1:
        return
    multiple = cp_sequence_multiple(p)
    if m.seq_length % multiple:
        under = f" x parallel.tp ({p.tp}) under sequence parallelism" if p.sequence_parallel else ""
        per_cp = multiple // p.cp
        fits = [str(d) for d in range(2, m.seq_length // per_cp + 1) if m.seq_length % (per_cp * d) == 0]
        valid = ", ".join(fits[:12]) + (", ..." if len(fits) > 12 else "")
        raise ConfigError(
            f"parallel.cp = {p.cp}: model.seq_length ({m.seq_length}) must be divisible by 2 x cp{under} "
            f"= {multiple} (each cp rank keeps two load-balanced chunks); cp values valid for this "
            f"sequence: {valid or 'none above 1'}"
        )
    if p.compile:
        raise ConfigError(
            f"parallel.cp = {p.cp} with parallel.compile: not built yet (context parallelism composes with "
            "data parallelism (ZeRO 0-3, hybrid sharding), tensor parallelism with or without sequence "
            "parallelism and pipeline parallelism); set parallel.compile = false or parallel.cp = 1"
        )


def check_expert_parallel(cfg: Config) -> None:
    """parallel.ep: the routed experts split evenly over ep ranks taken from dp x cp."""
    p, m = cfg.parallel, cfg.model
    if p.ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1, got {p.ep}")
    if m.num_experts and m.moe_router_load_balancing == "sinkhorn" and p.cp > 1:
        raise ConfigError(
            f"model.moe_router_load_balancing = 'sinkhorn' with parallel.cp = {p.cp}: Sinkhorn balances "
            "the experts over the tokens a rank routes, and a cp rank holds only chunks of each sequence, "
            "so the routing would change with cp; use parallel.cp = 1 or moe_router_load_balancing "
            "'aux_loss' or 'none'"
        )
    if p.ep == 1:
        return
    if m.num_experts == 0:
        raise ConfigError(
            f"parallel.ep = {p.ep} splits the experts of a mixture-of-experts model; model.num_experts is 0 "
            "(a dense model): set model.num_experts or parallel.ep = 1"
        )
    if m.num_experts % p.ep:
        valid = [str(d) for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide model.num_experts ({m.num_experts}): every expert-parallel "
            f"rank holds the same number of experts; valid: {', '.join(valid)}"
        )
    if (p.dp * p.cp) % p.ep:
        ranks = p.dp * p.cp
        valid = [str(d) for d in range(1, ranks + 1) if ranks % d == 0 and m.num_experts % d == 0]
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide parallel.dp x cp ({p.dp} x {p.cp} = {p.dp * p.cp}): the "
            f"expert-parallel ranks are carved out of the data- and context-parallel ones; valid: "
            f"{', '.join(valid)}"
        )
    _check_expert_parallel_composes(cfg)


def _check_expert_parallel_composes(cfg: Config) -> None:
    """What parallel.ep > 1 is built with (parallel/expert.py, parallel/apply.py): ZeRO-0 (FSDP2's
    replicate), ZeRO-2/3 (FSDP2, experts sharded over the edp ranks; under hybrid sharding over all of
    them), tensor (experts' weights over (ep, tp)), context and pipeline parallelism. Refused: ZeRO-1."""
    p = cfg.parallel
    if p.zero_stage == 1:
        raise ConfigError(
            f"parallel.ep = {p.ep} with parallel.zero_stage = 1: the expert weights are sharded tensors "
            "(DTensor) that torch's ZeroRedundancyOptimizer and DistributedDataParallel cannot hold; "
            "use parallel.zero_stage = 0, 2 or 3"
        )


def _check_recompute(cfg: Config) -> None:
    """Where checkpointed inputs are kept only means something for full recompute."""
    p = cfg.parallel
    for key in ("distribute_saved_activations", "cpu_checkpointing"):
        if getattr(p, key) and p.activation_checkpointing != "full":
            raise ConfigError(
                f"parallel.{key} places the inputs that full recompute keeps; set "
                f"parallel.activation_checkpointing = full (it is {p.activation_checkpointing!r})"
            )
    if p.distribute_saved_activations and p.sequence_parallel:
        raise ConfigError(
            "parallel.distribute_saved_activations with parallel.sequence_parallel: sequence "
            "parallelism already keeps 1/tp of every checkpointed layer input on each rank; set one "
            "of them (as Megatron requires)"
        )


# torch._scaled_mm's rule (torchao's float8 linears inherit it): both dimensions of each operand a
# multiple of 16, in the forward GEMM and in the two backward ones
FP8_MULTIPLE = 16


def check_fp8(cfg: Config) -> None:
    """train.fp8 (torchao float8 training of the blocks' linears): the non-GEMM parts compute in bf16
    (as torchtitan runs it), and every float8 GEMM's dimensions, on each tensor-parallel rank, are
    multiples of 16: the in/out features of qkv, proj, mlp.up and mlp.down, and the tokens of a
    micro-batch (the inner dimension of the weight-gradient GEMM)."""
    t, m, p = cfg.train, cfg.model, cfg.parallel
    if t.fp8 == "none":
        return
    if t.precision != "bf16":
        raise ConfigError(
            f"train.fp8 = {t.fp8} needs train.precision = bf16 (the embeddings, norms, attention and the "
            f"output layer compute in bf16 around the float8 GEMMs); it is {t.precision!r}"
        )
    groups = m.num_query_groups or m.num_attention_heads
    qkv = (m.num_attention_heads + 2 * groups) * head_dim(m)
    qkv_tp = qkv if groups % p.tp else qkv // p.tp  # replicated when tp > groups
    up = (2 if m.activation in ("geglu", "swiglu") else 1) * (m.ffn_hidden_size or 4 * m.hidden_size)
    sizes = [
        ("model.hidden_size", m.hidden_size),
        (
            f"the qkv projection's output features per tp rank ((heads + 2 groups) x head_dim / {p.tp})",
            qkv_tp,
        ),
        (
            f"the attention output's input features per tp rank (heads x head_dim / {p.tp})",
            m.num_attention_heads * head_dim(m) // p.tp,
        ),
        (f"mlp.up's output features per tp rank ({up} / {p.tp}, from model.ffn_hidden_size)", up // p.tp),
        (f"model.ffn_hidden_size / parallel.tp ({p.tp})", (m.ffn_hidden_size or 4 * m.hidden_size) // p.tp),
    ]
    if t.micro_batch_size is not None:
        sizes.append(
            (
                "train.micro_batch_size x model.seq_length (tokens per micro-batch)",
                t.micro_batch_size * m.seq_length,
            )
        )
    for name, size in sizes:
        if size % FP8_MULTIPLE:
            raise ConfigError(
                f"train.fp8 = {t.fp8}: {name} = {size} is not a multiple of {FP8_MULTIPLE}, which every "
                "float8 GEMM dimension must be (torch._scaled_mm); change the model or layout, or set "
                "train.fp8 = none"
            )


def _check_tensor_parallel(cfg: Config) -> None:
    """Whole heads, whole MLP columns and whole vocabulary rows on every tensor-parallel rank."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        if p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
        return
    if m.num_attention_heads % p.tp:
        raise ConfigError(
            f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by parallel.tp ({p.tp})"
        )
    if m.qk_norm == "full":
        raise ConfigError(
            f"model.qk_norm = full normalises over all heads' features, which parallel.tp = {p.tp} splits "
            "across ranks (a cross-rank reduction not built here): valid with tp > 1 are model.qk_norm = "
            "none or head, or set parallel.tp = 1"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if groups % p.tp and p.tp % groups:
        raise ConfigError(
            f"model.num_query_groups ({groups}) and parallel.tp ({p.tp}): tensor parallelism gives each "
            "rank whole key/value groups with their query heads (tp divides the groups, as in Megatron), "
            f"or a share of one replicated group (tp a multiple of the groups); "
            f"model.num_attention_heads is {m.num_attention_heads}"
        )
    # a model whose every layer is a mixture of experts (Mixtral, OLMoE) has no dense MLP to split
    if m.ffn_hidden_size is not None and m.ffn_hidden_size % p.tp and _has_dense_mlp(m):
        raise ConfigError(
            f"model.ffn_hidden_size ({m.ffn_hidden_size}) is not divisible by parallel.tp ({p.tp})"
        )
    _check_moe_tensor_parallel(m, p.tp)
    check_vocabulary(m, p.tp)
    if p.sequence_parallel and m.seq_length % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel: model.seq_length ({m.seq_length}) is not divisible by "
            f"parallel.tp ({p.tp})"
        )


def _has_dense_mlp(m: ModelConfig) -> bool:
    """Whether some layer has the dense MLP (config.model_shapes.is_moe_layer's pattern, which imports
    this module)."""
    return m.num_experts == 0 or any(
        i < m.moe_first_k_dense or i % m.moe_layer_freq for i in range(m.num_layers)
    )


def _check_moe_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """Tensor parallelism splits every routed expert's inner size, and the shared expert's, like a
    dense MLP's (parallel/expert.py, parallel/tensor.py)."""
    if not m.num_experts:
        return
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_size"):
        size = getattr(m, key)
        if size and size % tp:
            valid = [str(d) for d in range(1, size + 1) if size % d == 0 and m.num_attention_heads % d == 0]
            raise ConfigError(
                f"model.{key} ({size}) is not divisible by parallel.tp ({tp}): tensor parallelism splits "
                f"every expert's inner size over the tp ranks; valid tp: {', '.join(valid)}"
            )


def check_vocabulary(m: ModelConfig, tp: int) -> None:
    """Whole vocabulary rows on every tensor-parallel rank. The vocabulary is unknown until a tokenizer
    file is read: `validate.with_vocabulary` checks this rule again then."""
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by) if m.vocab_size else 0
    if vocab % tp:
        divisible = m.make_vocab_size_divisible_by
        raise ConfigError(
            f"the padded vocabulary ({vocab} = model.vocab_size {m.vocab_size} rounded up to a multiple "
            f"of model.make_vocab_size_divisible_by {divisible}) is not divisible "
            f"by parallel.tp ({tp}); set make_vocab_size_divisible_by to a multiple of "
            f"{divisible * tp // _gcd(divisible, tp)}"
        )


def _check_pipeline(cfg: Config, accumulation: int) -> None:
    p, m = cfg.parallel, cfg.model
    stages = p.pp * p.virtual_pipeline_stages
    stage_layer_counts(m.num_layers, stages, p.pipeline_layers)
    interleaved = p.pipeline_schedule in INTERLEAVED_SCHEDULES
    if interleaved and p.virtual_pipeline_stages < 2:
        raise ConfigError(
            f"parallel.pipeline_schedule = {p.pipeline_schedule} runs several stages per rank; "
            "set parallel.virtual_pipeline_stages >= 2"
        )
    if p.pipeline_schedule in V_SHAPED_SCHEDULES and p.virtual_pipeline_stages != 2:
        raise ConfigError("parallel.pipeline_schedule = zbv needs parallel.virtual_pipeline_stages = 2")
    if p.pipeline_schedule in SINGLE_STAGE_SCHEDULES and p.virtual_pipeline_stages != 1:
        raise ConfigError(
            f"parallel.virtual_pipeline_stages = {p.virtual_pipeline_stages} needs an interleaved "
            f"schedule (interleaved-1f1b, looped-bfs, zero-bubble, zbv), not {p.pipeline_schedule}"
        )
    if p.pipeline_schedule in ("1f1b", "zbv") and accumulation < stages:
        raise ConfigError(
            f"parallel.pipeline_schedule = {p.pipeline_schedule} needs at least as many micro-batches "
            f"per step as pipeline stages ({stages}); train.gradient_accumulation_steps is {accumulation}"
        )
    if interleaved and accumulation % p.pp:
        raise ConfigError(
            f"parallel.pipeline_schedule = {p.pipeline_schedule}: the micro-batches per step "
            f"(train.gradient_accumulation_steps = {accumulation}) must be a multiple of "
            f"parallel.pp ({p.pp})"
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
