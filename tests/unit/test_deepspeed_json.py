"""DeepSpeed JSON configs (config/deepspeed_json.py) on the files Megatron-DeepSpeed ships (read from its
snapshot at a pinned commit: tests/upstream.py, SOURCES.md): every key accounted for, the batch triple
derived as DeepSpeed derives it over a base preset, the scheduler replacing the preset's schedule,
max_grad_norm as the clip value, and an unknown key naming its nearest valid key."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from scalable_transformer.cli import main
from scalable_transformer.config.deepspeed_json import DEEPSPEED_KEYS, translate
from scalable_transformer.config.foreign_configs import ImportSources, import_configs, render_yaml
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from upstream import MEGATRON_DEEPSPEED, Upstream, read_upstream, upstream_file

ZERO1_BASELINE = Upstream(
    *MEGATRON_DEEPSPEED, "examples_deepspeed/curriculum_learning/ds_zero_stage_1_config_baseline.json"
)
UNIVERSAL_CHECKPOINTING = Upstream(
    *MEGATRON_DEEPSPEED, "examples_deepspeed/universal_checkpointing/ds_config.json"
)
SHIPPED = [ZERO1_BASELINE, UNIVERSAL_CHECKPOINTING]


def _leaf_keys(value: Any, prefix: str = "") -> set[str]:
    """Every leaf key of a JSON object, dotted, computed here without the table."""
    if isinstance(value, dict) and value:
        return {leaf for k, v in value.items() for leaf in _leaf_keys(v, f"{prefix}{k}.")}
    return {prefix.rstrip(".")}


@pytest.mark.parametrize("src", SHIPPED, ids=lambda s: s.path.split("/")[-2])
def test_every_key_of_a_shipped_ds_config_is_accounted_for(src, tmp_path):
    path = upstream_file(src, tmp_path)
    data = json.loads(path.read_text(encoding="utf-8"))
    translation = translate(data, str(path))
    carried, ignored = set(translation.carried), set(translation.ignored)
    assert carried | ignored == _leaf_keys(data)
    assert not carried & ignored
    imported = import_configs(ImportSources(deepspeed=path))
    assert {w.key for w in imported.ignored} == ignored  # the imported file lists each one
    text = render_yaml(imported, base="bert-175b")
    for key in ignored:
        assert f"#   {key} (" in text


def test_megatron_deepspeeds_zero1_baseline_carries_what_it_says(tmp_path):
    path = upstream_file(ZERO1_BASELINE, tmp_path)
    imported = import_configs(ImportSources(deepspeed=path))
    values = {p: v for p, (v, _) in imported.values.items()}
    assert values["parallel.zero_stage"] == 1 and values["train.precision"] == "fp16"
    assert values["optim.lr"] == 0.00015 and (values["optim.adam_beta1"], values["optim.adam_beta2"]) == (
        0.9,
        0.95,
    )
    assert values["optim.clip_grad"] == 1.0  # gradient_clipping and max_grad_norm agree
    assert values["train.global_batch_size"] == 512 and values["train.gradient_accumulation_steps"] == 1
    assert values["train.derive_micro_batch_size"] is True  # no micro batch: DeepSpeed derives it
    assert values["train.loss_scale"] is None  # 0: dynamic


def _write(tmp_path: Path, data: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- max_grad_norm


def test_max_grad_norm_is_the_clip_value(tmp_path):
    ds = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 0.5}}}
    assert resolve(load_config(_write(tmp_path, ds))).optim.clip_grad == 0.5
    ds["gradient_clipping"] = 0.5
    assert resolve(load_config(_write(tmp_path, ds))).optim.clip_grad == 0.5
    ds["gradient_clipping"] = 1.0
    with pytest.raises(
        ConfigError, match=r"'gradient_clipping' \(1\.0\) and 'optimizer\.params\.max_grad_norm' "
    ):
        load_config(_write(tmp_path, ds))


# --------------------------------------------------------------------------- the batch triple on a preset


def _on_preset(tmp_path: Path, ds: dict, base: str = "bert-175b") -> str:
    return _write(tmp_path, {"base": base, **ds})


def _batch(path: str, world: int) -> tuple[int, int, int]:
    t = resolve(load_config(path), world_size=world).train
    return t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps


def test_micro_and_accumulation_define_the_batch_over_the_presets(tmp_path):
    """The issue's case: bert-175b's global batch 512 no longer leaks into a ds_config giving two keys."""
    path = _on_preset(tmp_path, {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 32})
    assert _batch(path, 4) == (32 * 32 * 4, 32, 32)


def test_train_batch_and_micro_derive_the_accumulation(tmp_path):
    path = _on_preset(tmp_path, {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 8})
    assert _batch(path, 32) == (512, 8, 2)
    assert _batch(path, 64) == (512, 8, 1)
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size \(512\) must be divisible by train\.micro_batch_size \(8\) x dp \(48\)",
    ):
        _batch(path, 48)


def test_train_batch_and_accumulation_derive_the_micro_batch(tmp_path):
    data = json.loads(read_upstream(ZERO1_BASELINE))
    path = _on_preset(tmp_path, data)
    assert _batch(path, 32) == (512, 16, 1)
    assert _batch(path, 64) == (512, 8, 1)
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size \(512\) must be divisible by "
        r"train\.gradient_accumulation_steps \(1\) x dp \(3\)",
    ):
        _batch(path, 3)


def test_train_batch_alone_means_accumulation_one(tmp_path):
    assert _batch(_on_preset(tmp_path, {"train_batch_size": 256}), 16) == (256, 16, 1)


def test_three_consistent_keys_resolve_and_inconsistent_ones_name_them(tmp_path):
    triple = {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}
    assert _batch(_on_preset(tmp_path, triple), 32) == (512, 8, 2)
    triple["gradient_accumulation_steps"] = 4
    with pytest.raises(
        ConfigError,
        match=r"train\.global_batch_size \(512\) != micro_batch_size \(8\) x "
        r"gradient_accumulation_steps \(4\) x dp \(32\)",
    ):
        _batch(_on_preset(tmp_path, triple), 32)


def test_accumulation_alone_keeps_its_own_meaning(tmp_path):
    """`gradient_accumulation_steps` is our flat key too: without DeepSpeed's other two it sets itself."""
    cfg = resolve(load_config("tiny-bert", ["gradient_accumulation_steps=2"]), world_size=2)
    assert (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps) == (
        load_config("tiny-bert").train.micro_batch_size,
        2,
    )


