"""Every `stx` command's parser, and the handle that runs a command: argparse only, so that building the
parser (`stx --help`, a usage error, any command's start) imports no command's module.

A command's work lives in cli/<command>.py, which imports what it uses at its top: torch for train,
export, checkpoint, env and calibrate, the tokenizers library for tokenizer and preprocess, the results
store for report and sweep, the torch-free planner for plan. `command` imports that module only when
its command runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable

from ..launch.batch import DEFAULT_SIGNAL_GRACE
from ..metrics.device_table import DTYPES, PEAK_TFLOPS
from ..metrics.flops import CONVENTIONS, RECOMPUTE_MODES


def command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The handler `name` of cli/<module>.py, as a parser's `fn`."""

    def run(args: argparse.Namespace) -> int:
        # The one import of a command's module, when it runs: importing them all to build the parser
        # would import torch into `stx --help` (measured: see cli/__init__.py)
        handler: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(f".{module}", __package__), name
        )
        return handler(args)

    return run


def split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first item is the config unless it is an override."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def register_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train (no CONFIG = the embedded tiny BERT on the bundled corpus)",
        description="stx train [CONFIG] [key=value ...]; CONFIG is a preset name or a YAML "
        "path; overrides take dotted (optim.lr=3e-4) or Megatron/NeoX (num-layers=4) names.",
    )
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.set_defaults(fn=command("train", "run"), keeps_usr1=True)  # cli.EarlyStopRequest


def register_config(sub: argparse._SubParsersAction) -> None:
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
    imp.add_argument(
        "--neox",
        nargs="+",
        metavar="YAML",
        help="GPT-NeoX config files, merged in order as `deepy.py train.py a.yml b.yml` merges them",
    )
    imp.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="--neox: the tokenizer's vocabulary size (before padding) when the files name a tokenizer "
        "file the import does not know (Llama's tokenizer.model: 32000)",
    )
    imp.add_argument(
        "--hf",
        metavar="CONFIG_JSON",
        help="a Hugging Face model's config.json (or its directory): its shape (stx config from-hf also "
        "starts from its weights)",
    )
    imp.add_argument("--base", metavar="PRESET", help="a preset (or YAML) the written config extends")
    imp.add_argument("-o", "--output", metavar="FILE", help="the config file to write")
    imp.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.set_defaults(fn=command("config", "run"))


