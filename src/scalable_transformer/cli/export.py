"""`stx export CHECKPOINT --output DIR`: a checkpoint as a Hugging Face transformers model."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """checkpoint: a checkpoint or a save directory (its latest); output: a new directory."""

    checkpoint: str
    output: str
    format: str = "hf"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint as a Hugging Face transformers model (GPT2LMHeadModel, BertForPreTraining)",
    )
    p.add_argument("checkpoint", help="a checkpoint (iter_XXXXXXX) or a save directory (its latest)")
    p.add_argument("--format", choices=("hf",), default="hf", help="hf: transformers save_pretrained")
    p.add_argument("--output", required=True, help="a new directory")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.export import export_hf

    opts = ExportOptions(args.checkpoint, args.output, args.format)
    out = export_hf(opts.checkpoint, opts.output)
    print(f"exported {opts.checkpoint} to {out} (load with transformers' from_pretrained('{out}'))")
    return 0
