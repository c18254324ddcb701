"""The cost of measuring: phase timers + the telemetry sampler on the default run's step time.

    python benchmarks/telemetry_overhead.py                       # the default run (tiny-bert), 2-10 min
    python benchmarks/telemetry_overhead.py --rounds 120 --output /tmp/t.md
    python benchmarks/telemetry_overhead.py --control           # A against A: the method's own spread
    python benchmarks/telemetry_overhead.py --config tiny-gpt model.num_layers=4

In one process, one trainer (built as `train/build.py` builds it: the default config, `stx train` with no
arguments, on synthetic batches shaped like its data) alternates single optimizer steps:
  A  instrumented: the trainer's Megatron phase timers (a dozen per step, the backward split into
     compute and all-grads-sync), the telemetry sampler thread sampling every
     logging.telemetry_interval (psutil CPU + RAPL when readable; NVML on a GPU), and every
     logging.log_interval A steps what a log interval adds: the timers read and reset, the telemetry
     interval summarised (its time is added to A);
  B  bare: the same step with the timers replaced by no-ops and the sampler thread paused.
Steps run in rounds of A B B A (so load that comes and goes over seconds hits both alike); each round
gives one ratio (A1 + A2) / (B1 + B2). The record gives the median ratio over the rounds with its IQR
and a bootstrap 95% interval of the median against the target (< 1.02: under 2% overhead), every
ratio, the machine load, the resolved config and the environment, and next to it the direct cost:
each instrumentation operation timed in a tight loop and scaled to one step (free of step noise).
`--control` makes B instrumented as well: its A/B shows the spread of the method itself.

Not included: the cross-rank min/max all-reduce and the straggler gather (one small all-reduce per
log interval, which a single process does not run) and the DDP/FSDP comm-hook timing (two clock
reads per bucket); both are per interval or per bucket, not per operator.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scalable_transformer.config.load import load_config, to_yaml
from scalable_transformer.config.validate import resolve
from scalable_transformer.metrics.device_sampler import Telemetry
from scalable_transformer.metrics.device_specs import resolve_peak
from scalable_transformer.metrics.environment import record_sections
from scalable_transformer.metrics.flops import ModelShape, flops_per_iteration
from scalable_transformer.metrics.timers import Timers
from scalable_transformer.models import count_parameters
from step_vs_bare import build_ours, quartiles, synthetic_batches

TARGET = 1.02
NO_TIMERS = Timers(level=0)  # the product's disabled timers (logging.timing_log_level=0): the bare variant


class SwitchedTelemetry(Telemetry):
    """The sampler, with a switch: while `paused` is set the thread takes no samples (the bare steps)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if not self.paused.is_set():
                self.sample()


def timed_step(trainer: Any, batches: list, instrumented: bool, telemetry: SwitchedTelemetry) -> float:
    """Seconds of one optimizer step, instrumented (A) or bare (B)."""
    if instrumented:
        telemetry.paused.clear()
        trainer.timers = trainer.measure.timers = trainer.real_timers
    else:
        telemetry.paused.set()
        trainer.timers = trainer.measure.timers = NO_TIMERS
    t0 = time.perf_counter()
    trainer.train_step(batches)
    return time.perf_counter() - t0


def log_interval_reads(trainer: Any, telemetry: SwitchedTelemetry, steps: int) -> float:
    """Seconds of what a log interval adds to the instrumented run: timers read, telemetry summarised."""
    t0 = time.perf_counter()
    trainer.real_timers.elapsed_ms(normalizer=steps, reset=True)
    telemetry.interval()
    return time.perf_counter() - t0


def direct_costs(period: float) -> dict[str, float]:
    """CPU seconds per call of the instrumentation's own operations, timed in a tight loop with the
    thread's CPU clock (wall time would count the time other processes hold the core): one timer
    start+stop, one telemetry sample (what the thread does each period), one log interval's summary."""
    clock = time.thread_time
    timers, n = Timers(), 20_000
    t0 = clock()
    for _ in range(n):
        with timers("x"):
            pass
    per_timer = (clock() - t0) / n
    telemetry = Telemetry("cpu", period=period)
    telemetry._last = telemetry.sample()
    t0 = clock()
    for _ in range(200):
        telemetry.sample()
    per_sample = (clock() - t0) / 200
    t0 = clock()
    for _ in range(50):
        telemetry.interval()
    per_interval = (clock() - t0) / 50
    return {"timer": per_timer, "sample": per_sample, "interval": per_interval}