def add_tokenizer_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `stx tokenizer train`."""
    parser.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="files, directories or globs"
    )
    parser.add_argument(
        "--type", choices=("wordpiece", "bpe"), required=True, help="WordPiece (BERT) or BPE (GPT)"
    )
    parser.add_argument("--vocab-size", type=int, required=True, help="number of tokens, e.g. 30522")
    parser.add_argument(
        "--output", required=True, metavar="DIR", help="directory for tokenizer.json and vocab files"
    )
    add_text_column_argument(parser)
    parser.add_argument("--cased", action="store_true", help="keep case (default: lower-case the text)")


def register_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a WordPiece or BPE tokenizer (HF tokenizers)")
    tok = p.add_subparsers(dest="action", required=True)
    t = tok.add_parser(
        "train", help="train a tokenizer on text/jsonl(.gz/.zst)/parquet inputs or saved datasets"
    )
    add_tokenizer_train_arguments(t)
    t.set_defaults(fn=command("tokenizer", "run_train"))


# Megatron's tokenizer types (data/tokenizers.py TOKENIZER_TYPES), spelled out so that building the
# parser does not import the tokenizers library.
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "HFTokenizer")


def add_text_column_argument(parser: argparse.ArgumentParser) -> None:
    """--json-key / --text-column: where the text is in each input row."""
    parser.add_argument(
        "--json-key",
        "--text-column",
        dest="json_key",
        default="text",
        help="key of the text in JSON lines, column of the text in Parquet files and saved datasets "
        "(default: text)",
    )


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """--tokenizer, --vocab-file, --merge-file, --tokenizer-type, --tokenizer-vocab-size."""
    parser.add_argument(
        "--tokenizer",
        default="embedded",
        help="'embedded', a tokenizer.json, a BERT vocab.txt, a GPT-2 vocab.json, or a directory holding one",
    )
    parser.add_argument("--vocab-file", help="Megatron-style vocab file (BERT vocab.txt or GPT-2 vocab.json)")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt that goes with --vocab-file")
    parser.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        help="Megatron tokenizer type; default: inferred from the files",
    )
    parser.add_argument(
        "--tokenizer-vocab-size", type=int, default=8192, help="vocab size of the 'embedded' tokenizer"
    )


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `stx preprocess`."""
    parser.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="files, directories or globs"
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (give PREFIX as data.path)"
    )
    add_tokenizer_arguments(parser)
    add_text_column_argument(parser)
    parser.add_argument(
        "--split-sentences", action="store_true", help="one sequence per sentence (BERT); else per document"
    )
    parser.add_argument("--append-eod", action="store_true", help="end each document with the EOD token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count lines that are not UTF-8, not JSON or lack the key, instead of stopping",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar and summary")


def register_preprocess(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess", help="tokenize a corpus into a Megatron mmap indexed dataset (.bin/.idx)"
    )
    add_preprocess_arguments(p)
    p.set_defaults(fn=command("preprocess", "run"))


def add_flops_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `stx flops` options on parser."""
    model = parser.add_argument_group("model (a config, or an explicit shape)")
    model.add_argument(
        "--config", metavar="PATH_OR_PRESET", help="config YAML or preset name (e.g. bert-345m)"
    )
    model.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, repeatable (e.g. model.seq_length=1024)",
    )
    model.add_argument("--num-layers", type=int)
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--seq-length", type=int, help="tokens per sample")
    model.add_argument("--vocab-size", type=int, help="vocabulary before padding")
    model.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the explicit --vocab-size to a multiple of this, as Megatron does (default 128)",
    )
    model.add_argument("--ffn-hidden-size", type=int, help="MLP inner size (default 4 * hidden size)")
    model.add_argument(
        "--params",
        type=int,
        metavar="N",
        help="parameter count N; overrides the counted (config) or estimated (shape) count",
    )

    speed = parser.add_argument_group("measured throughput (one of)")
    rate = speed.add_mutually_exclusive_group(required=True)
    rate.add_argument("--samples-per-second", type=float, help="global samples (sequences) per second")
    rate.add_argument("--tokens-per-second", type=float, help="global tokens per second")
    rate.add_argument(
        "--iteration-time",
        type=float,
        metavar="SECONDS",
        help="seconds per optimizer step (needs --global-batch-size or a config)",
    )
    speed.add_argument("--global-batch-size", type=int, help="samples per optimizer step")

    hw = parser.add_argument_group("hardware")
    hw.add_argument("--devices", type=int, help="devices that shared the work (default 1)")
    hw.add_argument(
        "--device",
        metavar="NAME",
        help=f"peak table entry ({', '.join(PEAK_TFLOPS)}) or 'cpu' to measure this CPU",
    )
    hw.add_argument(
        "--dtype",
        help=f"compute dtype of the matmuls: {', '.join(DTYPES)} "
        "(default: the config's precision, else bf16)",
    )
    hw.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s per device (overrides --device)")
    parser.add_argument(
        "--activation-checkpointing",
        choices=RECOMPUTE_MODES,
        help="recompute mode, counts towards HFU (default: the config's, else none)",
    )
    parser.add_argument(
        "--convention",
        choices=(*CONVENTIONS, "all"),
        default="all",
        help="FLOPs convention (default all: one row each)",
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable dict")


def register_flops(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flops", help="TFLOPs/device, MFU and HFU from a model shape and a throughput")
    add_flops_arguments(p)
    p.set_defaults(fn=command("flops", "run"))


def _plan_what_if_options(p: argparse.ArgumentParser) -> None:
    """`stx plan`'s options that change what the time model assumes of the run, not the layout."""
    p.add_argument(
        "--attention-kernel",
        metavar="KERNEL",
        help="time the attention core at this kernel's rates from the hardware profile (flash, "
        "mem_efficient, math, cudnn, triton, flash1: those it has points of) instead of the kernel this "
        "engine's SDPA takes for the config; for another engine's run, or a what-if. Time model only "
        "(on cpu with --no-probe); docs/PLANNER.md#attention-kernels",
    )
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=None,
        metavar="X",
        help="MoE models: the routed tokens' max/mean per expert to plan the busiest expert-parallel rank "
        "at (its activations, expert GEMMs and all-to-alls), >= 1; default 1.25 (Switch Transformer's "
        "capacity factor: a balanced router's busiest expert); docs/PLANNER.md#mixture-of-experts",
    )


