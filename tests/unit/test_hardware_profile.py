"""Hardware profiles (plan/hardware_profile.py): strict loading with errors naming file and key, an atomic
round trip, the interpolated lookups the time model reads, and the fingerprint comparison."""

from __future__ import annotations

import copy
import csv
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import yaml

from scalable_transformer.calibrate.this_machine import fingerprint_here
from scalable_transformer.errors import ConfigError
from scalable_transformer.plan import hardware_profile as hp

BASE = {
    "format": 1,
    "name": "test machine",
    "kind": "cpu",
    "source": "written by the test",
    "fingerprint": {"device_name": "Test CPU", "torch": "2.0.0", "processes": 2, "threads_per_process": 1},
    "peak_tflops": {"fp32": 0.1, "bf16": 0.05},
    "device_memory_gb": 11.5,
    "host_link_gbps": 10.0,
    "gemm": [
        {"dtype": "fp32", "m": 64, "n": 64, "k": 64, "tflops": 0.02},
        {"dtype": "fp32", "m": 1024, "n": 1024, "k": 1024, "tflops": 0.08},
    ],
    "attention": [
        {"kernel": "math", "dtype": "fp32", "batch": 4, "heads": 4, "seq_len": 128, "head_dim": 64,
         "causal": True, "pass": "fwd", "tflops": 0.01},
        {"kernel": "math", "dtype": "fp32", "batch": 4, "heads": 4, "seq_len": 1024, "head_dim": 64,
         "causal": True, "pass": "fwd", "tflops": 0.03},
        {"kernel": "flash", "dtype": "fp32", "batch": 4, "heads": 4, "seq_len": 1024, "head_dim": 64,
         "causal": True, "pass": "bwd", "tflops": 0.05},
    ],
    "memory_bound": {"bandwidth_gbps": 12.0, "op_overhead_us": 9.0},
    "collectives": [
        {"op": "all_reduce", "scope": "intra_node", "ranks": 2, "size_bytes": 1024, "time_us": 100.0},
        {"op": "all_reduce", "scope": "intra_node", "ranks": 2, "size_bytes": 2**20, "busbw_gbps": 2.0},
        {"op": "all_reduce", "scope": "intra_node", "ranks": 2, "size_bytes": 2**26, "busbw_gbps": 4.0},
    ],
    "corrections": dict.fromkeys(("gemm", "attention", "memory_bound", "overhead", "communication"), 1.0),
    "corrections_source": None,
}  # fmt: skip


def profile(**changes):
    data = copy.deepcopy(BASE)
    data.update(changes)
    return hp.profile_from_dict(data, "prof.yaml")


def test_round_trip_is_atomic_and_equal(tmp_path):
    path = tmp_path / "prof.yaml"
    original = profile()
    hp.save_profile(original, path)
    assert hp.load_profile(path) == original
    assert [p.name for p in tmp_path.iterdir()] == ["prof.yaml"]  # no temporary file left beside it
    assert hp.is_profile_file(path)
    (tmp_path / "cluster.yaml").write_text("name: x\ndevice: a100-40gb\n")
    assert not hp.is_profile_file(tmp_path / "cluster.yaml")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": 2}, "prof.yaml: format must be 1, got 2"),
        ({"kind": "tpu"}, "prof.yaml: kind must be one of cpu, gpu, got 'tpu'"),
        ({"bogus": 1}, "prof.yaml: unknown key(s) bogus"),
        ({"peak_tflops": {"fp32": -1}}, "prof.yaml: peak_tflops.fp32 must be a positive number, got -1"),
        ({"device_memory_gb": "lots"}, "prof.yaml: device_memory_gb must be a positive number, got 'lots'"),
        ({"gemm": []}, "prof.yaml: gemm must be a non-empty list"),
        ({"memory_bound": {"bandwidth_gbps": 1.0}}, "prof.yaml: memory_bound.op_overhead_us is required"),
        ({"corrections": {"gemm": 1.0, "other": 2.0}}, "prof.yaml: unknown key corrections.other"),
        ({"fingerprint": {"colour": "red"}}, "prof.yaml: unknown key(s) colour in fingerprint"),
    ],
)
def test_malformed_top_level_names_file_and_key(change, message):
    with pytest.raises(ConfigError) as e:
        profile(**change)
    assert message in str(e.value)


