"""`stx config show|validate|docs|from-hf|import`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from .train import split_config_args


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
        from ..config.foreign_configs import ImportSources

        if args.output is None:
            raise ValueError("stx config import needs -o FILE: the config file to write")

        def path(value: str | None) -> Path | None:
            return None if value is None else Path(value)

        sources = ImportSources(
            deepspeed=path(args.deepspeed),
            megatron_args=args.megatron_args,
            megatron_args_file=path(args.megatron_args_file),
            from_log=path(args.from_log),
            neox=path(args.neox),
            base=args.base,
            hf_model=None if args.hf is None else _hf_model(Path(args.hf)),
        )
        return cls(sources, Path(args.output), args.force)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="show, validate, document or import configs",
        epilog='import: stx config import --deepspeed ds_config.json --megatron-args "--num-layers 24 ..." '
        "-o config.yaml",
    )
    p.add_argument("action", choices=("show", "validate", "docs", "from-hf", "import"))
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.add_argument("--world-size", type=int, default=1, help="processes the job will run on (for dp)")
    p.add_argument(
        "--update",
        nargs="*",
        metavar="FILE",
        help="docs: rewrite the reference block in these files (README.md docs/CONFIG.md)",
    )
    imp = p.add_argument_group("import (configs you already have -> one config file)")
    imp.add_argument("--deepspeed", metavar="JSON", help="a DeepSpeed config (ds_config.json)")
    megatron = imp.add_mutually_exclusive_group()
    megatron.add_argument("--megatron-args", metavar="ARGS", help="a Megatron command line, quoted")
    megatron.add_argument("--megatron-args-file", metavar="SCRIPT", help="a shell script running Megatron")
    megatron.add_argument("--from-log", metavar="LOG", help="a Megatron log (its argument dump)")
    imp.add_argument("--neox", metavar="YAML", help="a GPT-NeoX config")
    imp.add_argument(
        "--hf",
        metavar="CONFIG_JSON",
        help="a Hugging Face model's config.json (or its directory): its shape (stx config from-hf also "
        "starts from its weights)",
    )
    imp.add_argument("--base", metavar="PRESET", help="a preset (or YAML) the written config extends")
    imp.add_argument("-o", "--output", metavar="FILE", help="the config file to write")
    imp.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "import":
        return _import(ImportOptions.from_args(args))
    opts = ConfigOptions.from_args(args)
    if opts.action == "docs":
        from ..config.docs import reference_markdown, update_file

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
    from ..config.load import load_config, to_yaml
    from ..config.validate import resolve

    cfg = resolve(load_config(opts.config, list(opts.overrides)), world_size=opts.world_size)
    if opts.action == "validate":
        from ..errors import ConfigError
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
    from ..checkpoint.hf_import import model_overrides_from_hf

    hf_dir = path.parent if path.is_file() else path
    return str(hf_dir / "config.json"), model_overrides_from_hf(hf_dir)


def config_from_hf(hf_dir: Path) -> dict[str, Any]:
    """A config (as a YAML-ready dict) that continues pretraining the Hugging Face model in hf_dir."""
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
    import yaml

    config = config_from_hf(hf_dir)
    print(f"# continue pretraining {hf_dir}; save as a file and run `stx train FILE`", flush=True)
    print(yaml.safe_dump(config, sort_keys=False), end="")


def _import(opts: ImportOptions) -> int:
    from ..config.foreign_configs import import_configs, render_yaml, write_config

    imported = import_configs(opts.sources)
    write_config(render_yaml(imported, opts.sources.base, str(opts.output)), opts.output, opts.force)
    notes = len(imported.paths) + len(imported.ignored) + len(imported.skipped)
    print(
        f"wrote {opts.output}: {len(imported.values)} settings; {notes} not carried over, listed in its "
        f"comments. Check it: stx config show {opts.output} --world-size N"
    )
    return 0