# --------------------------------------------------------------------------- 175B on bert-175b

DS_175B = {
    "train_batch_size": 1024,
    "train_micro_batch_size_per_gpu": 16,
    "steps_per_print": 10,
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
    },
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 6e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 6e-5,
            "warmup_num_steps": 2000,
            "total_num_steps": 100000,
            "warmup_type": "linear",
        },
    },
    "wall_clock_breakdown": False,
}


@pytest.mark.parametrize("world", [32, 64])
def test_a_175b_ds_config_on_bert_175b_resolves(tmp_path, world, capsys):
    path = _on_preset(tmp_path, DS_175B)
    cfg = resolve(load_config(path), world_size=world)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (1024, 16)
    assert cfg.train.gradient_accumulation_steps == 1024 // (16 * world)
    o = cfg.optim
    assert (o.scheduler, o.lr, o.warmup_min_lr, o.lr_warmup_iters, o.warmup_type) == (
        "warmup_decay_lr",
        6e-5,
        0,
        2000,
        "linear",
    )
    assert o.lr_warmup_fraction is None and o.lr_decay_iters == 100000  # the preset's schedule is gone
    assert cfg.parallel.zero_stage == 3 and cfg.train.precision == "fp16" and cfg.model.num_layers == 96
    assert main(["config", "validate", path, "--world-size", str(world)]) == 0, capsys.readouterr().err


def test_the_schedule_trains_as_deepspeeds_warmup_decay_lr(tmp_path):
    from scalable_transformer.config.schedule import lr_at

    o = resolve(load_config(_on_preset(tmp_path, DS_175B)), world_size=64).optim

    def deepspeed(last: int) -> float:  # lr_schedules.py WarmupDecayLR.get_lr, written out
        warmup, total = 2000, 100000
        gamma = last / warmup if last < warmup else max(0.0, (total - last) / max(1.0, total - warmup))
        return 0 + gamma * (6e-5 - 0)

    for step in (1, 2, 1000, 2000, 2001, 50000, 99999, 100001):
        assert math.isclose(lr_at(step, o, 100000), deepspeed(step - 1), rel_tol=1e-12, abs_tol=1e-18)


