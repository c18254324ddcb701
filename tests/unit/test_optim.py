"""Optimizer builder and lr schedules (train/optim.py).

Expected learning rates are written out by hand from Megatron-LM's `OptimizerParamScheduler.get_lr`
and DeepSpeed's `WarmupLR` as the DeepSpeed engine steps it, not computed by the code under test.
"""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from torch import nn

from scalable_transformer.config.schedule import lr_at
from scalable_transformer.config.schema import Config, OptimConfig, TrainConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.train.optim import build_optimizer, build_scheduler, param_groups

LR, MIN_LR = 1e-3, 1e-4


def optim_cfg(**kw: object) -> OptimConfig:
    return dataclasses.replace(OptimConfig(), **kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TinyLM(nn.Module):
    """Embedding tied to the output layer, LayerNorm, RMSNorm, biased and bias-free linears, a scalar."""

    def __init__(self, vocab: int = 11, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.rms = RMSNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.frozen = nn.Parameter(torch.zeros(hidden, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.rms(self.fc(self.ln(self.embed(ids))))) * self.scale


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


# ---------------------------------------------------------------------------------------- param groups


def test_param_groups_split_by_ndim_tied_once_frozen_excluded():
    model = tiny_lm()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model.embed.weight), id(model.fc.weight)]
    # named_parameters() order: a module's own parameters before its children's
    assert [id(p) for p in no_decay["params"]] == [
        id(model.scale),
        id(model.ln.weight),
        id(model.ln.bias),
        id(model.fc.bias),
        id(model.rms.weight),
    ]
    # exactly the trainable 1-D (and 0-D) parameters, each parameter once
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in trainable if p.ndim < 2}
    everything = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(everything) == len(set(everything)) == len(trainable)


def test_param_groups_deterministic_and_both_groups_always_present():
    a, b = tiny_lm(), tiny_lm()
    names_a = {id(p): n for n, p in a.named_parameters()}
    names_b = {id(p): n for n, p in b.named_parameters()}
    ga, gb = param_groups(a, 0.01), param_groups(b, 0.01)
    assert [[names_a[id(p)] for p in g["params"]] for g in ga] == [
        [names_b[id(p)] for p in g["params"]] for g in gb
    ]
    groups = param_groups(nn.Linear(3, 3, bias=False), 0.01)
    assert len(groups) == 2 and groups[1]["params"] == []


# ---------------------------------------------------------------------------------------- optimizers


def test_build_optimizer_types_and_hyperparameters():
    model = tiny_lm()
    cfg = optim_cfg(lr=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.05)
    for name in ("adam", "adamw"):
        opt = build_optimizer(model, dataclasses.replace(cfg, optimizer=name))
        assert type(opt) is torch.optim.AdamW
        g = opt.param_groups[0]
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.05)
        assert opt.param_groups[1]["weight_decay"] == 0.0
    assert type(build_optimizer(model, dataclasses.replace(cfg, adam_w_mode=False))) is torch.optim.Adam
    sgd = build_optimizer(model, dataclasses.replace(cfg, optimizer="sgd", sgd_momentum=0.7))
    assert type(sgd) is torch.optim.SGD
    assert sgd.param_groups[0]["momentum"] == 0.7
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.05, 0.0]


def _one_step(cfg: OptimConfig) -> list[torch.Tensor]:
    model = tiny_lm()
    opt = build_optimizer(model, cfg)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    model(ids).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_adamw_and_adam_differ_with_weight_decay_and_match_without():
    adamw = optim_cfg(lr=1e-2, weight_decay=0.1, adam_w_mode=True)
    adam = dataclasses.replace(adamw, adam_w_mode=False)
    with_wd = list(zip(_one_step(adamw), _one_step(adam), strict=True))
    assert any(not torch.equal(a, b) for a, b in with_wd)
    adamw0, adam0 = dataclasses.replace(adamw, weight_decay=0.0), dataclasses.replace(adam, weight_decay=0.0)
    for a, b in zip(_one_step(adamw0), _one_step(adam0), strict=True):
        assert torch.equal(a, b)


