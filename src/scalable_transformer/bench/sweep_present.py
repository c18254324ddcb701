"""Present: the console lines of a sweep (plan, progress with ETA, outcomes, totals), on stderr.

Only formatting: `run_sweep` decides what happens and calls one method per event.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from ..metrics.sinks import progress_columns
from .sweep_spec import SweepSpec
from .sweep_types import Member


def hms(seconds: float) -> str:
    """seconds as H:MM:SS."""
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class SweepConsole:
    """What `stx sweep` prints while it plans and runs; plain text (no markup), soft-wrapped."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
        self.progress: Any = None  # rich Progress while members run in a terminal
        self.task: Any = None

    def plan(self, spec: SweepSpec, members: list[Member], filtered: int, store_path: Path) -> None:
        invalid = [m for m in members if m.invalid_reason]
        self.console.print(
            f"sweep {spec.name}: {len(members)} member(s) ({len(invalid)} invalid, {filtered} left out by "
            f"filters), {spec.steps} steps each, store {store_path}"
        )
        for m in invalid:
            if m.repeat == 0:
                self.console.print(f"  invalid: {m.label} (nproc {m.nproc}): {m.invalid_reason}")

    def dry_run(self, members: list[Member]) -> None:
        for m in members:
            if not m.invalid_reason:
                self.console.print(
                    f"  would run: {m.label} (nproc {m.nproc}, repeat {m.repeat}, timeout "
                    f"{m.timeout_seconds:g} s, memory limit {m.memory_limit_mb or '-'} MiB) [{m.config_hash}]"
                )

    def note(self, text: str) -> None:
        """One line of news (a batch job submitted, re-attached to, ended)."""
        self.console.print(text)

    def to_run(self, todo: int, skipped: int) -> None:
        self.console.print(f"to run: {todo}; already in the store: {skipped}")
        if self.console.is_terminal and todo:  # a live bar under the lines; plain lines only otherwise
            self.progress = Progress(*progress_columns("members"), console=self.console, transient=True)
            self.task = self.progress.add_task("sweep", total=todo, status="")
            self.progress.start()

    def starting(self, done: int, total: int, m: Member, elapsed: float, eta: float | None) -> None:
        self.console.print(
            f"[{done}/{total} done] running {m.label} (nproc {m.nproc}, repeat {m.repeat}) | "
            f"elapsed {hms(elapsed)} | ETA {hms(eta) if eta is not None else '?'}"
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=done, status=f"running {m.label}")

    def _stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finished(self, record: dict[str, Any]) -> None:
        extra = ""
        if record["status"] == "ok":
            extra = (
                f": {record['samples_per_second']:.2f} samples/s, overhead "
                f"{record['overhead_seconds'] or float('nan'):.1f} s"
            )
        self.console.print(f"  -> {record['status']} in {record['wall_seconds']:.1f} s{extra}")
        if self.progress is not None:
            self.progress.advance(self.task)

    def interrupted(self, done: int) -> None:
        self._stop()
        self.console.print(
            f"sweep interrupted after {done} member(s); run it again to resume (finished members are skipped)"
        )

    def summary(self, total: int, seconds: float, counts: dict[str, int], store_path: Path) -> None:
        self._stop()
        self.console.print(
            f"[{total}/{total} done] in {hms(seconds)}: "
            + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing to run")
            + f"; store {store_path}"
        )
