"""Calibration section `collectives` (world > 1): bus bandwidth and time of each collective between the
ranks, in the whole job and in smaller groups timed side by side, and a GPU's host link.
Bus bandwidth follows nccl-tests' definitions (calibrate/calibration.py's docstring).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .timing import (
    COLLECTIVE_OPS,
    MAX_REPEATS,
    MESSAGE_SIZES,
    QUICK_MESSAGE_SIZES,
    Job,
    Section,
    _figure,
    median_seconds,
)


def host_link_gbps(job: Job) -> float:
    """GB/s of a pinned host -> device copy of 256 MiB (GPU); this CPU: its elementwise bandwidth."""
    if not job.cuda:
        return 0.0
    host = torch.empty(64 * 2**20, pin_memory=True)
    dev = torch.empty(64 * 2**20, device=job.device)
    seconds = median_seconds(job, lambda: dev.copy_(host, non_blocking=True), 1.0, 5)
    return _figure(host.numel() * 4 / seconds / 1e9)


def _busbw_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(
        op, 1.0
    )


def _collective(op: str, size: int, group: Any, n: int, me: int, device: torch.device) -> Callable[[], Any]:
    """One call of `op` moving `size` bytes in all (nccl-tests' size: the whole tensor; send_recv:
    each rank sends `size` bytes to the next rank of the group and receives from the one before)."""
    numel = max(n, size // 4 // n * n)  # fp32, divisible by the group for the sharded ops
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    recv = torch.empty_like(full)
    dst, src = ranks[(me + 1) % n], ranks[(me - 1) % n]

    def send_recv() -> None:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, full, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
        )
        for w in works:
            w.wait()

    return send_recv


def _time_collective(job: Job, fn: Callable[[], Any], repeats: int, group: Any) -> float:
    """Seconds of the median of `repeats` calls, each started together (barrier) and counted until
    the slowest rank of the group is done; every rank returns the same figure."""
    fn()
    job.sync()
    times: list[float] = []
    for _ in range(repeats):
        dist.barrier(group=group)
        job.sync()
        t0 = time.perf_counter()
        fn()
        job.sync()
        times.append(time.perf_counter() - t0)
    return job.reduce([statistics.median(times)], dist.ReduceOp.MAX, group)[0]


def collective_groups(job: Job) -> list[tuple[str, Any, int, int]]:
    """(scope, group, its size, this rank's index in it): the ranks of this node (intra_node, when
    every node holds two or more), the smaller groups inside a node (`_sub_node_groups`) and, when
    the job spans nodes, all ranks (inter_node). Every rank creates every group (new_group is
    collective), in the same order."""
    nodes = sorted(set(job.hosts), key=job.hosts.index)
    per_node = {host: [r for r, h in enumerate(job.hosts) if h == host] for host in nodes}
    if len(nodes) == 1:
        whole = [("intra_node", None, job.world, job.rank)] if job.world > 1 else []
        return whole + _sub_node_groups(job, per_node)
    out: list[tuple[str, Any, int, int]] = []
    groups = {host: dist.new_group(ranks) for host, ranks in per_node.items()}
    mine = per_node[job.hosts[job.rank]]
    # every rank must run the same sections: intra_node only when every node has two ranks or more
    if min(len(r) for r in per_node.values()) > 1:
        out.append(("intra_node", groups[job.hosts[job.rank]], len(mine), mine.index(job.rank)))
        out += _sub_node_groups(job, per_node)
    return [*out, ("inter_node", None, job.world, job.rank)]


def _sub_node_groups(job: Job, per_node: dict[str, list[int]]) -> list[tuple[str, Any, int, int]]:
    """intra_node groups of k consecutive ranks, for every power of two 2 <= k < the ranks of a node
    that divides every node's: each node's ranks split into such groups, all timed at once, as a
    layout's tensor- or data-parallel groups run side by side. A collective of 2 of a node's 8 GPUs
    (NVLink pairs under NVSwitch) or of 2 of 4 processes sharing 2 CPU cores is not the full node's
    curve scaled by its ring factor (measured on 4 processes on 2 cores: 0.3-0.5 ms for a 2-rank
    all-reduce of 4-256 KiB, where the scaled 4-rank curve said 1.6 ms)."""
    out: list[tuple[str, Any, int, int]] = []
    for k in _smaller_group_sizes([len(ranks) for ranks in per_node.values()]):
        blocks = [ranks[i : i + k] for ranks in per_node.values() for i in range(0, len(ranks), k)]
        groups = [dist.new_group(block) for block in blocks]  # every rank creates every group
        (index,) = [i for i, block in enumerate(blocks) if job.rank in block]
        out.append(("intra_node", groups[index], k, blocks[index].index(job.rank)))
    return out


def _smaller_group_sizes(counts: list[int]) -> list[int]:
    """The powers of two 2 <= k < min(counts) that divide every count (ranks per node): the group
    sizes a node's ranks split into evenly, short of the whole node."""
    sizes = (2**i for i in range(1, min(counts).bit_length()))
    return [k for k in sizes if k < min(counts) and all(c % k == 0 for c in counts)]


def measure_collectives(job: Job, say=print) -> list[dict]:
    """Time and bus bandwidth of each collective at each message size, per scope: the ranks of one
    node, and across nodes. Rank 0's node's figures are kept for intra_node. Empty for one process."""
    if job.world == 1:
        say("calibrate: collectives: one process, nothing to measure")
        return []
    sizes = QUICK_MESSAGE_SIZES if job.quick else MESSAGE_SIZES
    groups = collective_groups(job)
    section = Section(job, "collectives", len(COLLECTIVE_OPS) * len(sizes) * len(groups), say)
    out: list[dict] = []
    # sizes outermost: a section out of budget drops the largest messages of every op and scope
    for size in sizes:
        for scope, group, n, me in groups:
            for op in COLLECTIVE_OPS:
                if not section.go():
                    break
                repeats = 3 if job.quick else int(min(MAX_REPEATS, max(3, 2**24 // size)))
                fn = _collective(op, size, group, n, me, job.device)
                seconds = _time_collective(job, fn, repeats, group)
                seconds = job.reduce([seconds], dist.ReduceOp.MAX)[0]  # the other nodes' groups too
                section.done += 1
                busbw = _busbw_factor(op, n) * size / seconds / 1e9
                out.append(
                    {"op": op, "scope": scope, "ranks": n, "size_bytes": size,
                     "time_us": _figure(seconds * 1e6), "busbw_gbps": _figure(busbw)}
                )  # fmt: skip
    best = max((c["busbw_gbps"] for c in out), default=0.0)
    section.finish(f"{len(out)} points, best bus bandwidth {best:.2f} GB/s")
    return out
