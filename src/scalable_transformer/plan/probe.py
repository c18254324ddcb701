"""Step time on this CPU measured from the engine itself at reduced depth, then extrapolated in depth.

On a GPU the rate model (`speed.step_time`) is the planner's: kernels there run near the rates it
models. On a CPU most of a small model's step is not GEMM time: dispatch of every op, dropout's
random numbers, the log-softmax over the vocabulary, FSDP2's and DTensor's Python per parameter and
per op, gloo sharing the cores with compute. The rate model, fed with measured GEMM, bandwidth and
gloo rates, under-predicted the 15 layouts of `benchmarks/plan_accuracy.py` by 22-65% on an idle
machine (2026-11-24). The probe runs the layout for real: `stx launch -n N train CONFIG` with 1 and
with up to 4 layers per pipeline chunk (num_layers = pp x virtual stages x j, `probe_depths`), 16
iterations each, and reads the median step and every phase timer's median from their summary.json.
A step is a fixed part (the embedding, head, loss, metrics, the per-step calls) plus a part per
layer (its compute, its share of the gradient collectives, FSDP2's gathers, the optimizer over its
parameters), so the step and each phase are extrapolated linearly to the config's depth; the
pipeline's wait (bubble and sends) too, since a stage's micro-batch time is linear in its layers.
When the config has at most 2 layers per chunk the probe at its own depth is the answer.

What it is not: a memory model (the memory prediction stays analytic: a probe of 2 layers says
nothing about whether 96 fit), nor free: two short runs of the engine, ~15-60 s on this machine,
cached per config and machine in the user cache (`cpu_probes.json`) unless `remeasure`.
Depth probes were weighed against timing the model's pieces (one block, the ends, the optimizer)
in worker processes: that needs FSDP2's, DTensor's and DDP's per-unit costs measured as the engine
applies them, i.e. the engine; the probe is the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import put_json_entry, read_json_entries
from ..config.load import to_yaml
from ..config.schema import Config
from ..metrics.device_table import cpu_model

CACHE_NAME = "cpu_probes.json"
METHOD = "depth-probe v1"
# phase timers (train/trainer.py, Megatron's names) -> the planner's breakdown keys; the optimizer's
# sub-timers (optimizer-*) are inside "optimizer" and not counted again
PHASES = {
    "forward-compute": "compute",
    "backward-compute": "compute",
    "forward-backward": "compute",  # pipeline: minus its p2p wait, below
    "pipeline-p2p-wait": "pipeline_wait",
    "all-grads-sync": "dp_communication",
    "embedding-grads-all-reduce": "dp_communication",
    "layernorm-grads-all-reduce": "tp_communication",
    "metrics-all-reduce": "other",
    "zero-grad": "other",
    "batch-generator": "other",
    "optimizer": "optimizer",
}
# environment of a launcher that started us: the probe is a job of its own
_LAUNCH_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


class ProbeError(RuntimeError):
    """A probe run failed; the message names the command and the end of its output."""


@dataclass(frozen=True)
class DepthProbe:
    num_layers: int  # model.num_layers of the probe run
    step_seconds: float  # median step after the warm-up
    phases_seconds: dict[str, float]  # the planner's breakdown keys, per step
    load_average: float | None  # 1-minute load average before the run
    command: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ProbeResult:
    breakdown: dict[str, float]  # seconds per step at the config's depth, by part; sums to the step
    probes: list[DepthProbe]
    chunks: int  # pipeline chunks per rank x stages: layers = chunks x j
    method: str

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())


def probe_depths(cfg: Config) -> tuple[list[int], int]:
    """(the probe runs' num_layers, the layers per chunk the config has): chunks of pp x virtual
    stages; 1 and up to 4 layers per chunk (fewer than the config has: a probe never runs the whole
    model; 4 gives the slope a lever arm 3 layers long against the noise of short runs), or the
    config's own depth when that is 2 or fewer layers per chunk."""
    p = cfg.parallel
    chunks = p.pp * p.virtual_pipeline_stages
    per_chunk = cfg.model.num_layers // chunks
    if per_chunk <= 2:
        return [cfg.model.num_layers], per_chunk
    return [chunks, min(4, per_chunk - 1) * chunks], per_chunk


def _phases(summary: dict[str, Any]) -> dict[str, float]:
    medians = summary.get("phase_time_ms_median") or {}
    out: dict[str, float] = {}
    for name, key in PHASES.items():
        if isinstance(medians.get(name), (int, float)):
            out[key] = out.get(key, 0.0) + medians[name] / 1000
    if "pipeline_wait" in out:  # inside forward-backward
        out["compute"] = max(0.0, out.get("compute", 0.0) - out["pipeline_wait"])
    return out


def _cache_key(cfg: Config, world_size: int, num_layers: int, iters: int, warmup: int) -> str:

    body = to_yaml(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=num_layers)))
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # a part of the key only
        torch_version = "?"
    return (
        f"{METHOD} | {digest} | world={world_size} | iters={iters}/{warmup} | {cpu_model()} | "
        f"cores={os.cpu_count()} | torch={torch_version} | python={platform.python_version()}"
    )


