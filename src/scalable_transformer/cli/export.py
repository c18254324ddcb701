"""`stx export CHECKPOINT --output DIR`: a checkpoint as a Hugging Face transformers model."""

from __future__ import annotations

import argparse
import dataclasses

from ..checkpoint.export import export_hf


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """checkpoint: a checkpoint or a save directory (its latest); output: a new directory."""

    checkpoint: str
    output: str
    format: str = "hf"


def run(args: argparse.Namespace) -> int:
    opts = ExportOptions(args.checkpoint, args.output, args.format)
    out = export_hf(opts.checkpoint, opts.output)
    print(f"exported {opts.checkpoint} to {out} (load with transformers' from_pretrained('{out}'))")
    return 0
