"""`stx config import --megatron-args-file` on the launch scripts Megatron-LM and Megatron-DeepSpeed ship
(read from the projects' snapshots at pinned commits: tests/upstream.py, SOURCES.md): each imports with the
model and layout the file says, every argument carried, ignored with its reason or refused; values only
running the script gives are named, never guessed (config/shell_script.py, config/megatron_args.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scalable_transformer.cli import main
from scalable_transformer.config.foreign_configs import (
    ImportSources,
    _known,
    import_configs,
    read_megatron_command,
    render_yaml,
)
from scalable_transformer.config.load import assignments_from_mapping, grouped_config_warnings, load_config
from scalable_transformer.config.megatron_args import translate_megatron_args
from scalable_transformer.config.model_shapes import total_params
from scalable_transformer.config.shell_script import read_script
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from upstream import MEGATRON_DEEPSPEED, MEGATRON_LM, Upstream, upstream_file


def _lm(path: str) -> Upstream:
    return Upstream(*MEGATRON_LM, path)


def _ds(path: str) -> Upstream:
    return Upstream(*MEGATRON_DEEPSPEED, path)


BERT_340M = _lm("examples/bert/train_bert_340m_distributed.sh")
GPT3_175B = _lm("examples/gpt3/train_gpt3_175b_distributed.sh")
LLAMA3_8B = _lm("examples/llama/train_llama3_8b_h100_fp8.sh")
DS_GPT = _ds("examples/pretrain_gpt_distributed_with_mp.sh")
DS_BERT = _ds("examples/pretrain_bert_distributed_with_mp.sh")
DS_LLAMA2 = _ds("examples_deepspeed/pretrain_llama2_distributed.sh")


def _import(src: Upstream, tmp_path: Path, capsys) -> object:
    """The config `stx config import` writes for a script, loaded back (the file a user gets)."""
    path = upstream_file(src, tmp_path)
    out = tmp_path / "c.yaml"
    code = main(["config", "import", "--megatron-args-file", str(path), "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    return load_config(str(out))


# file -> family, layers, hidden, heads, ffn (None: derived 4h), seq, tp, pp, sequence parallel,
# precision, query groups (None: multi-head)
SHAPES = {
    BERT_340M: ("bert", 24, 1024, 16, None, 512, 8, 16, False, "fp16", None),
    GPT3_175B: ("gpt", 96, 12288, 96, None, 2048, 8, 16, False, "fp16", None),
    LLAMA3_8B: ("gpt", 32, 4096, 32, 14336, 8192, 1, 1, False, "bf16", 8),
    DS_GPT: ("gpt", 24, 1024, 16, None, 1024, 2, 2, True, "fp16", None),
    DS_BERT: ("bert", 24, 1024, 16, None, 512, 2, 2, False, "fp16", None),
    DS_LLAMA2: ("gpt", 24, 2048, 16, 5504, 2048, 2, 2, False, "bf16", 4),
}


@pytest.mark.parametrize("path", list(SHAPES), ids=str)
def test_each_upstream_script_imports_with_its_shape_and_layout(path, tmp_path, capsys):
    cfg = _import(path, tmp_path, capsys)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    family, layers, hidden, heads, ffn, seq, tp, pp, sp, precision, groups = SHAPES[path]
    assert (m.type, m.num_layers, m.hidden_size, m.num_attention_heads) == (family, layers, hidden, heads)
    assert (m.ffn_hidden_size, m.seq_length, m.max_position_embeddings) == (ffn, seq, seq)
    assert (p.tp, p.pp, p.sequence_parallel, t.precision, m.num_query_groups) == (
        tp,
        pp,
        sp,
        precision,
        groups,
    )


def test_llama3_script_is_llama3(tmp_path, capsys):
    cfg = _import(LLAMA3_8B, tmp_path, capsys)
    m = cfg.model
    assert (m.norm, m.activation, m.position_embedding_type, m.rotary_base) == (
        "rmsnorm",
        "swiglu",
        "rotary",
        1000000,
    )
    assert (m.add_bias_linear, m.tie_word_embeddings, m.vocab_size) == (False, False, 128256)
    # Megatron builds 128256 rows (NullTokenizer: vocab_size as given; 128256 = 1002 x 128, no padding),
    # untied: Llama-3-8B's published 8,030,261,248 parameters
    cfg.train.train_iters = 10  # the shape only: 15 M iterations' sample index is not needed to count
    assert total_params(resolve(cfg).model) == 8_030_261_248


def test_llama3_script_schedule_and_layout_as_megatron_reads_it(tmp_path, capsys):
    cfg = _import(LLAMA3_8B, tmp_path, capsys)
    # --train-samples 1953125000 at --global-batch-size 128: Megatron's train_iters = samples // batch
    assert cfg.train.train_iters == 1953125000 // 128 and cfg.train.global_batch_size == 128
    assert cfg.optim.lr_decay_iters == 1949218748 // 128 and cfg.optim.lr_warmup_iters == 3906252 // 128
    assert cfg.parallel.zero_stage == 1  # --use-distributed-optimizer
    assert cfg.parallel.grad_reduce_dtype == "bf16"  # --grad-reduce-in-bf16
    # the mock-data branch of the script's if (its $3 / $4 default to MOCK): --split '99,1,0' with quotes,
    # which Megatron reads as the numbers in it
    assert cfg.data.split == "99,1,0"
    assert (cfg.logging.profile_start_step, cfg.logging.profile_end_step) == (4, 5)  # Megatron: [4, 6)


def test_gpt3_175b_script_has_175b_parameters(tmp_path, capsys):
    cfg = _import(GPT3_175B, tmp_path, capsys)
    cfg.model.vocab_size = 50257  # the GPT-2 BPE vocabulary the script names (gpt2-vocab.json)
    n = total_params(resolve(cfg, world_size=8 * 16).model)
    assert abs(n - 175e9) / 175e9 < 0.005, n


def _file_flags(path: Path) -> set[str]:
    """The Megatron arguments a fixture names, by a regex over its text (independent of the reader):
    every --flag, less the launcher's (torchrun's) and those inside comments."""
    text = "\n".join(line.split("#")[0] for line in path.read_text(encoding="utf-8").splitlines())
    launcher = {"nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port"}
    return {f for f in re.findall(r"--([a-z][\w-]*)", text) if f not in launcher}


@pytest.mark.parametrize(
    "src",
    [DS_GPT, DS_BERT],
    ids=str,
)
def test_a_string_variable_script_carries_every_argument(src, tmp_path):
    """Megatron-DeepSpeed keeps the arguments in strings (GPT_ARGS="--num-layers 24 ..."): each one is
    carried (to a value or a path comment), ignored with its reason or listed as not carried."""
    path = upstream_file(src, tmp_path)
    command = read_megatron_command(path.read_text(encoding="utf-8"), str(path))
    assert set(command.flags) == _file_flags(path)
    translated = translate_megatron_args(command.flags, str(path), command.script, _known)
    imported = import_configs(ImportSources(megatron_args_file=path))
    ignored = {w.key.lstrip("-").replace("_", "-") for w in imported.ignored}
    not_carried = {s.key.lstrip("-") for s in imported.skipped}
    carried = set()
    for key, value in translated.mapping.items():
        with grouped_config_warnings(emit=False):  # an ignored key maps to nothing (counted above)
            paths = {a.path for a in assignments_from_mapping({key: value}, "t")}
        where = set(imported.values) | {a.path for a in imported.paths}
        if paths and paths <= where:
            carried.add(key.replace("_", "-"))
    assert carried | ignored | not_carried == _file_flags(path)
    assert not imported.paths or all(a.value for a in imported.paths)


def test_a_heredoc_deepspeed_config_is_read(tmp_path, capsys):
    path = upstream_file(DS_LLAMA2, tmp_path)
    imported = import_configs(ImportSources(megatron_args_file=path))
    assert any("heredoc" in s for s in imported.sources)
    assert imported.values["train.global_batch_size"][0] == 32  # "train_batch_size": $GLOBAL_BATCH_SIZE
    assert imported.values["parallel.zero_stage"][0] == 0 and imported.values["train.precision"][0] == "bf16"


def test_paths_the_script_leaves_to_its_caller_are_listed_not_guessed(tmp_path):
    imported = import_configs(ImportSources(megatron_args_file=upstream_file(GPT3_175B, tmp_path)))
    skipped = {s.key: s.why for s in imported.skipped}
    assert "$5 (a script argument" in skipped["--data-path"] and "$1" in skipped["--save"]
    text = render_yaml(imported)
    assert "--vocab-file" in text and "needs $3" in text


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.sh"
    path.write_text("#!/bin/bash\n" + body, encoding="utf-8")
    return path


SHAPE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128"
)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            f"torchrun pretrain_gpt.py {SHAPE} --tensor-model-parallel-size $TP\n",
            r"--tensor-model-parallel-size needs \$TP \(never set",
        ),
        (
            f"L=$1\ntorchrun pretrain_gpt.py {SHAPE} --ffn-hidden-size $L\n",
            r"--ffn-hidden-size needs \$1 \(a script argument",
        ),
        (
            f"H=$(python -c 'print(64)')\npython pretrain_gpt.py {SHAPE.replace('64', '$H')}\n",
            r"--hidden-size needs \$\(python -c",
        ),
        (f"python pretrain_t5.py {SHAPE}\n", r"run\.sh:2: the entry point 'pretrain_t5\.py'"),
        (
            f"python pretrain_gpt.py {SHAPE} --num-experts 8 --moe-router-load-balancing-type seq_aux_loss\n",
            r"'model.moe_router_load_balancing' = 'seq_aux_loss' is not valid; choose one of: aux_loss",
        ),
        (
            f"python pretrain_gpt.py {SHAPE} --frobnicate 3\n",
            r"Megatron argument --frobnicate is not known here",
        ),
        (
            f"python pretrain_gpt.py {SHAPE} --window-size 64,64\n",
            r"--window-size '64,64': only a causal window \(LEFT,0\)",
        ),
        ("python pretrain_gpt.py --micro-batch-size 4\n", r"does not give --num-layers, --hidden-size"),
        (
            "if [ -f /data/big ]; then L=24; else L=12; fi\n"
            f"python pretrain_gpt.py {SHAPE} --num-layers $L\n",
            r"--num-layers needs \$L \(set inside the if on line 2",
        ),
        ("echo hello\n", r"no line runs a Megatron pretrain_\*\.py entry point"),
    ],
)
def test_what_only_running_gives_or_is_not_built_is_an_error_naming_it(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        import_configs(ImportSources(megatron_args_file=_script(tmp_path, body)))


def test_partial_rotary_a_causal_window_and_the_vocabulary_padding_as_megatron_reads_them(tmp_path):
    """--rotary-percent rotates that share of each head; --window-size is flash-attention's (left, 0), so
    LEFT + 1 tokens counting the query; the vocabulary is padded to a multiple of
    --make-vocab-size-divisible-by x the tensor-parallel size, given or at Megatron's 128."""
    rope = "--position-embedding-type rope --rotary-percent 0.5 --window-size 64,0"
    silent = import_configs(
        ImportSources(
            megatron_args_file=_script(
                tmp_path, f"python pretrain_gpt.py {SHAPE} {rope} --tensor-model-parallel-size 2\n"
            )
        )
    )
    values = {p: v for p, (v, _) in silent.values.items()}
    assert (values["model.rotary_percent"], values["model.sliding_window"]) == (0.5, 65)
    assert values["model.make_vocab_size_divisible_by"] == 256
    given = import_configs(
        ImportSources(
            megatron_args_file=_script(
                tmp_path,
                f"python pretrain_gpt.py {SHAPE} --make-vocab-size-divisible-by 64 "
                "--tensor-model-parallel-size 4\n",
            )
        )
    )
    assert given.values["model.make_vocab_size_divisible_by"][0] == 256