def test_malformed_entry_names_its_index():
    data = copy.deepcopy(BASE)
    data["gemm"].append({"dtype": "fp32", "m": 8, "n": 8, "k": 8, "tflops": -1})
    with pytest.raises(ConfigError, match=r"prof\.yaml: gemm\[2\]\.tflops must be a positive number, got -1"):
        hp.profile_from_dict(data, "prof.yaml")
    data = copy.deepcopy(BASE)
    data["attention"][1]["pass"] = "both"
    with pytest.raises(ConfigError, match=r"attention\[1\]\.pass must be one of fwd, bwd, got 'both'"):
        hp.profile_from_dict(data, "prof.yaml")
    data = copy.deepcopy(BASE)
    del data["collectives"][0]["time_us"]
    with pytest.raises(ConfigError, match=r"collectives\[0\] needs time_us or busbw_gbps"):
        hp.profile_from_dict(data, "prof.yaml")


def test_load_reports_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the hardware profile"):
        hp.load_profile(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: [1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        hp.load_profile(bad)


def test_gemm_rate_interpolates_in_log_of_the_smallest_dimension_and_clamps():
    p = profile()
    assert p.gemm_rate(64, 4096, 4096, "fp32") == pytest.approx(0.02e12)  # smallest dim 64
    assert p.gemm_rate(8, 8, 8, "fp32") == pytest.approx(0.02e12)  # clamped below
    assert p.gemm_rate(9999, 9999, 9999, "fp32") == pytest.approx(0.08e12)  # clamped above
    assert p.gemm_rate(256, 256, 256, "fp32") == pytest.approx(0.05e12)  # halfway in log
    # a dtype without points: fp32's curve scaled by the peaks (0.05 / 0.1)
    assert p.gemm_rate(1024, 1024, 1024, "bf16") == pytest.approx(0.04e12)
    with pytest.raises(ConfigError, match="no gemm points for fp16"):
        p.gemm_rate(64, 64, 64, "fp16")


def test_attention_rate_picks_kernel_pass_and_interpolates_seq_len():
    p = profile()
    mid = math.exp((math.log(128) + math.log(1024)) / 2)
    assert p.attention_rate("math", "fp32", round(mid), 64, True, "fwd") == pytest.approx(0.02e12, rel=1e-3)
    assert p.attention_rate("flash", "fp32", 1024, 64, True, "bwd") == pytest.approx(0.05e12)
    # no mem_efficient points: math's; no bwd math points: the fwd ones
    assert p.attention_rate("mem_efficient", "fp32", 4096, 64, True, "bwd") == pytest.approx(0.03e12)


def test_collective_seconds_latency_bandwidth_and_rank_scaling():
    p = profile()
    assert p.collective_seconds("all_reduce", "intra_node", 1, 2**20) == 0.0
    assert p.collective_seconds("all_reduce", "intra_node", 2, 16) == pytest.approx(100e-6)  # latency floor
    big = p.collective_seconds("all_reduce", "intra_node", 2, 2**28)
    assert big == pytest.approx(1.0 * 2**28 / 4e9)  # ring factor 2 (n-1)/n = 1 at n = 2, busbw clamped
    # 4 ranks: bandwidth term x (2*3/4) / 1, latency x 6 / 2 hops
    four = p.collective_seconds("all_reduce", "intra_node", 4, 2**28)
    assert four == pytest.approx(100e-6 * 3 + (big - 100e-6) * 1.5)
    # all_gather borrows all_reduce's bus bandwidth at its own ring factor; inter_node the intra curve
    ag = p.collective_seconds("all_gather", "inter_node", 2, 2**28)
    assert ag == pytest.approx(0.5 * 2**28 / 4e9)


def test_profile_mismatch_names_each_difference():
    p = profile()
    same = {"device_name": "Test CPU", "torch": "2.0.0", "processes": 2, "threads_per_process": 1}
    assert hp.profile_mismatch(p, same) == []
    other = {**same, "torch": "2.1.0", "processes": 4}
    diffs = hp.profile_mismatch(p, other)
    assert diffs == ["torch: profile '2.0.0', here '2.1.0'", "processes: profile 2, here 4"]


def test_fingerprint_here_has_every_key():
    fp = fingerprint_here(processes=2, threads_per_process=1)
    assert set(fp) == set(hp.FINGERPRINT_KEYS)
    assert fp["processes"] == 2 and fp["threads_per_process"] == 1
    assert yaml.safe_load(yaml.safe_dump(fp)) == fp


def test_hardware_option_accepts_a_profile_or_a_cluster_file(tmp_path):
    from scalable_transformer.plan.cluster import load_hardware

    path = tmp_path / "prof.yaml"
    hp.save_profile(
        profile(kind="gpu", topology={"devices_per_node": 4, "nics_per_node": 4, "nic_gbps": 25}), path
    )
    cluster = load_hardware(path, nodes=2)
    assert cluster.profile is not None and cluster.profile.name == "test machine"
    assert (cluster.nodes, cluster.devices_per_node, cluster.kind) == (2, 4, "gpu")
    assert cluster.device.inter_node_bandwidth == pytest.approx(25e9)  # 4 NICs x 25 GB/s over 4 devices
    (tmp_path / "cluster.yaml").write_text("name: x\ndevice: a100-40gb\n")
    assert load_hardware(tmp_path / "cluster.yaml").profile is None


@pytest.mark.parametrize("device", ["a100-40gb", "a100-80gb", "h100-sxm", "h200-sxm"])
def test_builtin_profiles_load_and_cite_every_point(device):
    from scalable_transformer.plan.cluster import table_cluster

    cluster = table_cluster(device, 1)
    prof = cluster.profile
    assert prof is not None and prof.kind == "gpu" and prof.name == device
    assert all(p.source for p in (*prof.gemm, *prof.attention, *prof.collectives))
    # the interpolated lookups give finite, physical rates below the peaks
    assert 0 < prof.gemm_rate(4096, 4096, 4096, "bf16") <= prof.peak("bf16")
    assert 0 < prof.attention_rate("flash", "bf16", 2048, 128, True, "bwd") <= prof.peak("bf16")
    assert 0 < prof.collective_seconds("reduce_scatter", "intra_node", 8, 2**30) < 1.0


def _gpt(tp: int = 1, zero: int = 0, recompute: str = "none"):
    from scalable_transformer.config.load import load_config

    return load_config(
        "gpt-13b",
        [f"parallel.tp={tp}", f"parallel.zero_stage={zero}", f"parallel.activation_checkpointing={recompute}",
         "train.global_batch_size=64", "parallel.dp=-1"],
    )  # fmt: skip


def load_gpt(zero: int, *extra: str):
    from scalable_transformer.config.load import load_config

    return load_config(
        "gpt-13b",
        ["model.num_layers=4", "model.hidden_size=1024", "model.num_attention_heads=8",
         f"parallel.zero_stage={zero}", "train.micro_batch_size=1", *extra],
    )  # fmt: skip


def test_step_time_classes_sum_to_the_breakdown_and_corrections_scale_them():
    import dataclasses

    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import prepare
    from scalable_transformer.plan.speed import OP_CLASSES, PHASES, step_time

    cluster = table_cluster("a100-80gb", 2, 8)
    cfg = prepare(_gpt(tp=2, zero=3, recompute="full"), cluster.world_size)
    st = step_time(cfg, cluster)
    assert set(st.classes) <= set(PHASES) and {"forward", "backward", "grads_sync"} <= set(st.classes)
    assert all(set(by) <= set(OP_CLASSES) for by in st.classes.values())
    total = sum(sum(by.values()) for by in st.classes.values())
    assert total == pytest.approx(st.total)
    # full recompute: backward holds a forward more of every class
    assert st.classes["backward"]["gemm"] > 2.5 * st.classes["forward"]["gemm"]
    assert st.classes["tp_communication"]["communication"] > 0
    prof = cluster.profile
    assert prof is not None
    doubled = dataclasses.replace(prof, corrections={**prof.corrections, "gemm": 2.0})
    st2 = step_time(cfg, dataclasses.replace(cluster, profile=doubled))
    assert st2.classes["forward"]["gemm"] == pytest.approx(2 * st.classes["forward"]["gemm"])
    assert st2.classes["forward"]["attention"] == pytest.approx(st.classes["forward"]["attention"])


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_collectives_hide_their_bandwidth_but_not_their_latency(zero):
    """Each FSDP unit's gather and scatter hides behind compute except its latency (its time at one
    byte, the ring's n - 1 hops): across more nodes the exposed data-parallel time grows by the
    collectives' count times their latency growth, the hidden share does not shrink."""
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import prepare
    from scalable_transformer.plan.speed import _rates, step_time

    def plan(nodes: int):
        cluster = table_cluster("a100-40gb", nodes, 8)
        cfg = prepare(
            load_gpt(zero, f"parallel.dp={8 * nodes}", f"train.global_batch_size={16 * nodes}"),
            cluster.world_size,
        )
        return cfg, cluster, step_time(cfg, cluster)

    cfg2, c2, two = plan(2)
    cfg8, c8, eight = plan(8)
    m = cfg8.train.gradient_accumulation_steps
    assert m == cfg2.train.gradient_accumulation_steps == 2
    layers = cfg8.model.num_layers
    units = layers + 1  # the blocks and the root parameters
    gathers = m * (units + (units - 1 if zero == 3 else 0))
    scatters = (m if cfg8.parallel.reduce_each_micro_batch else 1) * units

    def latency(cfg, cluster) -> float:
        r = _rates(cluster)
        dp = cfg.parallel.dp
        return (gathers - m) * r.collective("all_gather", dp, 1.0, 1) + (scatters - 1) * r.collective(
            "reduce_scatter", dp, 1.0, 1
        )

    lat2, lat8 = latency(cfg2, c2), latency(cfg8, c8)
    assert lat8 > 3 * lat2 > 0  # 63 hops against 15
    exposed2 = two.breakdown["dp_communication"]
    exposed8 = eight.breakdown["dp_communication"]
    assert exposed8 - exposed2 >= 0.9 * (lat8 - lat2)
    assert exposed8 >= lat8


def _validation_harness():
    """benchmarks/plan_gpu_validation.py, a script, loaded as a module."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_gpu_validation.py"
    spec = importlib.util.spec_from_file_location("plan_gpu_validation", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_gpu_validation"] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["plan_gpu_validation"]
    return module


def test_gpu_validation_runs_on_a_few_rows(tmp_path):
    module = _validation_harness()
    out = tmp_path / "v.md"
    assert module.main(["--limit", "1", "--output", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and line.count("|") == 11]
    rows = [line for line in rows if "%" in line.split("|")[9]]
    assert len(rows) >= 4  # one row of each source the model expresses
    errors = [float(line.split("|")[9].strip().rstrip("%")) for line in rows]
    assert all(math.isfinite(e) for e in errors)


def _bridge_unplanned(r: dict) -> bool:
    return not r["precision"]  # bf16 and fp8 recipes share the layout: the precision is unknown


def _zoo_unplanned(r: dict) -> bool:
    # TFLOP/s by Megatron's formula with a head size the FLOPs conventions do not count
    return not r["iteration_time_s"] and int(r["kv_channels"]) * int(r["heads"]) != int(r["hidden"])


@pytest.mark.parametrize(
    ("name", "reader", "unplanned"),
    [
        ("megatron_bridge_moe_h100.csv", "_megatron_bridge_moe", _bridge_unplanned),
        ("megatron_moe_modelzoo_h100.csv", "_zoo_moe", _zoo_unplanned),
    ],
)
def test_gpu_validation_plans_published_moe_rows_with_their_layout(name, reader, unplanned):
    v = _validation_harness()
    with open(v.DATA / name) as f:
        pairs = [(r, getattr(v, reader)(r)) for r in csv.DictReader(f)]
    assert len(pairs) >= 5
    for r, row in pairs:
        assert row.moe
        for key, column in (("num_experts", "num_experts"), ("moe_router_topk", "moe_topk")):
            assert f"model.{key}={r[column]}" in row.args, (key, row.args)
        other_head_size = int(r["kv_channels"]) * int(r["heads"]) != int(r["hidden"])
        assert (f"model.kv_channels={r['kv_channels']}" in row.args) == other_head_size
        assert ("model.qk_norm=head" in row.args) == (r["qk_norm"] == "yes")  # Megatron --qk-layernorm
        assert f"parallel.ep={r['ep']}" in row.args and f"parallel.tp={r['tp']}" in row.args
        fp8 = [a for a in row.args if a.startswith("train.fp8=")]
        assert bool(fp8) == r["precision"].startswith("fp8")
        assert bool(row.skip) == unplanned(r)  # listed in the report, with the reason, not planned
        # Qwen3-235B's 94 layers over pp x vp virtual stages: Megatron counts the embedding and the loss
        split = [a.split("=", 1)[1] for a in row.args if a.startswith("parallel.pipeline_layers=")]
        chunks, layers = int(r["pp"]) * int(r["pipeline_interleave"]), int(r["layers"])
        if layers % chunks:
            per = [int(x) for x in split[0].split(",")]
            assert len(per) == chunks and sum(per) == layers and per[0] == per[-1] == per[1] - 1
        else:
            assert split == []


def test_gpu_validation_notes_why_a_row_is_not_planned():
    v = _validation_harness()
    refused = v.Row("s", "t", "m", "l", ["gpt-125m", "model.no_such_key=1"], "tokens/s/GPU", 1.0)
    v.predict(refused, "h100-sxm", 8)
    assert refused.predicted is None and "unknown key 'model.no_such_key'" in refused.note
    skipped = v.Row("s", "t", "m", "l", ["gpt-125m"], "tokens/s/GPU", 1.0, skip="not planned: no precision")
    v.predict(skipped, "h100-sxm", 8)
    assert skipped.predicted is None and skipped.note == "not planned: no precision"


@pytest.mark.parametrize(
    ("tp", "sp", "recompute", "memory_bound", "per_layer_us"),
    [
        (2, False, "none", {"tp_layer_overhead_us": 500.0, "sp_layer_overhead_us": 900.0}, 500.0),
        (2, True, "none", {"tp_layer_overhead_us": 500.0, "sp_layer_overhead_us": 900.0}, 900.0),
        (2, True, "none", {"tp_layer_overhead_us": 500.0}, 500.0),  # no SP point: at least TP's
        (2, False, "full", {"tp_layer_overhead_us": 500.0}, 700.0),  # the forward share (30 of 75) again
        (1, False, "none", {"tp_layer_overhead_us": 500.0, "sp_layer_overhead_us": 900.0}, 0.0),
    ],
)
def test_a_tensor_parallel_layers_measured_cost_is_added_per_layer_and_micro_batch(
    tp, sp, recompute, memory_bound, per_layer_us
):
    import dataclasses

    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import prepare
    from scalable_transformer.plan.speed import step_time

    cluster = table_cluster("a100-80gb", 2, 8)
    cfg = _gpt(tp=tp, recompute=recompute)
    cfg.parallel.sequence_parallel = sp
    cfg = prepare(cfg, cluster.world_size)
    prof = cluster.profile
    assert prof is not None and prof.memory_bound.tp_layer_overhead_us == 0.0  # built-in GPU: unmeasured
    base = step_time(cfg, cluster)
    measured = dataclasses.replace(prof.memory_bound, **memory_bound)
    st = step_time(
        cfg, dataclasses.replace(cluster, profile=dataclasses.replace(prof, memory_bound=measured))
    )
    overhead = sum(st.classes[p]["overhead"] - base.classes[p]["overhead"] for p in ("forward", "backward"))
    m = cfg.train.gradient_accumulation_steps
    assert overhead == pytest.approx(cfg.model.num_layers * m * per_layer_us * 1e-6)
    assert st.total - base.total == pytest.approx(overhead)


def test_the_tp_layer_costs_round_trip_and_a_negative_one_names_its_key(tmp_path):
    prof = profile(memory_bound={"bandwidth_gbps": 12.0, "op_overhead_us": 9.0, "tp_layer_overhead_us": 250.0,
                                 "sp_layer_overhead_us": 400.0})  # fmt: skip
    hp.save_profile(prof, tmp_path / "p.yaml")
    again = hp.load_profile(tmp_path / "p.yaml")
    mb = again.memory_bound
    assert (mb.tp_layer_overhead_us, mb.sp_layer_overhead_us) == (250.0, 400.0)
    with pytest.raises(ConfigError, match=r"memory_bound.sp_layer_overhead_us must be a non-negative number"):
        profile(memory_bound={"bandwidth_gbps": 12.0, "op_overhead_us": 9.0, "sp_layer_overhead_us": -1})


@pytest.mark.parametrize(
    ("optimizer", "momentum", "zero", "per_param"),
    [
        ("adamw", 0.0, 0, 80 + 12),
        ("adamw", 0.0, 1, 80 + 12),
        ("sgd", 0.9, 0, 32 + 12),
        ("sgd", 0.0, 0, 12 + 12),
    ],
)
def test_the_optimizer_phase_moves_the_bytes_of_torchs_foreach_passes(optimizer, momentum, zero, per_param):
    """AdamW's eight foreach passes (80 bytes per parameter) plus the norm and clipping (12), over the
    shard this rank steps, at the profile's bandwidth; SGD's passes by momentum."""
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import prepare
    from scalable_transformer.plan.speed import stage_params, step_time

    cluster = table_cluster("h100-sxm", 1, 8)
    cfg = _gpt(zero=zero)
    cfg.optim.optimizer, cfg.optim.sgd_momentum = optimizer, momentum
    cfg = prepare(cfg, cluster.world_size)
    prof = cluster.profile
    assert prof is not None
    st = step_time(cfg, cluster)
    p = cfg.parallel
    total = stage_params(cfg.model, 1, 1, 0, p.virtual_pipeline_stages, p.pipeline_schedule, None).total
    shard = total / (8 if zero >= 1 else 1)
    expected = shard * per_param / (prof.memory_bound.bandwidth_gbps * 1e9) * prof.correction("memory_bound")
    assert st.classes["optimizer"]["memory_bound"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_builtin_gpu_profiles_are_what_the_builder_makes_of_the_kernel_data(tmp_path, monkeypatch):
    """plan/profiles/*.yaml are benchmarks/build_gpu_profiles.py's output from benchmarks/data/gpu_kernels
    (public kernel data and the stx calibrate profiles in measured/): a profile edited by hand, or data
    changed without a rebuild, fails here."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "build_gpu_profiles", root / "benchmarks" / "build_gpu_profiles.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path)
    monkeypatch.setattr(module, "ROOT", tmp_path.parent)  # its progress line prints paths relative to ROOT
    module.main()
    shipped = root / "src" / "scalable_transformer" / "plan" / "profiles"
    built = sorted(p.name for p in tmp_path.glob("*.yaml"))
    assert built == sorted(p.name for p in shipped.glob("*.yaml"))
    for name in built:
        assert yaml.safe_load((tmp_path / name).read_text()) == yaml.safe_load(
            (shipped / name).read_text()
        ), name
    h100 = yaml.safe_load((shipped / "h100-sxm.yaml").read_text())
    assert any(str(p["source"]).startswith("measured/h100-") for p in h100["gemm"])


@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_the_attention_probabilities_dropout_is_counted_on_the_math_path(kernel):
    """On the math path (a CPU with attention dropout) the dropout of the b n s^2 probabilities moves
    fp32 in, fp32 out and a mask byte per score, and q, k, v and the output are copied to and from
    heads; SDPA's flash kernel does both inside the kernel."""
    import dataclasses

    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan.speed import _layer_bytes, _shape

    cfg = resolve(load_config("tiny-gpt", ["model.attention_dropout=0.1", "train.micro_batch_size=4"]), 1)
    sh = dataclasses.replace(_shape(cfg, "cpu"), kernel=kernel)
    assert sh.attention_dropout
    without = dataclasses.replace(sh, attention_dropout=False)
    extra = _layer_bytes(sh) - _layer_bytes(without)
    expected = sh.tokens * sh.n * sh.s * (2 * 4 + 1) if kernel == "math" else 0
    assert extra == pytest.approx(expected)
    # the math path's own work over the flash kernel's: the fp32 softmax and the head copies
    math_only = _layer_bytes(dataclasses.replace(without, kernel="math")) - _layer_bytes(
        dataclasses.replace(without, kernel="flash")
    )
    copies = (2 * sh.n + 2 * sh.g) * sh.d * 2 * sh.e
    assert math_only == pytest.approx(sh.tokens * (sh.n * sh.s * 3 * 4 + copies))


def _plan_json(capsys, *argv: str) -> dict:
    import json

    from scalable_transformer.cli import main

    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["layouts"][0]


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (
            ["gpt-1b", "--nodes", "4", "--gpus-per-node", "8", "--device", "a100-40gb"],
            ("a100", "1B-10B", "several nodes"),
        ),
        (["gpt-125m", "--world-size", "8", "--device", "h100-sxm"], ("h100", "< 1B", "one node")),
        (["gpt-13b", "--world-size", "8", "--device", "h200-sxm"], None),  # no published H200 runs
        (["tiny-gpt", "--world-size", "1", "--device", "cpu"], None),  # a CPU: not the GPU validation's
    ],
)
def test_plan_shows_the_validation_error_of_its_class_of_layout(capsys, argv, key):
    """`stx plan` reads the expected error from the table the GPU validation generates
    (plan/validation_errors.json): the class is the GPU family, the parameters' band and one node or
    several."""
    from scalable_transformer.cli import main
    from scalable_transformer.plan.validation_error import errors

    layout = _plan_json(capsys, *argv, "--no-probe")
    if key is None:
        assert layout["expected_error"] is None
        return
    runs, median, p90 = errors()[key]
    assert layout["expected_error"] == {
        "class": ", ".join(key),
        "runs": runs,
        "median_error": median,
        "p90_abs_error": p90,
    }
    assert runs > 0
    assert main(["plan", *argv, "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert f"expected error: on {runs} published runs of this class ({', '.join(key)})" in out


def test_attention_kernel_option_times_only_the_attention_core_at_that_kernels_rates(capsys):
    """`stx plan --attention-kernel triton` (another engine's run: llm-foundry's Triton FlashAttention)
    changes the attention class by the ratio of the profile's rates and nothing else; memory keeps the
    config's."""
    from scalable_transformer.plan.cluster import builtin_profile

    args = ["gpt-1b", "model.seq_length=8192", "model.max_position_embeddings=8192",
            "train.micro_batch_size=1", "--device", "a100-80gb", "--world-size", "8"]  # fmt: skip
    flash = _plan_json(capsys, *args)
    triton = _plan_json(capsys, *args, "--attention-kernel", "triton")
    profile = builtin_profile("a100-80gb")
    assert profile is not None
    ratio = profile.attention_rate("flash", "bf16", 8192, 128, True, "fwd") / profile.attention_rate(
        "triton", "bf16", 8192, 128, True, "fwd"
    )
    assert ratio > 1.5  # FlashAttention-2 against the 2022 Triton kernel in the flash-attention README
    for phase in ("forward", "backward"):
        assert triton["time_classes_seconds"][phase]["attention"] == pytest.approx(
            flash["time_classes_seconds"][phase]["attention"] * ratio, rel=1e-6
        )
        for c in ("gemm", "memory_bound"):
            assert triton["time_classes_seconds"][phase][c] == flash["time_classes_seconds"][phase][c]
    assert triton["step_seconds"] > flash["step_seconds"]
    assert triton["time_method"].endswith(", attention kernel triton")
    assert "attention kernel" not in flash["time_method"]
    assert triton["peak_memory_bytes"] == flash["peak_memory_bytes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "h100-sxm", "--attention-kernel", "cudnn"], "has no attention points of that kernel"),
        (["--device", "a100-80gb", "--attention-kernel", "flashy"], "has no attention points of that kernel"),
        (["--device", "cpu", "--attention-kernel", "flash"], "add --no-probe"),
    ],
)
def test_attention_kernel_option_refuses_a_kernel_it_cannot_plan(capsys, argv, message):
    from scalable_transformer.cli import main

    assert main(["plan", "tiny-gpt", "--world-size", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "points" in err:
        assert "it has flash, " in err and "math, mem_efficient" in err


def _gpu_profile(**extra: object) -> hp.HardwareProfile:
    """A GPU profile with flash and cudnn attention points (cudnn twice as fast)."""
    data = copy.deepcopy(BASE)
    data.update(kind="gpu", peak_tflops={"bf16": 989.0}, **extra)
    data["gemm"] = [{**g, "dtype": "bf16", "tflops": 500.0} for g in data["gemm"]]
    data["attention"] = [
        {"kernel": kernel, "dtype": "bf16", "batch": 1, "heads": 16, "seq_len": s, "head_dim": 128,
         "causal": True, "pass": pass_, "tflops": rate}
        for kernel, rate in (("flash", 200.0), ("cudnn", 400.0))
        for s in (1024, 8192)
        for pass_ in ("fwd", "bwd")
    ]  # fmt: skip
    return hp.profile_from_dict(data, "gpu.yaml")


def test_a_gpu_profile_times_attention_at_the_kernel_sdpa_dispatched_in_calibration(tmp_path):
    """`attention_kernel` (recorded by stx calibrate) picks the attention points the plan times on a GPU;
    `--attention-kernel` still overrides it; it round-trips; a kernel it has no points of is ignored."""
    import dataclasses

    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan.cluster import profile_cluster
    from scalable_transformer.plan.speed import step_time

    cfg = resolve(load_config("gpt-1b", ["model.num_layers=2", "train.micro_batch_size=1"]), 1)

    def attention_seconds(profile: hp.HardwareProfile, override: str | None = None) -> float:
        cluster = dataclasses.replace(profile_cluster(profile, 1, 1), attention_kernel=override)
        return step_time(cfg, cluster).classes["forward"]["attention"]

    flash = attention_seconds(_gpu_profile())
    cudnn = attention_seconds(_gpu_profile(attention_kernel="cudnn"))
    assert cudnn == pytest.approx(flash / 2)
    assert attention_seconds(_gpu_profile(attention_kernel="cudnn"), "flash") == pytest.approx(flash)
    assert attention_seconds(_gpu_profile(attention_kernel="mem_efficient")) == pytest.approx(flash)
    profile = _gpu_profile(attention_kernel="cudnn")
    hp.save_profile(profile, tmp_path / "p.yaml")
    assert hp.load_profile(tmp_path / "p.yaml").attention_kernel == "cudnn"
    with pytest.raises(ConfigError, match=r"gpu.yaml: attention_kernel must be null or one of flash"):
        _gpu_profile(attention_kernel="fastest")


def test_a_group_size_with_its_own_points_is_timed_at_them_not_at_another_sizes_scaled():
    """`stx calibrate` on 4 processes also times 2-rank groups side by side (calibrate.collective_groups):
    a 2-rank layout group reads those points; without them the 4-rank latency is scaled by hops."""

    def point(ranks: int, size: int, us: float) -> dict:
        return {"op": "all_reduce", "scope": "intra_node", "ranks": ranks, "size_bytes": size, "time_us": us}

    whole = [point(4, 4096, 6000.0), point(4, 2**20, 9000.0)]
    only_whole = profile(collectives=whole)
    both = profile(collectives=[*whole, point(2, 4096, 5500.0), point(2, 2**20, 7000.0)])
    assert only_whole.collective_seconds("all_reduce", "intra_node", 2, 4096) == pytest.approx(2e-3)
    assert both.collective_seconds("all_reduce", "intra_node", 2, 4096) == pytest.approx(5.5e-3)
    assert both.collective_seconds("all_reduce", "intra_node", 2, 2**20) == pytest.approx(7e-3)
    assert both.collective_seconds("all_reduce", "intra_node", 4, 4096) == pytest.approx(6e-3)


def test_a_layout_reads_the_tp_layer_cost_of_its_own_group_size_and_the_list_round_trips(tmp_path):
    """`stx calibrate` on 4 processes times the tensor-parallel layer at 2 and 4 ranks (`tp_layers`)."""
    import dataclasses

    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import prepare
    from scalable_transformer.plan.speed import step_time

    points = [{"ranks": 2, "tp_layer_overhead_us": 900.0, "sp_layer_overhead_us": 1500.0},
              {"ranks": 8, "tp_layer_overhead_us": 300.0}]  # fmt: skip
    prof = profile(tp_layers=points)
    assert prof.tp_layer_seconds(2, False) == pytest.approx(900e-6)
    assert prof.tp_layer_seconds(2, True) == pytest.approx(1500e-6)
    assert prof.tp_layer_seconds(8, True) == pytest.approx(300e-6)  # no SP figure: the TP one
    assert prof.tp_layer_seconds(4, False) == pytest.approx(300e-6)  # a tie in log: the larger size
    assert prof.tp_layer_seconds(16, False) == pytest.approx(300e-6)
    hp.save_profile(prof, tmp_path / "p.yaml")
    assert hp.load_profile(tmp_path / "p.yaml").tp_layers == prof.tp_layers
    with pytest.raises(ConfigError, match=r"tp_layers\[1\].ranks must be a tensor-parallel group size of 2"):
        profile(tp_layers=[points[0], {"ranks": 1, "tp_layer_overhead_us": 5.0}])

    cluster = table_cluster("a100-80gb", 2, 8)
    assert cluster.profile is not None
    per_layer = {}
    for tp in (2, 8):
        cfg = prepare(_gpt(tp=tp), cluster.world_size)
        base = step_time(cfg, cluster)
        with_points = dataclasses.replace(
            cluster, profile=dataclasses.replace(cluster.profile, tp_layers=prof.tp_layers)
        )
        st = step_time(cfg, with_points)
        layers = cfg.model.num_layers * cfg.train.gradient_accumulation_steps
        per_layer[tp] = (st.total - base.total) / layers
    assert per_layer == {2: pytest.approx(900e-6), 8: pytest.approx(300e-6)}
