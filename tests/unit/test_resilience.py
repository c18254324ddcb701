"""The decisions of train/resilience.py on plain numbers: non-finite steps, loss spikes, exit statuses."""

from __future__ import annotations

import math
import os
import signal

import pytest

from scalable_transformer.errors import NonFiniteError
from scalable_transformer.train.outputs import with_segment
from scalable_transformer.train.resilience import (
    EXIT_RESUMABLE,
    LossSpikes,
    NonFiniteSteps,
    StopSignals,
    exit_status,
)
from scalable_transformer.train.watchdog import DEFAULT_BOUNDS, HangWatchdog, default_timeout


def test_finite_steps_pass_and_stop_names_the_step_and_what_was_not_finite() -> None:
    steps = NonFiniteSteps("stop", max_skipped=10)
    assert steps.check(1, 2.5, 0.7) is False
    with pytest.raises(NonFiniteError, match=r"iteration 7: the gradient norm is inf \(train.on_nonfinite"):
        steps.check(7, 2.5, math.inf)
    with pytest.raises(NonFiniteError, match="iteration 8: the loss is nan and the gradient norm is nan"):
        steps.check(8, math.nan, math.nan)


def test_skip_counts_and_stops_past_max_skipped_steps() -> None:
    steps = NonFiniteSteps("skip", max_skipped=2)
    assert steps.check(3, math.nan, 1.0) is True
    assert steps.check(4, 1.0, math.inf) is True
    assert steps.check(5, 1.0, 1.0) is False
    with pytest.raises(NonFiniteError, match=r"3 steps skipped .*\[3, 4, 6\].*max_skipped_steps = 2"):
        steps.check(6, math.nan, 1.0)


def test_loss_spikes_against_the_running_median() -> None:
    spikes = LossSpikes(factor=3.0, window=5, min_history=3)
    assert [spikes.check(x) for x in (2.0, 2.2, 1.8)] == [None, None, None]  # too little history
    assert spikes.check(6.5) == 2.0  # 6.5 > 3 x median(2.0, 2.2, 1.8)
    assert spikes.check(math.nan) is None
    assert LossSpikes(factor=0).check(1e9) is None  # off


def test_exit_status_of_a_summary() -> None:
    assert exit_status({"stopped_by_signal": None}) == 0
    assert exit_status({"stopped_by_signal": "SIGUSR1", "resume_from": "ckpt"}) == EXIT_RESUMABLE
    assert exit_status({"stopped_by_signal": "SIGTERM"}) == 128 + signal.SIGTERM  # nothing saved


def test_stop_signals_are_caught_only_while_active_and_the_first_one_counts() -> None:
    stop = StopSignals(world=None, check_interval=2)
    before = signal.getsignal(signal.SIGUSR1)
    with stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(3) is None  # not a check iteration
        assert stop.agreed(4) == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def seg(first: int, last: int, start: str, end: str, wall: float, steps: float) -> dict:
    return {
        "first_iteration": first,
        "last_iteration": last,
        "started_at": f"2026-11-25T10:{start}+00:00",
        "ended_at": f"2026-11-25T10:{end}+00:00",
        "wall_seconds": wall,
        "step_seconds": steps,
    }


def test_goodput_counts_queueing_overheads_and_redone_steps_as_lost() -> None:
    # job 1 ran iterations 1-10 (steps 50 s of its 60 s) but crashed: its next job resumed at 9,
    # so iterations 9-10 (10 s) were redone; 30 s of queueing between the jobs.
    first = with_segment(None, seg(1, 10, "00:00.000", "01:00.000", 60.0, 50.0))
    assert first["goodput"] == pytest.approx(50 / 60)
    both = with_segment(first, seg(9, 20, "01:30.000", "02:30.000", 60.0, 48.0))
    assert [s["first_iteration"] for s in both["segments"]] == [1, 9]
    assert both["productive_step_seconds"] == pytest.approx(40 + 48)
    assert both["run_wall_seconds"] == pytest.approx(150)
    assert both["goodput"] == pytest.approx(88 / 150)
    assert both["lost_seconds"] == pytest.approx(
        {"between_segments": 30.0, "inside_segments": 22.0, "redone_steps": 10.0}
    )


def test_the_default_hang_timeout_follows_the_measured_steps_within_bounds() -> None:
    assert default_timeout([1.0, 1.0], before_steps=1800.0) == 1800.0  # too few steps measured
    assert default_timeout([0.01, 0.02, 0.015], before_steps=1800.0) == DEFAULT_BOUNDS[0]
    assert default_timeout([30.0, 31.0, 29.0], before_steps=1800.0) == pytest.approx(20 * 30.0)
    assert default_timeout([900.0] * 3, before_steps=60.0) == DEFAULT_BOUNDS[1]


def test_a_rank_whose_shared_directories_vanish_keeps_watching(tmp_path, monkeypatch) -> None:
    """Rank 1 failing at its first step removes the empty .watchdog and hang directories as it closes;
    when that falls between rank 0's mkdir and its file, rank 0 makes them again (CI once saw rank 0
    end with '[Errno 2] No such file or directory' there instead)."""
    ending, starting = HangWatchdog(60, 60, tmp_path, 1, 2), HangWatchdog(60, 60, tmp_path, 0, 2)
    ending._tick()
    made = HangWatchdog._dir

    def made_then_removed_once(self, name, seen=set()):  # noqa: B006 - one removal per directory
        path = made(self, name)
        if self is starting and name not in seen:
            seen.add(name)
            ending.close()  # rank 1's close: its own files, then the directories it leaves empty
            assert not path.exists()
        return path

    monkeypatch.setattr(HangWatchdog, "_dir", made_then_removed_once)
    try:
        starting._tick()
        assert (tmp_path / ".watchdog" / "rank-0.json").is_file()
        assert (tmp_path / "hang" / "rank-0.txt").is_file()
    finally:
        starting.close()
    assert not (tmp_path / ".watchdog").exists() and not (tmp_path / "hang").exists()
