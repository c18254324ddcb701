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
from .schema import RESOLVED_SECTIONS, SECTIONS, Config, ResolvedConfig, check_fields, freeze


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
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.vocab_size is None and cfg.data.tokenizer == "embedded" and cfg.data.vocab_file is None:
        m.vocab_size = cfg.data.tokenizer_vocab_size
    cfg.model = m = family_options(m)  # a GPT has no binary head (the planner applies the same rule)
    rules.check_model(m)

    # layout: dp inferred here; every layout rule is checked by config.rules.check_layout below
    p.dp = rules.infer_dp(cfg, world_size)
    rules.check_world_size(cfg, world_size)

    # batch sizes: global = micro x accumulation x dp, as DeepSpeed checks it
    per_step = t.micro_batch_size * p.dp
    if t.gradient_accumulation_steps is None:
        if t.global_batch_size is None:
            t.gradient_accumulation_steps = 1
        elif t.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({t.micro_batch_size}) x dp ({p.dp}) = {per_step}"
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
            f"({t.gradient_accumulation_steps}) x dp ({p.dp}) = {expected}"
        )

    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    rules.check_optim(o)
    rules.check_layout(cfg, world_size)
    rules.check_checkpoint(cfg.checkpoint)
    rules.check_profile(cfg, world_size)
    rules.check_data(cfg.data)
    rules.check_sample_index(cfg)
    return _frozen(cfg)


def _thawed_copy(cfg: Config) -> Config:
    """A mutable deep copy in the plain section classes (a resolved config may be resolved again)."""
    sections = {}
    for name, base in SECTIONS.items():
        section = getattr(cfg, name)
        values = {f.name: copy.deepcopy(getattr(section, f.name)) for f in dataclasses.fields(base)}
        sections[name] = base(**values)
    return Config(**sections)


def _frozen(cfg: Config) -> ResolvedConfig:
    sections = {
        name: resolved(**{f.name: getattr(getattr(cfg, name), f.name) for f in dataclasses.fields(resolved)})
        for name, resolved in RESOLVED_SECTIONS.items()
    }
    return freeze(ResolvedConfig(**sections))