def register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict memory, fit/OOM and speed of a layout (or rank every layout) before running it",
        description="stx plan CONFIG [key=value ...] --world-size N --device a100-40gb: memory per "
        "device, fit/OOM, step time, samples/s and MFU of the config's layout; --search ranks every "
        "valid layout. Formulas and sources: docs/PLANNER.md.",
    )
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.add_argument(
        "--world-size",
        type=int,
        help="devices in total (whole nodes of the device's usual size; cpu: local processes)",
    )
    p.add_argument("--nodes", type=int, help="nodes (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, help="devices per node (default: the device's usual)")
    p.add_argument(
        "--device", help="device table name (a100-40gb, a100-80gb, h100-sxm, h100-pcie, h200-sxm) or cpu"
    )
    p.add_argument("--host-memory-gb", type=float, help="host memory per node in GiB (checks offload)")
    p.add_argument(
        "--hardware",
        help="cluster YAML file (docs/PLANNER.md#hardware) or hardware profile (a file with `format:`, "
        "written by stx calibrate; docs/PLANNER.md#hardware-profiles)",
    )
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]} as JSON')
    p.add_argument("--search", action="store_true", help="rank every valid layout of these devices")
    p.add_argument(
        "--top",
        type=int,
        default=10,
        help="--search: layouts shown that fit, and closest that do not (default 10)",
    )
    p.add_argument(
        "--emit-sweep",
        metavar="FILE",
        help="--search: write a sweep file of the best --top layouts plus the fit/OOM boundary",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="--device cpu: the rate model's step time instead of measuring it with two short runs of "
        "the engine at 1 and up to 4 layers per pipeline chunk (docs/PLANNER.md#cpu-depth-probes)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="--device cpu: run the depth probes again instead of reading them from the user cache",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="also build and run two steps of the real engine on fake tensors over a fake process group "
        "of the target world size, one rank per memory class: measured peak memory per rank, the "
        "collectives and host synchronizations per step, beside the prediction (docs/PLANNER.md#dry-runs)",
    )
    p.add_argument(
        "--dry-run-top",
        type=int,
        metavar="K",
        help="--search: dry-run the best K layouts that fit (docs/PLANNER.md#dry-runs)",
    )
    p.add_argument(
        "--calibrate-from",
        metavar="STORE",
        help="refit the hardware profile's op-class corrections from the runs in this results store "
        "(docs/PLANNER.md#prediction-error-and-refits) and plan with them",
    )
    p.add_argument("--output", metavar="PROFILE", help="--calibrate-from: write the refitted profile here")
    _plan_what_if_options(p)
    p.set_defaults(fn=command("plan", "run"))


# The hardware profile `stx calibrate` writes (and `stx submit ... calibrate` has it write).
DEFAULT_PROFILE_OUTPUT = "hardware-profile.yaml"


