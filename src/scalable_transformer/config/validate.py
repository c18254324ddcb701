"""Derived values and cross-section checks.

`resolve` returns a copy of the config with every derived field filled (`None` -> a number) and
raises `ConfigError` with a message that names the keys involved when sections disagree.
"""

from __future__ import annotations

import copy

from ..errors import ConfigError
from .rules import check_layout, check_world_size, infer_dp
from .schema import Config


def _positive(value: int | float | None, key: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"'{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def resolve(cfg: Config, world_size: int = 1) -> Config:
    """Fill derived values for a job of `world_size` processes and check the config as a whole."""
    cfg = copy.deepcopy(cfg)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim

    for key, value in [
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.seq_length", m.seq_length),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ("model.vocab_size", m.vocab_size),
        ("train.train_iters", t.train_iters),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.gradient_accumulation_steps", t.gradient_accumulation_steps),
        ("train.global_batch_size", t.global_batch_size),
        ("logging.log_interval", cfg.logging.log_interval),
        ("parallel.checkpoint_num_layers", p.checkpoint_num_layers),
    ]:
        _positive(value, key)
    for key, amount in [
        ("train.eval_interval", t.eval_interval),
        ("train.eval_iters", t.eval_iters),
        ("optim.lr", o.lr),
        ("optim.min_lr", o.min_lr),
        ("optim.weight_decay", o.weight_decay),
        ("optim.clip_grad", o.clip_grad),
        ("optim.lr_warmup_iters", o.lr_warmup_iters),
        ("logging.warmup_iters", cfg.logging.warmup_iters),
        ("data.num_workers", cfg.data.num_workers),
    ]:
        _positive(amount, key, allow_zero=True)
    for key, prob in [
        ("model.hidden_dropout", m.hidden_dropout),
        ("model.attention_dropout", m.attention_dropout),
        ("data.mask_prob", cfg.data.mask_prob),
        ("data.short_seq_prob", cfg.data.short_seq_prob),
    ]:
        if not 0.0 <= prob < 1.0:
            raise ConfigError(f"'{key}' must be in [0, 1), got {prob}")

    # model
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({m.num_attention_heads})"
        )
    head_dim = m.hidden_size // m.num_attention_heads
    if m.position_embedding_type == "rotary" and head_dim % 2:
        raise ConfigError(
            f"rotary position embeddings need an even head dimension; hidden_size / heads = {head_dim}"
        )
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) must be <= model.max_position_embeddings "
            f"({m.max_position_embeddings})"
        )
    if m.vocab_size is None and cfg.data.tokenizer == "embedded" and cfg.data.vocab_file is None:
        m.vocab_size = cfg.data.tokenizer_vocab_size
    if m.type == "gpt" and m.bert_binary_head:
        m.bert_binary_head = False  # a BERT-only option; GPT has no binary head
    if m.type == "bert" and m.seq_length < 8:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) is too short for BERT samples ([CLS] A [SEP] B "
            "[SEP] needs at least 8)"
        )

    # layout: dp inferred here; every layout rule is checked by config.rules.check_layout below
    p.dp = infer_dp(cfg, world_size)
    check_world_size(cfg, world_size)

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

    # optimizer schedule
    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")
    if o.lr_warmup_fraction is not None and not 0.0 <= o.lr_warmup_fraction <= 1.0:
        raise ConfigError(f"optim.lr_warmup_fraction must be in [0, 1], got {o.lr_warmup_fraction}")

    check_layout(cfg, world_size)

    c = cfg.checkpoint
    if c.save_interval is not None and c.save_interval < 1:
        raise ConfigError(f"checkpoint.save_interval must be >= 1, got {c.save_interval}")
    if c.save_interval is not None and not c.save:
        raise ConfigError("checkpoint.save_interval is set without checkpoint.save: set the save directory")
    if c.keep_last_n is not None and c.keep_last_n < 1:
        raise ConfigError(f"checkpoint.keep_last_n must be >= 1, got {c.keep_last_n}")
    if c.load == "auto" and not c.save:
        raise ConfigError("checkpoint.load = auto resumes from checkpoint.save: set checkpoint.save too")
    if c.finetune and not c.load:
        raise ConfigError("checkpoint.finetune loads weights from checkpoint.load: set checkpoint.load")
    if c.init_from_hf and c.load:
        raise ConfigError(
            "checkpoint.init_from_hf and checkpoint.load both set the starting weights: keep one "
            "(init_from_hf for a Hugging Face model, load to resume or finetune one of ours)"
        )
    return cfg
