"""Run a function on N gloo processes and collect what each rank returns.

    from harness import run_distributed
    results = run_distributed(fn, 2, arg1, arg2, tmp_dir=tmp_path, timeout=120)

`fn(rank, world_size, *args)` must be importable (module level) and its arguments and result
picklable (torch.save). The children are forked from one fork server per test session that has
imported torch and the project once (a spawned child spent 3-5 s of CPU importing them, and every
call starts 2-4 children); the server holds the environment of the first call, so a test that needs
another environment variable sets it inside `fn`. Each child runs with OMP_NUM_THREADS=1 and one
torch thread, inside a gloo default process group (file:// rendezvous in tmp_dir) that the harness
creates and destroys. The call returns [result of rank 0, result of rank 1, ...]; if a child raises,
it raises RuntimeError carrying that child's traceback (the other children are terminated); past
`timeout` seconds it terminates them all and raises TimeoutError.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported once by the fork server, then shared by every child it forks (module doc)
mp.set_forkserver_preload(["torch", "torch.distributed", "scalable_transformer.train.run", "harness"])


def _child(
    rank: int, fn: Callable[..., Any], world_size: int, args: tuple, tmp_dir: str, timeout: float
) -> None:
    torch.set_num_threads(1)
    out = Path(tmp_dir)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, out / f"result-{rank}.pt")
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    # The result is saved. Skip the interpreter's teardown, where torch's static destructors (gloo's
    # and autograd's threads) aborted a finished child in C++ a few times under load ("terminate
    # called without an active exception"), failing a run that had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tmp_dir: str | os.PathLike[str] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """[fn(rank, world_size, *args) for every rank], each run in its own gloo process (see module doc)."""
    with tempfile.TemporaryDirectory(dir=tmp_dir) as work:
        previous = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before they import torch
        try:
            context = mp.start_processes(
                _child,
                args=(fn, world_size, args, work, timeout),
                nprocs=world_size,
                join=False,
                start_method="forkserver",
            )
        finally:
            if previous is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = previous
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} processes ran past {timeout} s")
        except mp.ProcessRaisedException:
            errors = sorted(Path(work).glob("error-*.txt"))
            details = "\n".join(f"--- {path.stem} ---\n{path.read_text()}" for path in errors)
            raise RuntimeError(f"{fn.__name__} failed in a child process:\n{details}") from None
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"{fn.__name__}: a child process died: {exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                process.join()
        return [torch.load(Path(work, f"result-{rank}.pt"), weights_only=False) for rank in range(world_size)]
