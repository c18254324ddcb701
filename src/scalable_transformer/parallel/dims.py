"""ParallelDims: the one topology object (data x tensor x pipeline sizes, and the DeviceMesh).

Rank order follows Megatron: tensor-parallel ranks are adjacent (fastest-varying), then data
parallel, then pipeline. The mesh is always 3-D, ("pp", "dp", "tp"), with size-1 dimensions kept, so
`mesh["dp"]` exists in every layout.

`check_layout` runs inside `config.validate.resolve`, before any process group exists: every
divisibility rule a layout needs is checked there and reported with the keys involved.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from ..errors import ConfigError
from ..models.layers import padded_vocab_size

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    virtual_stages: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @classmethod
    def from_config(cls, cfg: Config) -> ParallelDims:
        """For a resolved config (dp already inferred)."""
        p = cfg.parallel
        if p.dp < 1:
            raise ConfigError(f"parallel.dp = {p.dp}: resolve the config for a world size first")
        return cls(dp=p.dp, tp=p.tp, pp=p.pp, virtual_stages=p.virtual_pipeline_stages)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(pp, dp, tp) coordinates of a global rank, without a mesh."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}

    def build_mesh(self, device_type: str):
        """The DeviceMesh over the default process group (which must already be initialized)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.virtual_stages > 1:
            parts.append(f"virtual stages={self.virtual_stages}")
        return " x ".join(parts[:3]) + (f" ({parts[3]})" if len(parts) > 3 else "")


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


def check_layout(cfg: Config, world_size: int) -> None:
    """Every rule the layout imposes on the model and batch sizes; raises ConfigError naming the keys.

    Expects cfg.parallel.dp resolved and the model's derived sizes (ffn_hidden_size) filled.
    """
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for key, value in [("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.dp", p.dp)]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1 (or dp = -1 to infer it), got {value}")
    if p.dp * p.tp * p.pp != world_size:
        raise ConfigError(
            f"parallel.dp ({p.dp}) x tp ({p.tp}) x pp ({p.pp}) = {p.dp * p.tp * p.pp} must equal the "
            f"world size ({world_size} processes)"
        )
    if p.virtual_pipeline_stages < 1:
        raise ConfigError(f"parallel.virtual_pipeline_stages must be >= 1, got {p.virtual_pipeline_stages}")

    # ZeRO and offload
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

    # tensor parallel: whole heads, whole MLP columns and whole vocabulary rows on every rank
    if p.tp > 1:
        assert m.ffn_hidden_size is not None
        if m.num_attention_heads % p.tp:
            raise ConfigError(
                f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by "
                f"parallel.tp ({p.tp})"
            )
        if m.ffn_hidden_size % p.tp:
            raise ConfigError(
                f"model.ffn_hidden_size ({m.ffn_hidden_size}) is not divisible by parallel.tp ({p.tp})"
            )
        # the vocabulary is unknown until a tokenizer file is read; resolve runs again after that
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by) if m.vocab_size else 0
        if vocab % p.tp:
            raise ConfigError(
                f"the padded vocabulary ({vocab} = model.vocab_size {m.vocab_size} rounded up to a multiple "
                f"of model.make_vocab_size_divisible_by {m.make_vocab_size_divisible_by}) is not divisible "
                f"by parallel.tp ({p.tp}); set make_vocab_size_divisible_by to a multiple of "
                f"{m.make_vocab_size_divisible_by * p.tp // _gcd(m.make_vocab_size_divisible_by, p.tp)}"
            )
        if p.sequence_parallel and m.seq_length % p.tp:
            raise ConfigError(
                f"parallel.sequence_parallel: model.seq_length ({m.seq_length}) is not divisible by "
                f"parallel.tp ({p.tp})"
            )
    elif p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")

    # pipeline parallel
    if p.pp > 1:
        stage_layer_counts(m.num_layers, p.pp * p.virtual_pipeline_stages, p.pipeline_layers)
        accumulation = t.gradient_accumulation_steps or 1
        interleaved = p.pipeline_schedule in ("interleaved-1f1b", "looped-bfs", "zero-bubble")
        if interleaved and p.virtual_pipeline_stages < 2:
            raise ConfigError(
                f"parallel.pipeline_schedule = {p.pipeline_schedule} runs several stages per rank; "
                "set parallel.virtual_pipeline_stages >= 2"
            )
        if p.pipeline_schedule == "zbv" and p.virtual_pipeline_stages != 2:
            raise ConfigError("parallel.pipeline_schedule = zbv needs parallel.virtual_pipeline_stages = 2")
        if not interleaved and p.pipeline_schedule != "zbv" and p.virtual_pipeline_stages != 1:
            raise ConfigError(
                f"parallel.virtual_pipeline_stages = {p.virtual_pipeline_stages} needs an interleaved "
                f"schedule (interleaved-1f1b, looped-bfs, zero-bubble, zbv), not {p.pipeline_schedule}"
            )
        stages = p.pp * p.virtual_pipeline_stages
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
    elif p.virtual_pipeline_stages != 1 or p.pipeline_layers is not None:
        raise ConfigError(
            "parallel.virtual_pipeline_stages / pipeline_layers need pipeline parallelism (parallel.pp > 1)"
        )
    if p.timeout_minutes <= 0:
        raise ConfigError(f"parallel.timeout_minutes must be > 0, got {p.timeout_minutes}")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
