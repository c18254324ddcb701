"""Named timers with an injected clock, and the measured CPU memory peak."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from scalable_transformer.metrics import peak_memory
from scalable_transformer.metrics.peak_memory import MemoryTracker
from scalable_transformer.metrics.timers import Timers, format_ms


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timers_accumulate_and_normalise():
    clock = FakeClock()
    timers = Timers(clock=clock)
    timers("forward").start()
    clock.now = 0.5
    timers("forward").stop()
    clock.now = 1.0
    with timers("forward"):
        clock.now = 1.25
    with timers("optimizer"):
        clock.now = 1.35
    # forward: 0.5 s + 0.25 s = 750 ms over 2 iterations; optimizer: 100 ms over 2
    got = timers.elapsed_ms(["forward", "optimizer"], normalizer=2)
    assert got == pytest.approx({"forward": 375.0, "optimizer": 50.0})
    assert timers.elapsed_ms() == pytest.approx({"forward": 0.0, "optimizer": 0.0})  # reset
    assert timers.names() == ["forward", "optimizer"]


def test_elapsed_without_reset_and_of_a_running_timer():
    clock = FakeClock()
    timers = Timers(clock=clock)
    timers("step").start()
    clock.now = 2.0
    assert timers.elapsed_ms(["step"], reset=False) == pytest.approx({"step": 2000.0})
    assert timers.elapsed_ms(["step"]) == pytest.approx({"step": 2000.0})  # still running, now reset
    clock.now = 3.0
    timers("step").stop()
    assert timers.elapsed_ms(["step"]) == pytest.approx({"step": 1000.0})


def test_sync_fn_called_at_every_start_and_stop():
    calls = []
    timers = Timers(sync_fn=lambda: calls.append(1), clock=FakeClock())
    with timers("backward"):
        pass
    timers("backward").start().stop()
    assert len(calls) == 4


def test_timer_misuse_raises():
    timers = Timers(clock=FakeClock())
    timers("a").start()
    with pytest.raises(RuntimeError, match="already running"):
        timers("a").start()
    timers("a").stop()
    with pytest.raises(RuntimeError, match="not running"):
        timers("a").stop()
    with pytest.raises(KeyError, match="unknown timer"):
        timers.elapsed_ms(["b"])
    with pytest.raises(ValueError, match="normalizer"):
        timers.elapsed_ms(["a"], normalizer=0)


def test_format_ms():
    assert format_ms({"forward-compute": 43.421, "optimizer": 24.05}) == (
        "time (ms) | forward-compute: 43.42 | optimizer: 24.05"
    )


needs_clear_refs = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)


@needs_clear_refs
def test_cpu_peak_rises_by_a_large_allocation_and_resets():
    size = 256 * 2**20  # bytes
    tracker = MemoryTracker(torch.device("cpu"))
    gc.collect()
    tracker.reset_peak()
    before = tracker.peak()
    assert "VmHWM" in before.method and "since last reset" in before.method
    x = torch.ones(size // 4, dtype=torch.float32)  # ones() touches every page, so it is resident
    after = tracker.peak()
    assert after.peak_allocated_bytes - before.peak_allocated_bytes >= 0.8 * size
    assert after.peak_reserved_bytes == after.peak_allocated_bytes
    del x
    gc.collect()
    tracker.reset_peak()  # the high-water mark falls back to the (smaller) current RSS
    assert tracker.peak().peak_allocated_bytes < after.peak_allocated_bytes - 0.5 * size


def test_cpu_fallbacks_say_what_they_measure(tmp_path, monkeypatch):
    tracker = MemoryTracker("cpu")
    monkeypatch.setattr(peak_memory, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    tracker.reset_peak()
    stats = tracker.peak()
    if os.path.exists("/proc/self/status"):
        assert "reset unavailable" in stats.method
    monkeypatch.setattr(peak_memory, "_STATUS", str(tmp_path / "missing" / "status"))
    stats = tracker.peak()
    assert "ru_maxrss" in stats.method and stats.peak_allocated_bytes > 0


def test_unsupported_device():
    with pytest.raises(ValueError, match="cuda and cpu"):
        MemoryTracker("meta")


@needs_clear_refs
def test_run_peak_keeps_what_interval_resets_discard():
    """The whole-run high-water mark still shows an allocation made before the interval resets (model
    initialization happens before the trainer's first reset)."""
    tracker = MemoryTracker("cpu")
    tracker.reset_peak()
    size = 256 * 2**20
    block = torch.ones(size // 4)  # touched: resident
    during = tracker.peak().peak_allocated_bytes
    del block
    tracker.reset_peak()
    tracker.reset_peak()
    assert tracker.peak().peak_allocated_bytes < during - 0.5 * size  # the interval forgot it
    run = tracker.run_peak()
    # the kernel's RSS counters lag by a few pages (per-thread caches), hence the small margin
    assert run.peak_allocated_bytes >= during - 0.05 * size and "whole run" in run.method


def test_model_state_bytes_counts_each_storage_once():
    """Parameters, gradients, Adam's two moments; a tied weight counts once, Adam's step counter not."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=True)
    head.weight = emb.weight  # tied: one storage of 40 floats
    model = torch.nn.Sequential(emb, head)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert peak_memory.model_state_bytes(model, opt)["optimizer"] == 0  # no state before the first step
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sizes = peak_memory.model_state_bytes(model, opt)
    params = (40 + 10) * 4
    assert sizes == {"parameters": params, "gradients": params, "optimizer": 2 * params}


def test_model_state_bytes_sees_zero_redundancy_shards():
    """ZeroRedundancyOptimizer keeps its shard's state in `.optim`; without a group it holds everything."""
    pytest.importorskip("torch.distributed.optim")
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if dist.is_initialized():
        pytest.skip("needs its own process group")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(8, 8)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
        model(torch.ones(1, 8)).sum().backward()
        opt.step()
        assert peak_memory.model_state_bytes(model, opt)["optimizer"] == 2 * (64 + 8) * 4
    finally:
        dist.destroy_process_group()
