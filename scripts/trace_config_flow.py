"""Trace which modules of scalable_transformer a tiny `stx train` walks through, and how often it comes back.

    PYTHONPATH=src python scripts/trace_config_flow.py [key=value ...]

Runs `stx train` in-process (the embedded default config, train.train_iters=2, in a temporary directory)
under `sys.setprofile`, and follows every call made below `train.run.run_training`. Frames outside
scalable_transformer (torch, the standard library) are transparent: a call from module A into torch that
calls back into module B is a move from A to B. Counted, per module:

- entered: the module was entered at least once (the figure "distinct modules").
- re-entries: a call moves into module M from another module, and M was entered before. Two kinds:
  "back up" when M is still on the call stack below (A -> B -> back to A: A is re-entered while it
  waits on B), and "again" when M had been left (A calls B, B returns, A calls B once more).

The counts are split into the construction (everything before `Trainer.fit` starts) and the fit (the
steps: the same modules come back every iteration by design, so these are reported apart).
Extra key=value arguments are passed to `stx train` after the defaults.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
from types import FrameType
from typing import Any

PACKAGE = "scalable_transformer"
ENTRY = ("scalable_transformer.train.run", "run_training")
FIT = ("scalable_transformer.train.trainer", "fit")
DEFAULTS = ["train.train_iters=2", "logging.log_interval=1"]


class Tracer:
    """A `sys.setprofile` hook that keeps the stack of package modules under the entry function."""

    def __init__(self) -> None:
        self.stack: list[tuple[FrameType, str]] = []  # (frame, module) of the package's frames
        self.active = False
        self.in_fit = 0
        self.entered: dict[str, set[str]] = {"construction": set(), "fit": set()}
        self.back_up: dict[str, collections.Counter] = {k: collections.Counter() for k in self.entered}
        self.again: dict[str, collections.Counter] = {k: collections.Counter() for k in self.entered}
        self.seen: dict[str, set[str]] = {k: set() for k in self.entered}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(PACKAGE):
            return
        key = (module, frame.f_code.co_name)
        if event == "call":
            if not self.active:
                if key != ENTRY:
                    return
                self.active = True
            self._enter(frame, module, key)
        elif self.active and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()
            if key == FIT:
                self.in_fit -= 1
            if not self.stack:
                self.active = False

    def _enter(self, frame: FrameType, module: str, key: tuple[str, str]) -> None:
        phase = "fit" if self.in_fit else "construction"
        previous = self.stack[-1][1] if self.stack else None
        if module != previous:
            if module in self.seen[phase]:
                on_stack = any(m == module for _, m in self.stack)
                (self.back_up if on_stack else self.again)[phase][module] += 1
            self.seen[phase].add(module)
            self.entered[phase].add(module)
        self.stack.append((frame, module))
        if key == FIT:
            self.in_fit += 1


def run(overrides: list[str]) -> Tracer:
    from scalable_transformer.cli import main

    tracer = Tracer()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        sys.setprofile(tracer)
        try:
            status = main(["train", *DEFAULTS, *overrides])
        finally:
            sys.setprofile(None)
            os.chdir(cwd)
    if status:
        raise SystemExit(f"stx train failed with status {status}")
    return tracer


def report(tracer: Tracer) -> None:
    for phase in ("construction", "fit"):
        back, again = tracer.back_up[phase], tracer.again[phase]
        modules = sorted(tracer.entered[phase])
        print(
            f"\n== {phase}: {len(modules)} modules entered, "
            f"{sum(back.values())} re-entries back up the stack, {sum(again.values())} after leaving"
        )
        rows = sorted(modules, key=lambda m: (-(back[m] + again[m]), m))
        print(f"  {'module':<58} {'back up':>8} {'again':>8}")
        for m in rows:
            print(f"  {m.removeprefix(PACKAGE + '.'):<58} {back[m]:>8} {again[m]:>8}")
    both = tracer.entered["construction"] | tracer.entered["fit"]
    print(f"\nin all: {len(both)} distinct modules of {PACKAGE} entered below run_training")


if __name__ == "__main__":
    report(run(sys.argv[1:]))
