"""`stx export --format hf`: a checkpoint as GPT2LMHeadModel with the same logits; no-equivalent errors."""

from __future__ import annotations

import pytest
import torch

from scalable_transformer.checkpoint.export import export_hf, load_model
from scalable_transformer.checkpoint.manager import CheckpointError
from scalable_transformer.config.load import load_config
from scalable_transformer.train.run import run_training

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TINY = [
    "model.type=gpt",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.train_iters=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.tensorboard=false",
]


def save(tmp_path, name: str, *overrides: str):
    ckpt = tmp_path / name
    cfg = load_config(
        None, [*TINY, f"logging.run_dir={tmp_path / 'runs'}", f"checkpoint.save={ckpt}", *overrides]
    )
    run_training(cfg)
    return ckpt


@pytest.mark.parametrize("extra", [[], ["model.activation=openai-gelu", "model.tie_word_embeddings=false"]])
def test_gpt2_export_has_our_logits(tmp_path, extra):
    ckpt = save(tmp_path, "ckpt", *extra)
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ours, cfg, _ = load_model(str(ckpt))
    ids = torch.randint(0, cfg.vocab_size or 1, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("def f(x): return x")["input_ids"]
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(str(ckpt), str(out))


@pytest.mark.parametrize("extra", [[], ["model.activation=openai-gelu", "model.tie_word_embeddings=false"]])
def test_rotary_layernorm_gpt_exports_to_gpt_neox_with_our_logits(tmp_path, extra):
    ckpt = save(tmp_path, "ckpt", "model.position_embedding_type=rotary", *extra)
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    ours, cfg, _ = load_model(str(ckpt))
    ids = torch.randint(0, cfg.vocab_size or 1, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_no_hf_equivalent_is_a_clear_error(tmp_path):
    ckpt = save(tmp_path, "rotary", "model.position_embedding_type=rotary", "model.norm=rmsnorm")
    # GPT-2 needs learned positions and LayerNorm; Llama a SwiGLU MLP: each class says what it lacks
    with pytest.raises(
        CheckpointError,
        match=r"GPT2LMHeadModel: .*position_embedding_type = rotary .*LlamaForCausalLM: .*activation",
    ):
        export_hf(str(ckpt), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


BERT = [
    "model.type=bert",
    "model.apply_residual_connection_post_layernorm=true",
    "model.bert_binary_head=true",
]


def test_bert_export_has_our_logits(tmp_path):
    ckpt = save(tmp_path, "bert", *BERT)
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = transformers.BertForPreTraining.from_pretrained(out).eval()
    ours, cfg, _ = load_model(str(ckpt))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size or 1, (2, 32), generator=gen)
    types = torch.randint(0, 2, (2, 32), generator=gen)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 20:] = 0
    with torch.no_grad():
        mlm, binary = ours(ids, types, mask)
        got = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    torch.testing.assert_close(got.prediction_logits[0], mlm[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.prediction_logits[1, :20], mlm[1, :20], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.seq_relationship_logits, binary, rtol=1e-5, atol=1e-5)


def test_tiny_bert_as_it_ships_exports_to_megatron_bert_with_our_logits(tmp_path):
    """tiny-bert's defaults (pre-LN, Megatron's): MegatronBertForPreTraining, and fill-mask runs on it."""
    ckpt = tmp_path / "tiny-bert"
    overrides = [
        "train.train_iters=2",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "logging.tensorboard=false",
    ]
    run_training(
        load_config(
            "tiny-bert", [*overrides, f"logging.run_dir={tmp_path / 'runs'}", f"checkpoint.save={ckpt}"]
        )
    )
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = transformers.AutoModelForPreTraining.from_pretrained(out).eval()
    assert type(hf).__name__ == "MegatronBertForPreTraining"
    ours, cfg, _ = load_model(str(ckpt))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size or 1, (2, 32), generator=gen)
    types, mask = torch.zeros_like(ids), torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.no_grad():
        mlm = ours(ids, types, mask)[0]
        got = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).prediction_logits
    diff = max((got[0] - mlm[0]).abs().max().item(), (got[1, :20] - mlm[1, :20]).abs().max().item())
    print(f"tiny-bert: max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-5
    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=str(out))
    predictions = fill("the function returns a [MASK] of the values.")
    assert len(predictions) == 5 and all("[MASK]" not in p["sequence"] for p in predictions)


