"""The parameter reference, generated from the schema (README.md and docs/CONFIG.md hold copies)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from .deepspeed_json import classification_markdown as deepspeed_classification_markdown
from .load import SPECIAL_KEYS, _hints
from .neox_args import neox_args_markdown as neox_classification_markdown
from .schema import SECTIONS

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
NEOX_START, NEOX_END = "<!-- neox-classification:start -->", "<!-- neox-classification:end -->"
DS_START, DS_END = "<!-- deepspeed-classification:start -->", "<!-- deepspeed-classification:end -->"


def _type_name(hint) -> str:
    return str(hint).replace("<class '", "").replace("'>", "").replace("NoneType", "None")


def reference_markdown() -> str:
    lines = [
        "Keys are `section.field` in YAML sections, in `key=value` overrides, or flat by field name. "
        "Megatron/NeoX names (kebab or snake case) and DeepSpeed keys listed under *aliases* set the same "
        "field. `None` = derived (shown resolved by `stx config show`).",
        "",
    ]
    for section in SECTIONS:
        lines += [f"### `{section}`", "", "| key | type | default | description |", "|---|---|---|---|"]
        hints = _hints(section)
        for f in dataclasses.fields(SECTIONS[section]):
            doc = f.metadata.get("doc", "")
            if f.metadata.get("choices"):
                doc += " Choices: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
            if f.metadata.get("bounds"):
                signs = {"ge": ">=", "gt": ">", "lt": "<", "le": "<="}
                doc += (
                    " Valid: "
                    + " and ".join(f"{signs[k]} {b:g}" for k, b in f.metadata["bounds"].items())
                    + "."
                )
            if f.metadata.get("aliases"):
                doc += " Aliases: " + ", ".join(f"`{a}`" for a in f.metadata["aliases"]) + "."
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"| `{f.name}` | {_type_name(hints[f.name])} | `{default}` | {doc} |")
        lines.append("")
    lines += ["### Switches and DeepSpeed blocks", "", "| key | effect |", "|---|---|"]
    for key, fn in SPECIAL_KEYS.items():
        lines.append(f"| `{key}` | {(fn.__doc__ or '').strip().splitlines()[0]} |")
    lines += ["| `base` | A preset name or a YAML path this file extends. |", ""]
    return "\n".join(lines)


def _blocks() -> list[tuple[str, str, Callable[[], str]]]:

    return [
        (START, END, reference_markdown),
        (NEOX_START, NEOX_END, neox_classification_markdown),
        (DS_START, DS_END, deepspeed_classification_markdown),
    ]


def update_file(path: Path) -> bool:
    """Replace every generated block (between its markers) that `path` holds; True when it changed."""
    text = path.read_text(encoding="utf-8")
    blocks = [b for b in _blocks() if b[0] in text and b[1] in text]
    if not blocks:
        raise ValueError(f"{path}: no {START} ... {END} markers to fill")
    new = text
    for start, end, generate in blocks:
        filled = f"{start}\n{generate()}\n{end}"
        first, rest = new.split(start, 1)
        new = first + filled + rest.split(end, 1)[1]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text