def test_megatron_defaults_where_the_script_is_silent(tmp_path):
    path = _script(tmp_path, f"python pretrain_gpt.py {SHAPE} --swiglu --fp16\n")
    values = {k: v for k, (v, _) in import_configs(ImportSources(megatron_args_file=path)).values.items()}
    assert values["model.ffn_hidden_size"] == int((4 * 64 * 2 / 3) / 64) * 64  # Megatron's swiglu rule
    assert values["logging.log_interval"] == 100 and values["train.eval_iters"] == 100
    assert values["train.initial_scale_power"] == 32  # --initial-loss-scale 2**32
    # --num-query-groups only counts with --group-query-attention, whose default is 1 group
    path = _script(tmp_path, f"python pretrain_gpt.py {SHAPE} --num-query-groups 2\n")
    assert "model.num_query_groups" not in import_configs(ImportSources(megatron_args_file=path)).values
    path = _script(tmp_path, f"python pretrain_gpt.py {SHAPE} --group-query-attention\n")
    assert import_configs(ImportSources(megatron_args_file=path)).values["model.num_query_groups"][0] == 1


# --------------------------------------------------------------------------- the shell reader


def _words(text: str) -> list[str]:
    """The words after the entry point of the script's launch line."""
    script = read_script(text, "t.sh")
    command = next(c for c in script.commands if c.entry() is not None)
    return command.words[(command.entry() or 0) + 1 :]


