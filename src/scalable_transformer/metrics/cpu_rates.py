"""Rates of this CPU that the planner needs beyond the GEMM peak (metrics/device_specs.py): a GEMM of a
given shape, memory bandwidth, the fixed cost of one small torch op, and gloo collective bandwidth
and latency between local processes. Cached per machine / torch / thread count as JSON in the user
cache (`cache.cache_dir()`), like the CPU peak; the quick ones are measured again at each use and the
best value kept (the gloo rates, which start processes, once).

Torch is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..cache import cache_dir, put_json_entry, read_json_entries
from .device_table import cpu_model

CACHE_NAME = "cpu_rates.json"
METHOD = "v1"


def cache_path() -> Path:
    return cache_dir() / CACHE_NAME


def _key(what: str, threads: int) -> str:
    import torch

    machine = f"{cpu_model()} | cores={os.cpu_count()}"
    return f"{METHOD} | {what} | {machine} | threads={threads} | torch={torch.__version__}"


def _read() -> dict[str, Any]:
    return read_json_entries(CACHE_NAME)


def _write(key: str, value: float) -> None:
    put_json_entry(CACHE_NAME, key, {"value": value})


class NotMeasured(LookupError):
    """Inside `cached_only()`: a rate this machine has not measured yet."""


_CACHED_ONLY = False


@contextlib.contextmanager
def cached_only() -> Iterator[None]:
    """Rates from the cache only, never measured: a missing one raises NotMeasured. The end of a
    training run predicts its own step with what earlier plans measured, in no time and without
    measuring beside a job that is still shutting down."""
    global _CACHED_ONLY
    previous, _CACHED_ONLY = _CACHED_ONLY, True
    try:
        yield
    finally:
        _CACHED_ONLY = previous


def _cached(what: str, threads: int, measure, lower_is_better: bool = False) -> float:
    """The best value ever measured here: measured again at every call (a fraction of a second) and
    the better of the new and the cached value kept, because a shared machine disturbs measurements
    only one way (the planner accounts for the load separately, `calibrate.this_machine.cpu_cluster`)."""
    key = _key(what, threads)
    if key in _MEASURED:  # once per process: a search asks for the same rate thousands of times
        return _MEASURED[key]
    entry = _read().get(key)
    old = (
        float(entry["value"])
        if isinstance(entry, dict) and isinstance(entry.get("value"), (int, float)) and entry["value"] > 0
        else None
    )
    if _CACHED_ONLY:
        if old is None:
            raise NotMeasured(f"{what} at {threads} thread(s)")
        return old
    new = float(measure())
    value = new if old is None else (min(old, new) if lower_is_better else max(old, new))
    if value != old:
        _write(key, value)
    _MEASURED[key] = value
    return value


_MEASURED: dict[str, float] = {}


def _with_threads(threads: int, fn):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def _best_seconds(fn, budget: float = 0.3, repeats: int = 50) -> float:
    fn()  # warm-up
    best, deadline = float("inf"), time.perf_counter() + budget
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best


def gemm_rate(m: int, k: int, n: int, dtype: str, threads: int) -> float:
    """FLOP/s of the three GEMMs of a linear layer with input [m, k] and weight [n, k] (forward,
    grad-input, grad-weight; fp32 or autocast bf16/fp16 as training runs them), best of a few runs."""
    import torch
    import torch.nn.functional as F

    low = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def measure() -> float:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen, requires_grad=True)
        g = torch.randn(m, n, generator=gen).to(low)
        wl, xl = w.detach().to(low), x.to(low)
        ctx = torch.autocast("cpu", dtype=low) if dtype != "fp32" else torch.autocast("cpu", enabled=False)

        def run() -> None:
            with torch.no_grad(), ctx:
                F.linear(x, w)
            torch.mm(g, wl)
            torch.mm(g.t(), xl)

        return 3 * 2 * m * k * n / _best_seconds(run)

    rate = _cached(f"gemm {m}x{k}x{n} {dtype}", threads, lambda: _with_threads(threads, measure))
    if threads > 1:  # more threads are never slower undisturbed: a lower figure is the machine's load
        rate = max(rate, _cached(f"gemm {m}x{k}x{n} {dtype}", 1, lambda: _with_threads(1, measure)))
    return rate


def memory_bandwidth(threads: int) -> float:
    """Bytes/s moved by an elementwise op (read + write) on 64 MiB fp32 tensors."""
    import torch

    def measure() -> float:
        a = torch.ones(16 * 2**20)
        b = torch.empty_like(a)
        return 2 * a.numel() * 4 / _best_seconds(lambda: torch.add(a, 1.0, out=b))

    value = _cached("memory bandwidth", threads, lambda: _with_threads(threads, measure))
    if threads > 1:
        value = max(value, _cached("memory bandwidth", 1, lambda: _with_threads(1, measure)))
    return value


def op_overhead(threads: int) -> float:
    """Seconds of one tiny torch op with autograd (dispatch + Python): the floor of every kernel."""
    import torch

    def measure() -> float:
        x = torch.ones(8, 8, requires_grad=True)

        def run() -> None:
            y = x
            for _ in range(100):
                y = y * 1.0
            y.sum().backward()

        return _best_seconds(run) / 201  # 100 forward, 100 backward, the sum

    return _cached("op overhead", threads, lambda: _with_threads(threads, measure), lower_is_better=True)


_WORKER = r"""
import os, sys, time, torch, torch.distributed as dist
rank, world, port, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
def best(fn, n=8):
    fn(); dist.barrier(); b = 1e9
    for _ in range(n):
        dist.barrier(); t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    t = torch.tensor([b]); dist.all_reduce(t, op=dist.ReduceOp.MAX); return float(t)
small = torch.ones(1)
big = torch.ones(nbytes // 4)
lat = best(lambda: dist.all_reduce(small), 20)
ar = best(lambda: dist.all_reduce(big))
if rank == 0:
    print(lat, ar)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_rates(world: int, nbytes: int = 16 * 2**20) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in s) of gloo all-reduce between `world` local processes:
    bandwidth = 2 (n - 1) / n x bytes / time (the ring formula's bus bandwidth, as nccl-tests define it).
    Cached per world size; measured by starting `world` Python processes (~5-10 s)."""
    key_bw, key_lat = _key(f"gloo allreduce busbw world={world}", 1), _key(f"gloo latency world={world}", 1)
    data = _read()
    if key_bw in data and key_lat in data:
        return float(data[key_bw]["value"]), float(data[key_lat]["value"])
    if _CACHED_ONLY:
        raise NotMeasured(f"gloo all-reduce between {world} processes")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(r), str(world), str(port), str(nbytes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    lat, seconds = (float(x) for x in outs[0].split())
    busbw = 2 * (world - 1) / world * nbytes / seconds
    _write(key_bw, busbw)
    _write(key_lat, lat)
    return busbw, lat