def register_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine's GEMM, attention, memory and collective rates into a hardware "
        "profile for `stx plan --hardware` (a few minutes)",
        description="stx calibrate CONFIG [key=value ...] [--output FILE] [--quick]: measure GEMMs at "
        "the config's layer shapes and dtype, attention forward and backward per SDPA kernel, "
        "elementwise bandwidth and the cost of one op, and (more than one process) all-reduce, "
        "all-gather, reduce-scatter and send/recv from 4 KiB to 64 MiB, within and across nodes. "
        "Run it as the training runs: `stx launch -n N calibrate ...`, srun, mpiexec or stx submit. "
        "Rank 0 writes the profile. See docs/PLANNER.md#calibrating-on-your-cluster.",
    )
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.add_argument(
        "--output",
        default=DEFAULT_PROFILE_OUTPUT,
        metavar="FILE",
        help=f"the hardware profile to write (YAML; default {DEFAULT_PROFILE_OUTPUT})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer shapes and sizes, a tenth of the time budget (a smoke test, not a profile to plan with)",
    )
    p.set_defaults(fn=command("calibrate", "run"))


def register_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect checkpoints")
    ck = p.add_subparsers(dest="action", required=True)
    c = ck.add_parser("info", help="iteration, layout, model shape, size and files of a checkpoint")
    c.add_argument("path", help="a checkpoint (iter_XXXXXXX) or a save directory (its latest)")
    c.add_argument("--json", action="store_true", help="print metadata.json")
    c.set_defaults(fn=command("checkpoint", "run_info"))


def register_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint as a Hugging Face transformers model (GPT2LMHeadModel, BertForPreTraining)",
    )
    p.add_argument("checkpoint", help="a checkpoint (iter_XXXXXXX) or a save directory (its latest)")
    p.add_argument("--format", choices=("hf",), default="hf", help="hf: transformers save_pretrained")
    p.add_argument("--output", required=True, help="a new directory")
    p.set_defaults(fn=command("export", "run"))


def register_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions and hardware fingerprint (stored in every run directory)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=command("env", "run"))


def register_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a grid of layouts (each via stx launch), catch OOM/timeout/crash, store every result",
        description="stx sweep SWEEP.yaml: expand the axes, list invalid members, run the rest one job "
        "each, and record them in the results store; a restarted sweep skips finished members (and, "
        "with executor: slurm|pbs, re-attaches to its queued jobs). "
        "stx sweep status STORE: the batch jobs of a store, with their states.",
    )
    p.add_argument("sweep", help="the sweep file (YAML), or `status`")
    p.add_argument("status_store", nargs="?", metavar="STORE", help="with `status`: the results store")
    p.add_argument("--store", help="results store (default: the sweep's store:, or results.sqlite beside it)")
    p.add_argument("--retry-failed", action="store_true", help="rerun members stored as oom/timeout/crashed")
    p.add_argument(
        "--retry-suspect",
        action="store_true",
        help="rerun members whose stored measurement stx report flags as suspect (far from its prediction, "
        "repeats that disagree, scaling above 100%%)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the members and invalid ones; run nothing")
    p.set_defaults(fn=command("sweep", "run"))


REPORT_USAGE = """stx report RUN_DIR
       stx report [STORE] [--rows KEYS] [--cols KEYS] [--value V1,V2] [--format md|csv|html]
                  [--output DIR] [--device-memory-gb G] [--suspect-factor F]
       stx report export STORE --format csv|parquet --output FILE
       stx report import-log FILE --format megatron|deepspeed [--store PATH] [--label L] [--devices N]"""


def report_parsers() -> dict[str, argparse.ArgumentParser]:
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
        help="cell values: samples_per_second, tokens_per_second, tflops_per_device, mfu, hfu, peak_memory, "
        "device_memory, power, util, energy_per_sample, energy_per_token, grad_sync, comm; or users (the "
        "users' cell: samples/s, TFLOPs/dev, used/total GiB, power/limit W, utilisation %)",
    )
    table.add_argument("--format", choices=("md", "csv", "html"), default="md", help="what is printed")
    table.add_argument("--output", help="directory: table/wide .md and .csv, report.html, PNG plots")
    table.add_argument("--device-memory-gb", type=float, help="device memory line of the memory plot (GiB)")
    table.add_argument(
        "--suspect-factor",
        type=float,
        default=2.0,
        help="flag a measured step time more than F times its prediction, or less than 1/F (default 2)",
    )
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


