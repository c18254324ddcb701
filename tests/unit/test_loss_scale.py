"""Loss scalers: Megatron's dynamic rule, static scale, exact unscaling, DTensor grads, rank agreement."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from scalable_transformer.config.schema import TrainConfig
from scalable_transformer.train.loss_scale import (
    DynamicLossScaler,
    NoLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)


def dynamic(scale: float = 2.0**10, window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0):
    return DynamicLossScaler(scale, growth_interval=window, hysteresis=hysteresis, min_scale=min_scale)


def scales_after(scaler: DynamicLossScaler, found_infs: list[bool]) -> list[float]:
    out = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        out.append(scaler.get_scale())
    return out


def test_build_follows_precision_and_deepspeed_defaults():
    assert not build_loss_scaler(TrainConfig(precision="fp32")).is_enabled()
    assert not build_loss_scaler(TrainConfig(precision="bf16", loss_scale=128.0)).is_enabled()
    static = build_loss_scaler(TrainConfig(precision="fp16", loss_scale=128.0))
    assert isinstance(static, StaticLossScaler) and static.get_scale() == 128.0
    dyn = build_loss_scaler(TrainConfig(precision="fp16"))
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.get_scale(), dyn.growth_interval, dyn.hysteresis, dyn.min_scale) == (2.0**16, 1000, 2, 1.0)
    custom = build_loss_scaler(
        TrainConfig(
            precision="fp16", initial_scale_power=8, loss_scale_window=5, hysteresis=3, min_loss_scale=4.0
        )
    )
    assert isinstance(custom, DynamicLossScaler)
    assert (custom.get_scale(), custom.growth_interval, custom.hysteresis, custom.min_scale) == (
        256.0,
        5,
        3,
        4.0,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": 0.0},
        {"scale": math.inf},
        {"min_scale": 0.0},
        {"scale": 4.0, "min_scale": 8.0},
        {"window": 0},
        {"hysteresis": 0},
    ],
)
def test_dynamic_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        dynamic(**kwargs)


def test_static_rejects_bad_scale():
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)


def test_dynamic_hysteresis_1_halves_on_first_overflow():
    assert scales_after(dynamic(1024.0, hysteresis=1), [True, True]) == [512.0, 256.0]


def test_dynamic_hysteresis_2_keeps_scale_on_first_overflow_and_halves_on_second():
    assert scales_after(dynamic(1024.0, hysteresis=2), [True, True, True]) == [1024.0, 512.0, 256.0]


def test_dynamic_clean_steps_short_of_the_window_do_not_restore_hysteresis():
    # Megatron's rule: only growth refills the hysteresis tracker, so these overflows need not be consecutive.
    assert scales_after(dynamic(1024.0, window=4, hysteresis=2), [True, False, False, True]) == [
        1024.0
    ] * 3 + [512.0]


def test_dynamic_grows_after_window_clean_steps_and_restores_hysteresis():
    scaler = dynamic(1024.0, window=3, hysteresis=2)
    # The overflow spends one unit of hysteresis and restarts the window: 3 more clean steps to grow.
    assert scales_after(scaler, [True, False, False]) == [1024.0] * 3
    assert scales_after(scaler, [False]) == [2048.0]
    assert scaler.state_dict() == {"scale": 2048.0, "growth_tracker": 0, "hysteresis_tracker": 2}
    # Hysteresis restored: again the first overflow is tolerated, the second halves.
    assert scales_after(scaler, [True, True]) == [2048.0, 1024.0]
    assert scales_after(scaler, [False] * 3) == [1024.0, 1024.0, 2048.0]


def test_dynamic_never_drops_below_min_scale():
    assert scales_after(dynamic(8.0, hysteresis=1, min_scale=1.0), [True] * 5) == [4.0, 2.0, 1.0, 1.0, 1.0]
    assert scales_after(dynamic(8.0, hysteresis=1, min_scale=3.0), [True] * 3) == [4.0, 3.0, 3.0]


def test_dynamic_state_dict_round_trip():
    scaler = dynamic(1024.0, window=4, hysteresis=3)
    scales_after(scaler, [True, False, False])
    state = scaler.state_dict()
    assert state == {"scale": 1024.0, "growth_tracker": 2, "hysteresis_tracker": 2}
    restored = dynamic(2.0**16, window=4, hysteresis=3)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    steps = [False, False, True, True, True]
    assert (
        scales_after(restored, steps)
        == scales_after(scaler, steps)
        == [1024.0, 2048.0, 2048.0, 2048.0, 1024.0]
    )
    with pytest.raises(ValueError, match="hysteresis_tracker"):
        restored.load_state_dict({"scale": 1.0, "growth_tracker": 0})


def test_unscale_divides_exactly_across_dtypes():
    scaler = StaticLossScaler(2.0**12)
    values = torch.tensor([3.0, -5.0, 0.25, 0.0])
    grads = [values * 2.0**12, (values * 2.0**12).half(), (values * 2.0**12).bfloat16()]
    assert scaler.unscale_(grads) is False
    assert torch.equal(grads[0], values)
    assert torch.equal(grads[1], values.half())
    assert torch.equal(grads[2], values.bfloat16())
    assert torch.equal(scaler.scale(torch.tensor(1.5)), torch.tensor(1.5 * 2.0**12))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_flags_inf_and_nan(bad):
    scaler = dynamic(4.0)
    grads = [torch.ones(3), torch.ones(2, dtype=torch.float16)]
    grads[1][1] = bad
    assert scaler.unscale_(grads) is True
    assert scaler.unscale_([torch.ones(3)]) is False
    assert scaler.unscale_([]) is False


def test_disabled_scaler_leaves_grads_alone_and_skips_collectives(monkeypatch):
    def no_collectives(*args, **kwargs):
        raise AssertionError("a disabled scaler must not communicate")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", no_collectives)
    scaler = NoLossScaler()
    grads = [torch.tensor([8.0, math.inf])]
    assert scaler.unscale_(grads) is False
    assert torch.equal(grads[0], torch.tensor([8.0, math.inf]))
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    scaler.update(True)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_static_scale_is_constant_and_reports_overflow():
    scaler = StaticLossScaler(256.0)
    for _ in range(3):
        grads = [torch.tensor([256.0, math.inf])]
        assert scaler.unscale_(grads) is True
        scaler.update(True)
        assert scaler.get_scale() == 256.0
    grads = [torch.tensor([512.0])]
    assert scaler.unscale_(grads) is False and torch.equal(grads[0], torch.tensor([2.0]))
    scaler.update(False)
    assert scaler.get_scale() == 256.0


@pytest.fixture
def single_rank_gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_unscale_dtensor_grads_in_place(single_rank_gloo):
    scaler = StaticLossScaler(8.0)
    grad = distribute_tensor(torch.full((4, 2), 8.0), single_rank_gloo, [Shard(0)])
    other = torch.full((3,), 16.0)
    assert scaler.unscale_([grad, other]) is False
    assert torch.equal(grad.to_local(), torch.ones(4, 2)) and torch.equal(other, torch.full((3,), 2.0))

    grad.to_local()[2, 1] = math.inf
    assert scaler.unscale_([grad]) is True


def _agreement_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        group = dist.new_group([0, 1])
        scaler = DynamicLossScaler(1024.0, growth_interval=1000, hysteresis=1, min_scale=1.0)
        results = []
        # Round 1: only rank 1 overflows. Round 2: rank 0 has no grads, rank 1 is clean.
        # Round 3: rank 0 has no grads, rank 1 overflows; rank 0 must still learn of it.
        rounds = [
            [torch.full((3,), 1024.0)] if rank == 0 else [torch.tensor([1.0, math.inf])],
            [] if rank == 0 else [torch.ones(2)],
            [] if rank == 0 else [torch.tensor([math.nan])],
        ]
        for grads in rounds:
            found_inf = scaler.unscale_(grads, group)
            scaler.update(found_inf)
            results.append([found_inf, scaler.get_scale()])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_found_inf_agreed_across_ranks(tmp_path):
    mp.spawn(_agreement_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert per_rank[0] == per_rank[1] == [[True, 512.0], [False, 512.0], [True, 256.0]]
