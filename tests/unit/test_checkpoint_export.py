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


def test_no_hf_equivalent_is_a_clear_error(tmp_path):
    ckpt = save(tmp_path, "rotary", "model.position_embedding_type=rotary", "model.norm=rmsnorm")
    with pytest.raises(CheckpointError, match=r"position_embedding_type = rotary .*model.norm = rmsnorm"):
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


def test_pre_ln_bert_is_a_clear_error(tmp_path):
    ckpt = save(tmp_path, "pre-ln", "model.type=bert")
    with pytest.raises(CheckpointError, match="apply_residual_connection_post_layernorm = true"):
        export_hf(str(ckpt), str(tmp_path / "hf"))
