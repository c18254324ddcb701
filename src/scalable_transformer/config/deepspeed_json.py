"""DeepSpeed's JSON config dialect, read as DeepSpeed reads it: every key of DeepSpeed's documented
config (`docs/_pages/config-json.md` of microsoft/DeepSpeed at 38327e07f6cd, 2025-02-21, plus the keys
its config classes accept beside the page: `zero_optimization`'s, `bf16`'s) is carried to a key of
ours, ignored with its reason, or refused with its reason. A key in none is an error naming the file,
the key and the nearest valid key: a misspelt key must not pass as an ignored one.

ONE table, `DEEPSPEED_KEYS`, keyed by the dotted path of a key as DeepSpeed nests it
(`zero_optimization.offload_optimizer.device`). A section listed with `whole=True` (`flops_profiler`)
is treated as one: every key under it follows the section's rule, and a refused section is an error
only when it asks for something (`enabled: true`, or any `enabled` under it).

Two things are read over the whole file, as DeepSpeed does:
- The batch triple (`train_batch_size` = `train_micro_batch_size_per_gpu` x
  `gradient_accumulation_steps` x data-parallel size): the keys the file gives are kept and the ones
  it leaves out are derived once dp is known (`config.validate.resolve`), whatever a base preset said.
- A `scheduler` replaces the whole schedule: its parameters, with DeepSpeed's defaults for those it
  leaves out, set every schedule key, so no warmup fraction or decay of a base preset leaks into it.
  WarmupLR and WarmupDecayLR write their `warmup_max_lr` into the optimizer, so the optimizer's own
  `lr` is then ignored, as DeepSpeed ignores it.

`translate` returns the assignments as (key, value) pairs and the account of every leaf key of the
file: carried (to which keys) or ignored (why). The loader (`load.py`) and `stx config import`
(`foreign_configs.py`) both go through it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

from ..errors import ConfigError

SOURCE_DOC = "microsoft/DeepSpeed docs/_pages/config-json.md at 38327e07f6cd (2025-02-21)"


@dataclasses.dataclass(frozen=True)
class Rule:
    """carried (detail: the keys it sets), ignored or refused (detail: why). `whole`: a section whose
    keys all follow this rule. `loud`: an ignored key warns even when false (today's DeepSpeed fp16
    and ZeRO knobs, which were always listed)."""

    kind: str
    detail: str
    whole: bool = False
    loud: bool = False


def _carried(detail: str) -> Rule:
    return Rule("carried", detail)


def _ignored(why: str, whole: bool = False, loud: bool = False) -> Rule:
    return Rule("ignored", why, whole, loud)


def _refused(why: str, whole: bool = False) -> Rule:
    return Rule("refused", why, whole)


# Reasons shared with the loader's IGNORED_KEYS (GPT-NeoX forwards these DeepSpeed keys as they are).
ALLREDUCE_DTYPE = "chooses the gradient all-reduce dtype (not configurable here: FSDP2/DDP's own)"
PREDIVIDE = "chooses when gradients are divided by dp (the mean is the same)"
_ZERO_TUNING = "is a DeepSpeed tuning knob with no equivalent here"
_FP16_KNOB = "is a DeepSpeed fp16 knob with no equivalent here"
_ACT_BUFFER = "is a DeepSpeed buffer/profiling knob with no equivalent here"
_NVME = "tunes NVMe offload (not supported: offload goes to CPU memory, FSDP2's CPU offload)"
_GATHER_16BIT = "consolidates 16-bit weights at save (stx export writes whole Hugging Face checkpoints)"
_ZEROPP_WEIGHTS = "quantizes ZeRO++ weight communication (communication here is in full precision)"
_PIN = "pins the offloaded tensors' host memory (FSDP2's CPU offload pins its own)"
_MONITOR = (
    "is a DeepSpeed monitoring backend (stx logs to its run directory; TensorBoard: logging.tensorboard_dir)"
)
_AUTO = "'auto' is filled in by the HF Trainer"
_SCHED_PEAK = (
    "is overwritten by the scheduler's warmup_max_lr (DeepSpeed's WarmupLR writes its lr into the optimizer)"
)

_OFFLOAD_COMMON = {
    "device": _carried("parallel.offload_* (cpu: on, none: off; nvme refused)"),
    "nvme_path": _ignored(_NVME, loud=True),
    "pin_memory": _ignored(_PIN, loud=True),
    "buffer_count": _ignored(_NVME, loud=True),
    "buffer_size": _ignored(_NVME, loud=True),
}
_ZERO_TUNING_KEYS = (
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "contiguous_gradients",
    "load_from_fp32_weights",
    "grad_hooks",
    "round_robin_gradients",
    "use_multi_rank_bucket_allreduce",
    "elastic_checkpoint",
    "sub_group_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "ignore_unused_parameters",
    "legacy_stage1",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
)
_OPTIMIZER_PARAMS = {
    "lr": _carried("optim.lr"),
    "betas": _carried("optim.adam_beta1, optim.adam_beta2"),
    "eps": _carried("optim.adam_eps"),
    "weight_decay": _carried("optim.weight_decay"),
    "adam_w_mode": _carried("optim.adam_w_mode"),
    "momentum": _carried("optim.sgd_momentum"),
    "max_grad_norm": _carried(
        "optim.clip_grad (apex's FusedAdam took it as the clip; DeepSpeed's engine since 2020 refuses it "
        "and points at gradient_clipping, which must then agree)"
    ),
    "torch_adam": _ignored("chooses torch's Adam kernel instead of DeepSpeed's fused one (the same update)"),
    "bias_correction": _ignored("true is Adam's bias correction, always applied here (false is refused)"),
    "amsgrad": _ignored("false is plain Adam, as here (true is refused)"),
    "fused": _ignored("chooses torch's optimizer kernel (the same update)"),
    "foreach": _ignored("chooses torch's optimizer kernel (the same update)"),
    "capturable": _ignored("chooses torch's optimizer kernel (the same update)"),
    "nesterov": _ignored("false is plain SGD momentum, as here (true is refused)"),
    "dampening": _ignored("0 is plain SGD momentum, as here (other values are refused)"),
}
_SCHEDULER_PARAMS = {
    "warmup_min_lr": _carried("optim.warmup_min_lr, optim.min_lr"),
    "warmup_max_lr": _carried("optim.lr"),
    "warmup_num_steps": _carried("optim.lr_warmup_iters"),
    "warmup_type": _carried("optim.warmup_type"),
    "total_num_steps": _carried("optim.lr_decay_iters"),
    "last_batch_iteration": _ignored("a resumed run takes its iteration from the checkpoint"),
    # WarmupCosineLR, OneCycle and LRRangeTest: their type is refused, so these never carry
    **dict.fromkeys(
        (
            "warmup_min_ratio",
            "cos_min_ratio",
            "cycle_min_lr",
            "cycle_max_lr",
            "decay_lr_rate",
            "cycle_first_step_size",
            "cycle_second_step_size",
            "cycle_first_stair_count",
            "cycle_second_stair_count",
            "decay_step_size",
            "cycle_momentum",
            "cycle_min_mom",
            "cycle_max_mom",
            "decay_mom_rate",
            "lr_range_test_min_lr",
            "lr_range_test_step_size",
            "lr_range_test_step_rate",
            "lr_range_test_staircase",
        ),
        _ignored("belongs to a scheduler type that is refused"),
    ),
}

DEEPSPEED_KEYS: dict[str, Rule] = {
    # batch
    "train_batch_size": _carried("train.global_batch_size (the keys of the triple left out are derived)"),
    "train_micro_batch_size_per_gpu": _carried(
        "train.micro_batch_size (left out: train.derive_micro_batch_size, as DeepSpeed derives it)"
    ),
    "gradient_accumulation_steps": _carried("train.gradient_accumulation_steps"),
    # optimizer and schedule
    "optimizer": _carried("optim.optimizer and optim.* (its params)"),
    "optimizer.type": _carried(
        "optim.optimizer (Adam, AdamW, SGD; 1-bit, 0/1, Lamb, Lion and others refused)"
    ),
    "optimizer.params": _carried("optim.*"),
    **{f"optimizer.params.{k}": rule for k, rule in _OPTIMIZER_PARAMS.items()},
    "scheduler": _carried("optim.scheduler and every schedule key (the whole schedule is the file's)"),
    "scheduler.type": _carried(
        "optim.scheduler (WarmupLR: warmup_lr, WarmupDecayLR: warmup_decay_lr; WarmupCosineLR, OneCycle, "
        "LRRangeTest refused)"
    ),
    "scheduler.params": _carried("optim.*"),
    **{f"scheduler.params.{k}": rule for k, rule in _SCHEDULER_PARAMS.items()},
    "gradient_clipping": _carried("optim.clip_grad"),
    # communication
    "communication_data_type": _ignored(ALLREDUCE_DTYPE),
    "prescale_gradients": _ignored(PREDIVIDE),
    "gradient_predivide_factor": _ignored(PREDIVIDE),
    "sparse_gradients": _refused("sparse embedding gradients are not supported"),
    # precision
    "fp16": _carried("train.precision and the fp16 loss-scale keys"),
    "fp16.enabled": _carried("train.precision (true: fp16)"),
    "fp16.auto_cast": _ignored(_FP16_KNOB, loud=True),
    "fp16.loss_scale": _carried("train.loss_scale (0: dynamic)"),
    "fp16.initial_scale_power": _carried("train.initial_scale_power"),
    "fp16.loss_scale_window": _carried("train.loss_scale_window"),
    "fp16.hysteresis": _carried("train.hysteresis"),
    "fp16.consecutive_hysteresis": _ignored(_FP16_KNOB, loud=True),
    "fp16.min_loss_scale": _carried("train.min_loss_scale"),
    "fp16.immediate_grad_update": _ignored(_FP16_KNOB, loud=True),
    "fp16.fp16_master_weights_and_grads": _ignored(_FP16_KNOB, loud=True),
    "bf16": _carried("train.precision"),
    "bf16.enabled": _carried("train.precision (true: bf16)"),
    "bf16.immediate_grad_update": _ignored(_FP16_KNOB, loud=True),
    "bf16.check_grad_overflow": _ignored(_FP16_KNOB, loud=True),
    "amp": _refused(
        "Apex AMP is not supported; use train.precision (or a DeepSpeed fp16/bf16 block)", whole=True
    ),
    "data_types": _ignored("holds grad_accum_dtype"),
    "data_types.grad_accum_dtype": _ignored(
        "chooses the gradient-accumulation dtype (not configurable here: FSDP2/DDP's own)"
    ),
    # ZeRO
    "zero_optimization": _carried("parallel.zero_stage, parallel.offload_*"),
    "zero_optimization.stage": _carried(
        "parallel.zero_stage (2 and 3 also parallel.reduce_each_micro_batch)"
    ),
    **{f"zero_optimization.{k}": _ignored(_ZERO_TUNING, loud=True) for k in _ZERO_TUNING_KEYS},
    "zero_optimization.offload_param": _carried("parallel.offload_param"),
    **{f"zero_optimization.offload_param.{k}": rule for k, rule in _OFFLOAD_COMMON.items()},
    "zero_optimization.offload_param.max_in_cpu": _ignored(_NVME, loud=True),
    "zero_optimization.offload_optimizer": _carried("parallel.offload_optimizer"),
    **{f"zero_optimization.offload_optimizer.{k}": rule for k, rule in _OFFLOAD_COMMON.items()},
    "zero_optimization.offload_optimizer.ratio": _ignored(
        "offloads part of the optimizer step (here the whole step runs on the CPU when offloaded)", loud=True
    ),
    "zero_optimization.offload_optimizer.fast_init": _ignored(_NVME, loud=True),
    "zero_optimization.offload_optimizer.pipeline_read": _ignored(_NVME, loud=True),
    "zero_optimization.offload_optimizer.pipeline_write": _ignored(_NVME, loud=True),
    "zero_optimization.offload_optimizer.pipeline": _ignored(_NVME, loud=True),
    "zero_optimization.cpu_offload": _carried("parallel.offload_optimizer (DeepSpeed's older name)"),
    "zero_optimization.cpu_offload_param": _carried("parallel.offload_param (DeepSpeed's older name)"),
    "zero_optimization.cpu_offload_use_pin_memory": _ignored(_PIN, loud=True),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _ignored(_GATHER_16BIT, loud=True),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _ignored(_GATHER_16BIT, loud=True),
    "zero_optimization.zero_hpz_partition_size": _ignored(
        "keeps a secondary weight copy per node (ZeRO++ hpZ: less communication, the same model)", loud=True
    ),
    "zero_optimization.zero_quantized_weights": _ignored(_ZEROPP_WEIGHTS, loud=True),
    "zero_optimization.zero_quantized_nontrainable_weights": _ignored(_ZEROPP_WEIGHTS, loud=True),
    "zero_optimization.zero_quantized_gradients": _ignored(
        "quantizes ZeRO++ gradient communication (communication here is in full precision)", loud=True
    ),
    "zero_optimization.zeropp_loco_param": _ignored(
        "tunes ZeRO++ quantized gradients (communication here is in full precision)", whole=True, loud=True
    ),
    "zero_optimization.mics_shard_size": _carried(
        "parallel.dp_shard (MiCS: ZeRO-3 sharded within groups of this many ranks, replicated across "
        "them, as HSDP; -1: off)"
    ),
    "zero_optimization.mics_hierarchical_params_gather": _ignored(_ZERO_TUNING, loud=True),
    "aio": _ignored(_NVME, whole=True),
    # logging and profiling
    "steps_per_print": _carried("logging.log_interval"),
    "wall_clock_breakdown": _carried("logging.timers_sync (phase timers that wait for the device)"),
    "dump_state": _ignored("is a DeepSpeed debugging aid"),
    "memory_breakdown": _ignored("is a DeepSpeed debugging aid (stx logs memory every log_interval)"),
    "autotuning": _ignored("is DeepSpeed's autotuner (stx plan searches layouts)", whole=True),
    "flops_profiler": _ignored(
        "is DeepSpeed's profiler (stx reports TFLOPs/MFU from the analytic count)", whole=True
    ),
    "comms_logger": _ignored("is a DeepSpeed debugging aid", whole=True),
    "tensorboard": _ignored(_MONITOR, whole=True),
    "wandb": _ignored(_MONITOR, whole=True),
    "comet": _ignored(_MONITOR, whole=True),
    "csv_monitor": _ignored(_MONITOR, whole=True),
    # activation checkpointing
    "activation_checkpointing": _carried("parallel.distribute_saved_activations, parallel.cpu_checkpointing"),
    "activation_checkpointing.partition_activations": _carried("parallel.distribute_saved_activations"),
    "activation_checkpointing.cpu_checkpointing": _carried("parallel.cpu_checkpointing"),
    **{
        f"activation_checkpointing.{k}": _ignored(_ACT_BUFFER)
        for k in (
            "contiguous_memory_optimization",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    },
    # features that change what is trained, or how the batch is chosen: refused when asked for
    "sparse_attention": _refused("sparse attention is not supported; attention is dense", whole=True),
    "data_efficiency": _refused(
        "DeepSpeed's data efficiency (curriculum learning, random-LTD token dropping) is not supported: "
        "every sample is trained at full length",
        whole=True,
    ),
    "curriculum_learning": _refused(
        "curriculum learning is not supported: every sample is trained at full length", whole=True
    ),
    "compression_training": _refused(
        "compression training (quantization, pruning, layer reduction) is not supported", whole=True
    ),
    "elasticity": _refused(
        "elastic training chooses the batch size at run time; give the batch triple instead", whole=True
    ),
    # safety switches and checkpoint writing
    "zero_allow_untested_optimizer": _ignored(
        "is a DeepSpeed safety switch (every optimizer here works with every ZeRO stage)"
    ),
    "zero_force_ds_cpu_optimizer": _ignored("is a DeepSpeed safety switch"),
    "checkpoint": _ignored(
        "tunes how DeepSpeed writes and checks its checkpoints (stx writes its own: checkpoint.*)", whole=True
    ),
}

# Blocks that DeepSpeed also takes as a plain value (an offload block as true/false)
_NOT_ONLY_BLOCKS = ("zero_optimization.offload_param", "zero_optimization.offload_optimizer", "data_types")

# The top-level keys that are sections of ours too: DeepSpeed's `checkpoint` is read as DeepSpeed's
# only in a DeepSpeed file (`stx config import --deepspeed`); in a config of ours it is our section.
SHARED_WITH_OURS = ("checkpoint",)

_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "fusedadam": "adam", "cpu_adam": "adam"}
_SCHEDULERS = {"warmuplr": "warmup_lr", "warmupdecaylr": "warmup_decay_lr"}
_REFUSED_SCHEDULERS = {
    "warmupcosinelr": "WarmupCosineLR (cosine decay to a ratio of the optimizer's lr) has no equivalent "
    "here; use optim.scheduler megatron with lr_decay_style cosine",
    "onecycle": "OneCycle (a cyclic lr and momentum) has no equivalent here",
    "lrrangetest": "LRRangeTest is an lr search, not a pretraining schedule",
}
# DeepSpeed's defaults for the parameters a WarmupLR / WarmupDecayLR block leaves out (lr_schedules.py)
_WARMUP_DEFAULTS = {
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 0.001,
    "warmup_num_steps": 1000,
    "warmup_type": "log",
}
_PLAIN = {"steps_per_print": "logging.log_interval", "wall_clock_breakdown": "logging.timers_sync"}
_BATCH = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
}


def norm(key: Any) -> str:
    return str(key).strip().replace("-", "_")


@functools.cache
def top_level_keys() -> frozenset[str]:
    return frozenset(key.split(".")[0] for key in DEEPSPEED_KEYS)


def top_level_rules(kind: str) -> dict[str, str]:
    """The top-level keys of one kind (ignored, refused) that are one value or a section treated whole,
    with their reasons: the loader's tables, which GPT-NeoX's forwarded DeepSpeed keys share."""
    return {
        key: rule.detail
        for key, rule in DEEPSPEED_KEYS.items()
        if "." not in key
        and rule.kind == kind
        and key not in SHARED_WITH_OURS
        and (rule.whole or not any(k.startswith(key + ".") for k in DEEPSPEED_KEYS))
    }


def asks_for_something(value: Any) -> bool:
    """A switch or section that asks for nothing: false, null, empty, `enabled: false`, or a section whose
    every `enabled` (at any depth) is false."""
    if value is None or value is False:
        return False
    if not isinstance(value, dict):
        return True
    if "enabled" in value:
        return bool(value["enabled"]) and _any_enabled_below(value, default=True)
    return _any_enabled_below(value, default=bool(value))


def _any_enabled_below(value: dict, default: bool) -> bool:
    subsections = [v for v in value.values() if isinstance(v, dict) and _holds_enabled(v)]
    return any(asks_for_something(v) for v in subsections) if subsections else default


def _holds_enabled(value: dict) -> bool:
    return "enabled" in value or any(isinstance(v, dict) and _holds_enabled(v) for v in value.values())


def unknown_key(source: str, shown: str, key: str, candidates: list[str]) -> str:
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return f"{source}: unknown key '{shown}'{hint}"


@dataclasses.dataclass
class Translation:
    """What a DeepSpeed file sets: `assignments` ((key, value) in order; a None value means "derive it"),
    and the account of every leaf key as the file spells it: `carried` (leaf -> the keys it sets) and
    `ignored` (leaf -> (value, why)); `warnings`: the ignored keys that ask for something (or are loud),
    one per section treated whole, as the loader prints them."""

    assignments: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    carried: dict[str, str] = dataclasses.field(default_factory=dict)
    ignored: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    warnings: dict[str, str] = dataclasses.field(default_factory=dict)  # shown key -> why, for the loader
    given: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)  # norm path -> (value, shown)

    def value(self, path: str, default: Any = None) -> Any:
        return self.given[path][0] if path in self.given else default

    def shown(self, path: str) -> str:
        return self.given[path][1] if path in self.given else path

    def ignore(self, path: str, why: str, warn: bool) -> None:
        """A key the walk found carried that the whole file makes ignored (the optimizer's lr under a
        WarmupLR scheduler)."""
        shown = self.shown(path)
        self.carried.pop(shown, None)
        self.ignored[shown] = (self.value(path), why)
        if warn:
            self.warnings[shown] = why


def translate(data: dict[str, Any], source: str) -> Translation:
    """The assignments and the account of a DeepSpeed mapping; ConfigError names `source` and the key for
    an unknown key, a refused feature or a value DeepSpeed itself would not take."""
    t = Translation()
    _walk(data, "", "", source, t)
    _batch(t, source)
    _precision(t, source)
    _optimizer(t, source)
    _scheduler(t, source)
    _clip(t, source)
    _zero(t, source)
    _activation_checkpointing(t)
    for key, path in _PLAIN.items():
        if key in t.given:
            _set(t, path, t.value(key))
    return t


def _walk(mapping: dict[str, Any], shown_prefix: str, prefix: str, source: str, t: Translation) -> None:
    for raw, value in mapping.items():
        path, shown = f"{prefix}{norm(raw)}", f"{shown_prefix}{raw}"
        rule = DEEPSPEED_KEYS.get(path)
        if rule is None:
            level = [k[len(prefix) :] for k in DEEPSPEED_KEYS if k.startswith(prefix)]
            raise ConfigError(unknown_key(source, shown, norm(raw), [k for k in level if "." not in k]))
        t.given[path] = (value, shown)
        has_keys = any(k.startswith(path + ".") for k in DEEPSPEED_KEYS)
        if has_keys and not rule.whole and not isinstance(value, dict) and path not in _NOT_ONLY_BLOCKS:
            raise ConfigError(
                f"{source}: '{shown}' must be a block {{...}} as DeepSpeed nests it, got {value!r}"
            )
        if isinstance(value, dict) and not rule.whole and has_keys:
            _walk(value, shown + ".", path + ".", source, t)
        elif rule.kind == "refused" and asks_for_something(value):
            raise ConfigError(f"{source}: '{shown}' = {value!r}: {rule.detail}")
        elif rule.whole or rule.kind != "carried":
            for leaf, v in _leaves(value, shown):
                t.ignored[leaf] = (v, rule.detail)
            if rule.loud or asks_for_something(value):
                t.warnings[shown] = rule.detail
        elif isinstance(value, str) and value == "auto":
            t.ignored[shown] = (value, _AUTO)
            t.warnings[shown] = _AUTO
            del t.given[path]
        else:
            t.carried[shown] = rule.detail


def _leaves(value: Any, shown: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{shown}.{k}")]
    return [(shown, value)]


def _set(t: Translation, path: str, value: Any) -> None:
    t.assignments.append((path, value))


def _batch(t: Translation, source: str) -> None:
    """DeepSpeed's triple: the keys given are kept, the others derived at resolve whatever a base said
    (None; train.derive_micro_batch_size for the micro batch). Only a file naming train_batch_size or
    train_micro_batch_size_per_gpu speaks DeepSpeed's batch: `gradient_accumulation_steps` alone is
    our own key too, and keeps its own meaning (DeepSpeed would refuse it alone)."""
    given = [k for k in _BATCH if k in t.given]
    if "train_batch_size" not in given and "train_micro_batch_size_per_gpu" not in given:
        for k in given:
            _set(t, _BATCH[k], t.value(k))
        return
    _set(t, "train.global_batch_size", t.value("train_batch_size"))
    _set(t, "train.gradient_accumulation_steps", t.value("gradient_accumulation_steps"))
    micro = t.value("train_micro_batch_size_per_gpu")
    if micro is not None:
        _set(t, "train.micro_batch_size", micro)
    _set(t, "train.derive_micro_batch_size", micro is None)


def _precision(t: Translation, source: str) -> None:
    fp16, bf16 = t.value("fp16.enabled") is True, t.value("bf16.enabled") is True
    if fp16 and bf16:
        raise ConfigError(
            f"{source}: '{t.shown('fp16.enabled')}' and '{t.shown('bf16.enabled')}' are both true; "
            "DeepSpeed takes one"
        )
    if fp16 or bf16:
        _set(t, "train.precision", "fp16" if fp16 else "bf16")
    for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        if f"fp16.{key}" in t.given:
            _set(t, f"train.{key}", t.value(f"fp16.{key}"))
    if "fp16.loss_scale" in t.given:
        scale = t.value("fp16.loss_scale")
        _set(t, "train.loss_scale", None if scale == 0 else scale)  # DeepSpeed: 0 means dynamic


def _optimizer(t: Translation, source: str) -> None:
    if "optimizer" not in t.given:
        return
    kind = str(t.value("optimizer.type", "adam")).lower()
    if kind not in _OPTIMIZERS:
        raise ConfigError(
            f"{source}: '{t.shown('optimizer.type')}' = {t.value('optimizer.type')!r} is not supported; "
            f"valid: {', '.join(sorted(_OPTIMIZERS))}"
        )
    _set(t, "optim.optimizer", _OPTIMIZERS[kind])
    _refuse_params(t, source)
    betas = t.value("optimizer.params.betas")
    if betas is not None:
        if not (isinstance(betas, list | tuple) and len(betas) == 2):
            raise ConfigError(
                f"{source}: '{t.shown('optimizer.params.betas')}' must be a list of two numbers, "
                f"got {betas!r}"
            )
        _set(t, "optim.adam_beta1", betas[0])
        _set(t, "optim.adam_beta2", betas[1])
    for key, path in (
        ("lr", "optim.lr"),
        ("eps", "optim.adam_eps"),
        ("weight_decay", "optim.weight_decay"),
        ("adam_w_mode", "optim.adam_w_mode"),
        ("momentum", "optim.sgd_momentum"),
    ):
        if f"optimizer.params.{key}" in t.given and not (key == "lr" and _scheduler_sets_peak(t)):
            _set(t, path, t.value(f"optimizer.params.{key}"))
    if _scheduler_sets_peak(t) and "optimizer.params.lr" in t.given:
        peak = t.value("scheduler.params.warmup_max_lr", _WARMUP_DEFAULTS["warmup_max_lr"])
        t.ignore("optimizer.params.lr", _SCHED_PEAK, warn=t.value("optimizer.params.lr") != peak)


def _refuse_params(t: Translation, source: str) -> None:
    """Optimizer parameters whose non-default values change the update: refused, naming the key."""
    refused = {
        "bias_correction": (False, "Adam without bias correction is not supported"),
        "amsgrad": (True, "AMSGrad is not supported"),
        "nesterov": (True, "Nesterov momentum is not supported"),
    }
    for key, (bad, why) in refused.items():
        if t.value(f"optimizer.params.{key}") is bad:
            raise ConfigError(f"{source}: '{t.shown(f'optimizer.params.{key}')}' = {bad}: {why}")
    if t.value("optimizer.params.dampening", 0) != 0:
        raise ConfigError(
            f"{source}: '{t.shown('optimizer.params.dampening')}': SGD dampening is not supported"
        )


def _clip(t: Translation, source: str) -> None:
    """gradient_clipping, or the optimizer's max_grad_norm (what apex's optimizers clipped with); when
    both are given they must agree: which one a run used depends on the DeepSpeed version."""
    clip, max_norm = t.value("gradient_clipping"), t.value("optimizer.params.max_grad_norm")
    if clip is not None and max_norm is not None and clip != max_norm:
        raise ConfigError(
            f"{source}: 'gradient_clipping' ({clip}) and '{t.shown('optimizer.params.max_grad_norm')}' "
            f"({max_norm}) disagree: give one clip value (gradient_clipping is DeepSpeed's)"
        )
    value = clip if clip is not None else max_norm
    if value is not None:
        _set(t, "optim.clip_grad", value)


def _scheduler_sets_peak(t: Translation) -> bool:
    return str(t.value("scheduler.type", "")).lower() in _SCHEDULERS


def _scheduler(t: Translation, source: str) -> None:
    """The whole schedule from the file: every schedule key set (DeepSpeed's defaults where the block is
    silent), so nothing of a base preset's schedule leaks into DeepSpeed's."""
    if "scheduler" not in t.given:
        return
    kind = str(t.value("scheduler.type", "")).lower()
    if kind in _REFUSED_SCHEDULERS:
        raise ConfigError(
            f"{source}: '{t.shown('scheduler.type')}' = {t.value('scheduler.type')!r}: "
            f"{_REFUSED_SCHEDULERS[kind]}"
        )
    if kind not in _SCHEDULERS:
        raise ConfigError(
            f"{source}: '{t.shown('scheduler.type')}' = {t.value('scheduler.type')!r} is not a DeepSpeed "
            "scheduler this import reads; valid: WarmupLR, WarmupDecayLR"
        )
    params = {k: t.value(f"scheduler.params.{k}", d) for k, d in _WARMUP_DEFAULTS.items()}
    total = t.value("scheduler.params.total_num_steps")
    if kind == "warmupdecaylr" and total is None:
        raise ConfigError(
            f"{source}: 'scheduler.params.total_num_steps' is required by WarmupDecayLR "
            "(DeepSpeed requires it too)"
        )
    _set(t, "optim.scheduler", _SCHEDULERS[kind])
    _set(t, "optim.lr", params["warmup_max_lr"])
    _set(t, "optim.warmup_min_lr", params["warmup_min_lr"])
    _set(t, "optim.min_lr", params["warmup_min_lr"])
    _set(t, "optim.lr_warmup_iters", params["warmup_num_steps"])
    _set(t, "optim.lr_warmup_fraction", None)
    _set(t, "optim.warmup_type", params["warmup_type"])
    _set(t, "optim.lr_decay_iters", total if kind == "warmupdecaylr" else None)


def _zero(t: Translation, source: str) -> None:
    if "zero_optimization.stage" in t.given:
        stage = t.value("zero_optimization.stage")
        _set(t, "parallel.zero_stage", stage)
        if isinstance(stage, int) and stage >= 2:
            # DeepSpeed partitions the gradients of every micro-batch (its reduce_scatter /
            # contiguous_gradients path), which is what these users expect
            _set(t, "parallel.reduce_each_micro_batch", True)
    for name in ("offload_optimizer", "offload_param"):
        if f"zero_optimization.{name}" in t.given:
            _set(t, f"parallel.{name}", _offload_device(t, f"zero_optimization.{name}", source))
    for old, name in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if f"zero_optimization.{old}" in t.given:
            _set(t, f"parallel.{name}", bool(t.value(f"zero_optimization.{old}")))
    mics = t.value("zero_optimization.mics_shard_size", -1)
    if mics not in (-1, None):
        if not isinstance(mics, int) or isinstance(mics, bool) or mics < 1:
            raise ConfigError(
                f"{source}: '{t.shown('zero_optimization.mics_shard_size')}' = {mics!r}: a number of "
                "ranks >= 1 (or -1: off)"
            )
        _set(t, "parallel.dp_shard", mics)


def _offload_device(t: Translation, path: str, source: str) -> bool:
    """`offload_*: {device: cpu|none, ...}` -> on/off; NVMe has no equivalent here."""
    value = t.value(path)
    if isinstance(value, bool):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: '{t.shown(path)}' must be a block like {{device: cpu}}, got {value!r}")
    device = str(value.get("device", "cpu")).lower()
    if device not in ("cpu", "none"):
        raise ConfigError(
            f"{source}: '{t.shown(path)}.device' = {device!r}: only 'cpu' (FSDP2 CPU offload) or 'none' are "
            "supported; NVMe offload has no PyTorch equivalent"
        )
    return device == "cpu"


def _activation_checkpointing(t: Translation) -> None:
    for key, path in (
        ("partition_activations", "parallel.distribute_saved_activations"),
        ("cpu_checkpointing", "parallel.cpu_checkpointing"),
    ):
        if f"activation_checkpointing.{key}" in t.given:
            _set(t, path, t.value(f"activation_checkpointing.{key}"))


def classification_markdown() -> str:
    """The table docs/CONFIG.md holds: every key of DeepSpeed's config and what the import does."""
    lines = [
        f"Every key of DeepSpeed's configuration JSON ({SOURCE_DOC}, and the ZeRO and bf16 keys its config "
        "classes accept), as `stx` reads it in a config file and in `stx config import --deepspeed`: "
        "**carried** to keys of ours, **ignored** (listed in the imported file; a warning) or **refused** "
        "(an error, unless it asks for nothing: false, or `enabled: false`). A section marked *whole* "
        "applies its rule to every key under it. Any other key is an error naming the nearest valid one.",
        "",
        "| key | status | sets, or why |",
        "|---|---|---|",
    ]
    for key, rule in DEEPSPEED_KEYS.items():
        if not rule.detail:
            continue
        whole = " (whole)" if rule.whole else ""
        lines.append(f"| `{key}` | {rule.kind}{whole} | {rule.detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
