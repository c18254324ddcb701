"""Hugging Face Llama: `stx export --format hf` writes a LlamaForCausalLM with our logits, a random
transformers LlamaForCausalLM imports with its logits, and `stx config from-hf` reads its config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scalable_transformer.checkpoint.export import export_hf, load_model
from scalable_transformer.checkpoint.hf_import import load_hf_weights, model_overrides_from_hf
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.models import build_model
from scalable_transformer.train.run import run_training

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TINY = [
    "model.type=gpt",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.position_embedding_type=rotary",
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.train_iters=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.tensorboard=false",
]
VARIANTS = {
    "gqa-untied-llama3-rope": [
        "model.num_query_groups=2",
        "model.add_bias_linear=false",
        "model.tie_word_embeddings=false",
        "model.rotary_base=500000",
        "model.rope_scaling=true",
        "model.rope_scaling_factor=8",
    ],
    "mqa-tied-biases": ["model.num_query_groups=1", "model.add_bias_linear=true"],
}


@pytest.mark.parametrize("extra", list(VARIANTS.values()), ids=list(VARIANTS))
def test_llama_export_has_our_logits(tmp_path, extra):
    ckpt = tmp_path / "ckpt"
    run_training(
        load_config(None, [*TINY, *extra, f"logging.run_dir={tmp_path / 'runs'}", f"checkpoint.save={ckpt}"])
    )
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours, cfg, _ = load_model(str(ckpt))
    ids = torch.randint(0, cfg.vocab_size or 1, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(ids), hf(ids).logits
    diff = (got - want).abs().max().item()
    print(f"max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-5
    assert (out / "tokenizer.json").is_file()


def _random_llama(tmp_path, **overrides):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    settings.update(overrides)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    hf.save_pretrained(tmp_path / "llama")
    return hf, tmp_path / "llama"


def test_random_hf_llama_imports_with_its_logits(tmp_path):
    hf, path = _random_llama(tmp_path)
    settings = model_overrides_from_hf(path)
    assert (
        settings["num_query_groups"] == 2 and settings["rope_scaling"] and settings["rotary_base"] == 500000
    )
    cfg = resolve(load_config(None, [*TINY, *(f"model.{k}={v}" for k, v in settings.items())])).model
    model = build_model(cfg).eval()
    load_hf_weights(model, cfg, path)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids)[..., :500] - hf(ids).logits).abs().max().item()
    print(f"max |ours - HF| = {diff:.2e}")
    assert diff <= 1e-5
    wrong = dataclasses.replace(cfg, num_query_groups=4)
    with pytest.raises(Exception, match=r"model.num_query_groups = 4 \(the Hugging Face model has 2\)"):
        load_hf_weights(build_model(wrong), wrong, path)


def test_foreign_rope_type_is_refused_naming_it(tmp_path):
    _, path = _random_llama(
        tmp_path, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    )
    with pytest.raises(Exception, match=r"rope_type = 'linear'"):
        model_overrides_from_hf(path)


def test_config_from_hf_reads_a_llama_3_config_json(tmp_path):
    """Meta's Llama 3.1 8B config.json (written by transformers, no weights): the same model as llama-8b."""
    from scalable_transformer.cli.config import config_from_hf
    from scalable_transformer.models import count_parameters

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "llama-3.1-8b")  # fmt: skip
    model = config_from_hf(tmp_path / "llama-3.1-8b")["model"]
    assert model["seq_length"] == 8192  # the pretraining context, not the scaled 131072
    ours = resolve(load_config(None, [f"model.{k}={v}" for k, v in model.items()])).model
    preset = resolve(load_config("llama-8b")).model
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "vocab_size", "activation", "norm", "rotary_base", "rope_scaling", "rope_scaling_factor",
                "add_bias_linear", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, key) == getattr(preset, key), key
    assert count_parameters(ours) == count_parameters(preset) == 8_030_261_248


def test_shape_without_hf_equivalent_is_refused_by_validate_and_warned_by_train(tmp_path, capsys):
    from scalable_transformer.cli import main

    no_hf = ["model.activation=geglu", f"checkpoint.save={tmp_path / 'ckpt'}"]
    assert main(["config", "validate", "tiny-gpt", *no_hf]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.save" in err and "model.activation = geglu" in err and "LlamaForCausalLM" in err
    assert main(["config", "validate", "tiny-gpt", "model.activation=geglu"]) == 0  # nothing saved: fine
    assert main(["config", "validate", "llama-tiny", f"checkpoint.save={tmp_path / 'ckpt'}"]) == 0
    capsys.readouterr()
    short = [
        "train.train_iters=1",
        "train.eval_iters=0",
        "logging.tensorboard=false",
        f"logging.run_dir={tmp_path}",
    ]
    assert main(["train", "tiny-gpt", *no_hf, *short]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "model.activation = geglu" in out and "stx export --format hf" in out
