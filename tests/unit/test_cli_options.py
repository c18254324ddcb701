"""The `stx` commands turn argv into typed options objects; the library takes those, not argparse."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scalable_transformer.bench.sweep_types import SweepOptions
from scalable_transformer.cli import parse_command_line
from scalable_transformer.cli.config import ConfigOptions
from scalable_transformer.cli.flops import flops_options
from scalable_transformer.cli.parsers import report_parsers
from scalable_transformer.cli.preprocess import preprocess_options
from scalable_transformer.cli.report import TableOptions, table_options
from scalable_transformer.cli.sweep import sweep_options
from scalable_transformer.cli.tokenizer import train_options
from scalable_transformer.cli.train import TrainOptions
from scalable_transformer.data.tokenizers import TokenizerSource
from scalable_transformer.metrics.calculator import FlopsOptions, calculate


def parse(*argv: str):
    return parse_command_line(list(argv))


def test_train_and_config_options() -> None:
    assert TrainOptions.from_args(parse("train")) == TrainOptions(None, ())
    assert TrainOptions.from_args(parse("train", "tiny-gpt", "optim.lr=3e-4")) == TrainOptions(
        "tiny-gpt", ("optim.lr=3e-4",)
    )
    assert TrainOptions.from_args(parse("train", "num-layers=4")) == TrainOptions(None, ("num-layers=4",))
    opts = ConfigOptions.from_args(
        parse("config", "validate", "tiny-gpt", "model.num_layers=1", "--world-size", "2")
    )
    assert opts == ConfigOptions("validate", "tiny-gpt", ("model.num_layers=1",), 2, None)
    assert ConfigOptions.from_args(parse("config", "docs", "--update", "README.md")).update == ("README.md",)
    with pytest.raises(ValueError, match="one argument"):
        ConfigOptions.from_args(parse("config", "from-hf"))


def test_overrides_may_follow_options_and_anything_else_is_still_refused(capsys) -> None:
    # argparse's nargs="*" stops at the first option: a plan typed as users type it lost its overrides
    opts = ConfigOptions.from_args(
        parse("config", "validate", "gpt-13b", "--world-size", "64", "parallel.tp=4", "parallel.pp=2")
    )
    assert (opts.config, opts.overrides, opts.world_size) == (
        "gpt-13b",
        ("parallel.tp=4", "parallel.pp=2"),
        64,
    )
    args = parse(
        "plan", "gpt-13b", "--world-size", "64", "parallel.tp=4", "--device", "a100-80gb", "train.x=1"
    )
    assert args.items == ["gpt-13b", "parallel.tp=4", "train.x=1"]
    for argv in (("plan", "gpt-13b", "--bogus"), ("env", "parallel.tp=4")):
        with pytest.raises(SystemExit) as e:
            parse(*argv)
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_options_are_frozen() -> None:
    opts = TrainOptions("tiny-gpt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.config = "tiny-bert"  # type: ignore[misc]


def test_flops_options_and_calculate_without_argparse() -> None:
    argv = ("--num-layers", "2", "--hidden-size", "4", "--seq-length", "8", "--vocab-size", "16")
    opts = flops_options(parse("flops", *argv, "--samples-per-second", "1.5", "--override", "a=b"))
    assert opts == FlopsOptions(
        override=("a=b",), num_layers=2, hidden_size=4, seq_length=8, vocab_size=16, samples_per_second=1.5
    )
    direct = FlopsOptions(
        num_layers=2,
        hidden_size=4,
        seq_length=8,
        vocab_size=16,
        make_vocab_size_divisible_by=16,
        params=1000,
        samples_per_second=1.5,
        convention="6n",
    )
    result = calculate(direct)
    assert result["samples_per_second"] == 1.5 and result["tokens_per_second"] == 12.0
    assert [row["convention"] for row in result["results"]] == ["6n"]
    with pytest.raises(ValueError, match="give one throughput"):
        calculate(dataclasses.replace(direct, samples_per_second=None))


def test_preprocess_tokenizer_and_sweep_options(tmp_path: Path) -> None:
    opts = preprocess_options(
        parse("preprocess", "--input", "a.jsonl", "b/", "--output-prefix", "out/c", "--workers", "2")
    )
    assert opts.inputs == ("a.jsonl", "b/") and opts.output_prefix == "out/c" and opts.workers == 2
    assert opts.tokenizer == TokenizerSource() and opts.progress and not opts.split_sentences
    argv = ("tokenizer", "train", "--input", "c.txt", "--type", "bpe", "--vocab-size", "300", "--output", "t")
    tok = train_options(parse(*argv, "--cased"))
    assert (tok.inputs, tok.kind, tok.vocab_size, tok.output_dir, tok.lowercase) == (
        ("c.txt",),
        "bpe",
        300,
        "t",
        False,
    )
    sweep = sweep_options(parse("sweep", "s.yaml", "--store", str(tmp_path / "r.sqlite"), "--retry-failed"))
    assert sweep == SweepOptions(Path("s.yaml"), tmp_path / "r.sqlite", retry_failed=True, dry_run=False)


def test_report_table_options() -> None:
    args = report_parsers()["table"].parse_args(["r.sqlite", "--rows", "label, nproc", "--value", "mfu"])
    assert table_options(args) == TableOptions(
        Path("r.sqlite"), ("label", "nproc"), ("devices",), ("mfu",), "md", None, None
    )
