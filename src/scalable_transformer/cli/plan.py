"""`stx plan CONFIG [key=value ...] (--world-size N | --nodes K --gpus-per-node G) --device NAME
[--host-memory-gb M] [--hardware cluster.yaml|profile.yaml] [--json] [--search] [--top K] [--emit-sweep FILE]
[--no-probe] [--remeasure] [--dry-run | --dry-run-top K] [--calibrate-from STORE [--output PROFILE]]`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import yaml

from ..bench.refit_store import refit_cluster
from ..config.load import load_config
from ..errors import StxWarning, UsageError
from ..plan.cluster import load_hardware, table_cluster, with_nodes
from ..plan.search import plan_config, search_layouts
from .parsers import split_config_args


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    config: str | None
    overrides: tuple[str, ...]
    world_size: int | None
    nodes: int | None
    gpus_per_node: int | None
    device: str | None
    host_memory_gb: float | None
    hardware: str | None
    json: bool
    search: bool
    top: int
    emit_sweep: Path | None
    probe: bool = True  # --device cpu, one layout: measure the step time (plan/probe.py)
    remeasure: bool = False
    dry_run: bool = False  # the engine on fake tensors at the target world size (dryrun/dry_run.py)
    dry_run_top: int = 0  # --search: dry-run the best K layouts that fit
    calibrate_from: Path | None = None  # a results store: refit the profile's corrections from its runs
    output: Path | None = None  # where the refitted profile goes
    attention_kernel: str | None = None  # plan the attention core at this kernel's rates
    moe_imbalance: float | None = None  # MoE: max/mean routed tokens per expert (None: the planner's default)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlanOptions:
        config, overrides = split_config_args(args.items)
        if args.world_size is None and args.nodes is None and args.hardware is None:
            raise UsageError("stx plan needs the devices: --world-size N, or --nodes K --gpus-per-node G")
        if args.world_size is not None and args.nodes is not None:
            raise UsageError("give --world-size or --nodes/--gpus-per-node, not both")
        if args.device is None and args.hardware is None:
            raise UsageError(
                "stx plan needs --device NAME (e.g. a100-40gb, or cpu) or --hardware cluster.yaml"
            )
        for name in ("world_size", "nodes", "gpus_per_node", "top"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if args.emit_sweep and not args.search:
            raise UsageError("--emit-sweep writes the best layouts of a --search; add --search")
        if args.remeasure and args.no_probe:
            raise UsageError("--remeasure runs the depth probes again; it cannot go with --no-probe")
        if args.dry_run and args.search:
            raise UsageError("--search verifies its best layouts with --dry-run-top K, not --dry-run")
        if args.dry_run_top is not None and not args.search:
            raise UsageError("--dry-run-top K dry-runs the best K layouts of a --search; add --search")
        if args.dry_run_top is not None and args.dry_run_top < 1:
            raise UsageError(f"--dry-run-top must be >= 1, got {args.dry_run_top}")
        imbalance = getattr(args, "moe_imbalance", None)
        if imbalance is not None and not imbalance >= 1:
            raise UsageError(
                f"--moe-imbalance is the busiest expert's tokens over the mean, so >= 1; got {imbalance}"
            )
        return cls(
            config,
            tuple(overrides),
            args.world_size,
            args.nodes,
            args.gpus_per_node,
            args.device,
            args.host_memory_gb,
            args.hardware,
            args.json,
            args.search,
            args.top,
            Path(args.emit_sweep) if args.emit_sweep else None,
            probe=not args.no_probe,
            remeasure=args.remeasure,
            dry_run=args.dry_run,
            dry_run_top=args.dry_run_top or 0,
            attention_kernel=args.attention_kernel,
            moe_imbalance=imbalance,
            **calibrate_options(args),
        )


def calibrate_options(args: argparse.Namespace) -> dict[str, Any]:
    """--calibrate-from STORE [--output PROFILE] (plan/refit.py)."""
    if args.output and not args.calibrate_from:
        raise UsageError("--output writes the profile that --calibrate-from STORE refits; add it")
    return {
        "calibrate_from": Path(args.calibrate_from) if args.calibrate_from else None,
        "output": Path(args.output) if args.output else None,
    }


def build_cluster(opts: PlanOptions, precision: str) -> Any:
    nodes: int
    per_node: int | None
    if opts.world_size is not None:
        nodes, per_node = 1, opts.world_size
    else:
        nodes, per_node = opts.nodes or 1, opts.gpus_per_node
    if opts.hardware:
        # here, not at the top: this machine's fingerprint needs torch (calibrate/this_machine.py: 2-4 s to
        # import, measured), which a table device's plan (`stx plan --device a100-80gb`) never imports
        from ..calibrate.this_machine import fingerprint_here

        cluster = load_hardware(opts.hardware, nodes=opts.nodes, here=fingerprint_here)
        if opts.world_size is not None:
            # a world size on a multi-node cluster file: as many nodes as it takes
            per = cluster.devices_per_node
            cluster = with_nodes(cluster, -(-opts.world_size // per), min(per, opts.world_size))
        elif per_node is not None:
            cluster = with_nodes(cluster, nodes, per_node)
        measured = cluster.profile.fingerprint.get("processes") if cluster.profile is not None else None
        if cluster.kind == "cpu" and measured is not None and measured != cluster.world_size:
            warnings.warn(
                StxWarning(
                    f"{opts.hardware}: measured with {measured} process(es), planned for "
                    f"{cluster.world_size}: its per-process rates may not hold"
                ),
                stacklevel=2,
            )
    elif (opts.device or "").lower() == "cpu":
        # here, not at the top: measuring this CPU takes torch (2-4 s to import, measured); only --device cpu
        from ..calibrate.this_machine import cpu_cluster

        cluster = cpu_cluster(nodes * (per_node or 1), precision)
    else:
        assert opts.device is not None
        if opts.world_size is not None:
            # a world size spans as many full nodes of the device's usual size as it takes
            usual = table_cluster(opts.device, 1).devices_per_node
            if opts.world_size > usual:
                if opts.world_size % usual:
                    raise UsageError(
                        f"--world-size {opts.world_size} is not a whole number of {usual}-device "
                        f"{opts.device} nodes; give --nodes K --gpus-per-node G"
                    )
                nodes, per_node = opts.world_size // usual, usual
        cluster = table_cluster(opts.device, nodes, per_node, opts.host_memory_gb)
    if opts.host_memory_gb is not None:
        cluster = dataclasses.replace(cluster, host_memory_bytes=int(opts.host_memory_gb * 2**30))
    if opts.attention_kernel is not None:
        cluster = with_attention_kernel(cluster, opts.attention_kernel, opts.probe)
    if opts.moe_imbalance is not None:
        cluster = dataclasses.replace(cluster, moe_imbalance=opts.moe_imbalance)
    return cluster


def with_attention_kernel(cluster: Any, kernel: str, probe: bool) -> Any:
    """`--attention-kernel`: the cluster planned with this kernel's attention rates, which its hardware
    profile must have."""
    if cluster.kind == "cpu" and probe:
        raise UsageError(
            "--attention-kernel changes the time model; on cpu `stx plan` measures the step with the "
            "depth probes instead: add --no-probe"
        )
    have = cluster.profile.attention_kernels if cluster.profile is not None else []
    if kernel not in have:
        where = f"hardware profile {cluster.profile.name!r}" if cluster.profile is not None else cluster.name
        raise UsageError(
            f"--attention-kernel {kernel}: {where} has no attention points of that kernel (it has "
            f"{', '.join(have) or 'none'}); `stx calibrate` measures the SDPA kernels of a machine"
        )
    return dataclasses.replace(cluster, attention_kernel=kernel)


def run(args: argparse.Namespace) -> int:
    opts = PlanOptions.from_args(args)
    cfg = load_config(opts.config, list(opts.overrides))
    cluster = build_cluster(opts, cfg.train.precision)
    if opts.calibrate_from is not None:
        cluster, lines = refit_cluster(cluster, opts.calibrate_from, opts.output)
        print("\n".join(lines), file=sys.stderr if opts.json else sys.stdout)
    if opts.search:
        results = search_layouts(cfg, cluster)
        # the best --top that fit, then the --top closest to fitting (as the human output lists them)
        shown = [r for r in results if r.fits][: opts.top] + [r for r in results if not r.fits][: opts.top]
    else:
        shown = [plan_config(cfg, cluster, probe=opts.probe, remeasure=opts.remeasure)]
        results = shown
    if opts.dry_run or opts.dry_run_top:
        # here, not at the top: dryrun/ imports torch (dryrun/dry_run.py: 5-8 s to import, measured), which a
        # plan without --dry-run never needs
        from ..dryrun.dry_run import verify

        count = 1 if opts.dry_run else opts.dry_run_top
        verified = [r for r in shown if r.fits][:count] if opts.search else shown
        done = {id(r): verify(r, cfg, cluster) for r in verified}
        shown = [done.get(id(r), r) for r in shown]
        results = [done.get(id(r), r) for r in results]
    if opts.emit_sweep is not None:
        write_sweep(opts, results, cluster)
    if opts.json:
        json.dump({"layouts": [r.to_dict() for r in shown]}, sys.stdout, indent=1)
        print()
        return 0
    print(
        f"cluster: {cluster.name}; {cluster.device.memory_bytes / 2**30:.1f} GiB per device "
        f"({cluster.source})"
    )
    print(corrections_line(cluster))
    if opts.search:
        render_search(results, opts.top)
        for r in results:
            if r.dry_run is not None:
                print(f"\n{r.layout.label()}:")
                render_dry_run(r.dry_run)
        if cluster.kind == "cpu":
            print(
                "on a CPU the rate model ranks the layouts but under-predicts their steps; `stx plan` of "
                "one layout (without --search) measures it (docs/PLANNER.md#cpu-depth-probes)"
            )
    else:
        render_one(shown[0], cluster)
        if shown[0].dry_run is not None:
            render_dry_run(shown[0].dry_run)
    if opts.emit_sweep is not None:
        print(f"sweep file: {opts.emit_sweep} (run it with `stx sweep {opts.emit_sweep}`)")
    return 0


def corrections_line(cluster: Any) -> str:
    """The op-class corrections the time model multiplies by, and where they came from; the measured
    layer factors when the profile has them."""
    profile = getattr(cluster, "profile", None)
    if profile is None:
        return "corrections: none (no hardware profile)"
    text = ", ".join(f"{c} {v:.3g}" for c, v in profile.corrections.items())
    source = profile.corrections_source
    if isinstance(source, dict):
        source = f"refit from {source.get('runs')} run(s) in {source.get('store')} on {source.get('date')}"
    line = f"corrections in use: {text} ({source or 'as measured, not refitted'})"
    if profile.layer_factors:
        factors = ", ".join(f"{k} {v:.3g}" for k, v in profile.layer_factors.items())
        line += f"; layer factors: {factors} (the model's own layer and head over their kernels, measured)"
    return line


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def render_one(r: Any, cluster: Any) -> None:
    print(f"layout: {r.layout.label()}")
    stages = r.stages
    different = len({tuple(sorted(s.breakdown.items())) for s in stages}) > 1
    shown = stages if different else stages[:1]
    for st in shown:
        title = f"memory per device, pipeline rank {st.pp_rank}" if different else "memory per device"
        print(f"{title}: {_gib(st.total)} of {_gib(cluster.device.memory_bytes)}")
        for key, value in st.breakdown.items():
            if value:
                print(f"  {key.replace('_', ' '):<24} {_gib(value):>14}")
    if r.host_memory_bytes is not None:
        host = cluster.host_memory_bytes
        print(
            f"host memory per node (offload): {_gib(r.host_memory_bytes)}"
            + (f" of {_gib(host)}" if host else "")
        )
    print(("fits" if r.fits else "DOES NOT FIT") + (f": {r.reason}" if r.reason else ""))
    print(f"step time: {r.time.total * 1000:,.1f} ms ({r.time_method})")
    if r.layout.ep > 1:
        print(
            f"  experts: the busiest of {r.layout.ep} expert-parallel ranks at {cluster.moe_imbalance:g}x "
            "the mean routed tokens (--moe-imbalance; docs/PLANNER.md#mixture-of-experts)"
        )
    if r.expected_error:
        e = r.expected_error
        print(
            f"  expected error: on {e['runs']} published runs of this class ({e['class']}) the planned "
            f"throughput was off by {e['median_error']:+.0%} (median; + = too fast), by at most "
            f"{e['p90_abs_error']:.0%} on 9 in 10 (benchmarks/results/plan_gpu_validation.md)"
        )
    for key, value in r.time.breakdown.items():
        print(f"  {key.replace('_', ' '):<24} {value * 1000:>12,.1f} ms")
    if r.time.dp_overlapped_seconds:
        print(
            f"  {'(dp comm. overlapped)':<24} {r.time.dp_overlapped_seconds * 1000:>12,.1f} ms "
            "hidden behind compute"
        )
    print(
        f"throughput: {r.samples_per_second:,.2f} samples/s, {r.tokens_per_second:,.0f} tokens/s, "
        f"{r.tflops_per_device:,.1f} TFLOP/s per device, MFU {r.mfu:.1%} (megatron convention, "
        f"peak {r.peak_flops / 1e12:,.1f} TFLOP/s {r.dtype} per device: {cluster.source})"
    )
    if r.fp8 != "none":
        against = (
            f"MFU {r.mfu_fp8:.1%} against the fp8 peak {r.peak_flops_fp8 / 1e12:,.1f} TFLOP/s per device"
            if r.mfu_fp8 is not None and r.peak_flops_fp8
            else f"no fp8 peak for {cluster.device.name}: MFU against the {r.dtype} peak only"
        )
        print(f"  fp8 ({r.fp8}, the blocks' linear layers): {against}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def render_dry_run(d: dict[str, Any]) -> None:
    """The dry run's measurements beside the prediction (dryrun/dry_run.py's dict)."""
    if "error" in d:
        print(f"dry run: failed; the prediction above stands. {d['error']}")
        return
    print(
        f"dry run: the engine on fake tensors, {d['world_size']} ranks ({d['device']}), "
        f"{len(d['ranks'])} rank(s) simulated in {d['seconds']:.1f} s: peak {_gib(d['peak_memory_bytes'])} "
        f"per device vs {_gib(d['predicted_peak_memory_bytes'])} predicted ({_pct(d['difference'])}; "
        "live tensor bytes)"
    )
    for r in d["ranks"]:
        at = r["peak_at"]
        where = ", ".join(x for x in (at["phase"], at["module"], at["op"]) if x)
        predicted = "" if r["predicted_bytes"] is None else f" vs {_gib(r['predicted_bytes'])} predicted"
        print(
            f"  rank {r['rank']} (pipeline rank {r['stage']}): {_gib(r['peak_memory_bytes'])}{predicted} "
            f"({_pct(r['difference'])}), peak in step {at['step']} at {where}"
        )
        for key, value in r["memory_breakdown_bytes"].items():
            print(f"    {key.replace('_', ' '):<24} {_gib(value):>14}")
    if d["collectives"]:
        print("  collectives per step (rank 0, a step without logging):")
        for c in d["collectives"]:
            print(f"    {c['group']:<6} {c['kind']:<15} x{c['count']:<5} {c['bytes'] / 2**20:>12,.1f} MiB")
    plain = [s for s in d["host_syncs"] if not s["logging_step"]]
    logged = [s for s in d["host_syncs"] if s["logging_step"]]
    print(
        f"  host synchronizations per step: {d['host_syncs_per_step']} without logging, "
        f"{sum(s['count'] for s in logged)} in a logging step (reads of a device value, data-dependent "
        "shapes)"
    )
    for s in plain:
        print(f"    {s['where']} x{s['count']}")
    for note in d.get("notes", []):
        print(f"  note: {note}")


def render_search(results: list[Any], top: int) -> None:
    fit = [r for r in results if r.fits]
    oom = [r for r in results if not r.fits]
    print(f"{len(results)} valid layouts: {len(fit)} fit, {len(oom)} do not")
    if results:
        print(f"step times: {results[0].time_method}")
    if fit:
        print(f"best {min(top, len(fit))} that fit (by predicted samples/s; MFU in the megatron convention):")
        for r in fit[:top]:
            print(
                f"  {r.samples_per_second:>10,.2f} samples/s  MFU {r.mfu:>6.1%}  "
                f"{_gib(r.peak_memory_bytes):>12}  {r.layout.label()}"
            )
    if oom:
        print(f"closest {min(top, len(oom))} that do not fit:")
        for r in oom[:top]:
            print(f"  {r.layout.label()}: {r.reason}")


def write_sweep(opts: PlanOptions, results: list[Any], cluster: Any) -> None:
    """A sweep file (bench/sweep.py format, explicit `members`) of the best --top layouts that fit
    and the fit/OOM boundary: the OOM layouts predicted closest to fitting, so a sweep checks both."""
    fit = [r for r in results if r.fits][: opts.top]
    boundary = [r for r in results if not r.fits][: max(1, opts.top // 3)]
    members = []
    for r in fit + boundary:
        point: dict[str, Any] = {"nproc": r.layout.world_size}
        point.update(r.layout.overrides())
        members.append(point)
    data = {
        "base": opts.config or "tiny-bert",
        "overrides": list(opts.overrides),
        "members": members,
        "steps": 20,
        "warmup_steps": 3,
    }
    header = (
        f"# stx plan --search on {cluster.name}: the best {len(fit)} predicted layouts that fit, then "
        f"{len(boundary)} predicted not to fit (the boundary); `stx sweep` checks them.\n"
    )
    opts.emit_sweep.write_text(header + yaml.safe_dump(data, sort_keys=False))  # type: ignore[union-attr]
