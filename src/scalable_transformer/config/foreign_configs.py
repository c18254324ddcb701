"""`stx config import`: the configs users already have (a DeepSpeed JSON, a Megatron command line or the
argument dump a Megatron log prints, GPT-NeoX files) become one config file of ours.

No second mapping: each dialect's names live in its own module (deepspeed_json.py, megatron_args.py,
neox_args.py; the loader's SPECIAL_KEYS / IGNORED_KEYS / UNSUPPORTED_KEYS join the names a config file of
ours may use). What this module adds is reading the foreign
formats, deciding what is carried over, and writing one YAML that lists, in comments, what was not:
paths of the machine the run came from, knobs with no equivalent, values Megatron derives.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from ..errors import ConfigError, ConfigWarning
from ..files import atomic_output
from . import deepspeed_json, neox_args
from .load import (
    IGNORED_KEYS,
    SPECIAL_KEYS,
    UNSUPPORTED_KEYS,
    Assignment,
    _hints,
    assignments_from_mapping,
    coerce,
    field_index,
    grouped_config_warnings,
    load_config,
    norm_key,
    parse_yaml,
)
from .megatron_args import family_of_entry, megatron_defaults, translate_megatron_args
from .schema import SECTIONS, check_value, section_fields
from .shell_script import MARK, Script, read_script

# Settings that name files on the machine the imported run came from: written as comments to fill in,
# so that the imported config does not point at paths that do not exist here.
PATH_FIELDS = (
    "data.path",
    "data.vocab_file",
    "data.merge_file",
    "data.tokenizer_type",  # goes with vocab_file
    "checkpoint.save",
    "checkpoint.load",
    "checkpoint.save_interval",  # needs checkpoint.save
    "checkpoint.finetune",  # needs checkpoint.load
    "logging.tensorboard_dir",
)

# Values a Megatron log prints that Megatron derived (from the world size, or the run's progress):
# carrying them over would pin the layout of the original machine.
DERIVED_IN_DUMP = {
    "data_parallel_size": "derived from the world size (stx config show --world-size N derives it)",
    "world_size": "the original run's world size (give it as --world-size)",
    "rank": "the printing process's rank",
    "consumed_train_samples": "progress of the original run",
    "consumed_valid_samples": "progress of the original run",
    "params_dtype": "derived from fp16/bf16",
    "padded_vocab_size": "derived from the tokenizer",
}


@dataclasses.dataclass(frozen=True)
class ImportSources:
    """What to import: any of a DeepSpeed JSON, one Megatron source (a command line, a script holding
    one, or a log with Megatron's argument dump), GPT-NeoX files (merged in order, as `deepy.py train.py
    a.yml b.yml`; neox_vocab_size: the tokenizer's size when the files name an unknown one); base: a
    preset or YAML the result extends."""

    deepspeed: Path | None = None
    megatron_args: str | None = None
    megatron_args_file: Path | None = None
    from_log: Path | None = None
    neox: tuple[Path, ...] = ()
    neox_vocab_size: int | None = None
    base: str | None = None
    # a Hugging Face model's shape: (its config.json, the model.* settings read from it by the caller,
    # checkpoint/hf_import.py `model_overrides_from_hf`)
    hf_model: tuple[str, dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A setting not carried over: the original key, its value, where from and why."""

    key: str
    value: Any
    source: str
    why: str


@dataclasses.dataclass
class Imported:
    """The settings carried over (path -> (value, source)), the ones written as comments, the model
    family if a Megatron entry script named it, and the original world size if a log printed it."""

    values: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    paths: list[Assignment] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    ignored: list[ConfigWarning] = dataclasses.field(default_factory=list)
    model_type: str | None = None
    world_size: int | None = None
    sources: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # defaults taken, for the comments


# --------------------------------------------------------------------------- reading the formats


def read_deepspeed_json(path: Path) -> dict[str, Any]:
    """A DeepSpeed config as a dict; errors name the file (and the line of a JSON error)."""
    return parse_deepspeed_json(_read_text(path, "DeepSpeed config"), str(path))


def parse_deepspeed_json(text: str, path: str) -> dict[str, Any]:
    """A DeepSpeed config's text as a dict; errors name `path` (and the line of a JSON error)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{path}: duplicate key '{key}'")
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object {{...}}, got {type(data).__name__}")
    return data


@dataclasses.dataclass
class MegatronCommand:
    """The Megatron arguments of a command line or script (flags -> values, as argparse would see them),
    the model family its entry point names (None for bare arguments), the script as read (its heredoc
    files, the values it cannot give) and the line of the launch."""

    flags: dict[str, Any]
    family: str | None
    script: Script
    line: int = 0


def read_megatron_command(text: str, source: str) -> MegatronCommand:
    """The Megatron arguments of the command that runs `pretrain_*.py` in a shell script or command
    line, read as bash would expand them (config/shell_script.py: nothing is run); flags before the
    entry point belong to the launcher (torchrun, deepspeed, python -m ...). Bare arguments
    (`--num-layers 24 ...`, no entry point) are read as they are."""
    script = read_script(text, source)
    runs = [c for c in script.commands if c.entry() is not None]
    megatron = [c for c in runs if PurePosixPath(c.words[c.entry() or 0]).name.startswith("pretrain_")]
    if not runs and script.commands and script.commands[0].words[0].startswith("--"):
        return MegatronCommand(_flags(script.commands[0].words, source), None, script)
    if not megatron:
        found = ", ".join(f"line {c.line}: {c.words[c.entry() or 0]}" for c in runs)
        raise ConfigError(
            f"{source}: no line runs a Megatron pretrain_*.py entry point"
            + (f" (found {found})" if found else "; no Megatron arguments (--name value ...) found")
        )
    certain = [c for c in megatron if c.uncertain is None]
    if len(certain) > 1:
        lines = ", ".join(str(c.line) for c in certain)
        raise ConfigError(f"{source}: lines {lines} each run a Megatron entry point; import one command")
    if not certain:
        c = megatron[0]
        raise ConfigError(
            f"{source}:{c.line}: the line running Megatron is {c.uncertain}; import it as a command line"
        )
    command = certain[0]
    k = command.entry() or 0
    family = family_of_entry(command.words[k], command.line, source)
    return MegatronCommand(_flags(command.words[k + 1 :], source), family, script, command.line)


def megatron_args_from_command(text: str, source: str) -> tuple[dict[str, Any], str | None]:
    """(flags -> values, model family or None) of a Megatron command line or a shell script running one
    (`read_megatron_command`)."""
    command = read_megatron_command(text, source)
    return command.flags, command.family


def _flags(words: list[str], source: str) -> dict[str, Any]:
    """argparse's view of the words: a flag with no value is a switch (true); a flag with several values
    (`--data-path 0.3 A 0.7 B`) keeps them joined by spaces, as Megatron's nargs do; the last of a
    repeated flag wins."""
    flags: dict[str, Any] = {}
    current: str | None = None
    for word in words:
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            current = None if eq else name
            flags.pop(name, None)  # a repeated flag: argparse keeps the last
            flags[name] = _scalar(value) if eq else True
        elif current is not None:
            previous = flags[current]
            flags[current] = _scalar(word) if previous is True else f"{previous} {word}"
    if not flags:
        raise ConfigError(f"{source}: no Megatron arguments (--name value ...) found")
    return flags


_DUMP_START = re.compile(r"-+ arguments -+")
_DUMP_END = re.compile(r"-+ end of arguments -+")
_DUMP_LINE = re.compile(r"^\s*(\S+) \.+ ?(.*?)\s*$")


def megatron_args_from_log(text: str, source: str) -> tuple[dict[str, Any], str | None]:
    """(argument -> value, model family or None) of the argument dump a Megatron log prints
    ('---- arguments ----' ... '---- end of arguments ----'); the first dump if the log holds several.
    `None` values (Megatron's "unset") are left out."""
    start = _DUMP_START.search(text)
    end = _DUMP_END.search(text, start.end()) if start else None
    if start is None or end is None:
        raise ConfigError(
            f"{source}: no Megatron argument dump ('---- arguments ----' ... '---- end of arguments ----') "
            "in this log; give the command line with --megatron-args instead"
        )
    args: dict[str, Any] = {}
    for line in text[start.end() : end.start()].splitlines():
        m = _DUMP_LINE.match(line)
        if m is None or m.group(2) == "None":
            continue
        raw = m.group(2)
        value: Any = _scalar(raw)
        if raw.startswith("["):  # data_path ['0.3', 'A', ...]: Megatron's nargs list
            with contextlib.suppress(ValueError, SyntaxError):
                value = " ".join(str(v) for v in ast.literal_eval(raw))
            if value == "":
                continue
        args[m.group(1)] = value
    head = text[: start.start()]
    family = "bert" if "pretrain_bert" in head else "gpt" if "pretrain_gpt" in head else None
    return args, family


def _scalar(text: str) -> Any:
    """A command-line or dump value as the YAML loader would read it (numbers, true/false), else text."""
    if text in ("True", "False"):
        return text == "True"
    if MARK in text:  # a piece a script leaves unknown: kept as text, for the error that names it
        return text
    try:
        value = parse_yaml(text, "value")
    except ConfigError:
        return text
    return value if isinstance(value, int | float | bool) else text


def _read_text(path: Path, what: str) -> str:
    if path.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory; give a file")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{what} '{path}' cannot be read: {e.strerror}") from None


# --------------------------------------------------------------------------- mapping


def _known(key: str) -> bool:
    k = norm_key(key)
    return (
        k in SECTIONS
        or k in field_index()
        or k in SPECIAL_KEYS
        or k.lower() in IGNORED_KEYS
        or (k.lower() in UNSUPPORTED_KEYS)
        or k in deepspeed_json.top_level_keys()
    )


def _add(result: Imported, mapping: dict[str, Any], source: str, dump: bool = False) -> None:
    """Carry the settings of one source over; dump: a log's argument dump, which prints every argument
    (defaults included), so an unsupported feature's default there is skipped, not an error."""
    result.sources.append(source)
    for key, value in mapping.items():
        k = norm_key(key)
        if dump and k in DERIVED_IN_DUMP:
            result.skipped.append(Skipped(key, value, source, DERIVED_IN_DUMP[k]))
            if k == "world_size" and isinstance(value, int):
                result.world_size = value
            continue
        if dump and k.lower() in UNSUPPORTED_KEYS and (value is None or value is False):
            continue  # the dump prints every switch; false asks for nothing
        if not _known(key) or (dump and k.lower() in UNSUPPORTED_KEYS):
            why = UNSUPPORTED_KEYS.get(k.lower(), "no equivalent here")
            result.skipped.append(Skipped(key, value, source, why))
            continue
        if isinstance(value, str) and value == "auto":  # HF Trainer's DeepSpeed placeholder
            result.skipped.append(Skipped(key, value, source, "'auto' is filled in by the HF Trainer"))
            continue
        with grouped_config_warnings(emit=False) as ignored:
            assignments = assignments_from_mapping({key: value}, source)
        result.ignored += ignored
        _carry(result, assignments, source)


def _carry(result: Imported, assignments: list[Assignment], source: str) -> None:
    """Check each value against its key (the error names the file it came from) and carry it over; two
    sources giving one key different values is an error. A None (DeepSpeed's batch keys a file leaves
    out: derived at resolve) gives way to a value another source gives."""
    for a in assignments:
        if a.path in PATH_FIELDS:
            result.paths.append(a)
            continue
        section, name = a.path.split(".")
        f = section_fields(section)[name]
        where = f"{source}: '{a.path}'"
        new = coerce(a.value, _hints(section)[name], where, f.metadata.get("choices", ()))
        check_value(f, new, where)  # here, so the error names the file the value came from
        old = result.values.get(a.path)
        if new is None and old is not None and old[1] != source:
            continue
        if old is not None and old[1] != source and old[0] is not None and old[0] != new:
            raise ConfigError(
                f"{a.path} is {old[0]!r} in {old[1]} but {new!r} in {source}: make them agree (or leave "
                "it out of one)"
            )
        result.values[a.path] = (new, source)


def _add_deepspeed(result: Imported, data: dict[str, Any], source: str) -> None:
    """A DeepSpeed file, read whole as DeepSpeed reads it (deepspeed_json): every key carried, listed as
    ignored with its reason, or refused; an unknown key is an error naming the nearest valid one."""
    result.sources.append(source)
    translation = deepspeed_json.translate(data, source)
    result.ignored += [ConfigWarning(source, key, why) for key, (_, why) in translation.ignored.items()]
    _carry(result, [Assignment(path, value, source) for path, value in translation.assignments], source)


def import_configs(sources: ImportSources) -> Imported:
    """Read every given source and map it; raises ConfigError naming the file and key on bad input."""
    megatron = [s for s in (sources.megatron_args, sources.megatron_args_file, sources.from_log) if s]
    if len(megatron) > 1:
        raise ConfigError("give one Megatron source: --megatron-args, --megatron-args-file or --from-log")
    if not (megatron or sources.deepspeed or sources.neox or sources.hf_model):
        raise ConfigError(
            "nothing to import: give --deepspeed, --neox, --hf and/or one of --megatron-args, "
            "--megatron-args-file, --from-log"
        )
    result = Imported()
    if sources.hf_model is not None:
        name, model = sources.hf_model
        _add(result, {"model": model}, name)
    if sources.deepspeed is not None:
        _add_deepspeed(result, read_deepspeed_json(sources.deepspeed), str(sources.deepspeed))
    family: str | None = None
    if sources.neox:
        family = _add_neox(result, list(sources.neox), sources.neox_vocab_size)
    if sources.megatron_args is not None:
        command = read_megatron_command(sources.megatron_args, "the Megatron command line")
        family = _add_megatron(result, command, "the Megatron command line")
    elif sources.megatron_args_file is not None:
        name = str(sources.megatron_args_file)
        command = read_megatron_command(_read_text(sources.megatron_args_file, "script"), name)
        family = _add_megatron(result, command, name)
        _check_script_shape(result, command, name)
    elif sources.from_log is not None:
        name = str(sources.from_log)
        args, family = megatron_args_from_log(_read_text(sources.from_log, "Megatron log"), name)
        _add(result, args, name, dump=True)
    if family is not None and "model.type" not in result.values:
        result.values["model.type"] = (family, "the Megatron entry script")
    result.model_type = family
    return result


def _add_neox(result: Imported, paths: list[Path], vocab_size: int | None) -> str:
    """Carry GPT-NeoX files, merged as NeoX merges them and read by neox_args.py (every argument carried,
    ignored with its reason, or refused); returns the family, gpt."""
    config, source = neox_args.read_neox_sources(paths, parse_yaml)
    translated = neox_args.translate_neox(config, source, vocab_size)
    result.sources.append(source)
    result.ignored += [ConfigWarning(source, key, why) for key, _, why in translated.ignored]
    _carry(result, [Assignment(path, value, source) for path, value in translated.values.items()], source)
    result.notes += translated.notes
    return "gpt"


def _add_megatron(result: Imported, command: MegatronCommand, source: str) -> str | None:
    """Carry a Megatron command's arguments (megatron_args.py decides each), the DeepSpeed config its
    script writes with a heredoc, and Megatron's defaults where nothing set the key; returns its family."""
    translated = translate_megatron_args(command.flags, source, command.script, _known)
    _add(result, translated.mapping, source)
    result.ignored += [ConfigWarning(source, flag, why) for flag, _, why in translated.ignored]
    result.skipped += [Skipped(flag, value, source, why) for flag, value, why in translated.not_carried]
    ds_path = command.flags.get("deepspeed_config", command.flags.get("deepspeed-config"))
    if isinstance(ds_path, str) and ds_path in command.script.files:
        ds_source = f"{source} (the DeepSpeed config its heredoc writes to {ds_path})"
        _add_deepspeed(result, parse_deepspeed_json(command.script.files[ds_path], ds_source), ds_source)
    elif ds_path is not None and not translated.not_carried_has("--deepspeed_config"):
        why = "the run's DeepSpeed config: give it with --deepspeed (the script does not write it)"
        result.skipped.append(Skipped("--deepspeed_config", ds_path, source, why))
    if command.family is not None:
        for path, (value, why) in megatron_defaults(command.flags).items():
            if path not in result.values:
                result.values[path] = (value, why)
                result.notes.append(f"{path}: {value!r}: {why}")
    result.notes += [f"script default used: {d}" for d in command.script.defaults]
    return command.family


# The shape a Megatron entry point needs (Megatron requires these arguments; pretrain_gpt/bert read
# --seq-length): an import of a script that leaves one out would be our default model, not theirs.
_SHAPE = ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.seq_length")


def _check_script_shape(result: Imported, command: MegatronCommand, source: str) -> None:
    missing = [path for path in _SHAPE if path not in result.values]
    if command.family is not None and missing:
        raise ConfigError(
            f"{source}: the command on line {command.line} does not give "
            f"{', '.join('--' + p.split('.')[1].replace('_', '-') for p in missing)}: "
            "Megatron requires the model's shape, and importing without it would give another model"
        )


# --------------------------------------------------------------------------- writing


def render_yaml(imported: Imported, base: str | None = None, name: str = "THIS_FILE") -> str:
    """The config file: header, settings by section, then what was not carried over as comments."""
    lines = ["# Imported by `stx config import` from:"]
    lines += [f"#   {s}" for s in imported.sources]
    check = f"stx config show {name} --world-size N"
    if imported.world_size:
        check += f"  (the original run: world size {imported.world_size})"
    lines += [f"# Check the layout with: {check}", ""]
    data: dict[str, Any] = {"base": base} if base else {}
    for section in SECTIONS:
        fields = [name for name in section_fields(section) if f"{section}.{name}" in imported.values]
        if fields:
            data[section] = {name: imported.values[f"{section}.{name}"][0] for name in fields}
    lines.append(yaml.safe_dump(data, sort_keys=False).rstrip())
    if imported.paths:
        lines += ["", "# Paths on the machine the imported run came from; set them for this one:"]
        for a in imported.paths:
            lines.append(f"#   {a.path}: {a.value}    ({a.source})")
    if imported.notes:
        lines += ["", "# Defaults taken where the source is silent:"]
        lines += [f"#   {note}" for note in imported.notes]
    if imported.ignored:
        lines += ["", "# Accepted and ignored (no equivalent here):"]
        lines += [f"#   {w.key} ({w.source}): {w.reason}" for w in imported.ignored]
    if imported.skipped:
        lines += ["", "# Not imported:"]
        lines += [f"#   {s.key} = {s.value!r} ({s.source}): {s.why}" for s in imported.skipped]
    return "\n".join(lines) + "\n"


def write_config(text: str, output: Path, force: bool = False) -> None:
    """Write `text` to `output` atomically after checking that it loads; never replaces an existing file
    unless force. A failure leaves no file behind (no half-written config, no temporary file)."""
    if output.is_dir():
        raise ConfigError(f"output '{output}' is a directory; give a file name like config.yaml")
    if output.exists() and not force:
        raise ConfigError(f"output '{output}' exists; give --force to replace it")
    if not output.parent.is_dir():
        raise ConfigError(f"the folder of output '{output}' does not exist")
    try:
        with atomic_output(output) as f:
            f.write(text.encode("utf-8"))
            f.flush()
            tmp = f.name
            try:
                with grouped_config_warnings(emit=False):  # the file lists them; the command prints a count
                    load_config(tmp)  # field-level checks with the loader itself, before it is published
            except ConfigError as e:  # name the file the user asked for, not our hidden temporary one
                raise ConfigError(str(e).replace(tmp, str(output))) from None
            if not force and output.exists():
                raise ConfigError(f"output '{output}' appeared while importing; give --force to replace it")
    except OSError as e:
        raise ConfigError(f"cannot write '{output}': {e.strerror}") from None


# --------------------------------------------------------------------------- foreign names in config files


def classify_foreign_key(name: str) -> tuple[str, str] | None:
    """(mapped | ignored | rejected, to which key / why / the message) for a Megatron, NeoX or DeepSpeed
    name, as the loader treats it; None if the loader does not know it (an unknown-key error)."""
    k = norm_key(name)
    if k in SPECIAL_KEYS:  # before field names, as the loader looks them up
        return "mapped", (SPECIAL_KEYS[k].__doc__ or "").strip().splitlines()[0]
    if k in field_index():
        return "mapped", f"`{field_index()[k]}`"
    rule = deepspeed_json.DEEPSPEED_KEYS.get(k)
    if rule is not None and rule.kind == "carried":
        return "mapped", f"DeepSpeed: {rule.detail} (docs/CONFIG.md, the DeepSpeed table)"
    if k.lower() in IGNORED_KEYS:
        return "ignored", IGNORED_KEYS[k.lower()]
    if k.lower() in UNSUPPORTED_KEYS:
        return "rejected", UNSUPPORTED_KEYS[k.lower()]
    return None