@pytest.mark.slow
def test_bert_345m_defaults_map_to_megatron_bert_with_our_logits():
    """bert-345m's model as the preset defines it (24 x 1024, pre-LN, binary head), built in fp32."""
    from scalable_transformer.checkpoint.export import hf_mapping
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.models import build_model

    cfg = resolve(load_config("bert-345m")).model
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    mapping = hf_mapping(cfg)
    assert mapping.hf_class == "MegatronBertForPreTraining"
    hf = mapping.to_hf(ours, cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size or 1, (1, 16), generator=gen)
    types, mask = torch.randint(0, 2, (1, 16), generator=gen), torch.ones_like(ids)
    with torch.no_grad():
        mlm, binary = ours(ids, types, mask)
        got = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    diff = (got.prediction_logits - mlm).abs().max().item()
    print(f"bert-345m: max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-5
    torch.testing.assert_close(got.seq_relationship_logits, binary, rtol=1e-5, atol=1e-5)


def _logits(model, cfg, ids):
    with torch.no_grad():
        out = model(ids) if cfg.type == "gpt" else model(ids, torch.zeros_like(ids), torch.ones_like(ids))
    return out if cfg.type == "gpt" else out[0]


@pytest.mark.parametrize(
    "extra",
    [
        ["model.activation=openai-gelu"],
        [
            "model.type=bert",
            "model.apply_residual_connection_post_layernorm=true",
            "model.bert_binary_head=true",
        ],
        ["model.type=bert", "model.bert_binary_head=true"],
        [
            "model.position_embedding_type=rotary",
            "model.norm=rmsnorm",
            "model.activation=swiglu",
            "model.num_query_groups=2",
            "model.add_bias_linear=false",
        ],
        ["model.position_embedding_type=rotary", "model.tie_word_embeddings=false"],
    ],
    ids=["gpt", "bert", "pre-ln-bert", "llama", "gpt-neox"],
)
def test_init_from_hf_is_the_export_run_backwards(tmp_path, extra):
    """Export a trained checkpoint, initialise a fresh model from it: every weight comes back exactly,
    and a run started from it has the trained model's first loss."""
    import dataclasses

    from scalable_transformer.checkpoint.hf_import import load_hf_weights, model_overrides_from_hf
    from scalable_transformer.models import build_model

    ckpt = save(tmp_path, "ckpt", *extra)
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    ours, cfg, _ = load_model(str(ckpt))
    settings = model_overrides_from_hf(out)
    fresh_cfg = dataclasses.replace(cfg, **{k: v for k, v in settings.items() if k != "bert_binary_head"})
    fresh = build_model(fresh_cfg)
    load_hf_weights(fresh, fresh_cfg, out)
    for key, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    with pytest.raises(CheckpointError, match=r"model.num_layers = 3 \(the Hugging Face model has 2\)"):
        load_hf_weights(
            build_model(dataclasses.replace(cfg, num_layers=3)), dataclasses.replace(cfg, num_layers=3), out
        )


def test_init_from_a_foreign_gpt2_with_an_unpadded_vocabulary(tmp_path):
    """A GPT-2 made by transformers (vocab 10100, not a multiple of 128, above the embedded tokenizer's):
    its rows fill the first 10100 of our 10112 and the logits over them are HF's; then a run starts from
    it through checkpoint.init_from_hf."""
    import dataclasses

    from scalable_transformer.checkpoint.hf_import import load_hf_weights, model_overrides_from_hf
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.models import build_model

    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=10100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    settings = model_overrides_from_hf(tmp_path / "gpt2")
    cfg = resolve(load_config(None, [*TINY, *(f"model.{k}={v}" for k, v in settings.items())])).model
    assert cfg.vocab_size == 10100
    model = build_model(cfg).eval()
    load_hf_weights(model, cfg, tmp_path / "gpt2")
    ids = torch.randint(0, 10100, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :10100], hf(ids).logits, rtol=1e-5, atol=1e-5)
    wrong = dataclasses.replace(cfg, hidden_size=64)
    with pytest.raises(CheckpointError, match=r"model.hidden_size = 64 \(the Hugging Face model has 32\)"):
        load_hf_weights(build_model(wrong), wrong, tmp_path / "gpt2")
    run_cfg = load_config(
        None,
        [*TINY, *(f"model.{k}={v}" for k, v in settings.items()),
         f"checkpoint.init_from_hf={tmp_path / 'gpt2'}", f"logging.run_dir={tmp_path / 'runs'}"],
    )  # fmt: skip
    _, summary = run_training(run_cfg)
    assert summary["iterations"] == 2
