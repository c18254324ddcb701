"""`stx checkpoint info`: iteration, layout, model shape, size and files of a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ..checkpoint.manager import describe_checkpoint


@dataclasses.dataclass(frozen=True)
class CheckpointInfoOptions:
    """path: a checkpoint (iter_XXXXXXX) or a save directory (its latest); as_json: print metadata.json."""

    path: str
    as_json: bool = False


def run_info(args: argparse.Namespace) -> int:
    opts = CheckpointInfoOptions(args.path, as_json=args.json)
    info = describe_checkpoint(opts.path)
    print(json.dumps(info["metadata"], indent=2) if opts.as_json else render_info(info))
    return 0


def render_info(info: dict[str, Any]) -> str:
    """The text of `stx checkpoint info` from `describe_checkpoint`'s dict."""
    meta = info["metadata"]
    m, files = meta["model"], meta["files"]
    env = meta.get("environment") or {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "scalable_transformer") if k in env)
    lines = [
        f"checkpoint: {info['path']}",
        f"iteration: {meta['iteration']} ({meta['consumed_samples']} consumed samples)",
        f"written by: {meta['world_size']} process(es), layout {meta['layout']}",
        f"model: {m['type']}, {meta.get('num_parameters', 0):,} parameters, {m['num_layers']} layers x "
        f"{m['hidden_size']} hidden, {m['num_attention_heads']} heads, seq {m['seq_length']}, "
        f"vocab {m['vocab_size']}, {m['position_embedding_type']} positions, {m['activation']}, {m['norm']}",
        f"holds: {info['model_tensors']} model tensors"
        + (", optimizer state" if meta["contents"]["optimizer"] else ", no optimizer state")
        + (f", RNG states of {meta['world_size']} rank(s)" if meta["contents"]["rng"] else ", no RNG states"),
        f"size on disk: {info['size_bytes'] / 2**20:.2f} MiB in {len(files) + 1} files"
        f" (saved in {meta.get('save_seconds', float('nan')):.2f} s)",
    ]
    if versions:
        lines.append(f"saved with: {versions}")
    lines.append("files:")
    lines += [f"  {name}  {size:,} bytes" for name, size in sorted(files.items())]
    lines += [f"  {name}  {size:,} bytes" for name, size in info["metadata_file"].items()]
    return "\n".join(lines)