def test_adamw_decay_is_decoupled():
    # First AdamW step: p -= lr * wd * p, then the Adam step (magnitude ~lr, sign of the grad).
    # With L2 instead, the decay term would pass through the normalisation and vanish into ~lr.
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)
    opt = build_optimizer(model, optim_cfg(lr=0.1, weight_decay=0.5, adam_eps=0.0))
    model.weight.grad = torch.tensor([[1.0]])
    opt.step()
    assert model.weight.item() == pytest.approx(2.0 * (1 - 0.1 * 0.5) - 0.1)


# ---------------------------------------------------------------------------------------- megatron schedule


def megatron(style: str, **kw: object) -> OptimConfig:
    base: dict[str, object] = dict(
        scheduler="megatron",
        lr=LR,
        min_lr=MIN_LR,
        lr_decay_style=style,
        lr_warmup_iters=10,
        lr_decay_iters=110,
    )
    base.update(kw)
    return optim_cfg(**base)


# iterations: start, mid-warmup, end of warmup, mid-decay, three-quarters, end of decay, past end
ITERS = [0, 5, 10, 60, 85, 110, 111, 500]


@pytest.mark.parametrize("it", ITERS)
def test_megatron_linear(it):
    expected = {
        0: 0.0,
        5: LR * 5 / 10,
        10: LR,
        60: MIN_LR + (1 - 50 / 100) * (LR - MIN_LR),
        85: MIN_LR + (1 - 75 / 100) * (LR - MIN_LR),
        110: MIN_LR,
        111: MIN_LR,
        500: MIN_LR,
    }[it]
    assert lr_at(it, megatron("linear"), train_iters=1000) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("it", ITERS)
def test_megatron_cosine(it):
    expected = {
        0: 0.0,
        5: LR / 2,
        10: LR,
        60: MIN_LR + 0.5 * (math.cos(math.pi * 0.5) + 1) * (LR - MIN_LR),  # halfway: the mean
        85: MIN_LR + 0.5 * (math.cos(math.pi * 0.75) + 1) * (LR - MIN_LR),
        110: MIN_LR,
        111: MIN_LR,
        500: MIN_LR,
    }[it]
    assert lr_at(it, megatron("cosine"), train_iters=1000) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if it == 60:
        assert expected == pytest.approx((LR + MIN_LR) / 2)


@pytest.mark.parametrize("it", ITERS)
def test_megatron_constant(it):
    expected = {0: 0.0, 5: LR / 2}.get(it, LR)  # constant after warmup, also past lr_decay_iters
    assert lr_at(it, megatron("constant"), train_iters=1000) == pytest.approx(expected, rel=1e-12)


def test_megatron_no_warmup_starts_at_peak():
    cfg = megatron("linear", lr_warmup_iters=0, lr_decay_iters=100)
    assert lr_at(0, cfg, 100) == LR
    assert lr_at(50, cfg, 100) == pytest.approx(MIN_LR + 0.5 * (LR - MIN_LR))


def test_megatron_decay_iters_default_to_train_iters():
    cfg = megatron("linear", lr_decay_iters=None, min_lr=0.0)
    assert lr_at(60, cfg, train_iters=110) == pytest.approx(LR * (1 - 50 / 100))
    assert lr_at(60, cfg, train_iters=210) == pytest.approx(LR * (1 - 50 / 200))
    assert lr_at(111, cfg, train_iters=110) == 0.0


def test_megatron_warmup_fraction_matches_iters_and_overrides_them():
    by_iters = megatron("cosine", lr_warmup_iters=10, lr_decay_iters=100)
    by_fraction = megatron("cosine", lr_warmup_iters=77, lr_warmup_fraction=0.1, lr_decay_iters=100)
    for it in range(0, 120, 3):
        assert lr_at(it, by_fraction, 100) == lr_at(it, by_iters, 100)
    # the fraction is taken of lr_decay_iters (default train_iters) and not rounded: 0.25 * 10 = 2.5
    cfg = megatron("linear", lr_warmup_fraction=0.25, lr_decay_iters=None, min_lr=0.0)
    assert lr_at(1, cfg, 10) == pytest.approx(LR * 1 / 2.5)
    assert lr_at(2, cfg, 10) == pytest.approx(LR * 2 / 2.5)
    assert lr_at(3, cfg, 10) == pytest.approx(LR * (1 - 0.5 / 7.5))


