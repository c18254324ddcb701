"""The sweep's shared types: a planned `Member`, what `stx sweep` was asked (`SweepOptions`) and how a
sweep call ended (`SweepOutcome`). Every sweep_* module imports them from here, so the sweep's modules
import one another in one direction only."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..config.schema import Config


@dataclasses.dataclass
class Member:
    point: dict[str, str]  # axis key -> value, as passed on the command line
    nproc: int
    repeat: int
    overrides: list[str]  # the axis overrides (without nproc)
    label: str
    config_hash: str
    cfg: Config | None  # resolved; None when invalid
    invalid_reason: str | None
    timeout_seconds: float
    memory_limit_mb: int | None
    nodes: int = 1  # the nodes axis (a scheduler's job); nproc is then processes per node

    @property
    def run_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", self.label)[:60]
        shape = f"n{self.nproc}" if self.nodes == 1 else f"N{self.nodes}n{self.nproc}"
        return f"{slug}-{shape}-{self.config_hash[:10]}-r{self.repeat}"


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """What `stx sweep` was asked: the sweep file, where to store (None: the sweep's store), whether
    to rerun members stored as oom / timeout / crashed, and whether to only list the plan."""

    sweep_file: Path
    store: Path | None = None
    retry_failed: bool = False
    dry_run: bool = False
    retry_suspect: bool = False


@dataclasses.dataclass
class SweepOutcome:
    """How a sweep call ended: the statuses of the members it ran, and whether it was interrupted."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 0
