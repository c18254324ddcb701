"""Config loading: strictness, aliases, overrides, cross-checks, presets and the generated reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalable_transformer.config.docs import END, START, reference_markdown
from scalable_transformer.config.load import ConfigError, load_config, preset_names, to_yaml
from scalable_transformer.config.validate import resolve

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_default_is_tiny_bert():
    cfg = resolve(load_config())
    assert cfg.model.type == "bert"
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size
    assert cfg.model.max_position_embeddings == cfg.model.seq_length
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size
    assert cfg.optim.lr_decay_iters == cfg.train.train_iters


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    cfg = resolve(load_config(name))
    assert cfg.model.hidden_size % cfg.model.num_attention_heads == 0
    assert cfg.train.global_batch_size == (
        cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * cfg.parallel.dp
    )


def test_presets_cover_the_issue_list():
    expected = {
        "tiny-bert",
        "tiny-gpt",
        "bert-345m",
        "bert-large",
        "gpt-125m",
        "gpt-350m",
        "gpt-760m",
        "gpt-1b",
        "gpt-3b",
        "gpt-7b",
        "gpt-13b",
        "llama-tiny",
        "llama-1b",
        "llama-8b",
        "llama-70b",
        "tiny-moe",
        "mixtral-8x7b",
        "olmoe-1b-7b",
    }
    assert expected <= set(preset_names())
    shapes = {
        "gpt-125m": (12, 768),
        "gpt-350m": (24, 1024),
        "gpt-760m": (24, 1536),
        "gpt-1b": (24, 2048),
        "gpt-3b": (32, 2560),
        "gpt-7b": (32, 4096),
        "gpt-13b": (40, 5120),
        "bert-345m": (24, 1024),
    }
    for name, (layers, hidden) in shapes.items():
        cfg = load_config(name)
        assert (cfg.model.num_layers, cfg.model.hidden_size) == (layers, hidden), name
    llama = {  # layers, hidden, heads, key/value groups, FFN, vocabulary (the published Llama 3 shapes)
        "llama-1b": (16, 2048, 32, 8, 8192, 128256),
        "llama-8b": (32, 4096, 32, 8, 14336, 128256),
        "llama-70b": (80, 8192, 64, 8, 28672, 128256),
    }
    for name, shape in llama.items():
        m = resolve(load_config(name)).model
        got = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size)
        assert (*got, m.vocab_size) == shape, name
        assert (m.activation, m.norm, m.position_embedding_type, m.add_bias_linear) == (
            "swiglu",
            "rmsnorm",
            "rotary",
            False,
        ), name


def test_unknown_key_names_file_key_and_nearest(tmp_path):
    path = write(tmp_path, "model:\n  num_layer: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert path in str(e.value) and "model.num_layer" in str(e.value) and "'num_layers'" in str(e.value)


def test_unknown_top_level_key_suggests(tmp_path):
    path = write(tmp_path, "hiden-size: 64\n")
    with pytest.raises(ConfigError, match=r"unknown key 'hiden-size'; did you mean 'hidden_size'"):
        load_config(path)


def test_unknown_override_is_an_error():
    with pytest.raises(ConfigError, match=r"command-line override 'optim.learning_rate=1'.*unknown key"):
        load_config(None, ["optim.learning_rate=1"])


def test_wrong_type_names_key_and_value(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: four\n")
    with pytest.raises(ConfigError, match=r"'model.num_layers' must be an integer, got 'four'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"must be true or false"):
        load_config(None, ["model.tie_word_embeddings=3"])
    with pytest.raises(ConfigError, match=r"choose one of: gelu, openai-gelu, geglu"):
        load_config(None, ["model.activation=relu"])


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 2\n  num_layers: 3\n")
    with pytest.raises(ConfigError, match="duplicate key 'num_layers'"):
        load_config(path)


def test_scientific_notation_is_a_number(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-4\ntrain:\n  train_iters: 5e3\n")
    cfg = load_config(path)
    assert cfg.optim.lr == pytest.approx(1e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.train_iters == 5000 and isinstance(cfg.train.train_iters, int)
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == pytest.approx(3e-4)


def test_quoted_number_stays_a_string_for_string_fields(tmp_path):
    cfg = load_config(write(tmp_path, "logging:\n  run_name: '1e5'\n"))
    assert cfg.logging.run_name == "1e5"


def test_megatron_and_neox_spellings(tmp_path):
    path = write(
        tmp_path,
        "num-layers: 3\nhidden_size: 64\nnum-attention-heads: 4\nlr-decay-style: cosine\n"
        "checkpoint-activations: true\nno-weight-tying: true\nrms-norm: true\npos-emb: rotary\n"
        "openai-gelu: true\nfp16: true\nmicro-batch-size: 2\nglobal-batch-size: 8\n",
    )
    cfg = resolve(load_config(path))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (3, 64, 4)
    assert (m.tie_word_embeddings, m.norm, m.position_embedding_type, m.activation) == (
        False,
        "rmsnorm",
        "rotary",
        "openai-gelu",
    )
    assert cfg.optim.lr_decay_style == "cosine"
    assert cfg.parallel.activation_checkpointing == "full"
    assert cfg.train.precision == "fp16"
    assert cfg.train.gradient_accumulation_steps == 4


def test_overrides_dotted_and_aliased():
    cfg = load_config(
        "tiny-gpt", ["optim.lr=3e-4", "model.num_layers=4", "num-attention-heads=4", "--seq-length=64"]
    )
    assert (cfg.optim.lr, cfg.model.num_layers, cfg.model.num_attention_heads, cfg.model.seq_length) == (
        3e-4,
        4,
        4,
        64,
    )


def test_deepspeed_keys(tmp_path):
    path = write(
        tmp_path,
        """
