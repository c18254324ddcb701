"""ModelSpec: what each family declares agrees with what its model and loss do."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scalable_transformer.config.model_shapes import ModelShape
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models import SPECS, build_model, count_parameters, get_spec, spec_for
from scalable_transformer.models.spec import ModelSpec

FAMILIES = sorted(SPECS)


def tiny(model_type: str, **overrides) -> ModelConfig:
    base = dict(
        type=model_type,
        num_layers=4,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        seq_length=8,
        max_position_embeddings=8,
        vocab_size=50,
        make_vocab_size_divisible_by=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(overrides)
    return ModelConfig(**base)


def batch(cfg: ModelConfig, b: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (b, cfg.seq_length), generator=gen)
    return {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": torch.ones_like(ids),
        "labels": torch.where(torch.rand(ids.shape, generator=gen) < 0.5, ids, -100),
        "nsp_labels": torch.randint(0, 2, (b,), generator=gen),
    }


VARIANTS = [
    ("bert", {}),
    ("bert", {"bert_binary_head": False}),
    ("bert", {"tie_word_embeddings": False, "position_embedding_type": "rotary"}),
    ("gpt", {}),
    ("gpt", {"tie_word_embeddings": False, "apply_residual_connection_post_layernorm": True}),
]


def test_registry_rejects_an_unknown_type_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"model.type='llama' is not one of \('bert', 'gpt'\)"):
        get_spec("llama")
    with pytest.raises(ValueError, match="is not one of"):
        build_model(tiny("bert", type="llama"))


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_is_registered_under_its_name(family):
    spec = get_spec(family)
    assert isinstance(spec, ModelSpec) and spec.name == family
    assert spec_for(tiny(family)) is spec
    assert spec.lm_metric in spec.metric_names(tiny(family))
    assert set(spec.pipeline.first_stage_keys) <= set(spec.input_keys)
    assert {key for key, _ in spec.pipeline.every_stage_kwargs} <= set(spec.input_keys)


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_declared_metric_names_are_the_keys_the_loss_returns(family, overrides):
    cfg = tiny(family, **overrides)
    spec = spec_for(cfg)
    data = batch(cfg)
    _, metrics = spec.loss(build_model(cfg)(*spec.inputs(data)), data, None)
    assert sorted(metrics) == sorted(spec.metric_names(cfg))


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_parameter_count_and_flops_shape_match_the_built_model(family, overrides):
    cfg = tiny(family, **overrides)
    model = build_model(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    shape = ModelShape.from_config(cfg, tp=2)
    assert shape.num_params == count_parameters(cfg) and shape.vocab_size % 16 == 0


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_construction_is_meta_device_safe(family, overrides):
    cfg = tiny(family, **overrides)
    with torch.device("meta"):
        model = spec_for(cfg).build(cfg)
    assert all(p.is_meta for p in model.parameters())
    real = build_model(cfg)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in real.named_parameters()]


def _pipeline(model: torch.nn.Module, spec: ModelSpec, cuts: list[range]) -> list[torch.nn.Module]:
    last = len(cuts) - 1
    return [spec.stage(model, ids, first=i == 0, last=i == last) for i, ids in enumerate(cuts)]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_stages_hold_exactly_the_full_models_parameter_names(family, overrides):
    cfg = tiny(family, **overrides)
    spec = spec_for(cfg)
    model = build_model(cfg)
    full = dict(model.named_parameters())
    stages = _pipeline(model, spec, [range(0, 1), range(1, 3), range(3, 4)])
    names = [dict(stage.named_parameters()) for stage in stages]
    assert set(names[1]) == {n for n in full if n.startswith(("layers.1.", "layers.2."))}
    assert "layers.3.mlp.up.weight" in names[2] and "layers.0.mlp.up.weight" in names[0]
    assert not any(n.startswith("embedding.") for n in names[1])
    for stage_names in names:
        assert set(stage_names) <= set(full)
        # shared with the model, not copied, except the tied word embedding's own copy
        for name, param in stage_names.items():
            if not (name == "embedding.word.weight" and stage_names is names[-1]):
                assert param is full[name]
    tied_copy = cfg.tie_word_embeddings and "embedding.word.weight" in names[-1]
    assert set().union(*names) == set(full)
    assert sum(len(n) for n in names) == len(full) + int(tied_copy)
    assert tied_copy == cfg.tie_word_embeddings
    if tied_copy:
        assert set(n for n in names[-1] if n.startswith("embedding.")) == {"embedding.word.weight"}
        assert torch.equal(names[-1]["embedding.word.weight"], full["embedding.word.weight"])


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_stages_chained_compute_the_full_forward_and_loss(family, overrides):
    cfg = tiny(family, **overrides)
    spec = spec_for(cfg)
    model = build_model(cfg).eval()
    data = batch(cfg)
    stages = _pipeline(model, spec, [range(0, 2), range(2, 4)])
    pipeline = spec.pipeline
    kwargs = {kw: data[key] for key, kw in pipeline.every_stage_kwargs}
    with torch.no_grad():
        x_bsh = stages[0](*(data[k] for k in pipeline.first_stage_keys), **kwargs)
        assert x_bsh.shape == (2, cfg.seq_length, cfg.hidden_size)
        out = stages[1](x_bsh, **kwargs)
        if isinstance(out, tuple):  # the runner's hook drops None outputs: do the same
            out = tuple(t for t in out if t is not None)
            out = out[0] if len(out) == 1 else out
        shapes = pipeline.last_stage_outputs(cfg, 2)
        got = (out,) if isinstance(out, torch.Tensor) else out
        assert tuple(tuple(t.shape) for t in got) == shapes
        staged_loss, staged = spec.loss(
            pipeline.outputs_from_stage(out), pipeline.unpack_target(pipeline.pack_target(data)), None
        )
        whole_loss, whole = spec.loss(model(*spec.inputs(data)), data, None)
    assert torch.equal(staged_loss, whole_loss)
    assert staged.keys() == whole.keys()


def test_the_rest_of_the_package_does_not_branch_on_the_model_type():
    """Only models/ and config/ may look at model.type (a run name may print it)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "src" / "scalable_transformer"
    branch = re.compile(r"(\b(model|mc|m|cfg)\.type|model_type)\s*(==|!=|\bin\b|\bnot in\b)")
    offenders = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if path.relative_to(root).parts[0] not in ("models", "config")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line) and "hf_cfg.model_type" not in line
    ]
    assert offenders == []


