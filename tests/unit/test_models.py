"""Models: exact analytic parameter counts, masking, init, loss, and that training reduces the loss."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models import (
    BertModel,
    GPTModel,
    build_model,
    compute_loss,
    count_parameters,
    count_parameters_breakdown,
    model_inputs,
    padded_vocab_size,
)
from scalable_transformer.models.layers import apply_rotary


def tiny(model_type: str = "bert", **overrides) -> ModelConfig:
    base = dict(
        type=model_type,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=40,  # deliberately not 4h
        seq_length=8,
        max_position_embeddings=12,
        vocab_size=101,  # padded to 128
        make_vocab_size_divisible_by=64,
    )
    base.update(overrides)
    return ModelConfig(**base)


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def bert_batch(cfg: ModelConfig, b: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    s = cfg.seq_length
    input_ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[0, -3:] = 0
    labels = torch.full((b, s), -100)
    labels[:, 1:4] = torch.randint(0, cfg.vocab_size, (b, 3), generator=gen)
    return {
        "input_ids": input_ids,
        "token_type_ids": (torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
        "attention_mask": attention_mask,
        "labels": labels,
        "nsp_labels": torch.randint(0, 2, (b,), generator=gen),
    }


def gpt_batch(cfg: ModelConfig, b: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


# ---------------------------------------------------------------- vocab padding and config checks


def test_padded_vocab_size_rule():
    assert padded_vocab_size(30522, 128) == 30592  # 239 * 128
    assert padded_vocab_size(30522, 128, tp=2) == 30720  # 120 * 256
    assert padded_vocab_size(30522, 128, tp=8) == 30720  # 30 * 1024
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(30592, 128) == 30592  # already a multiple: unchanged
    assert padded_vocab_size(1, 1) == 1
    with pytest.raises(ValueError):
        padded_vocab_size(100, 0)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"vocab_size": None}, "vocab_size"),
        ({"ffn_hidden_size": None}, "ffn_hidden_size"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"hidden_size": 12, "num_attention_heads": 4, "position_embedding_type": "rotary"}, "rotary"),
        ({"max_position_embeddings": 4}, "max_position_embeddings"),
        ({"activation": "relu"}, "activation"),
        ({"type": "t5"}, "type"),
    ],
)
def test_bad_config_raises_naming_the_field(overrides, field):
    cfg = tiny(**overrides)
    with pytest.raises(ValueError, match=field):
        build_model(cfg)
    with pytest.raises(ValueError, match=field):
        count_parameters(cfg)


# ---------------------------------------------------------------- analytic parameter count

GRID = [
    dict(
        type=t,
        activation=act,
        norm=norm,
        position_embedding_type=pos,
        tie_word_embeddings=tied,
        apply_residual_connection_post_layernorm=post,
        bert_binary_head=binary,
    )
    for t, act, norm, pos, tied, post, binary in itertools.product(
        ("bert", "gpt"),
        ("gelu", "openai-gelu", "geglu"),
        ("layernorm", "rmsnorm"),
        ("learned", "sinusoidal", "rotary"),
        (True, False),
        (True, False),
        (True, False),
    )
    if t == "bert" or binary  # the binary head is a BERT option
]


def test_count_parameters_exact_over_option_grid():
    assert len(GRID) == 216
    for options in GRID:
        cfg = tiny(**options)
        assert count_parameters(cfg) == numel(build_model(cfg)), options


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_tokentypes": 0},
        {"num_tokentypes": 3},
        {"vocab_size": 30522, "make_vocab_size_divisible_by": 128, "tie_word_embeddings": False},
        {"num_layers": 3, "hidden_size": 24, "num_attention_heads": 3, "ffn_hidden_size": 50},
    ],
)
@pytest.mark.parametrize("model_type", ["bert", "gpt"])
def test_count_parameters_exact_for_sizes(model_type, overrides):
    cfg = tiny(model_type, **overrides)
    model = build_model(cfg)
    assert count_parameters(cfg) == numel(model)
    breakdown = count_parameters_breakdown(cfg)
    assert sum(breakdown.values()) == count_parameters(cfg)
    assert breakdown["layers"] == cfg.num_layers * numel(model.layers[0])
    assert breakdown["embedding"] == numel(model.embedding)


def test_count_parameters_known_value():
    # BERT-base shape by hand: embedding, 12 layers of 12h^2+13h, pooler, MLM head, binary head.
    cfg = ModelConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
        seq_length=512, max_position_embeddings=512, vocab_size=30522,
    )  # fmt: skip
    h, v = 768, 30592
    expected = (v + 512 + 2) * h + 12 * (12 * h * h + 13 * h) + 2 * h  # + final LayerNorm
    expected += (h * h + h) + 2 * h + v  # MLM dense, LayerNorm, output bias (decoder tied)
    expected += (h * h + h) + (2 * h + 2)  # pooler, binary classifier
    assert count_parameters(cfg) == expected


# ---------------------------------------------------------------- forward: shapes and masking


@pytest.mark.parametrize("binary", [True, False])
def test_bert_forward_shapes(binary):
    cfg = tiny(bert_binary_head=binary)
    batch = bert_batch(cfg)
    mlm_logits, binary_logits = build_model(cfg)(*model_inputs("bert", batch))
    assert mlm_logits.shape == (3, cfg.seq_length, 128)
    assert binary_logits is None if not binary else binary_logits.shape == (3, 2)


def test_gpt_forward_shape_and_model_inputs():
    cfg = tiny("gpt")
    batch = gpt_batch(cfg)
    assert model_inputs("gpt", batch) == (batch["input_ids"],)
    assert build_model(cfg)(*model_inputs("gpt", batch)).shape == (3, cfg.seq_length, 128)
    with pytest.raises(KeyError, match="attention_mask"):
        model_inputs("bert", batch)


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rotary"])
@pytest.mark.parametrize("post_ln", [False, True])
def test_gpt_is_causal(pos, post_ln):
    torch.manual_seed(0)
    cfg = tiny("gpt", position_embedding_type=pos, apply_residual_connection_post_layernorm=post_ln)
    model = build_model(cfg).eval()
    ids = gpt_batch(cfg)["input_ids"]
    changed = ids.clone()
    t = 5
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t:], after[:, t:])


@pytest.mark.parametrize("pos", ["learned", "rotary"])
@pytest.mark.parametrize("post_ln", [False, True])
def test_bert_padding_is_masked(pos, post_ln):
    torch.manual_seed(0)
    cfg = tiny(position_embedding_type=pos, apply_residual_connection_post_layernorm=post_ln)
    model = build_model(cfg).eval()
    batch = bert_batch(cfg)
    real = batch["attention_mask"].bool()
    changed = batch["input_ids"].clone()
    changed[~real] = (changed[~real] + 7) % cfg.vocab_size
    with torch.no_grad():
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        mlm2, nsp2 = model(changed, batch["token_type_ids"], batch["attention_mask"])
        unmasked, _ = model(changed, batch["token_type_ids"], torch.ones_like(real))
    torch.testing.assert_close(mlm[real], mlm2[real], rtol=0, atol=1e-6)
    torch.testing.assert_close(nsp, nsp2, rtol=0, atol=1e-6)
    assert not torch.allclose(mlm[0][real[0]], unmasked[0][real[0]])  # the mask is what protects them


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    model = build_model(tiny("gpt", position_embedding_type="rotary", max_position_embeddings=32))
    assert model.rotary is not None
    cos, sin = model.rotary(32)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> torch.Tensor:
        return apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])

    torch.testing.assert_close(score(3, 1), score(20, 18))
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_position_buffers_are_not_state():
    for pos in ("sinusoidal", "rotary"):
        model = build_model(tiny("gpt", position_embedding_type=pos))
        assert all("sinusoid" not in key and "cos" not in key for key in model.state_dict()), pos


@pytest.mark.parametrize("pos", ["sinusoidal", "rotary"])
def test_meta_device_build_then_init_weights(pos):
    cfg = tiny("gpt", position_embedding_type=pos)
    reference = build_model(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    for name, buffer in reference.named_buffers():  # derived buffers must be recomputed, not garbage
        torch.testing.assert_close(model.get_buffer(name), buffer)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ids = gpt_batch(cfg)["input_ids"]
    assert torch.isfinite(model(ids)).all()


# ---------------------------------------------------------------- weights: tying and init


@pytest.mark.parametrize("model_type", ["bert", "gpt"])
@pytest.mark.parametrize("tied", [True, False])
def test_tied_output_uses_the_word_embedding(model_type, tied):
    cfg = tiny(model_type, tie_word_embeddings=tied)
    model = build_model(cfg).eval()
    batch = bert_batch(cfg) if model_type == "bert" else gpt_batch(cfg)
    inputs = model_inputs(model_type, batch)
    word = model.embedding.word.weight
    output = model.lm_head.decoder if model_type == "bert" else model.output
    if tied:
        assert output is None
    else:
        assert output.weight.data_ptr() != word.data_ptr()
    unused = 127  # a padding row: never an input id, so only the output layer can read it
    with torch.no_grad():
        before = model(*inputs)
        word[unused].add_(1.0)
        after = model(*inputs)
    before, after = (x[0] if model_type == "bert" else x for x in (before, after))
    assert torch.equal(before[..., :unused], after[..., :unused])
    assert torch.equal(before[..., unused], after[..., unused]) is not tied
    # And the gradient of the output layer must reach the embedding (a detached copy would not).
    logits = model(*inputs)
    (logits[0] if model_type == "bert" else logits)[..., unused].sum().backward()
    assert (word.grad[unused].abs().sum().item() > 0) is tied


def test_same_seed_same_init():
    cfg = tiny()
    states = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        states.append(build_model(cfg).state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not torch.equal(
        states[0]["layers.0.attention.qkv.weight"], states[2]["layers.0.attention.qkv.weight"]
    )


def test_init_std_scaled_on_output_projections():
    torch.manual_seed(0)
    cfg = tiny(
        "gpt",
        num_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        ffn_hidden_size=1024,
        init_method_std=0.02,
    )
    block = build_model(cfg).layers[3]
    scaled = 0.02 / math.sqrt(2 * 8)
    assert block.attention.proj.weight.std().item() == pytest.approx(scaled, rel=0.03)
    assert block.mlp.down.weight.std().item() == pytest.approx(scaled, rel=0.03)
    assert block.attention.qkv.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert block.mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert torch.count_nonzero(block.attention.qkv.bias) == 0
    assert torch.equal(block.norm1.weight, torch.ones(256))


# ---------------------------------------------------------------- loss


def test_bert_loss_matches_hand_computed_cross_entropy():
    torch.manual_seed(0)
    mlm = torch.randn(2, 4, 10)
    binary = torch.randn(2, 2)
    labels = torch.tensor([[-100, 3, -100, 7], [1, -100, -100, -100]])
    nsp = torch.tensor([1, 0])
    batch = {"labels": labels, "nsp_labels": nsp}
    loss, metrics = compute_loss("bert", (mlm, binary), batch)
    picked = torch.stack([mlm[0, 1], mlm[0, 3], mlm[1, 0]])
    expected_mlm = F.cross_entropy(picked, torch.tensor([3, 7, 1]))
    expected_binary = F.cross_entropy(binary, nsp)
    torch.testing.assert_close(loss, expected_mlm + expected_binary)
    torch.testing.assert_close(metrics["mlm_loss"], expected_mlm)
    torch.testing.assert_close(metrics["binary_loss"], expected_binary)
    assert metrics["mlm_count"].item() == 3
    assert metrics["mlm_correct"].item() == (picked.argmax(-1) == torch.tensor([3, 7, 1])).sum().item()
    assert metrics["binary_correct"].item() == (binary.argmax(-1) == nsp).sum().item()
    assert not any(m.requires_grad for m in metrics.values())

    loss_no_head, metrics_no_head = compute_loss("bert", (mlm, None), batch)
    torch.testing.assert_close(loss_no_head, expected_mlm)
    assert "binary_loss" not in metrics_no_head


def test_gpt_loss_matches_hand_computed_cross_entropy_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10)
    labels = torch.tensor([[4, -100, 2], [9, 9, -100]])
    loss, metrics = compute_loss("gpt", logits.bfloat16(), {"labels": labels})
    assert loss.dtype == torch.float32
    keep = labels != -100
    expected = F.cross_entropy(logits.bfloat16().float()[keep], labels[keep])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["lm_loss"], expected)
    empty, _ = compute_loss("gpt", logits, {"labels": torch.full_like(labels, -100)})
    assert empty.item() == 0.0  # no NaN from 0 / 0


@pytest.mark.parametrize("model_type", ["bert", "gpt"])
def test_bf16_autocast_forward_and_loss(model_type):
    cfg = tiny(model_type, position_embedding_type="rotary", activation="geglu")
    batch = bert_batch(cfg) if model_type == "bert" else gpt_batch(cfg)
    model = build_model(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = compute_loss(model_type, model(*model_inputs(model_type, batch)), batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("bert", {}),
        ("bert", {"apply_residual_connection_post_layernorm": True, "norm": "rmsnorm"}),
        ("gpt", {}),
        ("gpt", {"position_embedding_type": "rotary", "activation": "geglu", "tie_word_embeddings": False}),
    ],
)
def test_training_overfits_a_fixed_batch(model_type, overrides):
    torch.manual_seed(0)
    cfg = tiny(model_type, hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    model = build_model(cfg)
    assert isinstance(model, BertModel if model_type == "bert" else GPTModel)
    batch = bert_batch(cfg) if model_type == "bert" else gpt_batch(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss, _ = compute_loss(model_type, model(*model_inputs(model_type, batch)), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_dataclass_config_is_not_mutated():
    cfg = tiny()
    snapshot = dataclasses.asdict(cfg)
    build_model(cfg)
    count_parameters(cfg)
    assert dataclasses.asdict(cfg) == snapshot


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_streams_only_where_dropout_draws(sequence_parallel):
    """Tensor-parallel dropout regions get a stream only when their dropout probability is above 0."""
    from scalable_transformer.parallel.rng import tensor_parallel_regions

    off = build_model(tiny("gpt", hidden_dropout=0.0, attention_dropout=0.0))
    assert tensor_parallel_regions(off, sequence_parallel) == []
    on = build_model(tiny("gpt", hidden_dropout=0.1, attention_dropout=0.1))
    assert len(tensor_parallel_regions(on, sequence_parallel)) == 2 * (2 if sequence_parallel else 1)
    attention_only = build_model(tiny("gpt", hidden_dropout=0.0, attention_dropout=0.1))
    assert len(tensor_parallel_regions(attention_only, sequence_parallel)) == 2