# ---------------------------------------------------------------------------------------- DeepSpeed WarmupLR


def warmup_lr(kind: str, **kw: object) -> OptimConfig:
    base: dict[str, object] = dict(
        scheduler="warmup_lr", lr=LR, warmup_min_lr=MIN_LR, warmup_type=kind, lr_warmup_iters=8
    )
    base.update(kw)
    return optim_cfg(**base)


@pytest.mark.parametrize("it", [0, 1, 2, 5, 8, 9, 10, 100])
def test_warmup_lr_log(it):
    # DeepSpeed: gamma = log(s + 1) / log(8) with s = last_batch_iteration = it - 1 (0 at it = 0)
    expected = {
        0: MIN_LR,
        1: MIN_LR,  # log(1) = 0
        2: MIN_LR + (math.log(2) / math.log(8)) * (LR - MIN_LR),
        5: MIN_LR + (math.log(5) / math.log(8)) * (LR - MIN_LR),
        8: LR,  # log(8) / log(8): the peak at step 8
        9: LR,
        10: LR,
        100: LR,
    }[it]
    assert lr_at(it, warmup_lr("log"), train_iters=1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("it", [0, 1, 2, 5, 8, 9, 10, 100])
def test_warmup_lr_linear(it):
    expected = {
        0: MIN_LR,
        1: MIN_LR,
        2: MIN_LR + (1 / 8) * (LR - MIN_LR),
        5: MIN_LR + (4 / 8) * (LR - MIN_LR),
        8: MIN_LR + (7 / 8) * (LR - MIN_LR),
        9: LR,  # s = 8 = warmup_num_steps
        10: LR,
        100: LR,
    }[it]
    assert lr_at(it, warmup_lr("linear"), train_iters=1) == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_clamps_warmup_to_two_steps_as_deepspeed():
    for iters in (0, 1):
        cfg = warmup_lr("linear", lr_warmup_iters=iters, warmup_min_lr=0.0)
        assert [lr_at(i, cfg, 1) for i in range(5)] == pytest.approx([0.0, 0.0, LR / 2, LR, LR])


# ---------------------------------------------------------------------------------------- torch scheduler


SCHEDULES = {
    "linear": megatron("linear", lr_warmup_iters=4, lr_decay_iters=20),
    "cosine": megatron("cosine", lr_warmup_iters=4, lr_decay_iters=20),
    "constant": megatron("constant", lr_warmup_iters=4, lr_decay_iters=20),
    "fraction": megatron("cosine", lr_warmup_fraction=0.3, lr_decay_iters=None),
    "min_lr_equals_lr": megatron("linear", min_lr=LR, lr_warmup_iters=0, lr_decay_iters=20),
    "lr_zero": megatron("cosine", lr=0.0, min_lr=0.0, lr_warmup_iters=3, lr_decay_iters=20),
    "warmup_log": warmup_lr("log", lr_warmup_iters=6),
    "warmup_linear": warmup_lr("linear", lr_warmup_iters=6, warmup_min_lr=0.0),
    "warmup_lr_zero": warmup_lr("log", lr=0.0, warmup_min_lr=0.0),
}
RUN = 25  # longer than every schedule above, so the tail is covered too


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_scheduler_drives_optimizer_lr_to_lr_at(name):
    cfg = SCHEDULES[name]
    model = tiny_lm()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, train_iters=RUN)
    ids = torch.tensor([[1, 2, 3]])
    seen = []
    for i in range(RUN):
        expected = lr_at(i, cfg, RUN)
        assert [g["lr"] for g in opt.param_groups] == [expected, expected], f"step {i}"
        assert sched.get_last_lr() == [expected, expected]
        seen.append(expected)
        opt.zero_grad()
        model(ids).sum().backward()
        opt.step()
        sched.step()
    if name in ("lr_zero", "warmup_lr_zero"):
        assert set(seen) == {0.0}
    elif name == "min_lr_equals_lr":
        assert set(seen) == {LR}
    else:
        assert len(set(seen)) > 2