train_batch_size: 32
train_micro_batch_size_per_gpu: 4
gradient_accumulation_steps: 8
gradient_clipping: 0.5
optimizer:
  type: AdamW
  params: {lr: 2.0e-4, betas: [0.8, 0.95], eps: 1.0e-6, weight_decay: 0.1}
scheduler:
  type: WarmupLR
  params: {warmup_min_lr: 0, warmup_max_lr: 2.0e-4, warmup_num_steps: 50, warmup_type: linear}
fp16:
  enabled: true
  loss_scale: 0
  initial_scale_power: 12
  loss_scale_window: 500
""",
    )
    cfg = resolve(load_config(path))
    t, o = cfg.train, cfg.optim
    assert (t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (32, 4, 8)
    assert o.clip_grad == 0.5 and o.optimizer == "adamw" and o.lr == 2e-4
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (0.8, 0.95, 1e-6, 0.1)
    assert (o.scheduler, o.lr_warmup_iters, o.warmup_type, o.warmup_min_lr) == ("warmup_lr", 50, "linear", 0)
    assert (t.precision, t.loss_scale, t.initial_scale_power, t.loss_scale_window) == ("fp16", None, 12, 500)
    assert resolve(load_config(None, ["bf16.enabled=true"])).train.precision == "bf16"


def test_deepspeed_unknown_subkey(tmp_path):
    path = write(tmp_path, "optimizer:\n  type: Adam\n  params: {lr: 1.0e-3, betaz: [0.9, 0.99]}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.params.betaz'; did you mean 'betas'"):
        load_config(path)


def test_inconsistent_batch_sizes():
    with pytest.raises(
        ConfigError,
        match=r"train.global_batch_size \(30\) != micro_batch_size \(4\) x "
        r"gradient_accumulation_steps \(2\) x dp \(1\) = 8",
    ):
        resolve(
            load_config(
                None,
                [
                    "train.global_batch_size=30",
                    "train.micro_batch_size=4",
                    "train.gradient_accumulation_steps=2",
                ],
            )
        )
    with pytest.raises(ConfigError, match=r"must be divisible by train.micro_batch_size"):
        resolve(load_config(None, ["train.global_batch_size=30", "train.micro_batch_size=4"]))


def test_cross_checks():
    with pytest.raises(
        ConfigError, match=r"hidden_size \(130\) must be divisible by .*num_attention_heads \(4\)"
    ):
        resolve(load_config(None, ["model.hidden_size=130", "model.num_attention_heads=4"]))
    with pytest.raises(
        ConfigError, match=r"seq_length \(256\) must be <= model.max_position_embeddings \(128\)"
    ):
        resolve(load_config(None, ["model.seq_length=256", "model.max_position_embeddings=128"]))
    with pytest.raises(ConfigError, match=r"'model.hidden_dropout' must be in \[0, 1\)"):
        resolve(load_config(None, ["model.hidden_dropout=1.5"]))
    with pytest.raises(ConfigError, match=r"optim.min_lr .* must be <= optim.lr"):
        resolve(load_config(None, ["optim.min_lr=1", "optim.lr=0.1"]))


def test_checkpoint_keys_megatron_names_and_checks():
    cfg = resolve(
        load_config(
            None,
            [
                "save=/tmp/x",
                "load=auto",
                "save-interval=5",
                "keep-last-n-checkpoints=2",
                "no-save-optim=true",
                "no-load-rng=true",
                "finetune=false",
            ],
        )
    )
    c = cfg.checkpoint
    assert (c.save, c.load, c.save_interval, c.keep_last_n, c.no_save_optim, c.no_load_rng) == (
        "/tmp/x",
        "auto",
        5,
        2,
        True,
        True,
    )
    with pytest.raises(ConfigError, match=r"load = auto resumes from checkpoint\.save"):
        resolve(load_config(None, ["checkpoint.load=auto"]))
    with pytest.raises(ConfigError, match=r"save_interval is set without checkpoint\.save"):
        resolve(load_config(None, ["checkpoint.save_interval=2"]))
    with pytest.raises(ConfigError, match=r"'checkpoint\.keep_last_n' must be >= 1, got 0"):
        resolve(load_config(None, ["checkpoint.save=/tmp/x", "checkpoint.keep_last_n=0"]))
    with pytest.raises(ConfigError, match=r"finetune loads weights from checkpoint\.load"):
        resolve(load_config(None, ["checkpoint.finetune=true"]))


def test_base_preset_and_missing_file(tmp_path):
    cfg = load_config(write(tmp_path, "base: gpt-125m\nmodel:\n  num_layers: 2\n"))
    assert (cfg.model.type, cfg.model.hidden_size, cfg.model.num_layers) == ("gpt", 768, 2)
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"did you mean 'tiny-gpt'"):
        load_config("tiny-gtp")


def test_conflicting_alias_values_in_one_file(tmp_path):
    path = write(tmp_path, "num-layers: 2\nmodel:\n  num_layers: 3\n")
    with pytest.raises(ConfigError, match="set twice"):
        load_config(path)


def test_resolved_yaml_round_trips(tmp_path):
    cfg = resolve(load_config("gpt-350m"))
    again = resolve(load_config(write(tmp_path, to_yaml(cfg))))
    assert again == cfg


def test_generated_reference_is_in_readme_and_docs():
    block = f"{START}\n{reference_markdown()}\n{END}"
    for name in ("README.md", "docs/CONFIG.md"):
        assert block in (ROOT / name).read_text(), f"{name} is stale: run `make docs`"


def test_resolve_carries_the_derived_values_and_they_are_not_keys():
    """The resolved sections carry what is derived from the keys (read there, not recomputed
    outside config/), as attributes: config.yaml and `stx config show` print the keys only."""
    from scalable_transformer.config import rules

    cfg = resolve(
        load_config(
            None,
            [
                "model.vocab_size=1000",
                "model.num_layers=4",
                "parallel.pp=2",
                "parallel.tp=2",
                "train.global_batch_size=16",
                "data.split=98,2",
                "logging.profile_start_step=1",
                "logging.profile_ranks=all",
            ],
        ),
        world_size=4,
    )
    m, p = cfg.model, cfg.parallel
    assert m.padded_vocab_size == rules.padded_vocab_size(1000, m.make_vocab_size_divisible_by)
    assert p.layout_label == rules.layout_label(cfg)
    accumulation = cfg.train.gradient_accumulation_steps
    assert p.pipeline_bubble == rules.pipeline_bubble_fraction(2, p.virtual_pipeline_stages, accumulation)
    assert p.stage_layer_counts == [2, 2]
    assert cfg.data.split_fractions == rules.parse_split("98,2")
    assert cfg.logging.profiled_ranks == [0, 1, 2, 3]
    text = to_yaml(cfg)
    for derived in (
        "padded_vocab_size",
        "layout_label",
        "stage_layer_counts",
        "split_fractions",
        "profiled_ranks",
    ):
        assert derived not in text
    assert resolve(load_config()).logging.profiled_ranks == []  # no profiler window


def test_with_vocabulary_checks_only_the_vocabulary_again():
    from scalable_transformer.config.validate import with_vocabulary

    cfg = resolve(load_config(None, ["parallel.tp=2", "model.make_vocab_size_divisible_by=1"]), world_size=2)
    given = cfg.model.vocab_size
    assert with_vocabulary(cfg, given, 10) is cfg  # the configured size stands: nothing changes
    grown = with_vocabulary(cfg, None, 10088)
    assert (grown.model.vocab_size, grown.model.padded_vocab_size) == (10088, 10088)
    assert grown.parallel is cfg.parallel and grown.parallel.layout_label == cfg.parallel.layout_label
    with pytest.raises(ConfigError, match="smaller than the tokenizer's"):
        with_vocabulary(cfg, 100, 10088)
    with pytest.raises(ConfigError, match=r"not divisible by parallel\.tp"):
        with_vocabulary(cfg, None, 10087)
    with pytest.raises(Exception, match="frozen"):
        grown.model.vocab_size = 5