def probe_overrides(num_layers: int, iters: int, warmup: int, run_dir: Path) -> list[str]:
    """What a probe run changes in the config: its depth, its length, the device (this CPU, what
    `--device cpu` plans for, even where a GPU exists), and nothing it would keep (no checkpoints,
    evaluation, TensorBoard, tensor tracking, weights to load)."""
    return [
        f"model.num_layers={num_layers}",
        "train.device=cpu",
        "parallel.pipeline_layers=null",
        f"train.train_iters={iters}",
        f"logging.warmup_iters={warmup}",
        "train.eval_interval=0",
        "train.eval_iters=0",
        "train.exit_interval=null",
        "checkpoint.save=null",
        "checkpoint.load=null",
        "checkpoint.init_from_hf=null",
        "logging.tensorboard=false",
        "logging.track_tensor_bytes=false",
        f"logging.log_interval={iters}",
        f"logging.run_dir={run_dir}",
    ]


def run_probe(
    cfg: Config, world_size: int, num_layers: int, *, iters: int = 16, warmup: int = 3, timeout: float = 900
) -> DepthProbe:
    """One short run of the engine at `num_layers` on `world_size` local processes."""

    with tempfile.TemporaryDirectory(prefix="stx-probe-") as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(to_yaml(cfg))
        run_dir = Path(tmp) / "runs"
        cmd = [
            sys.executable,
            "-m",
            "scalable_transformer.cli",
            "launch",
            "-n",
            str(world_size),
            "train",
            str(config),
            *probe_overrides(num_layers, iters, warmup, run_dir),
        ]
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
        try:
            load: float | None = os.getloadavg()[0]
        except OSError:
            load = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:
            raise ProbeError(
                f"probe at {num_layers} layers ran over {timeout:.0f} s: {shlex.join(cmd)}"
            ) from e
        summaries = sorted(run_dir.glob("*/summary.json"))
        if proc.returncode != 0 or not summaries:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
            raise ProbeError(f"probe at {num_layers} layers exited {proc.returncode}: {tail}")
        summary = json.loads(summaries[-1].read_text())
    step = summary.get("median_iteration_seconds")
    if not isinstance(step, (int, float)) or step <= 0:
        raise ProbeError(f"probe at {num_layers} layers recorded no step time")
    shown = [c for c in cmd if not c.startswith(("logging.run_dir=",))]
    return DepthProbe(
        num_layers=num_layers,
        step_seconds=float(step),
        phases_seconds=_phases(summary),
        load_average=load,
        command=shlex.join(["stx", *shown[3:]]).replace(str(config), "CONFIG"),
    )


def extrapolate(probes: list[DepthProbe], chunks: int, per_chunk: int) -> dict[str, float]:
    """The median step and each phase linear in the layers per chunk through the two probes (slopes
    at least 0: a deeper model is never faster; two short runs' noise can say otherwise). The step
    is the figure (what a run's summary reports); the phases, whose medians need not add up to the
    median step, are scaled to it, and what no timer covers is `other` (with the metrics, zero-grad
    and batch timers). One probe (the config's own depth): its figures."""

    def line(va: float, vb: float, ja: float, jb: float) -> float:
        return va + max(0.0, (vb - va) / (jb - ja)) * (per_chunk - ja)

    if len(probes) == 1:
        phases, step = dict(probes[0].phases_seconds), probes[0].step_seconds
    else:
        a, b = probes
        ja, jb = a.num_layers / chunks, b.num_layers / chunks
        keys = sorted(set(a.phases_seconds) | set(b.phases_seconds))
        phases = {k: line(a.phases_seconds.get(k, 0.0), b.phases_seconds.get(k, 0.0), ja, jb) for k in keys}
        step = line(a.step_seconds, b.step_seconds, ja, jb)
    covered = sum(phases.values())
    if covered > step:
        phases = {k: v * step / covered for k, v in phases.items()}
    else:
        phases["other"] = phases.get("other", 0.0) + step - covered
    order = ("compute", "tp_communication", "dp_communication", "pipeline_wait", "optimizer", "other")
    return {k: phases[k] for k in order if phases.get(k, 0.0) > 0}


def probe_step_time(
    cfg: Config, world_size: int, *, remeasure: bool = False, iters: int = 16, warmup: int = 3
) -> ProbeResult:
    """The config's step time on this machine from depth probes (cached unless `remeasure`).
    Raises ProbeError when a probe run fails."""
    layers, per_chunk = probe_depths(cfg)
    chunks = cfg.parallel.pp * cfg.parallel.virtual_pipeline_stages
    cache = {} if remeasure else read_json_entries(CACHE_NAME)
    probes = []
    for n in layers:
        key = _cache_key(cfg, world_size, n, iters, warmup)
        entry = cache.get(key)
        if isinstance(entry, dict):
            try:
                probes.append(DepthProbe(**{f.name: entry[f.name] for f in dataclasses.fields(DepthProbe)}))
                continue
            except (KeyError, TypeError):
                pass
        probe = run_probe(cfg, world_size, n, iters=iters, warmup=warmup)
        put_json_entry(CACHE_NAME, key, probe.to_dict())
        probes.append(probe)
    if len(probes) > 1:
        depths = " and ".join(str(p.num_layers) for p in probes)
        method = (
            f"measured: the engine at {depths} layer(s) on {world_size} process(es), "
            f"extrapolated to {cfg.model.num_layers} layers"
        )
    else:
        method = (
            f"measured: the engine at the config's own {cfg.model.num_layers} layer(s) "
            f"on {world_size} process(es)"
        )
    return ProbeResult(extrapolate(probes, chunks, per_chunk), probes, chunks, method)