def register_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="tables (md/csv/html) and plots from a results store; export; import Megatron/DeepSpeed logs",
        usage=REPORT_USAGE,
        description="Tables like the users' own (layout x device count) and a wide MosaicML-style table.",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="see usage")
    p.set_defaults(fn=command("report", "run"))


def register_launch(sub: argparse._SubParsersAction) -> None:
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
        "-n",
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="processes on this node (>= 1); required without --hostfile (there: the hosts' slots)",
    )
    p.add_argument(
        "--hostfile",
        metavar="FILE",
        help="run on the hosts of FILE ('HOST slots=N' lines, DeepSpeed's format) over ssh; "
        "rank 0 on the first host",
    )
    p.add_argument("--include", metavar="SEL", help="with --hostfile: only these hosts/slots, e.g. h1@h2:0,1")
    p.add_argument("--exclude", metavar="SEL", help="with --hostfile: leave out these hosts/slots")
    p.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="NAME",
        help="with --hostfile: pass this variable to every host (repeatable; NCCL_*, PYTHON*, STX_*, "
        "TORCH_*, OMP_*, CUDA_* are passed anyway)",
    )
    p.add_argument("--env-file", metavar="FILE", help="with --hostfile: NAME=value lines set on every host")
    p.add_argument(
        "--ssh-config",
        metavar="FILE",
        default=os.environ.get("STX_SSH_CONFIG"),
        help="with --hostfile: ssh -F FILE (default: $STX_SSH_CONFIG, else ssh's own)",
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
    p.set_defaults(fn=command("launch", "run"))


def register_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="submit stx train as a Slurm or PBS batch job: "
        "stx submit --scheduler slurm --nodes 2 train gpt-1b",
        description="stx submit --scheduler slurm|pbs --nodes K --gpus-per-node G [options] train CONFIG "
        "[key=value ...]: write the batch script (one rank per GPU, started by srun or mpiexec) into the "
        "run directory, submit it and print the job id. --dry-run prints the script and submits nothing.",
    )
    p.add_argument("--scheduler", required=True, choices=("slurm", "pbs"), help="the batch scheduler")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    p.add_argument(
        "--gpus-per-node", type=int, default=1, metavar="G", help="GPUs per node = ranks per node (default 1)"
    )
    p.add_argument("--time", metavar="TIME", help="time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", "--queue", dest="partition", help="Slurm partition / PBS queue")
    p.add_argument("--account", help="account (project) to charge")
    p.add_argument(
        "--container", metavar="PREFIX", help='command prefix of every rank, e.g. "apptainer exec --nv IMAGE"'
    )
    p.add_argument("--env-file", metavar="FILE", help="a file of VAR=value lines, sourced by the job")
    p.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="NAME",
        help="pass this variable's current value to the job (repeatable), e.g. --export NCCL_SOCKET_IFNAME",
    )
    p.add_argument(
        "--no-gpu-request", action="store_true", help="leave the GPU request out (CPU-only partitions)"
    )
    p.add_argument(
        "--launcher",
        choices=("srun", "torchrun"),
        default="srun",
        help="Slurm: srun starts every rank (default), or torchrun: one stx launch per node starts them",
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="continue the run in new jobs until train.train_iters is reached: the ranks stop on "
        "SIGUSR1 before the time limit, save (checkpoint.save must be set) and the job submits the "
        "same script again, which resumes with checkpoint.load=auto",
    )
    p.add_argument(
        "--signal-grace",
        type=int,
        metavar="SECONDS",
        help="with --requeue: how long before the time limit the ranks get SIGUSR1, enough to finish "
        f"a step and save a checkpoint (default {DEFAULT_SIGNAL_GRACE}; Slurm may send it up to a "
        "minute earlier)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the batch script; write and submit nothing")
    p.add_argument(
        "subcommand",
        choices=("train", "calibrate"),
        metavar="train|calibrate",
        help="the stx command to run: train, or calibrate (a hardware profile of the job's nodes)",
    )
    p.add_argument("items", nargs=argparse.REMAINDER, metavar="CONFIG|key=value")
    p.set_defaults(fn=command("submit", "run"))
