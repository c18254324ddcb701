"""metrics.live_tensor_bytes: the replay of CPU allocation events that puts back the frees the profiler
cannot see (those made on an untracked thread, gloo's worker)."""

from __future__ import annotations

import torch

from scalable_transformer.metrics.live_tensor_bytes import (
    _MARK,
    Allocation,
    peak_from_profile,
    replay_allocations,
)

MAIN, WORKER = 1, 2


def test_seen_frees_replay_exactly():
    events = [
        Allocation(1, 0xA, 100, MAIN),
        Allocation(2, 0xB, 50, MAIN),
        Allocation(3, 0xA, -100, MAIN),
        Allocation(4, 0xC, 30, MAIN),
    ]
    assert replay_allocations(events, [], mark=0) == 150
    assert replay_allocations(events, [], mark=4) == 80  # the peak counts from the mark on


def test_address_reused_while_live_frees_the_old_block():
    events = [
        Allocation(1, 0xA, 100, MAIN),  # freed on another thread, never seen
        Allocation(2, 0xA, 40, MAIN),
        Allocation(3, 0xB, 10, MAIN),
    ]
    assert replay_allocations(events, [], mark=2) == 50


def test_collective_block_freed_at_the_workers_next_event_end():
    # a staging copy made inside a collective call (ends at 3), whose free the worker made unseen;
    # the worker's event for that work ends at 5
    events = [
        Allocation(1, 0xA, 100, MAIN),
        Allocation(2, 0x5, 1000, MAIN, collective_end=3),
        Allocation(4, 0xB, 10, MAIN),  # still live then: 1110
        Allocation(6, 0xC, 500, MAIN),  # after the worker's event: 100 + 10 + 500
    ]
    workers = [(MAIN, 3), (WORKER, 2), (WORKER, 5), (WORKER, 9)]
    assert replay_allocations(events, workers, mark=0) == 1110
    assert replay_allocations(events, workers, mark=6) == 610
    # without a worker event the block stays counted (the address rule alone)
    assert replay_allocations(events, [(MAIN, 3)], mark=6) == 1610


def test_collective_block_seen_freed_is_left_alone():
    events = [
        Allocation(1, 0x5, 1000, MAIN, collective_end=3),
        Allocation(6, 0xB, 10, MAIN),
        Allocation(7, 0x5, -1000, MAIN),  # the caller dropped it last: seen
    ]
    workers = [(WORKER, 5)]
    assert replay_allocations(events, workers, mark=6) == 1010  # live until 7: not released at 5


def test_release_does_not_free_a_new_block_at_the_same_address():
    events = [
        Allocation(1, 0x5, 1000, MAIN, collective_end=2),
        Allocation(3, 0x5, 200, MAIN),  # address reused: the staging block was freed by then
        Allocation(6, 0xB, 10, MAIN),
    ]
    assert replay_allocations(events, [(WORKER, 5)], mark=6) == 210


def test_blocks_outside_collectives_keep_the_address_rule_only():
    events = [Allocation(1, 0xA, 100, MAIN), Allocation(6, 0xB, 10, MAIN)]
    assert replay_allocations(events, [(WORKER, 5)], mark=6) == 110


def test_peak_from_a_real_profile():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = torch.empty(1 << 16)  # 256 KiB
        with torch.profiler.record_function(_MARK):
            pass
        tmp = torch.empty(1 << 14)  # 64 KiB, then freed
        del tmp
        small = torch.empty(1 << 10)  # 4 KiB
    assert peak_from_profile(prof) == (1 << 18) + (1 << 16)
    del keep, small


def test_no_mark_no_peak():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.empty(16)
    assert peak_from_profile(prof) is None
    del x