def test_a_scheduler_over_a_preset_with_a_warmup_fraction(tmp_path):
    """bert-175b has lr_warmup_fraction 0.01: a WarmupLR block replaces it instead of tripping on it."""
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}
    o = resolve(load_config(_on_preset(tmp_path, ds)), world_size=8).optim
    assert (o.scheduler, o.lr_warmup_fraction, o.lr_warmup_iters, o.lr, o.warmup_type) == (
        "warmup_lr",
        None,
        100,
        0.001,
        "log",
    )


def test_refused_schedulers_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"ds\.json: 'scheduler\.type' = 'OneCycle': OneCycle"):
        load_config(_write(tmp_path, {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}))


# --------------------------------------------------------------------------- unknown and refused keys


@pytest.mark.parametrize(
    ("data", "shown", "near"),
    [
        ({"zero_optimization": {"stagee": 3}}, "zero_optimization.stagee", "stage"),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_nrom": 1.0}}},
            "optimizer.params.max_grad_nrom",
            "max_grad_norm",
        ),
        ({"train_batch_sise": 8}, "train_batch_sise", "train_batch_size"),
        (
            {"fp16": {"enabled": True, "initial_scale_powr": 8}},
            "fp16.initial_scale_powr",
            "initial_scale_power",
        ),
    ],
)
def test_an_unknown_key_names_the_file_and_its_nearest_valid_key(tmp_path, data, shown, near):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=rf"ds\.json: unknown key '{shown}'; did you mean '{near}'\?"):
        import_configs(ImportSources(deepspeed=Path(path)))


def test_features_that_change_training_are_refused_unless_off(tmp_path):
    with pytest.raises(ConfigError, match=r"'zero_optimization\.offload_optimizer\.device' = 'nvme'"):
        translate({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, "ds.json")
    with pytest.raises(ConfigError, match=r"'data_efficiency' = .*curriculum"):
        translate({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}}, "ds.json")
    off = translate({"data_efficiency": {"enabled": False, "seed": 1}, "amp": {"enabled": False}}, "ds.json")
    assert (
        set(off.ignored) == {"data_efficiency.enabled", "data_efficiency.seed", "amp.enabled"}
        and not off.warnings
    )


# Keys of DeepSpeed's config-json.md (microsoft/DeepSpeed 38327e07), section by section, written out here.
DOCUMENTED = """
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer.type optimizer.params
scheduler.type scheduler.params communication_data_type prescale_gradients gradient_predivide_factor
sparse_gradients fp16.enabled fp16.auto_cast fp16.loss_scale fp16.initial_scale_power fp16.loss_scale_window
fp16.hysteresis fp16.consecutive_hysteresis fp16.min_loss_scale bf16.enabled amp gradient_clipping
zero_optimization.stage zero_optimization.allgather_partitions zero_optimization.allgather_bucket_size
zero_optimization.overlap_comm zero_optimization.reduce_scatter zero_optimization.reduce_bucket_size
zero_optimization.contiguous_gradients zero_optimization.load_from_fp32_weights zero_optimization.grad_hooks
zero_optimization.round_robin_gradients zero_optimization.offload_param zero_optimization.offload_optimizer
zero_optimization.stage3_max_live_parameters zero_optimization.stage3_max_reuse_distance
zero_optimization.stage3_prefetch_bucket_size zero_optimization.stage3_param_persistence_threshold
zero_optimization.stage3_gather_16bit_weights_on_model_save
zero_optimization.stage3_module_granularity_threshold
zero_optimization.zero_hpz_partition_size zero_optimization.zero_quantized_weights
zero_optimization.zero_quantized_gradients zero_optimization.log_trace_cache_warnings
zero_optimization.cpu_offload zero_optimization.sub_group_size zero_optimization.elastic_checkpoint
zero_optimization.ignore_unused_parameters
zero_optimization.offload_param.device zero_optimization.offload_param.nvme_path
zero_optimization.offload_param.pin_memory zero_optimization.offload_param.buffer_count
zero_optimization.offload_param.buffer_size zero_optimization.offload_param.max_in_cpu
zero_optimization.offload_optimizer.device zero_optimization.offload_optimizer.nvme_path
zero_optimization.offload_optimizer.pin_memory zero_optimization.offload_optimizer.ratio
zero_optimization.offload_optimizer.buffer_count zero_optimization.offload_optimizer.fast_init
aio.block_size aio.queue_depth aio.thread_count aio.single_submit aio.overlap_events
steps_per_print wall_clock_breakdown dump_state autotuning.enabled autotuning.metric
flops_profiler.enabled flops_profiler.profile_step flops_profiler.module_depth flops_profiler.top_modules
flops_profiler.detailed flops_profiler.output_file activation_checkpointing.partition_activations
activation_checkpointing.cpu_checkpointing activation_checkpointing.contiguous_memory_optimization
activation_checkpointing.number_checkpoints activation_checkpointing.synchronize_checkpoint_boundary
activation_checkpointing.profile sparse_attention.mode data_efficiency.enabled data_efficiency.seed
data_efficiency.data_routing data_efficiency.data_sampling curriculum_learning.enabled tensorboard.enabled
tensorboard.output_path tensorboard.job_name wandb.enabled wandb.project comet.enabled comet.api_key
csv_monitor.enabled elasticity.enabled comms_logger.enabled comms_logger.prof_ops
compression_training.layer_reduction checkpoint.tag_validation checkpoint.load_universal
checkpoint.use_node_local_storage checkpoint.parallel_write.pipeline_stage data_types.grad_accum_dtype
"""


