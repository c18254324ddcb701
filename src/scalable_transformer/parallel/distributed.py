"""Process-group setup and teardown, and the few collectives the trainer needs on plain floats.

Launchers (torchrun, `stx launch`, Slurm) export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT; `init_distributed` reads them. Backend by device: nccl for CUDA tensors plus gloo for
CPU tensors (CPU offload and host-side reductions), gloo alone on CPU. A single process that needs a
process group (ZeRO/FSDP on one device) gets a private one-rank group over an in-memory store.
"""

from __future__ import annotations

import datetime as dt
import os

import torch
import torch.distributed as dist


def env_world_size() -> int:
    """World size the launcher asked for (1 when started without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# Set once this process has started a process group: its backend's native threads may outlive
# destroy_process_group (see `native_threads_may_outlive_python`).
_started = False


def native_threads_may_outlive_python() -> bool:
    """True once this process created a process group. Measured with torch 2.13 on gloo: after a
    functional collective (FSDP2, DTensor) the group's worker threads ("pt_gloo_runloop",
    "gloo_tcp_loop") are still running after destroy_process_group, so the interpreter's teardown
    destroys them from C++ static destructors, which aborted a finished rank at exit ("terminate
    called without an active exception") - a run that had trained and saved everything, failed."""
    return _started


def init_distributed(device: torch.device, timeout_minutes: float, *, needed: bool) -> bool:
    """Join (or create) the default process group; returns True when this call created it.

    `needed`: the layout uses collectives (world size > 1, or ZeRO/FSDP on one process).
    """
    if dist.is_initialized():
        return False
    world = env_world_size()
    if world == 1 and not needed:
        return False
    global _started
    _started = True
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    timeout = dt.timedelta(minutes=timeout_minutes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank = int(os.environ.get("RANK", "0"))
        dist.init_process_group(
            backend, store=attempt_store(timeout), rank=rank, world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    return True


def attempt_store(timeout: dt.timedelta) -> dist.Store:
    """The elastic agent's store (`stx launch`, torchrun), under a prefix of this restart attempt.

    torch's own env:// rendezvous on the agent's store let a restarted attempt read the gloo
    addresses of the attempt before it: with torch 2.13, `torchrun --max-restarts 1` of a 2-rank gloo
    script whose rank 1 fails once failed 4 of 4 times in the restart ("connectFullMesh failed ...
    Connection refused"); with this store 3 of 3 restarts connected."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env_world_size(), False, timeout=timeout
    )
    return dist.PrefixStore(f"/stx/attempt_{attempt}", client)


def shutdown_distributed(created: bool) -> None:
    if created and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_floats(values: list[float], group=None, op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few Python floats across `group` (one collective, float64 on the host)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


# A dry run's process group is torch's "fake" backend; dryrun/dry_run.py sets this to the backend the
# real run would use ("nccl" for a GPU target), so collectives stage their tensors where they would.
SIMULATED_BACKEND: str | None = None


def collective_device(group) -> torch.device:
    """Host tensors for gloo groups; the current CUDA device for nccl-only groups."""
    backend = str(dist.get_backend(group))
    if backend == "fake" and SIMULATED_BACKEND is not None:
        if "nccl" in SIMULATED_BACKEND:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
