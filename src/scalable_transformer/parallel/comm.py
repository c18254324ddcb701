"""Measured communication: how long the data-parallel and pipeline collectives of a step took.

One `CommRecorder` per process collects, per kind, the wall seconds its collectives were busy:
  grads-all-reduce      DDP's bucket all-reduces (a comm hook: launch -> its future completes)
  grads-reduce-scatter  FSDP2's gradient reduce-scatters (a custom ReduceScatter around the default)
  params-all-gather     FSDP2's parameter all-gathers (the call; blocking on CPU/gloo)
  pipeline-p2p-wait     torch.distributed.pipelining's waits on its send/recv batches
and, for the trainer's split of backward, the moments a gradient collective was launched and the
seconds the training thread sat blocked in one (the "exposed" part, Megatron's `all-grads-sync`).

Wall-clock on the host: exact on CPU/gloo, where the collectives block or run on gloo's thread. On
CUDA, NCCL collectives are stream-ordered, so the host sees their launch only; there the recorded
figures are launch-to-completion of the future/Work (DDP) or call time (FSDP2), and the honest
exposed time is what the trainer measures around backward with timers_sync on.

Built on the public seams of each wrapper: `DistributedDataParallel.register_comm_hook`,
`FSDPModule.set_custom_reduce_scatter / set_custom_all_gather` (torch's Comm interface, implemented
here with the public collectives FSDP2's defaults call). Pipelining has no such seam in 2.13: its
module-level `_wait_batch_p2p` is wrapped for the duration of a schedule step (`pipeline_wait_timing`,
through parallel/torch_compat.py), and restored after.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .torch_compat import pipeline_p2p_wait_wrapped

KINDS = ("grads-all-reduce", "grads-reduce-scatter", "params-all-gather", "pipeline-p2p-wait")
GRAD_KINDS = ("grads-all-reduce", "grads-reduce-scatter")


class CommRecorder:
    """Busy seconds per kind since the last `take`; thread-safe (gloo completes futures on its own
    thread)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._busy: dict[str, float] = {}
        self._blocked = 0.0  # seconds the training thread waited inside gradient collectives
        self._busy_until: dict[str, float] = {}  # end of the latest interval per kind (FIFO queues)
        self.last_grad_launch: float | None = None

    def record(self, kind: str, start: float, end: float) -> None:
        """One collective of `kind` from `start` to `end` (clock seconds). Collectives of one kind run
        one after another (a process group's queue), so overlapping intervals count once."""
        with self._lock:
            begin = max(start, self._busy_until.get(kind, start))
            self._busy[kind] = self._busy.get(kind, 0.0) + max(0.0, end - begin)
            self._busy_until[kind] = max(end, self._busy_until.get(kind, end))

    def grad_launched(self, at: float) -> None:
        with self._lock:
            self.last_grad_launch = at

    def blocked(self, seconds: float) -> None:
        with self._lock:
            self._blocked += seconds

    def take(self) -> dict[str, float]:
        """Busy seconds per kind (only kinds that ran), and reset."""
        with self._lock:
            out, self._busy = dict(self._busy), {}
            return out

    def take_blocked(self) -> float:
        with self._lock:
            out, self._blocked = self._blocked, 0.0
            return out


def recorders(module: torch.nn.Module) -> list[CommRecorder]:
    """The distinct recorders attached (as `comm_recorder`) to `module` or any submodule."""
    found: dict[int, CommRecorder] = {}
    for sub in module.modules():
        rec = getattr(sub, "comm_recorder", None)
        if isinstance(rec, CommRecorder):
            found[id(rec)] = rec
    return list(found.values())


# ---------------------------------------------------------------- DDP


def timed_ddp_hook(inner: Callable[[Any, Any], torch.futures.Future]) -> Callable:
    """A DDP comm hook (state: (process group, CommRecorder)) that runs `inner` (torch's
    allreduce / bf16 / fp16 compress hook) and records launch -> completion of each bucket."""

    # unannotated: DDP checks the annotations, which `from __future__ import annotations` turns to str
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        group, recorder = state
        start = recorder.clock()
        recorder.grad_launched(start)
        future = inner(group, bucket)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            recorder.record("grads-all-reduce", start, recorder.clock())
            return fut.value()

        return future.then(done)

    return hook


# ---------------------------------------------------------------- FSDP2


def instrument_fsdp(module: Any, recorder: CommRecorder) -> None:
    """Time an FSDP2 module's all-gathers and reduce-scatters. The comms do what FSDP2's defaults
    (DefaultAllGather / DefaultReduceScatter in torch 2.13) do, with public calls: a plain buffer and
    one collective, so the timing changes nothing else (torch_compat.py says why no subclass)."""

    class TimedAllGather:
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
            start = recorder.clock()
            work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            recorder.record("params-all-gather", start, recorder.clock())
            # an async all-gather's later wait is not timed: FSDP2 checks isinstance(work, dist.Work)
            return work

    class TimedReduceScatter:
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
        ) -> Any:
            start = recorder.clock()
            recorder.grad_launched(start)
            work = dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
            )
            end = recorder.clock()
            recorder.record("grads-reduce-scatter", start, end)
            if work is None or not async_op:  # a synchronous call: the training thread waited for it
                recorder.blocked(end - start)
            return work

    module.set_custom_all_gather(TimedAllGather())
    module.set_custom_reduce_scatter(TimedReduceScatter())


# ---------------------------------------------------------------- pipelining


@contextlib.contextmanager
def pipeline_wait_timing(recorder: CommRecorder) -> Iterator[None]:
    """Record the time each pipeline schedule spends waiting on its P2P send/recv batches (the
    bubble plus the transfers) while the block runs."""

    def wrap(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def timed(work: Any) -> Any:
            start = recorder.clock()
            try:
                return original(work)
            finally:
                recorder.record("pipeline-p2p-wait", start, recorder.clock())

        return timed

    with pipeline_p2p_wait_wrapped(wrap):
        yield
