"""`stx tokenizer train`: a WordPiece (BERT) or byte-level BPE (GPT) tokenizer from a corpus."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..data.tokenizers import TokenizerTrainOptions, train_tokenizer_files

if TYPE_CHECKING:
    from ..data.tokenizers import TokenizerTrainOptions


def train_options(args: argparse.Namespace) -> TokenizerTrainOptions:
    return TokenizerTrainOptions(
        inputs=tuple(args.input),
        kind=args.type,
        vocab_size=args.vocab_size,
        output_dir=args.output,
        json_key=args.json_key,
        lowercase=not args.cased,
    )


def run_train(args: argparse.Namespace) -> int:
    """`stx tokenizer train`: 0 on success, 2 (message on stderr) on bad input."""
    try:
        trained = train_tokenizer_files(train_options(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"stx tokenizer train: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {', '.join(trained.files)} to {trained.directory}: {trained.kind}, "
        f"{trained.vocab_size} tokens"
    )
    return 0
