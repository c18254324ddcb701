"""FLOPs conventions against hand arithmetic, MFU guards, and the `stx flops` calculator."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import warnings

import pytest

from scalable_transformer.cli.flops import run
from scalable_transformer.cli.parsers import add_flops_arguments
from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import sized_model, total_params
from scalable_transformer.config.validate import resolve
from scalable_transformer.metrics import flops as flops_module
from scalable_transformer.metrics.device_table import lookup_peak
from scalable_transformer.metrics.flops import (
    CONVENTIONS,
    FlopsCount,
    MFUError,
    ModelShape,
    flops_per_iteration,
    throughput_metrics,
)

# A toy shape small enough to do by hand: L=2, h=4, s=8, V=16, N=1000, F=4h=16, B=3 samples.
SHAPE = ModelShape(num_layers=2, hidden_size=4, seq_length=8, vocab_size=16, num_params=1000)
B = 3


def test_megatron_by_hand():
    # bracket = 1 + s/(6h) + V/(16*L*h) = 1 + 8/24 + 16/128 = 1 + 1/3 + 1/8 = 35/24
    # 24*f*B*s*L*h^2 = 24 * 3 * 3 * 8 * 2 * 16 = 55296 (f=3), 73728 (f=4)
    none = flops_per_iteration(SHAPE, B, "megatron", "none")
    assert none.model_flops == pytest.approx(55296 * 35 / 24)  # 80640
    assert none.model_flops == pytest.approx(80640)
    assert none.hardware_flops == pytest.approx(80640)
    full = flops_per_iteration(SHAPE, B, "megatron", "full")
    assert full.model_flops == pytest.approx(80640)
    assert full.hardware_flops == pytest.approx(73728 * 35 / 24)  # 107520
    # selective: + one forward of the attention core, 4*B*s^2*h*L = 4*3*64*4*2 = 6144
    selective = flops_per_iteration(SHAPE, B, "megatron", "selective")
    assert selective.model_flops == pytest.approx(80640)
    assert selective.hardware_flops == pytest.approx(80640 + 6144)


def test_megatron_ffn_and_gated_mlp():
    # F = 8 = 2h: dense term 1/3 + F*(1+1)/(12h) = 1/3 + 16/48 = 2/3 -> bracket 2/3 + 1/3 + 1/8 = 9/8
    plain = ModelShape(2, 4, 8, 16, 1000, ffn_hidden_size=8)
    assert flops_per_iteration(plain, B, "megatron").model_flops == pytest.approx(55296 * 9 / 8)
    # GeGLU up-projection h -> 2F: dense term 1/3 + F*(1+2)/(12h) = 1/3 + 1/2 -> bracket 31/24
    gated = ModelShape(2, 4, 8, 16, 1000, ffn_hidden_size=8, gated_mlp=True)
    assert flops_per_iteration(gated, B, "megatron").model_flops == pytest.approx(55296 * 31 / 24)


def test_megatron_lm_by_hand():
    # 12*B*s*L*h^2 = 12*3*8*2*16 = 9216; (1 + g/n + s/h) + F/h + V/(2*L*h) = (1 + 1 + 2) + 4 + 1 = 9
    assert flops_per_iteration(SHAPE, B, "megatron-lm-2024").model_flops == pytest.approx(9216 * 9)
    # current Megatron-LM halves the attention core: s/(2h) = 1 -> 8
    current = flops_per_iteration(SHAPE, B, "megatron-lm", "selective")
    assert current.model_flops == pytest.approx(9216 * 8)
    # selective recompute repeats the (halved) core's forward: 9216 * 1 / 3
    assert current.hardware_flops == pytest.approx(9216 * 8 + 9216 / 3)
    assert flops_per_iteration(SHAPE, B, "megatron-lm", "full").hardware_flops == pytest.approx(
        9216 * 8 * 4 / 3
    )


def test_torchtitan_by_hand_tied_and_untied():
    # tied: 6*N*s*B + 12*L*h*s^2*B = 6*1000*24 + 12*2*4*64*3 = 144000 + 18432 (= llm-foundry's)
    assert flops_per_iteration(SHAPE, B, "torchtitan").model_flops == pytest.approx(162432)
    # untied: the embedding tables (E = 100) are not matmul parameters: 6*900*24 + 18432
    untied = ModelShape(2, 4, 8, 16, 1000, embedding_params=100, tied_embeddings=False)
    assert flops_per_iteration(untied, B, "torchtitan").model_flops == pytest.approx(129600 + 18432)


def test_sliding_window_counted_by_megatron_only_and_said():
    windowed = ModelShape(2, 4, 8, 16, 1000, sliding_window=4)
    # megatron: the core's s/(6h) = 1/3 becomes w/(6h) = 1/6: 55296 * (35/24 - 1/6)
    assert flops_per_iteration(windowed, B, "megatron").model_flops == pytest.approx(55296 * 31 / 24)
    for convention in CONVENTIONS:
        notes = flops_module.convention_notes(windowed, convention)
        if convention in flops_module.WINDOWED_CONVENTIONS:
            assert notes == []
        else:
            assert "no sliding-window term" in notes[0] and convention in notes[0]
            full = flops_per_iteration(SHAPE, B, convention).model_flops
            assert flops_per_iteration(windowed, B, convention).model_flops == pytest.approx(full)
    # a window as long as the sequence changes nothing and says nothing
    assert flops_module.convention_notes(ModelShape(2, 4, 8, 16, 1000, sliding_window=8), "6n") == []


def test_mosaic_by_hand():
    # per sequence: params = 2*N*s = 2*1000*8 = 16000; attn = L*2*h*s^2 = 2*2*4*64 = 1024
    c = flops_per_iteration(SHAPE, B, "mosaic", "none")
    assert c.model_flops == pytest.approx((3 * 16000 + 2 * 1024) * 3)  # 150144
    assert c.hardware_flops == pytest.approx(150144)
    full = flops_per_iteration(SHAPE, B, "mosaic", "full")
    assert full.hardware_flops == pytest.approx((4 * 16000 + 3 * 1024) * 3)  # 201216
    selective = flops_per_iteration(SHAPE, B, "mosaic", "selective")
    assert selective.hardware_flops == pytest.approx((3 * 16000 + 3 * 1024) * 3)  # 153216


def test_llm_foundry_by_hand():
    # per sequence: params = 16000; attn = L*2*2*h*s^2 = 2048 (twice the table's, times 3x in MFU)
    c = flops_per_iteration(SHAPE, B, "llm-foundry", "none")
    assert c.model_flops == pytest.approx(3 * (16000 + 2048) * 3)  # 162432
    assert c.hardware_flops == pytest.approx(162432)
    full = flops_per_iteration(SHAPE, B, "llm-foundry", "full")
    assert full.hardware_flops == pytest.approx(4 * (16000 + 2048) * 3)  # 216576
    selective = flops_per_iteration(SHAPE, B, "llm-foundry", "selective")
    assert selective.hardware_flops == pytest.approx((3 * 16000 + 4 * 2048) * 3)  # 168576


# MosaicML's published MosaicGPT throughput table, as issue 11 gives it: model, seq, GPUs, GPU,
# params, samples/s, activation checkpointing -> MFU, HFU. gpt13b: 40 layers, d_model 5120.
MOSAIC_TABLE = [
    ("gpt13b", 40, 5120, 16384, 8, "a100-80gb", 12_926_786_560, 0.5285, True, 0.3157, 0.4286),
    ("gpt13b", 40, 5120, 2048, 8, "a100-80gb", 12_853_386_240, 6.8014, True, 0.4397, 0.5879),
]


@pytest.mark.parametrize("row", MOSAIC_TABLE, ids=lambda r: f"{r[0]}-s{r[3]}")
def test_mosaic_reproduces_the_published_mosaicgpt_table(row):
    _, layers, d_model, seq, gpus, gpu, params, samples_per_s, ckpt, mfu, hfu = row
    shape = ModelShape(
        num_layers=layers, hidden_size=d_model, seq_length=seq, vocab_size=50368, num_params=params
    )
    count = flops_per_iteration(shape, samples_per_s, "mosaic", "full" if ckpt else "none")
    m = throughput_metrics(count, 1.0, gpus, lookup_peak(gpu, "bf16"), strict=True)
    assert m["mfu"] == pytest.approx(mfu, abs=1e-3)
    assert m["hfu"] == pytest.approx(hfu, abs=1e-3)
    # llm-foundry's current formula does not reproduce it: its attention term is 3x larger
    other = flops_per_iteration(shape, samples_per_s, "llm-foundry", "full" if ckpt else "none")
    assert throughput_metrics(other, 1.0, gpus, lookup_peak(gpu, "bf16"))["mfu"] > mfu + 1e-3


def test_6n_by_hand():
    # per token 6N + 12*L*h*s = 6000 + 12*64 = 6768; tokens = B*s = 24
    c = flops_per_iteration(SHAPE, B, "6n", "none")
    assert c.model_flops == pytest.approx(6768 * 24)  # 162432, the same as llm-foundry for the same N
    full = flops_per_iteration(SHAPE, B, "6n", "full")
    assert full.hardware_flops == pytest.approx((8000 + 16 * 64) * 24)  # 216576
    selective = flops_per_iteration(SHAPE, B, "6n", "selective")
    assert selective.model_flops == pytest.approx(162432)
    assert selective.hardware_flops == pytest.approx((6000 + 16 * 64) * 24)  # 168576


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_linear_in_samples_and_recompute_only_changes_hardware(convention):
    one = flops_per_iteration(SHAPE, 1, convention, "full")
    seven = flops_per_iteration(SHAPE, 7, convention, "full")
    assert seven.model_flops == pytest.approx(7 * one.model_flops)
    assert seven.hardware_flops == pytest.approx(7 * one.hardware_flops)
    assert one.hardware_flops > one.model_flops
    assert one.model_flops == pytest.approx(flops_per_iteration(SHAPE, 1, convention).model_flops)


def test_bad_inputs():
    with pytest.raises(ValueError, match="convention"):
        flops_per_iteration(SHAPE, 1, "palm")
    with pytest.raises(ValueError, match="recompute"):
        flops_per_iteration(SHAPE, 1, "megatron", "partial")
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape(2, 0, 8, 16, 1000)


def test_from_config_pads_the_vocabulary():
    from scalable_transformer.config.schema import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=4, seq_length=8, vocab_size=100, ffn_hidden_size=16)
    shape = ModelShape.from_config(cfg, 1234)
    assert (shape.vocab_size, shape.num_params, shape.ffn, shape.gated_mlp) == (128, 1234, 16, False)
    assert ModelShape.from_config(cfg, 1, tp=4).vocab_size == 512  # multiple of 128 * tp
    cfg.vocab_size = None
    with pytest.raises(ValueError, match="resolve"):
        ModelShape.from_config(cfg, 1)


def test_throughput_metrics_arithmetic():
    count = FlopsCount(model_flops=2e12, hardware_flops=3e12, convention="megatron")
    m = throughput_metrics(count, iteration_seconds=2.0, num_devices=4, peak_flops_per_device=1e12)
    # 2e12 FLOPs / 2 s / 4 devices = 0.25e12 FLOP/s per device
    assert m["tflops_per_device"] == pytest.approx(0.25)
    assert m["hw_tflops_per_device"] == pytest.approx(0.375)
    assert m["mfu"] == pytest.approx(0.25)
    assert m["hfu"] == pytest.approx(0.375)
    assert m["convention"] == "megatron"
    no_peak = throughput_metrics(count, 2.0, 4, None)
    assert no_peak["mfu"] is None and no_peak["tflops_per_device"] == pytest.approx(0.25)


def test_impossible_mfu_is_stored_as_null_and_logged_once(monkeypatch, caplog):
    # Training path: a metric must never stop a run, so > 100% becomes None plus one log warning.
    monkeypatch.setattr(flops_module, "_WARNED", set())
    count = FlopsCount(model_flops=5e12, hardware_flops=5e12, convention="6n")
    with caplog.at_level(logging.WARNING, logger=flops_module.__name__), warnings.catch_warnings():
        warnings.simplefilter("error")  # no Python warning (with its source line) on this path
        first = throughput_metrics(count, 1.0, 1, 1e12)
        again = throughput_metrics(count, 1.0, 1, 1e12)  # the next log interval of the same run
        # HFU above 100% with MFU below is just as impossible: both become null
        hfu_only = throughput_metrics(FlopsCount(0.9e12, 1.2e12, "6n"), 1.0, 1, 1e12)
    for m in (first, again, hfu_only):
        assert m["mfu"] is None and m["hfu"] is None
    assert first["tflops_per_device"] == pytest.approx(5.0)  # the rate itself is still reported
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # once for each distinct (FLOPs, devices, peak), not once per call
    assert "MFU 500.0%" in messages[0] and "logging.peak_tflops" in messages[0] and "null" in messages[0]
    # a possible figure is untouched
    assert throughput_metrics(count, 10.0, 1, 1e12)["mfu"] == pytest.approx(0.5)


def test_strict_and_calculator_paths_keep_the_error():
    count = FlopsCount(model_flops=5e12, hardware_flops=5e12, convention="6n")
    with pytest.raises(MFUError, match="bug"):
        throughput_metrics(count, 1.0, 1, 1e12, strict=True)
    with pytest.raises(MFUError):
        throughput_metrics(FlopsCount(0.9e12, 1.2e12, "6n"), 1.0, 1, 1e12, strict=True)
    assert throughput_metrics(count, 10.0, 1, 1e12, strict=True)["mfu"] == pytest.approx(0.5)
    # the calculator reports what it was given, with the warning
    with pytest.warns(RuntimeWarning, match="exceed 100%"):
        m = throughput_metrics(count, 1.0, 1, 1e12, allow_over_100=True)
    assert m["mfu"] == pytest.approx(5.0)


# ------------------------------------------------------------------------------------ calculator


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    add_flops_arguments(parser)
    code = run(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out


TOY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "4",
    "--seq-length",
    "8",
    "--vocab-size",
    "16",
    "--make-vocab-size-divisible-by",
    "16",
    "--params",
    "1000",
]


def test_calculator_json_explicit_shape(capsys):
    argv = [
        *TOY,
        "--iteration-time",
        "2",
        "--global-batch-size",
        "3",
        "--peak-tflops",
        "2e-7",
        "--activation-checkpointing",
        "full",
        "--json",
    ]
    code, out = _run(argv, capsys)
    assert code == 0, out.err
    result = json.loads(out.out)
    assert result["samples_per_second"] == pytest.approx(1.5)
    assert result["tokens_per_second"] == pytest.approx(12.0)
    assert result["peak"]["tflops_per_device"] == pytest.approx(2e-7)
    assert "user override" in result["peak"]["source"]
    rows = {r["convention"]: r for r in result["results"]}
    assert list(rows) == list(CONVENTIONS)
    # megatron: 80640 model / 107520 hardware FLOPs per step of 3 samples, over 2 s, peak 2e5 FLOP/s
    assert rows["megatron"]["model_flops_per_iteration"] == pytest.approx(80640)
    assert rows["megatron"]["hardware_flops_per_iteration"] == pytest.approx(107520)
    assert rows["megatron"]["tflops_per_device"] == pytest.approx(40320 / 1e12)
    assert rows["megatron"]["mfu"] == pytest.approx(40320 / 2e5)
    assert rows["megatron"]["hfu"] == pytest.approx(53760 / 2e5)
    # mosaic: 150144 model, 201216 hardware FLOPs per step
    assert rows["mosaic"]["mfu"] == pytest.approx(150144 / 2 / 2e5)
    assert rows["mosaic"]["hfu"] == pytest.approx(201216 / 2 / 2e5)
    # llm-foundry / 6n: 162432 model, 216576 hardware FLOPs per step
    for name in ("llm-foundry", "6n"):
        assert rows[name]["mfu"] == pytest.approx(162432 / 2 / 2e5)
        assert rows[name]["hfu"] == pytest.approx(216576 / 2 / 2e5)
        assert rows[name]["model_flops_per_sample"] == pytest.approx(162432 / 3)
    assert result["warnings"] == []


def test_calculator_table_and_mfu_over_100_warning(capsys):
    argv = [
        *TOY,
        "--samples-per-second",
        "1.5",
        "--peak-tflops",
        "1e-7",
        "--activation-checkpointing",
        "full",
    ]
    code, out = _run(argv, capsys)
    assert code == 0
    assert "megatron" in out.out and "mosaic" in out.out and "user override" in out.out
    # llm-foundry HFU = 216576 / 3 * 1.5 / 1e5 = 108% of the peak: reported, with a warning naming it a bug
    assert "warning" in out.out and "bug" in out.out


def test_calculator_estimates_params_and_works_without_peak(capsys):
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "4",
        "--seq-length",
        "8",
        "--vocab-size",
        "16",
        "--make-vocab-size-divisible-by",
        "1",
        "--tokens-per-second",
        "80",
        "--convention",
        "6n",
        "--json",
    ]
    code, out = _run(argv, capsys)
    assert code == 0, out.err
    result = json.loads(out.out)
    # 12*L*h^2 + 13*L*h + V*h + s*h + 2h = 384 + 104 + 64 + 32 + 8 = 592
    assert result["shape"]["num_params"] == 592 == total_params(sized_model(2, 4, 8, 16))
    assert "estimated" in result["num_params_source"]
    (row,) = result["results"]
    assert row["mfu"] is None and result["peak"] is None
    # 10 samples/s * 8 tokens * (6*592 + 12*2*4*8) FLOPs/token
    assert row["tflops_per_device"] == pytest.approx(80 * (6 * 592 + 768) / 1e12)


def test_calculator_bert_345m_megatron_anchor(capsys):
    # Megatron-LM BERT-345M on one A100-40GB, fp16, --checkpoint-activations: 22.39 ms/sample = 44.7
    # samples/s (/work/shared/reference/megatron-bert-345m-runs.md). Vocab 28996 pads to 29056.
    argv = [
        "--num-layers",
        "24",
        "--hidden-size",
        "1024",
        "--seq-length",
        "512",
        "--vocab-size",
        "28996",
        "--samples-per-second",
        "44.7",
        "--device",
        "a100-40gb",
        "--dtype",
        "fp16",
        "--activation-checkpointing",
        "full",
        "--convention",
        "megatron",
        "--json",
    ]
    code, out = _run(argv, capsys)
    assert code == 0, out.err
    (row,) = json.loads(out.out)["results"]
    bracket = 1 + 512 / (6 * 1024) + 29056 / (16 * 24 * 1024)
    per_sample_f3 = 24 * 3 * 512 * 24 * 1024**2 * bracket  # 1.0736e12 FLOPs
    assert row["tflops_per_device"] == pytest.approx(44.7 * per_sample_f3 / 1e12)  # 47.99
    assert row["hw_tflops_per_device"] == pytest.approx(44.7 * per_sample_f3 * 4 / 3 / 1e12)  # 63.99
    assert row["hfu"] == pytest.approx(63.985 / 312, rel=1e-4)  # 20.5% of the fp16 dense peak


def test_calculator_from_a_preset(capsys):
    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.models import count_parameters

    code, out = _run(["--config", "tiny-bert", "--samples-per-second", "10", "--json"], capsys)
    assert code == 0, out.err
    result = json.loads(out.out)
    cfg = resolve(load_config("tiny-bert"))
    assert result["shape"]["num_params"] == count_parameters(cfg.model)
    assert result["shape"]["num_layers"] == cfg.model.num_layers
    assert result["dtype"] == cfg.train.precision


def test_calculator_errors(capsys):
    code, out = _run(["--num-layers", "2", "--samples-per-second", "1"], capsys)
    assert code == 2 and "--hidden-size" in out.err
    code, out = _run(["--config", "tiny-bert", "--num-layers", "2", "--samples-per-second", "1"], capsys)
    assert code == 2 and "exclusive" in out.err
    code, out = _run([*TOY, "--iteration-time", "1"], capsys)
    assert code == 2 and "--global-batch-size" in out.err
    code, out = _run([*TOY, "--samples-per-second", "1", "--device", "a100-80"], capsys)
    assert code == 2 and "a100-80gb" in out.err


def test_alibi_partial_rotary_and_parallel_residual_change_no_figure():
    """ALiBi adds a bias to the scores, rotary (partial or not) rotates elementwise, the parallel
    residual reorders the same matmuls: no convention has a term for them."""
    llama = resolve(load_config("llama-8b", [])).model
    variants = [
        dataclasses.replace(llama, position_embedding_type="alibi"),
        dataclasses.replace(llama, rotary_percent=0.25, parallel_residual=True),
    ]
    for convention in CONVENTIONS:
        for recompute in ("none", "full", "selective"):
            base = flops_per_iteration(ModelShape.from_config(llama), 2, convention, recompute)
            for variant in variants:
                assert flops_per_iteration(ModelShape.from_config(variant), 2, convention, recompute) == base
