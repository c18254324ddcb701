"""`stx tokenizer train`: a WordPiece (BERT) or byte-level BPE (GPT) tokenizer from a corpus."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..data.tokenizers import TokenizerTrainOptions


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--json-key", default="text", help="key of the text in JSON lines (default: text)")
    parser.add_argument("--cased", action="store_true", help="keep case (default: lower-case the text)")


def train_options(args: argparse.Namespace) -> TokenizerTrainOptions:
    from ..data.tokenizers import TokenizerTrainOptions

    return TokenizerTrainOptions(
        inputs=tuple(args.input),
        kind=args.type,
        vocab_size=args.vocab_size,
        output_dir=args.output,
        json_key=args.json_key,
        lowercase=not args.cased,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a WordPiece or BPE tokenizer (HF tokenizers)")
    tok = p.add_subparsers(dest="action", required=True)
    t = tok.add_parser("train", help="train a tokenizer on text/jsonl(.gz/.zst) inputs")
    add_train_arguments(t)
    t.set_defaults(fn=run_train)


def run_train(args: argparse.Namespace) -> int:
    """`stx tokenizer train`: 0 on success, 2 (message on stderr) on bad input."""
    from ..data.tokenizers import train_tokenizer_files

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