def row(name: str, values: list[float], digits: int) -> str:
    lo, hi = quartiles(values)
    return f"| {name} | {statistics.median(values):.{digits}f} | {lo:.{digits}f}-{hi:.{digits}f} |"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="preset or YAML (default: the default run, tiny-bert)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--rounds", type=int, default=45, help="A B B A rounds (4 steps each)")
    parser.add_argument("--control", action="store_true", help="B instrumented too (an A/A run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "telemetry_overhead.md"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = resolve(load_config(args.config, args.overrides), world_size=1)
    if cfg.model.vocab_size is None:  # the embedded tokenizer's size, as `stx train` finds it
        from scalable_transformer.data.tokenizers import load_tokenizer

        d = cfg.data
        vocab = load_tokenizer(d.tokenizer, d.tokenizer_vocab_size).vocab_size
        cfg = resolve(load_config(args.config, [*args.overrides, f"model.vocab_size={vocab}"]), world_size=1)
    torch.manual_seed(cfg.train.seed)
    num_params = count_parameters(cfg.model)
    flops = flops_per_iteration(
        ModelShape.from_config(cfg.model, num_params), cfg.train.global_batch_size, "megatron", "none"
    )
    peak = resolve_peak("cpu", cfg.train.precision, None, None)
    trainer = build_ours(cfg, flops, peak)
    batches = synthetic_batches(cfg, cfg.train.seed)
    period = cfg.logging.telemetry_interval
    for _ in range(args.warmup):
        trainer.train_step(batches)
    telemetry = SwitchedTelemetry("cpu", period=period).start()
    trainer.real_timers = Timers()
    log_every = cfg.logging.log_interval
    load = [os.getloadavg()[0]]
    ratios, a_ms, b_ms = [], [], []
    a_steps = 0
    for round_ in range(args.rounds):
        a = b = 0.0
        for instrumented in (True, False, False, True):  # step by step: drift hits both alike
            seconds = timed_step(trainer, batches, instrumented or args.control, telemetry)
            if instrumented:
                a += seconds
                a_steps += 1
                if a_steps % log_every == 0:
                    a += log_interval_reads(trainer, telemetry, log_every)
            else:
                b += seconds
                if args.control and (a_steps % log_every == 0):
                    b += log_interval_reads(trainer, telemetry, log_every)
        ratios.append(a / b)
        a_ms.append(1000 * a / 2)
        b_ms.append(1000 * b / 2)
        if (round_ + 1) % 5 == 0:
            print(f"round {round_ + 1}/{args.rounds}: median A/B so far {statistics.median(ratios):.4f}")
    telemetry.stop()
    costs = direct_costs(period)
    timer_calls = len(trainer.real_timers.names())  # timers started per step (all ran every step)
    step_s = statistics.median(b_ms) / 1000
    direct = (
        timer_calls * costs["timer"] + step_s / period * costs["sample"] + costs["interval"] / log_every
    ) / step_s
    load.append(os.getloadavg()[0])
    median = statistics.median(ratios)
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    ci = (boots[50], boots[1949])
    verdict = "PASS" if median < TARGET else "FAIL"
    if ci[0] < TARGET <= ci[1] or ci[0] <= TARGET < ci[1]:
        verdict += " (within noise: the 95% interval of the median straddles the target)"
    control = " (control: B instrumented too)" if args.control else ""
    command = "python benchmarks/telemetry_overhead.py " + shlex.join(argv)
    lines = [
        "# Telemetry and timer overhead on the default run's step",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Model: {cfg.model.type}, {num_params:,} parameters, {cfg.model.num_layers} layers x "
        f"{cfg.model.hidden_size} hidden, seq {cfg.model.seq_length}, micro-batch "
        f"{cfg.train.micro_batch_size}, accumulation {cfg.train.gradient_accumulation_steps}, "
        f"{cfg.train.precision}, CPU, {torch.get_num_threads()} torch thread(s); telemetry every "
        f"{period:g} s.",
        f"{args.rounds} rounds of single steps A B B A{control}; "
        "1-min load average "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end.",
        "",
        "| | median | IQR |",
        "|---|---|---|",
        row("A instrumented (ms/step)", a_ms, 1),
        row("B bare (ms/step)", b_ms, 1),
        row("A/B", ratios, 4),
        "",
        f"Median A/B {median:.4f}, bootstrap 95% interval of the median {ci[0]:.4f}-{ci[1]:.4f}.",
        f"Target: A/B < {TARGET:.2f} (overhead under 2%): **{verdict}**.",
        "",
        "Per round (A/B): " + ", ".join(f"{r:.3f}" for r in ratios),
        "",
        "Direct cost, free of step noise (each operation's CPU time in a tight loop, scaled to one bare step "
        f"of {1000 * step_s:.0f} ms): {timer_calls} timers x {1e6 * costs['timer']:.2f} us + "
        f"{step_s / period:.1f} samples x {1e6 * costs['sample']:.0f} us + one telemetry summary "
        f"({1e6 * costs['interval']:.0f} us) per {log_every} steps = **{100 * direct:.4f}% of the step** "
        "(the sampler thread also takes the GIL for about a sample's time per period).",
        "",
        *record_sections(to_yaml(cfg)),
    ]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    print(
        f"A/B median {median:.4f} (95% {ci[0]:.4f}-{ci[1]:.4f}): {verdict}; direct cost {100 * direct:.4f}% "
        f"of a step; record: {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