def test_every_documented_key_has_a_rule():
    def rule_of(key: str):
        parts = key.split(".")
        for i in range(len(parts), 0, -1):
            rule = DEEPSPEED_KEYS.get(".".join(parts[:i]))
            if rule is not None and (i == len(parts) or rule.whole):
                return rule
        return None

    missing = [key for key in DOCUMENTED.split() if rule_of(key) is None]
    assert missing == []


def test_stx_plan_decides_the_batch_and_checks_the_schedule_as_resolve_does(tmp_path):
    """One validation path (issue 41): a file that gives train_batch_size alone has its micro batch
    derived by `stx plan` as by `stx train` (plan read the preset's micro batch before), and a schedule
    `stx train` refuses is refused by the plan too (plan let one pass that the dry run then refused)."""
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import plan_config

    path = _on_preset(tmp_path, {"train_batch_size": 512, "gradient_accumulation_steps": 2})
    resolved = resolve(load_config(path), world_size=64).train
    planned = plan_config(load_config(path), table_cluster("a100-80gb", 8, 8)).layout
    assert (
        (planned.micro_batch_size, planned.gradient_accumulation_steps, planned.global_batch_size)
        == (
            resolved.micro_batch_size,
            resolved.gradient_accumulation_steps,
            resolved.global_batch_size,
        )
        == (4, 2, 512)
    )
    bad = load_config(path, ["optim.scheduler=warmup_lr", "optim.lr_warmup_fraction=0.1"])
    for check in (
        lambda: resolve(bad, world_size=64),
        lambda: plan_config(bad, table_cluster("a100-80gb", 8, 8)),
    ):
        with pytest.raises(ConfigError, match=r"optim\.lr_warmup_fraction applies to scheduler 'megatron'"):
            check()


def test_mics_shard_size_is_hybrid_sharding(tmp_path):
    """DeepSpeed MiCS (ZeRO-3 within groups of mics_shard_size ranks, replicated across them) is HSDP:
    parallel.dp_shard; a value that is not a rank count names the key."""
    zero = {"zero_optimization": {"stage": 3, "mics_shard_size": 8}, "train_micro_batch_size_per_gpu": 4}
    cfg = resolve(load_config(_on_preset(tmp_path, zero, "gpt-125m")), world_size=32)
    assert (cfg.parallel.zero_stage, cfg.parallel.dp, cfg.parallel.dp_shard) == (3, 32, 8)
    assert "dp_shard=8" in cfg.parallel.layout_label
    with pytest.raises(ConfigError, match=r"mics_shard_size' = 0: a number of ranks"):
        translate({"zero_optimization": {"stage": 3, "mics_shard_size": 0}}, "ds.json")