def test_arrays_expand_as_bash_expands_them():
    text = """A=(
    --x 1   # a comment --y 9
    "--z two words"
)
B=("a b" c)
A+=(--w)
python pretrain_gpt.py ${A[@]} "${B[@]}" "${B[*]}" ${#A[@]}
"""
    assert _words(text) == ["--x", "1", "--z", "two", "words", "--w", "a b", "c", "a b c", "4"]


def test_variables_defaults_arithmetic_and_quotes():
    text = """N=4
export G=${GPUS:-8}
W=$(( N * G / 2 ))
S='$N'
python pretrain_gpt.py --a $W --b "$S" --c ${N}x --d "${UNSET_X-d e}" --e \\
    --f '' --g "q \\"r\\""
"""
    assert _words(text) == [
        "--a",
        "16",
        "--b",
        "$N",
        "--c",
        "4x",
        "--d",
        "d e",
        "--e",
        "--f",
        "",
        "--g",
        'q "r"',
    ]


def test_cmd_variable_and_eval_run_the_command_they_hold():
    text = 'ARGS="--num-layers 2"\ncmd="torchrun pretrain_gpt.py $ARGS"\n$cmd --lr 1\neval "$cmd --lr 2"\n'
    runs = [c.words for c in read_script(text, "t.sh").commands]
    assert runs == [["torchrun", "pretrain_gpt.py", "--num-layers", "2", "--lr", "1"]] * 1 + [
        ["torchrun", "pretrain_gpt.py", "--num-layers", "2", "--lr", "2"]
    ]


def test_heredocs_expand_unless_the_delimiter_is_quoted():
    text = 'B=32\ncat <<EOT > a.json\n{"b": $B}\nEOT\ncat <<\'EOT\' > b.json\n{"b": $B}\nEOT\n'
    files = read_script(text, "t.sh").files
    assert files == {"a.json": '{"b": 32}\n', "b.json": '{"b": $B}\n'}


def test_conditions_it_can_decide_pick_their_branch():
    text = """MODE=${1:-big}
if [[ "$MODE" == "big" ]] && [ 2 -gt 1 ]; then
    L=24
elif [ "$MODE" = small ]; then
    L=2
else
    L=1
fi
python pretrain_gpt.py --num-layers $L
"""
    script = read_script(text, "t.sh")
    assert _words(text) == ["--num-layers", "24"]
    assert any("$1" in d for d in script.defaults)  # the script's default for its argument, recorded
