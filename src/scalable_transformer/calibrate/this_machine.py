"""The planner's view of the machine a command runs on, measured here (torch): this CPU as a cluster
(its GEMM rates, memory bandwidth, op cost and gloo rates, metrics/cpu_rates.py, cached), the table
GPU matching torch.cuda's device, the fingerprint a hardware profile is compared with, and the
prediction stored beside a finished run (`run_prediction`). plan/ itself is torch-free: callers (cli/,
bench/) build the cluster here and pass it to the planner."""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import datetime, timezone
from typing import Any

import torch

from ..config.rules import physical_memory_bytes
from ..config.schema import Config
from ..metrics import cpu_rates
from ..metrics.cpu_rates import NotMeasured, cached_only
from ..metrics.device_specs import cpu_peak, detect_device_name
from ..metrics.device_table import DeviceSpec, cpu_model
from ..plan.cluster import Cluster, load_hardware, table_cluster, with_nodes
from ..plan.refit import PROFILE_ENV, prediction_record


def fingerprint_here(processes: int | None = None, threads_per_process: int | None = None) -> dict[str, Any]:
    """What identifies this machine and software for a profile: host, device (the first CUDA device,
    else the CPU model), device count (CUDA devices, else logical cores), torch and CUDA versions, the
    processes and threads per process the rates are for (default: this process's), and the time."""

    cuda = torch.cuda.is_available()
    return {
        "hostname": socket.gethostname(),
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_model(),
        "device_count": torch.cuda.device_count() if cuda else (os.cpu_count() or 1),
        "cpu_model": cpu_model(),
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda) if torch.version.cuda else None,
        "processes": processes if processes is not None else int(os.environ.get("WORLD_SIZE", "1")),
        "threads_per_process": threads_per_process
        if threads_per_process is not None
        else torch.get_num_threads(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def cpu_cluster(world_size: int, dtype: str = "fp32") -> Cluster:
    """This machine as `world_size` local processes (one node): measured GEMM peak for the threads
    each rank gets (stx launch gives each cores // world threads), memory bandwidth, the fixed cost of
    one op, gloo all-reduce bandwidth and latency between `world_size` processes; memory = this
    machine's RAM shared by the ranks. Imports torch (measurement), cached after the first time."""

    cores = os.cpu_count() or 1
    threads = max(1, cores // world_size)
    bandwidth = cpu_rates.memory_bandwidth(threads)  # first: under cpu_rates.cached_only() it may stop here
    peak = cpu_peak(dtype, threads)
    if world_size > 1:
        busbw, latency = cpu_rates.gloo_rates(world_size)
    else:
        busbw, latency = bandwidth, 0.0
    memory = physical_memory_bytes() or 0
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    share = min(1.0, cores / ((load or 0.0) + world_size * threads))
    spec = DeviceSpec(
        name="cpu",
        memory_bytes=memory // world_size,
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=busbw,
        inter_node_bandwidth=busbw,
        devices_per_node=world_size,
        host_link_bandwidth=bandwidth,
        source="measured on this machine (metrics/cpu_rates.py, cached)",
    )
    load_text = f", load average {load:.1f} -> {share:.0%} of a core per thread" if load is not None else ""
    return Cluster(
        name=f"this CPU x {world_size} process(es), {threads} thread(s) each{load_text}",
        kind="cpu",
        nodes=1,
        devices_per_node=world_size,
        device=spec,
        peak_flops={dtype: peak},
        host_memory_bytes=memory,
        reserve_bytes=0,
        source=spec.source,
        threads=threads,
        op_seconds=cpu_rates.op_overhead(threads),
        gemm_rate=cpu_rates.gemm_rate,
        comm_latency=latency,
        cpu_share=share,
        load_average=load,
    )


def _gpu_cluster(world: int) -> Any:
    """The table device matching torch.cuda's device name, as nodes x LOCAL_WORLD_SIZE devices."""

    if not torch.cuda.is_available():
        raise ValueError("the run was on CUDA, but there is no CUDA device now; no prediction")
    name = detect_device_name()
    if name is None:
        raise ValueError(
            f"the GPU {torch.cuda.get_device_name()!r} is not in the device table "
            "(metrics/device_specs.py); no prediction"
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return table_cluster(name, max(1, world // max(1, per_node)), min(per_node, world))


def _cpu_cluster_after_run(world: int, dtype: str) -> Any:
    """This CPU as `world` processes. The 1-minute load average read at the end of a run counts the
    run's own threads; they are taken out again so the share is what other work left the job."""

    cluster = cpu_cluster(world, dtype)
    if cluster.load_average is None:
        return cluster
    cores = os.cpu_count() or 1
    own = world * cluster.threads
    others = max(0.0, cluster.load_average - own)
    return dataclasses.replace(cluster, cpu_share=min(1.0, cores / (others + own)))


def _profile_cluster(path: str, world: int) -> Any:
    """The hardware profile (or cluster file) at `path` as `world` devices, the way `stx plan
    --hardware PATH --world-size WORLD` builds it."""

    cluster = load_hardware(path, here=fingerprint_here)
    per = cluster.devices_per_node
    return with_nodes(cluster, -(-world // per), min(per, world))


def run_prediction(cfg: Config, world: int, device_type: str) -> dict[str, Any]:
    """{"prediction": {...}} for a finished run's resolved config on the hardware it ran on, or
    {"prediction_error": "..."} saying why there is none. Never raises: a prediction is an aid. The
    hardware: the profile named by $STX_HARDWARE_PROFILE (what `stx plan --hardware` would use, so
    `stx plan --calibrate-from` refits that profile from these runs), else this CPU as `world`
    processes (only rates an earlier plan measured and cached: nothing is measured here) or the table
    GPU matching torch.cuda's device name."""

    try:
        if os.environ.get(PROFILE_ENV):
            cluster = _profile_cluster(os.environ[PROFILE_ENV], world)
        elif device_type == "cuda":
            cluster = _gpu_cluster(world)
        else:
            # this CPU's rates as earlier plans measured them: nothing is measured at a run's end
            with cached_only():
                cluster = _cpu_cluster_after_run(world, cfg.train.precision)
                return {"prediction": prediction_record(cfg, cluster)}
        return {"prediction": prediction_record(cfg, cluster)}
    except NotMeasured as e:
        return {
            "prediction_error": f"this CPU's rates are not measured yet ({e}): `stx plan CONFIG --device cpu "
            f"--world-size {world} --no-probe` measures them once (cached), or set {PROFILE_ENV} to a "
            "`stx calibrate` profile"
        }
    except Exception as e:  # reported in summary.json, never fatal
        return {"prediction_error": f"{type(e).__name__}: {e}"}
