"""`stx config show|validate|docs|from-hf|import`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..config.docs import reference_markdown, update_file
from ..config.foreign_configs import ImportSources, import_configs, render_yaml, write_config
from ..config.load import load_config, to_yaml
from ..config.validate import resolve
from ..errors import ConfigError
from .parsers import split_config_args


@dataclasses.dataclass(frozen=True)
class ConfigOptions:
    """action: show, validate, docs or from-hf; config and overrides as `stx train` takes them;
    world_size: processes the job will run on (for dp); update: docs files to rewrite (None: print)."""

    action: str
    config: str | None = None
    overrides: tuple[str, ...] = ()
    world_size: int = 1
    update: tuple[str, ...] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConfigOptions:
        if args.action == "import" and args.items:
            raise ValueError(
                "stx config import takes its inputs as options (--deepspeed, --megatron-args, ...), "
                f"not {args.items[0]!r}"
            )
        if args.action == "from-hf":  # one directory, whatever it looks like
            if len(args.items) != 1:
                raise ValueError(
                    "stx config from-hf takes one argument: a Hugging Face model directory or its config.json"
                )
            return cls(args.action, args.items[0], (), args.world_size)
        config, overrides = split_config_args(args.items)
        update = tuple(args.update) if args.update is not None else None
        return cls(args.action, config, tuple(overrides), args.world_size, update)


@dataclasses.dataclass(frozen=True)
class ImportOptions:
    """`stx config import`: the sources (config.foreign_configs.ImportSources), the file to write, and whether
    an existing one may be replaced."""

    sources: Any
    output: Path
    force: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ImportOptions:
        if args.output is None:
            raise ValueError("stx config import needs -o FILE: the config file to write")

        def path(value: str | None) -> Path | None:
            return None if value is None else Path(value)

        sources = ImportSources(
            deepspeed=path(args.deepspeed),
            megatron_args=args.megatron_args,
            megatron_args_file=path(args.megatron_args_file),
            from_log=path(args.from_log),
            neox=tuple(Path(p) for p in args.neox or ()),
            neox_vocab_size=args.vocab_size,
            base=args.base,
            hf_model=None if args.hf is None else _hf_model(Path(args.hf)),
        )
        return cls(sources, Path(args.output), args.force)


def run(args: argparse.Namespace) -> int:
    if args.action == "import":
        return _import(ImportOptions.from_args(args))
    opts = ConfigOptions.from_args(args)
    if opts.action == "docs":
        if opts.update:
            for path in opts.update:
                changed = update_file(Path(path))
                print(f"{path}: {'updated' if changed else 'already up to date'}")
        else:
            print(reference_markdown())
        return 0
    if opts.action == "from-hf":
        hf_path = Path(str(opts.config)).resolve()
        _print_from_hf(hf_path.parent if hf_path.is_file() else hf_path)  # a config.json or its directory
        return 0

    cfg = resolve(load_config(opts.config, list(opts.overrides)), world_size=opts.world_size)
    if opts.action == "validate":
        # only here: train/outputs.py imports torch, 4.9 s (measured), which `stx config show` never needs
        from ..train.outputs import export_warning

        no_export = export_warning(cfg)
        if no_export is not None:
            raise ConfigError(
                no_export
                + "; change those settings, or unset checkpoint.save if the run is not meant to be kept"
            )
    if opts.action == "show":
        print(to_yaml(cfg), end="")
    else:
        name = opts.config or "the embedded default (tiny-bert)"
        print(
            f"{name}: valid (world size {opts.world_size}: dp={cfg.parallel.dp}, global batch "
            f"{cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accumulation "
            f"{cfg.train.gradient_accumulation_steps} x dp {cfg.parallel.dp})"
        )
    return 0


def _hf_model(path: Path) -> tuple[str, dict[str, Any]]:
    """(config.json's path, the model.* settings of the Hugging Face model it describes)."""
    # only for a Hugging Face directory: checkpoint/hf_import.py imports torch (4.9-6.4 s measured)
    from ..checkpoint.hf_import import model_overrides_from_hf

    hf_dir = path.parent if path.is_file() else path
    return str(hf_dir / "config.json"), model_overrides_from_hf(hf_dir)


def config_from_hf(hf_dir: Path) -> dict[str, Any]:
    """A config (as a YAML-ready dict) that continues pretraining the Hugging Face model in hf_dir."""
    # only for a Hugging Face directory: checkpoint/hf_import.py imports torch (4.9-6.4 s measured)
    from ..checkpoint.hf_import import model_overrides_from_hf

    model = model_overrides_from_hf(hf_dir)
    # the longest the model was trained for: Llama 3.1's scaled rotary extends a pretraining context
    # of 8192 positions (models.layers.LLAMA3_ORIGINAL_POSITIONS)
    model["seq_length"] = (
        min(model["max_position_embeddings"], 8192)
        if model.get("rope_scaling")
        else (model["max_position_embeddings"])
    )
    config: dict[str, Any] = {"model": model, "checkpoint": {"init_from_hf": str(hf_dir)}}
    if (hf_dir / "tokenizer.json").is_file():
        config["data"] = {"vocab_file": str(hf_dir / "tokenizer.json")}
    return config


def _print_from_hf(hf_dir: Path) -> None:

    config = config_from_hf(hf_dir)
    print(f"# continue pretraining {hf_dir}; save as a file and run `stx train FILE`", flush=True)
    print(yaml.safe_dump(config, sort_keys=False), end="")


def _import(opts: ImportOptions) -> int:
    imported = import_configs(opts.sources)
    write_config(render_yaml(imported, opts.sources.base, str(opts.output)), opts.output, opts.force)
    notes = len(imported.paths) + len(imported.ignored) + len(imported.skipped)
    print(
        f"wrote {opts.output}: {len(imported.values)} settings; {notes} not carried over, listed in its "
        f"comments. Check it: stx config show {opts.output} --world-size N"
    )
    return 0
