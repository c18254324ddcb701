"""The training step: accumulation is numerics-neutral, seeds reproduce, fp16 skips overflowing steps."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.metrics.flops import ModelShape, flops_per_iteration
from scalable_transformer.metrics.sinks import Sinks
from scalable_transformer.models import build_model, count_parameters
from scalable_transformer.parallel.dims import ParallelDims
from scalable_transformer.train.measurement import Measurement
from scalable_transformer.train.optim import build_optimizer, build_scheduler
from scalable_transformer.train.run import run_training
from scalable_transformer.train.trainer import Trainer

VOCAB, SEQ = 64, 16


def tiny_cfg(model_type: str, micro: int, accum: int, *extra: str):
    return resolve(
        load_config(
            f"tiny-{model_type}",
            [
                "model.num_layers=2",
                "model.hidden_size=32",
                "model.num_attention_heads=2",
                f"model.seq_length={SEQ}",
                f"model.vocab_size={VOCAB}",
                "model.make_vocab_size_divisible_by=8",
                "model.hidden_dropout=0",
                "model.attention_dropout=0",
                f"train.micro_batch_size={micro}",
                f"train.gradient_accumulation_steps={accum}",
                "train.train_iters=3",
                "optim.lr_warmup_fraction=0",
                "optim.lr=1e-2",
                *extra,
            ],
        )
    )


def global_batches(model_type: str, size: int, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Synthetic global batches; BERT batches have uneven masked counts per half on purpose."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(5, VOCAB, (size, SEQ), generator=g)
        if model_type == "gpt":
            out.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)})
            continue
        labels = torch.full_like(ids, -100)
        masked = torch.rand(size, SEQ, generator=g) < torch.linspace(0.05, 0.5, size)[:, None]
        labels[masked] = ids[masked]
        out.append(
            {
                "input_ids": ids,
                "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(size, SEQ).clone(),
                "attention_mask": torch.ones_like(ids),
                "labels": labels,
                "nsp_labels": torch.randint(0, 2, (size,), generator=g),
            }
        )
    return out


def make_trainer(cfg, micro_batches) -> Trainer:
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)
    flops = flops_per_iteration(
        ModelShape.from_config(cfg.model, count_parameters(cfg.model)),
        cfg.train.global_batch_size,
        "megatron",
    )
    measurement = Measurement(
        cfg, torch.device("cpu"), ParallelDims(dp=1, tp=1, pp=1), flops, 1e12, Sinks([])
    )
    return Trainer(cfg, model, optimizer, scheduler, iter(micro_batches), lambda: [], measurement)


def split(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    return [
        dict(zip(batch, chunk, strict=True))
        for chunk in zip(*(v.chunk(parts) for v in batch.values()), strict=True)
    ]


@pytest.mark.parametrize("model_type", ["bert", "gpt"])
def test_accumulation_matches_one_large_micro_batch(model_type):
    batches = global_batches(model_type, size=4, steps=3)
    # SGD, not Adam: Adam divides by sqrt(v), which turns float noise in gradients that are zero in
    # exact arithmetic (the key bias) into lr-sized updates, hiding what this test compares.
    one = make_trainer(tiny_cfg(model_type, 4, 1, "optim.optimizer=sgd"), [])
    two = make_trainer(tiny_cfg(model_type, 2, 2, "optim.optimizer=sgd"), [])
    for batch in batches:
        a = one.train_step([batch])
        b = two.train_step(split(batch, 2))
        assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-6, abs=1e-6)
        assert float(a.grad_norm) == pytest.approx(float(b.grad_norm), rel=1e-5)
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_per_micro_batch_mean_would_not_match():
    """Guards the test above: averaging per-micro-batch means (not token-weighted) gives another loss."""
    batch = global_batches("bert", size=4, steps=1)[0]
    from scalable_transformer.models import compute_loss, model_inputs

    torch.manual_seed(0)
    model = build_model(tiny_cfg("bert", 4, 1).model)
    with torch.no_grad():
        whole = compute_loss("bert", model(*model_inputs("bert", batch)), batch)[0]
        halves = [compute_loss("bert", model(*model_inputs("bert", h)), h)[0] for h in split(batch, 2)]
    assert abs(float(whole) - float(sum(halves) / 2)) > 1e-4


def test_fp16_overflow_skips_the_step_and_backs_off():
    # hysteresis 1: the first overflow halves the scale (the default 2 tolerates one; see test_loss_scale)
    cfg = tiny_cfg("gpt", 2, 1, "train.precision=fp16", "train.initial_scale_power=8", "train.hysteresis=1")
    batches = global_batches("gpt", size=2, steps=3)
    trainer = make_trainer(cfg, [])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    scale = trainer.scaler.get_scale()
    first = trainer.model.get_submodule("layers")[0]
    handle = first.register_forward_hook(lambda m, i, out: out * math.inf)  # inject an overflow
    result = trainer.train_step([batches[0]])
    handle.remove()
    assert result.skipped and trainer.scaler.get_scale() == scale / 2
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    assert trainer.scheduler.last_epoch == 0  # a skipped update does not advance the schedule
    result = trainer.train_step([batches[1]])
    assert not result.skipped and math.isfinite(float(result.loss))
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if json.loads(line)["kind"] == "train"]


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_differs(tmp_path):
    def run(seed: int, name: str):
        overrides = [
            "train.train_iters=4",
            "logging.log_interval=1",
            "train.eval_interval=0",
            "train.eval_iters=1",
            "train.micro_batch_size=4",
            "model.seq_length=32",
            f"train.seed={seed}",
            f"logging.run_dir={tmp_path}",
            f"logging.run_name={name}",
            "logging.tensorboard=false",
        ]
        run_dir, _ = run_training(load_config("tiny-bert", overrides))
        return _losses(run_dir)

    a, b, c = run(7, "a"), run(7, "b"), run(8, "c")
    assert len(a) == 4 and a == b
    assert a != c


def test_static_loss_scale_skips_overflow_without_backing_off():
    cfg = tiny_cfg("gpt", 2, 1, "train.precision=fp16", "train.loss_scale=256")
    trainer = make_trainer(cfg, [])
    batch = global_batches("gpt", size=2, steps=1)[0]
    handle = trainer.model.get_submodule("layers")[0].register_forward_hook(lambda m, i, out: out * math.inf)
    result = trainer.train_step([batch])
    handle.remove()
    assert result.skipped and trainer.scaler.get_scale() == 256.0
    assert trainer.scheduler.last_epoch == 0


def test_a_run_resolves_its_config_once(tmp_path):
    """`resolve` runs once per run: the tokenizer's vocabulary completes the resolved config
    (`with_vocabulary`) instead of a second resolve. Counted on the function's code object, so no
    module's own reference to it can hide a call."""
    import sys

    from scalable_transformer.config import validate

    calls = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code is validate.resolve.__code__:
            calls.append(frame.f_code.co_name)

    overrides = [
        "train.train_iters=1",
        "train.eval_iters=0",
        "train.micro_batch_size=2",
        "model.seq_length=32",
        f"logging.run_dir={tmp_path}",
        "logging.tensorboard=false",
    ]
    cfg = load_config("tiny-bert", overrides)
    sys.setprofile(count)
    try:
        _, summary = run_training(cfg)
    finally:
        sys.setprofile(None)
    assert summary["iterations"] == 1
    assert calls == ["resolve"]
