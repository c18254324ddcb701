"""`stx`: command parsing and dispatch only; the work happens in the modules it calls."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

EPILOG = """Examples:
  stx train
  stx train tiny-gpt model.num_layers=4 optim.lr=3e-4
  stx launch -n 2 train tiny-gpt
  stx config show bert-345m
  stx tokenizer train --input corpus.jsonl --type wordpiece --vocab-size 30522 --output tok/
  stx preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer tok/tokenizer.json
  stx flops --config gpt-1b --tokens-per-second 30000 --devices 8 --device a100-80gb --dtype bf16
  stx sweep sweep.yaml
  stx report results.sqlite --output report/"""


def _split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first item is the config unless it is an override."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _load(items: list[str], world_size: int = 1):
    from .config.load import load_config
    from .config.validate import resolve

    spec, overrides = _split_config_args(items)
    return resolve(load_config(spec, overrides), world_size=world_size)


def cmd_train(args: argparse.Namespace) -> int:
    from .config.load import load_config
    from .train.run import run_training

    spec, overrides = _split_config_args(args.items)
    run_training(load_config(spec, overrides))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from .config.load import to_yaml

    if args.action == "docs":
        from .config.docs import reference_markdown, update_file

        if args.update:
            for path in args.update:
                changed = update_file(Path(path))
                print(f"{path}: {'updated' if changed else 'already up to date'}")
        else:
            print(reference_markdown())
        return 0
    if args.action == "from-hf":
        return _config_from_hf(args.items)
    cfg = _load(args.items, args.world_size)
    if args.action == "show":
        print(to_yaml(cfg), end="")
    else:
        name = _split_config_args(args.items)[0] or "the embedded default (tiny-bert)"
        print(
            f"{name}: valid (world size {args.world_size}: dp={cfg.parallel.dp}, global batch "
            f"{cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accumulation "
            f"{cfg.train.gradient_accumulation_steps} x dp {cfg.parallel.dp})"
        )
    return 0


def _config_from_hf(items: list[str]) -> int:
    """`stx config from-hf DIR`: a config YAML that trains on from a Hugging Face model directory."""
    import yaml

    from .checkpoint.hf_import import model_overrides_from_hf

    if len(items) != 1:
        raise ValueError("stx config from-hf takes one argument: a Hugging Face model directory")
    hf_dir = Path(items[0]).resolve()
    model = model_overrides_from_hf(hf_dir)
    model["seq_length"] = model["max_position_embeddings"]  # the longest the model was trained for
    config: dict = {"model": model, "checkpoint": {"init_from_hf": str(hf_dir)}}
    if (hf_dir / "tokenizer.json").is_file():
        config["data"] = {"vocab_file": str(hf_dir / "tokenizer.json")}
    print(f"# continue pretraining {hf_dir}; save as a file and run `stx train FILE`", flush=True)
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from .data.preprocess import run

    return run(args)


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from .data.tokenizers import run_train

    return run_train(args)


def cmd_flops(args: argparse.Namespace) -> int:
    from .metrics import calculator

    return calculator.run(args)


def cmd_env(args: argparse.Namespace) -> int:
    from .bench.environment import environment

    env = environment()
    if args.json:
        print(json.dumps(env, indent=2))
    else:
        for key, value in env.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
            elif isinstance(value, list):
                value = "; ".join(json.dumps(v) for v in value) or "-"
            print(f"{key:>22}: {value}")
    return 0


def cmd_checkpoint_info(args: argparse.Namespace) -> int:
    from .checkpoint.manager import describe_checkpoint

    print(describe_checkpoint(args.path, as_json=args.json))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .checkpoint.export import export_hf

    out = export_hf(args.checkpoint, args.output)
    print(f"exported {args.checkpoint} to {out} (load with transformers' from_pretrained('{out}'))")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from .launch.local import LaunchOptions, launch, stx_command

    try:
        if args.subcommand == "launch":
            raise ValueError("SUBCOMMAND cannot be launch itself")
        opts = LaunchOptions(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            log_dir=args.log_dir,
            ranks_output=args.ranks_output,
        )
    except ValueError as e:  # before any process starts
        print(f"stx launch: error: {e}", file=sys.stderr)
        return 2
    return launch(opts, stx_command(args.subcommand, args.args))


# --- sweeps and reports (bench/sweep.py, bench/report.py, bench/importers.py) -----------------------

REPORT_USAGE = """stx report [STORE] [--rows KEYS] [--cols KEYS] [--value V1,V2] [--format md|csv|html]
                  [--output DIR] [--device-memory-gb G]
       stx report export STORE --format csv|parquet --output FILE
       stx report import-log FILE --format megatron|deepspeed [--store PATH] [--label L] [--devices N]"""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_sweep(args: argparse.Namespace) -> int:
    import signal

    from .bench.sweep import SweepOptions, load_sweep, run_sweep

    opts = SweepOptions(
        sweep_file=Path(args.sweep),
        store=Path(args.store).resolve() if args.store else None,
        retry_failed=args.retry_failed,
        dry_run=args.dry_run,
    )
    spec = load_sweep(opts.sweep_file)
    # SIGTERM (a scheduler, `kill`) stops the sweep like Ctrl-C: the running member is killed, not recorded.
    signal.signal(signal.SIGTERM, _interrupt)
    # The members' processes inherit it: their output reaches the member's log as it is written.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run_sweep(spec, opts).exit_code


def _report_parsers() -> dict[str, argparse.ArgumentParser]:
    table = argparse.ArgumentParser(prog="stx report", usage=REPORT_USAGE)
    table.add_argument(
        "store", nargs="?", default="results.sqlite", help="results store (default results.sqlite)"
    )
    table.add_argument(
        "--rows", default="label", help="row keys, comma-separated (default label: the layout)"
    )
    table.add_argument(
        "--cols", default="devices", help="column keys (default devices: '2', or '4*8' for nodes)"
    )
    table.add_argument(
        "--value",
        default="samples_per_second,tflops_per_device",
        help="cell values: samples_per_second, tokens_per_second, tflops_per_device, mfu, hfu, peak_memory",
    )
    table.add_argument("--format", choices=("md", "csv", "html"), default="md", help="what is printed")
    table.add_argument("--output", help="directory: table/wide .md and .csv, report.html, PNG plots")
    table.add_argument("--device-memory-gb", type=float, help="device memory line of the memory plot (GiB)")
    export = argparse.ArgumentParser(prog="stx report export")
    export.add_argument("store")
    export.add_argument("--format", choices=("csv", "parquet"), required=True)
    export.add_argument("--output", required=True)
    imp = argparse.ArgumentParser(prog="stx report import-log")
    imp.add_argument("file")
    imp.add_argument("--format", choices=("megatron", "deepspeed"), required=True)
    imp.add_argument("--store", default="results.sqlite", help="results store (default results.sqlite)")
    imp.add_argument("--label", help="report row label (default: file name and format)")
    imp.add_argument("--devices", type=int, help="GPUs of the job (default: world size from the log)")
    imp.add_argument("--nnodes", type=int, default=1, help="nodes of the job (for the '4*8' column)")
    imp.add_argument("--seq-length", type=int, help="tokens per sample, when the log does not say")
    return {"table": table, "export": export, "import-log": imp}


def cmd_report(args: argparse.Namespace) -> int:
    from .bench import importers, report
    from .bench.results import StoreError

    parsers = _report_parsers()
    rest = list(args.args)
    action = rest.pop(0) if rest and rest[0] in ("export", "import-log") else "table"
    sub_args = parsers[action].parse_args(rest)
    try:
        if action == "export":
            return report.main_export(sub_args)
        if action == "import-log":
            return importers.main_import(sub_args)
        return report.main_report(sub_args)
    except StoreError as e:
        print(f"stx report: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stx",
        description="Pretrain BERT/GPT with any parallel layout "
        "from one config; measure and compare layouts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train (no CONFIG = the embedded tiny BERT on the bundled corpus)",
        description="stx train [CONFIG] [key=value ...]; CONFIG is a preset name or a YAML "
        "path; overrides take dotted (optim.lr=3e-4) or Megatron/NeoX (num-layers=4) names.",
    )
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("config", help="show, validate or document configs")
    p.add_argument("action", choices=("show", "validate", "docs", "from-hf"))
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.add_argument("--world-size", type=int, default=1, help="processes the job will run on (for dp)")
    p.add_argument(
        "--update",
        nargs="*",
        metavar="FILE",
        help="docs: rewrite the reference block in these files (README.md docs/CONFIG.md)",
    )
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("tokenizer", help="train a WordPiece or BPE tokenizer (HF tokenizers)")
    tok = p.add_subparsers(dest="action", required=True)
    t = tok.add_parser("train", help="train a tokenizer on text/jsonl(.gz/.zst) inputs")
    from .data.tokenizers import add_train_arguments

    add_train_arguments(t)
    t.set_defaults(fn=cmd_tokenizer_train)

    p = sub.add_parser(
        "preprocess", help="tokenize a corpus into a Megatron mmap indexed dataset (.bin/.idx)"
    )
    from .data.preprocess import add_arguments as add_preprocess_arguments

    add_preprocess_arguments(p)
    p.set_defaults(fn=cmd_preprocess)

    p = sub.add_parser("flops", help="TFLOPs/device, MFU and HFU from a model shape and a throughput")
    from .metrics import calculator

    calculator.add_arguments(p)
    p.set_defaults(fn=cmd_flops)

    p = sub.add_parser("checkpoint", help="inspect checkpoints")
    ck = p.add_subparsers(dest="action", required=True)
    c = ck.add_parser("info", help="iteration, layout, model shape, size and files of a checkpoint")
    c.add_argument("path", help="a checkpoint (iter_XXXXXXX) or a save directory (its latest)")
    c.add_argument("--json", action="store_true", help="print metadata.json")
    c.set_defaults(fn=cmd_checkpoint_info)

    p = sub.add_parser(
        "export",
        help="a checkpoint as a Hugging Face transformers model (GPT2LMHeadModel, BertForPreTraining)",
    )
    p.add_argument("checkpoint", help="a checkpoint (iter_XXXXXXX) or a save directory (its latest)")
    p.add_argument("--format", choices=("hf",), default="hf", help="hf: transformers save_pretrained")
    p.add_argument("--output", required=True, help="a new directory")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("env", help="versions and hardware fingerprint (stored in every run directory)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_env)

    # --- sweeps and reports ---
    p = sub.add_parser(
        "sweep",
        help="run a grid of layouts (each via stx launch), catch OOM/timeout/crash, store every result",
        description="stx sweep SWEEP.yaml: expand the axes, list invalid members, run the rest one job "
        "each, and record them in the results store; a restarted sweep skips finished members.",
    )
    p.add_argument("sweep", help="the sweep file (YAML)")
    p.add_argument("--store", help="results store (default: the sweep's store:, or results.sqlite beside it)")
    p.add_argument("--retry-failed", action="store_true", help="rerun members stored as oom/timeout/crashed")
    p.add_argument("--dry-run", action="store_true", help="list the members and invalid ones; run nothing")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser(
        "report",
        help="tables (md/csv/html) and plots from a results store; export; import Megatron/DeepSpeed logs",
        usage=REPORT_USAGE,
        description="Tables like the users' own (layout x device count) and a wide MosaicML-style table.",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="see usage")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser(
        "launch",
        help="run an stx command as N processes (torchrun): stx launch -n 2 train tiny-gpt",
        description="stx launch -n N [options] SUBCOMMAND [ARGS ...]: start N processes on this node, "
        "each running `stx SUBCOMMAND ARGS` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
        "MASTER_PORT set, through torchrun's agent. Options go before SUBCOMMAND; everything after it "
        "is passed on untouched. When a rank fails, the others are stopped and the failing rank, its "
        "exit code and its error are printed (exit status 1).",
    )
    p.add_argument(
        "-n", "--nproc-per-node", type=int, required=True, metavar="N", help="processes on this node (>= 1)"
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default 0)")
    p.add_argument(
        "--master-addr",
        help="address of node 0 (needed with --nnodes > 1; default 127.0.0.1 with --master-port)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        help="port on node 0 (default: one node picks a free port itself; several nodes use 29500)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank up to this many times on a failure (default 0)",
    )
    p.add_argument(
        "--monitor-interval",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="how often the ranks are polled, i.e. how fast a failure is noticed (default 0.1)",
    )
    p.add_argument(
        "--log-dir",
        help="keep the ranks' logs (stderr, the stdout not shown) and error files here (default: not kept)",
    )
    p.add_argument(
        "--ranks-output",
        choices=("0", "all"),
        default="0",
        help="whose stdout is shown: rank 0 (default) or all (prefixed [rankN]:); all stderr is shown",
    )
    # `sub.choices` is the live name -> parser map: every command, including ones added after this.
    p.add_argument("subcommand", choices=sub.choices, metavar="SUBCOMMAND", help="the stx command to run")
    p.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments, passed on untouched"
    )
    p.set_defaults(fn=cmd_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import CheckpointError, ConfigError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"] and not {"-h", "--help"} & set(argv[1:2]):
        # `stx report` has three forms with their own options (see REPORT_USAGE): parsed in cmd_report.
        args = argparse.Namespace(fn=cmd_report, args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    warnings.simplefilter("default")
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"stx: config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"stx: checkpoint error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        # Bad input (a dataset, a tokenizer file, a blend) is reported as a message, not a traceback;
        # STX_DEBUG=1 re-raises for the full stack when the message is not enough.
        if os.environ.get("STX_DEBUG"):
            raise
        print(f"stx: error: {e}\n(set STX_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stx ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    # `stx launch` runs each rank as `python -m scalable_transformer.cli`: @record writes an uncaught
    # exception to the error file torchelastic names (TORCHELASTIC_ERROR_FILE; a no-op without it),
    # which is how the launcher reports the failing rank's exception and traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