def test_scheduler_state_dict_round_trips_through_torch_save():
    cfg = SCHEDULES["cosine"]
    model = tiny_lm()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, RUN)
    for _ in range(7):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # numbers only: safe to load

    # resume into fresh objects without loading the optimizer state: the lr must still be lr_at(7)
    opt2 = build_optimizer(tiny_lm(), cfg)
    sched2 = build_scheduler(opt2, cfg, RUN)
    sched2.load_state_dict(state)
    for i in range(7, RUN):
        assert [g["lr"] for g in opt2.param_groups] == [lr_at(i, cfg, RUN)] * 2
        assert [g["lr"] for g in opt.param_groups] == [lr_at(i, cfg, RUN)] * 2
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()


# ---------------------------------------------------------------------------------------- errors


BAD = [
    (dict(lr=-1e-3), "optim.lr"),
    (dict(min_lr=-1e-5), "optim.min_lr"),
    (dict(min_lr=2e-3, lr=1e-3), "optim.min_lr"),
    (dict(lr_warmup_iters=-1), "optim.lr_warmup_iters"),
    (dict(lr_warmup_iters=200, lr_decay_iters=100), "optim.lr_warmup_iters"),
    (dict(lr_warmup_iters=100, lr_decay_iters=100), "optim.lr_warmup_iters"),  # Megatron: warmup < decay
    (dict(lr_warmup_iters=50, lr_decay_iters=None), "train.train_iters"),  # decay defaults to train_iters
    (dict(lr_decay_iters=0), "optim.lr_decay_iters"),
    (dict(lr_decay_iters=-5), "optim.lr_decay_iters"),
    (dict(lr_warmup_fraction=1.0), "optim.lr_warmup_fraction"),
    (dict(lr_warmup_fraction=-0.1), "optim.lr_warmup_fraction"),
    (dict(lr_decay_style="exponential"), "optim.lr_decay_style"),
    (dict(scheduler="onecycle"), "optim.scheduler"),
    (dict(scheduler="warmup_lr", warmup_min_lr=-1.0), "optim.warmup_min_lr"),
    (dict(scheduler="warmup_lr", warmup_min_lr=1.0, lr=1e-3), "optim.warmup_min_lr"),
    (dict(scheduler="warmup_lr", lr_warmup_iters=-3), "optim.lr_warmup_iters"),
    (dict(scheduler="warmup_lr", lr_warmup_fraction=0.1), "optim.lr_warmup_fraction"),
    (dict(scheduler="warmup_lr", warmup_type="cosine"), "optim.warmup_type"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD, ids=[f"{k}:{sorted(o)}" for o, k in BAD])
def test_bad_schedule_settings_raise_naming_the_key(overrides, key):
    cfg = optim_cfg(**{"lr_decay_iters": 100, **overrides})
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        lr_at(0, cfg, train_iters=20)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_scheduler(build_optimizer(tiny_lm(), dataclasses.replace(cfg, lr=1e-3)), cfg, train_iters=20)
    # and when the config is resolved, the one check `stx plan`, its dry run and `stx train` share (a
    # schedule `stx plan` let pass once stopped the dry run and the run)
    whole = Config(optim=cfg, train=TrainConfig(train_iters=20))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        resolve(whole)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (dict(optimizer="lamb"), "optim.optimizer"),
        (dict(optimizer="adamw", adam_w_mode=False), "optim.adam_w_mode"),
        (dict(weight_decay=-0.1), "optim.weight_decay"),
        (dict(lr=-1.0), "optim.lr"),
    ],
)
def test_bad_optimizer_settings_raise_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_optimizer(tiny_lm(), optim_cfg(**overrides))


def test_negative_iteration_raises():
    with pytest.raises(ValueError, match="iteration"):
        lr_at(-1, OptimConfig(), train_iters=10)