def test_a_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_spec("gpt").lm_metric = "x"  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_sum_matches_torchs_in_value_and_gradient(dtype):
    from torch.nn import functional as F

    from scalable_transformer.models.spec import IGNORE_INDEX, cross_entropy_sum

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(48, 97, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, 97, (48,), generator=gen)
    labels[::5] = IGNORE_INDEX
    ours = cross_entropy_sum(logits, labels, IGNORE_INDEX)
    (0.37 * ours).backward()
    ours_grad, logits.grad = logits.grad, None
    torchs = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (0.37 * torchs).backward()
    assert ours.dtype == torch.float32 and ours_grad.dtype == dtype
    torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_grad, logits.grad, rtol=1e-5, atol=1e-7)
    assert ours_grad[::5].eq(0).all()  # ignored rows get no gradient


def test_cross_entropy_sum_of_no_labelled_row_is_zero_and_a_second_backward_is_an_error():
    from scalable_transformer.models.spec import IGNORE_INDEX, cross_entropy_sum

    logits = torch.randn(4, 10, requires_grad=True)
    loss = cross_entropy_sum(logits, torch.full((4,), IGNORE_INDEX), IGNORE_INDEX)
    loss.backward()
    assert loss.item() == 0.0 and not str(loss.item()).startswith("-")
    assert logits.grad is not None and logits.grad.eq(0).all()
    # the backward overwrites its saved log-probabilities: reusing the graph must fail, not mislead
    again = cross_entropy_sum(logits, torch.tensor([1, 2, 3, 4]), IGNORE_INDEX)
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        again.backward()


def test_cross_entropy_sum_of_fp32_logits_with_history_reuses_their_buffer_with_torchs_gradients():
    from torch.nn import functional as F

    from scalable_transformer.models.spec import IGNORE_INDEX, cross_entropy_sum

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, 16, generator=gen, requires_grad=True)
    w = (0.5 * torch.randn(97, 16, generator=gen)).requires_grad_()
    labels = torch.randint(0, 97, (48,), generator=gen)
    labels[::7] = IGNORE_INDEX

    logits = F.linear(x, w)
    buffer = logits.data_ptr()
    ours = cross_entropy_sum(logits, labels, IGNORE_INDEX)
    # the log-softmax was written over the logits: the same storage, now log-probabilities
    assert logits.data_ptr() == buffer
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(2, 24))
    (0.37 * ours).backward()
    ours_grads = (x.grad, w.grad)
    x.grad = w.grad = None
    torchs = F.cross_entropy(
        F.linear(x, w).reshape(48, 97), labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (0.37 * torchs).backward()
    torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=0)
    for mine, theirs in zip(ours_grads, (x.grad, w.grad), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: t.detach().requires_grad_(), id="leaf"),
        pytest.param(lambda t: t.reshape(-1, t.shape[-1]), id="view"),
        pytest.param(lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), id="non-contiguous"),
        pytest.param(lambda t: t.detach(), id="no-gradient"),
    ],
)
def test_cross_entropy_sum_leaves_logits_it_may_not_overwrite_as_they_were(make):
    from torch.nn import functional as F

    from scalable_transformer.models.spec import IGNORE_INDEX, cross_entropy_sum

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 8, generator=gen, requires_grad=True)
    logits = make(F.linear(x, torch.randn(11, 8, generator=gen)))
    before = logits.detach().clone()
    labels = torch.randint(0, 11, (15,), generator=gen)
    loss = cross_entropy_sum(logits, labels, IGNORE_INDEX)
    reference = before.requires_grad_()
    torchs = F.cross_entropy(reference.reshape(15, 11), labels, reduction="sum")
    torch.testing.assert_close(loss, torchs)
    assert torch.equal(logits.detach(), reference.detach())
    if logits.requires_grad:
        (mine,) = torch.autograd.grad(loss, logits)
        torchs.backward()
        torch.testing.assert_close(mine, reference.grad)


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_a_training_loss_overwrites_the_models_fp32_logits_and_an_evaluation_loss_does_not(family, overrides):
    """The models hand the loss logits it may overwrite (not a view), and evaluation's accuracy counts
    are the same as over untouched logits."""
    cfg = tiny(family, **overrides)
    spec = spec_for(cfg)
    data = batch(cfg)
    model = build_model(cfg)
    with torch.no_grad():
        outputs = model(*spec.inputs(data))
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        kept = first.clone()
        _, evaluated = spec.loss(outputs, data, None)
    assert torch.equal(first, kept)
    outputs = model(*spec.inputs(data))
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    loss, trained = spec.loss(outputs, data, None)
    torch.testing.assert_close(first.detach(), torch.log_softmax(kept, -1))
    torch.testing.assert_close(trained["loss"], evaluated["loss"])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
