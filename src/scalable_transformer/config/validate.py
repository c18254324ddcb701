"""`resolve`: derived values filled, every rule checked, a frozen config returned.

The raw config (from the loader, or built in Python) may leave derived fields as None ("derive
it"). `resolve` fills them for a job of `world_size` processes, applies every field rule (schema) and
every cross-section rule (`config.rules`), and returns a `ResolvedConfig`: typed without None where a
number is needed, and frozen (assigning to it raises; `dataclasses.replace` + `resolve` again makes
a changed copy). Errors name the keys involved.
"""

from __future__ import annotations

import copy
import dataclasses

from ..errors import ConfigError
from . import rules
from .model_shapes import default_ffn_hidden_size, family_options
from .schedule import check_schedule
from .schema import RESOLVED_SECTIONS, SECTIONS, Config, ResolvedConfig, TrainConfig, check_fields, freeze


def resolve(cfg: Config, world_size: int = 1) -> ResolvedConfig:
    """Fill derived values for a job of `world_size` processes and check the config as a whole."""
    cfg = _thawed_copy(cfg)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    check_fields(cfg)  # every field's own rule (bounds, finite); the loader checked them with sources

    # model: derived sizes, then its internal consistency
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = default_ffn_hidden_size(m)
    if m.num_experts and m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.vocab_size is None and cfg.data.tokenizer == "embedded" and cfg.data.vocab_file is None:
        m.vocab_size = cfg.data.tokenizer_vocab_size
    cfg.model = m = family_options(m)  # a GPT has no binary head (the planner applies the same rule)
    rules.check_model(m)
    if cfg.data.eod_mask_loss and m.type != "gpt":
        raise ConfigError(f"data.eod_mask_loss masks a GPT's next-token loss; model.type is {m.type}")

    # layout: dp inferred here; every layout rule is checked by config.rules.check_layout below
    p.dp = rules.infer_dp(cfg, world_size)
    rules.check_world_size(cfg, world_size)

    cfg.train = t = batch_sizes(t, p.dp)
    check_schedule(o, t.train_iters)  # here, so plan, dry run and train refuse the same schedules
    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    rules.check_optim(o)
    rules.check_layout(cfg, world_size)
    p.dp_shard = rules.dp_shard_size(p)  # -1 (all of dp) resolved
    rules.check_checkpoint(cfg.checkpoint)
    rules.check_profile(cfg, world_size)
    rules.check_data(cfg.data)
    rules.check_sample_index(cfg)
    return _derived(_frozen(cfg), world_size)


def batch_sizes(t: TrainConfig, dp: int) -> TrainConfig:
    """The train section with micro batch, accumulation and global batch all set: global = micro x
    accumulation x dp, as DeepSpeed checks it (and derives the one left out). The one place this is
    decided: `resolve`, and `stx plan` before it searches layouts (plan/search.py `prepare`)."""
    t = dataclasses.replace(t)
    if t.derive_micro_batch_size:
        t.micro_batch_size = _derived_micro_batch(t, dp)
    per_step = t.micro_batch_size * dp
    if t.gradient_accumulation_steps is None:
        if t.global_batch_size is None:
            t.gradient_accumulation_steps = 1
        elif t.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({t.micro_batch_size}) x dp ({dp}) = {per_step}"
            )
        else:
            t.gradient_accumulation_steps = t.global_batch_size // per_step
    expected = per_step * t.gradient_accumulation_steps
    if t.global_batch_size is None:
        t.global_batch_size = expected
    elif t.global_batch_size != expected:
        raise ConfigError(
            f"batch sizes disagree: train.global_batch_size ({t.global_batch_size}) != "
            f"micro_batch_size ({t.micro_batch_size}) x gradient_accumulation_steps "
            f"({t.gradient_accumulation_steps}) x dp ({dp}) = {expected}"
        )
    return t


def _derived_micro_batch(t: TrainConfig, dp: int) -> int:
    """DeepSpeed's micro batch where a file gives train_batch_size without it: train_batch_size /
    (gradient_accumulation_steps x dp), accumulation 1 when that is not given either."""
    if t.global_batch_size is None:
        raise ConfigError(
            "train.derive_micro_batch_size needs train.global_batch_size (DeepSpeed: "
            "train_micro_batch_size_per_gpu or train_batch_size must be given)"
        )
    if t.gradient_accumulation_steps is None:
        t.gradient_accumulation_steps = 1
    per_micro = t.gradient_accumulation_steps * dp
    if t.global_batch_size % per_micro:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps}) x dp ({dp}) = {per_micro} "
            "to derive train.micro_batch_size (DeepSpeed: train_batch_size = "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size)"
        )
    return t.global_batch_size // per_micro


def with_vocabulary(cfg: ResolvedConfig, configured: int | None, tokenizer_vocab: int) -> ResolvedConfig:
    """The resolved config with the tokenizer's vocabulary: `configured` is model.vocab_size as the
    user gave it (None: the tokenizer's size). Only the rule that reads the vocabulary is checked
    again (whole vocabulary rows on every tensor-parallel rank): the config is not resolved twice."""
    if configured is not None and configured < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size ({configured}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab}); remove it to use the tokenizer's size"
        )
    vocab = tokenizer_vocab if configured is None else configured
    if vocab == cfg.model.vocab_size:
        return cfg
    model = dataclasses.replace(cfg.model, vocab_size=vocab)
    rules.check_vocabulary(model, cfg.parallel.tp)
    model.padded_vocab_size = rules.padded_vocab_size(vocab, model.make_vocab_size_divisible_by)
    sections = {name: getattr(cfg, name) for name in RESOLVED_SECTIONS}
    return freeze(ResolvedConfig(**{**sections, "model": model}))


def _thawed_copy(cfg: Config) -> Config:
    """A mutable deep copy in the plain section classes (a resolved config may be resolved again)."""
    sections = {}
    for name, base in SECTIONS.items():
        section = getattr(cfg, name)
        values = {f.name: copy.deepcopy(getattr(section, f.name)) for f in dataclasses.fields(base)}
        sections[name] = base(**values)
    return Config(**sections)


def _derived(cfg: ResolvedConfig, world_size: int) -> ResolvedConfig:
    """The values derived from the checked keys, set on the resolved sections (schema: `_*Derived`)."""
    m, p, d, lg = cfg.model, cfg.parallel, cfg.data, cfg.logging
    divisible = m.make_vocab_size_divisible_by
    m.padded_vocab_size = rules.padded_vocab_size(m.vocab_size, divisible) if m.vocab_size else None
    p.layout_label = rules.layout_label(cfg)
    p.pipeline_bubble = rules.pipeline_bubble_fraction(
        p.pp, p.virtual_pipeline_stages, cfg.train.gradient_accumulation_steps
    )
    stages = p.pp * p.virtual_pipeline_stages
    explicit = p.pipeline_layers if stages > 1 else None  # one stage holds every layer, as given or not
    p.stage_layer_counts = rules.stage_layer_counts(m.num_layers, stages, explicit)
    d.split_fractions = rules.parse_split(d.split)
    windowed = lg.profile_start_step is not None
    lg.profiled_ranks = rules.profile_ranks(lg.profile_ranks, world_size) if windowed else []
    return freeze(cfg)


def _frozen(cfg: Config) -> ResolvedConfig:
    sections = {
        name: resolved(**{f.name: getattr(getattr(cfg, name), f.name) for f in dataclasses.fields(resolved)})
        for name, resolved in RESOLVED_SECTIONS.items()
    }
    return ResolvedConfig(**sections)
