"""`stx config import` (config/foreign_configs.py) and how config warnings reach users: each source format,
what is carried over and what is listed in comments, conflicts and unsupported features as errors, and
a failed import leaving no file behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from scalable_transformer.cli import main
from scalable_transformer.config.foreign_configs import (
    ImportSources,
    import_configs,
    megatron_args_from_command,
    megatron_args_from_log,
    render_yaml,
)
from scalable_transformer.config.load import load_config
from scalable_transformer.errors import ConfigError, ConfigWarning

LOG = """\
using world size: 16, data-parallel-size: 8, tensor-model-parallel size: 2
/opt/conda/bin/python3 /x/megatron/pretrain_bert.py --num-layers 24 ...
------------------------ arguments ------------------------
  adam_beta2 ...................................... 0.999
  bias_gelu_fusion ................................ True
  checkpoint_activations .......................... True
  data_parallel_size .............................. 8
  data_path ....................................... ['/gpfs/data/text_sentence']
  fp16 ............................................ True
  bf16 ............................................ False
  global_batch_size ............................... 64
  hidden_size ..................................... 1024
  ict_head_size ................................... None
  img_dim ......................................... 224
  initial_loss_scale .............................. 4294967296
  micro_batch_size ................................ 4
  num_attention_heads ............................. 16
  num_layers ...................................... 24
  optimizer ....................................... adam
  query_in_block_prob ............................. 0.1
  reset_position_ids .............................. False
  seq_length ...................................... 512
  tensor_model_parallel_size ...................... 2
  world_size ...................................... 16
-------------------- end of arguments ---------------------
 iteration       10/ 2000000 | elapsed time per iteration (ms): 612.3
"""


def test_log_argument_dump(tmp_path):
    args, family = megatron_args_from_log(LOG, "run.log")
    assert family == "bert"
    assert args["num_layers"] == 24 and args["fp16"] is True and args["adam_beta2"] == 0.999
    assert args["data_path"] == "/gpfs/data/text_sentence" and "ict_head_size" not in args  # None: unset
    (tmp_path / "run.log").write_text(LOG, encoding="utf-8")
    imported = import_configs(ImportSources(from_log=tmp_path / "run.log"))
    values = {path: v for path, (v, _) in imported.values.items()}
    assert values["parallel.tp"] == 2 and values["train.precision"] == "fp16"
    assert values["train.initial_scale_power"] == 32 and values["optim.optimizer"] == "adam"
    assert "parallel.dp" not in values  # derived from the world size, not pinned
    assert imported.world_size == 16
    skipped = {s.key: s.why for s in imported.skipped}
    assert "img_dim" in skipped and "data_parallel_size" in skipped
    assert "reset_position_ids" not in skipped  # false asks for nothing
    # a dump prints every argument, defaults of features not used here included: listed, not an error
    assert "query_in_block_prob" in {w.key for w in imported.ignored}
    text = render_yaml(imported, name="c.yaml")
    assert "#   data.path: /gpfs/data/text_sentence" in text and "bias_gelu_fusion" in text
    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.model.num_layers == 24 and cfg.train.global_batch_size == 64


def test_log_without_a_dump_is_an_error():
    with pytest.raises(ConfigError, match=r"run\.log: no Megatron argument dump"):
        megatron_args_from_log("iteration 10 | loss 3.2\n", "run.log")


def test_script_with_variables_and_continuations():
    script = """#!/bin/bash
GPUS=8
MODEL_ARGS="--num-layers 12 --hidden-size 768"
# a comment --num-layers 99
torchrun --nproc_per_node $GPUS pretrain_gpt.py \\
    $MODEL_ARGS \\
    --data-path 0.3 /d/a 0.7 /d/b \\
    --bf16 --lr=3e-4
"""
    args, family = megatron_args_from_command(script, "run.sh")
    assert family == "gpt"
    assert args == {
        "num-layers": 12,
        "hidden-size": 768,
        "data-path": "0.3 /d/a 0.7 /d/b",
        "bf16": True,
        "lr": 3e-4,
    }


def test_sources_that_disagree_are_an_error(tmp_path):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 8}', encoding="utf-8")
    with pytest.raises(
        ConfigError, match=r"train\.micro_batch_size is 8 in .*ds\.json but 4 in the Megatron"
    ):
        import_configs(ImportSources(deepspeed=tmp_path / "ds.json", megatron_args="--micro-batch-size 4"))


def test_unsupported_feature_asked_for_is_an_error():
    with pytest.raises(ConfigError, match=r"'num-unique-layers' = 2: layers sharing weights"):
        import_configs(ImportSources(megatron_args="pretrain_gpt.py --num-layers 4 --num-unique-layers 2"))


def test_document_masking_switches_are_carried():
    line = "pretrain_gpt.py --num-layers 2 --reset-position-ids --reset-attention-mask --eod-mask-loss"
    values = {p: v for p, (v, _) in import_configs(ImportSources(megatron_args=line)).values.items()}
    assert values["model.reset_position_ids"] and values["model.reset_attention_mask"]
    assert values["data.eod_mask_loss"]


def _import(tmp_path, capsys, *argv):
    code = main(["config", "import", *argv])
    return code, capsys.readouterr()


def test_import_errors_write_nothing(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(
        '{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": -4}', encoding="utf-8"
    )
    out = tmp_path / "c.yaml"
    code, cap = _import(tmp_path, capsys, "--deepspeed", str(ds), "-o", str(out))
    assert code == 2 and len(cap.err.strip().splitlines()) == 1, cap.err
    assert re.search(r"ds\.json: 'train\.micro_batch_size' must be > 0, got -4", cap.err), cap.err
    assert os.listdir(tmp_path) == ["ds.json"]  # no config, no hidden temporary file
    ds.write_text('{"train_batch_size": 8,\n "train_batch_size": 16}', encoding="utf-8")
    code, cap = _import(tmp_path, capsys, "--deepspeed", str(ds), "-o", str(out))
    assert code == 2 and "duplicate key 'train_batch_size'" in cap.err
    ds.write_text('{"train_batch_size": 8,}', encoding="utf-8")
    code, cap = _import(tmp_path, capsys, "--deepspeed", str(ds), "-o", str(out))
    assert code == 2 and re.search(r"ds\.json:1: not valid JSON", cap.err), cap.err
    code, cap = _import(tmp_path, capsys, "-o", str(out))
    assert code == 2 and "nothing to import" in cap.err
    assert os.listdir(tmp_path) == ["ds.json"]


def test_import_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}', encoding="utf-8")
    out = tmp_path / "c.yaml"
    out.write_text("mine\n", encoding="utf-8")
    code, cap = _import(tmp_path, capsys, "--deepspeed", str(ds), "-o", str(out))
    assert code == 2 and "exists; give --force" in cap.err and out.read_text() == "mine\n"
    code, cap = _import(
        tmp_path, capsys, "--deepspeed", str(ds), "--base", "tiny-gpt", "-o", str(out), "--force"
    )
    assert code == 0, cap.err
    data = yaml.safe_load(out.read_text(encoding="utf-8"))
    # DeepSpeed partitions gradients every micro-batch at stage 2: the import says so
    parallel = {"zero_stage": 2, "reduce_each_micro_batch": True}
    assert data == {"base": "tiny-gpt", "parallel": parallel, "train": {"precision": "bf16"}}
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "ds.json"]


# --------------------------------------------------------------------------- warnings as users see them

DS_KNOBS = """{"zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": true,
  "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}, "zero_allow_untested_optimizer": true,
  "fp16": {"enabled": true, "auto_cast": false}}"""


def test_config_warnings_are_one_line_each_grouped(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(DS_KNOBS, encoding="utf-8")
    assert main(["config", "validate", str(path), "--world-size", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("stx: warning: ") for line in err), err
    assert not any("warnings.warn" in line or "load.py" in line for line in err)  # no source lines
    # four zero_optimization knobs for one reason: one line naming them all
    grouped = [line for line in err if "4 keys ignored" in line]
    assert len(grouped) == 1 and "zero_optimization.allgather_bucket_size" in grouped[0]
    assert any("'zero_allow_untested_optimizer' is a DeepSpeed safety switch" in line for line in err)
    assert any("'fp16.auto_cast'" in line for line in err)
    assert len(err) == 3, err


def test_a_false_switch_asks_for_nothing(tmp_path, capsys):
    path = tmp_path / "neox.yml"
    path.write_text("bias-gelu-fusion: false\nreset-position-ids: false\nnum-layers: 2\n", encoding="utf-8")
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_torch_deprecation_warnings_stay_hidden(capsys, monkeypatch):
    """`stx` used to set simplefilter("default"), which printed torch.jit's DeprecationWarnings on every
    checkpoint save; users can do nothing about those. Ours print as one line; others as Python shows."""
    import warnings

    from scalable_transformer.errors import StxWarning

    shown_by_python = []
    monkeypatch.setattr(
        "scalable_transformer.cli._python_show_warning", lambda *a, **k: shown_by_python.append(a)
    )

    def command(args):
        warnings.warn_explicit("torch.jit is deprecated", DeprecationWarning, "torch/jit/__init__.py", 1)
        warnings.warn_explicit("a torch user warning", UserWarning, "/x/torch/nn/modules.py", 3)
        warnings.warn(StxWarning("one of ours"), stacklevel=1)
        return 0

    monkeypatch.setattr("scalable_transformer.cli.env.run", command)
    assert main(["env"]) == 0
    assert [str(a[0]) for a in shown_by_python] == ["a torch user warning"]
    assert capsys.readouterr().err == "stx: warning: one of ours\n"


# --------------------------------------------------------------------------- the GPT-NeoX reference

REFERENCES = [
    Path(__file__).parents[1] / "fixtures" / "neox" / "neox-config-parameters.md",  # a copy in the repo
    Path("/work/shared/reference/neox-config-parameters.md"),  # the users' copy, where it exists
]


def _reference_names(path: Path) -> list[tuple[str, str]]:
    names = []
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1] in ("DSL", "DSC", "Meg", "NeoX"):
            names.append((cells[1], cells[2]))
    return names


@pytest.mark.parametrize("reference", [p for p in REFERENCES if p.is_file()], ids=lambda p: p.parent.name)
def test_every_neox_parameter_is_classified(reference):
    from scalable_transformer.config.foreign_configs import classify_foreign_key
    from scalable_transformer.config.neox_args import NEOX_PARAMETERS

    names = _reference_names(reference)
    assert len(names) > 100  # the table was parsed, not skipped
    listed = {(origin, name) for origin, group in NEOX_PARAMETERS.items() for name in group}
    assert set(names) - listed == set(), "parameters missing from NEOX_PARAMETERS"
    unclassified = [name for _, name in names if classify_foreign_key(name) is None]
    assert unclassified == []


def test_classification_is_what_the_loader_does(tmp_path, capsys):
    """Each status in the table is the loader's behaviour: mapped sets the key, ignored warns, rejected
    fails with the message."""
    from scalable_transformer.config.foreign_configs import classify_foreign_key

    assert classify_foreign_key("model-parallel-size") == ("mapped", "`parallel.tp`")
    path = tmp_path / "neox.yml"
    path.write_text("model-parallel-size: 2\nbias-gelu-fusion: true\n", encoding="utf-8")
    with pytest.warns(ConfigWarning, match="bias-gelu-fusion"):
        assert load_config(str(path)).parallel.tp == 2
    status, reason = classify_foreign_key("bias-gelu-fusion")
    assert status == "ignored"
    assert main(["config", "validate", str(path), "--world-size", "2"]) == 0
    assert f"'bias-gelu-fusion' {reason}; ignored" in capsys.readouterr().err
    status, message = classify_foreign_key("rpe-num-buckets")
    assert status == "rejected"
    path.write_text("rpe-num-buckets: 32\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(path))


def test_import_reads_deepspeeds_activation_checkpointing_block(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(
        '{"zero_optimization": {"stage": 3}, "activation_checkpointing": {"partition_activations": true, '
        '"cpu_checkpointing": true, "contiguous_memory_optimization": false, "profile": false}}',
        encoding="utf-8",
    )
    out = tmp_path / "c.yaml"
    megatron = "--checkpoint-activations --tensor-model-parallel-size 2"
    code, cap = _import(tmp_path, capsys, "--deepspeed", str(ds), "--megatron-args", megatron, "-o", str(out))
    assert code == 0, cap.err
    p = load_config(str(out)).parallel
    assert (p.activation_checkpointing, p.distribute_saved_activations, p.cpu_checkpointing) == (
        "full",
        True,
        True,
    )
    assert p.zero_stage == 3 and p.reduce_each_micro_batch


def test_megatron_llama_command_line():
    """Megatron's Llama switches: GQA, SwiGLU, no linear biases, RMSNorm, RoPE with Llama 3.1 scaling."""
    imported = import_configs(
        ImportSources(
            megatron_args="pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
            "--group-query-attention --num-query-groups 2 --swiglu --disable-bias-linear "
            "--normalization RMSNorm --position-embedding-type rope --use-rope-scaling --rotary-base 500000 "
            "--untie-embeddings-and-output-weights"
        )
    )
    values = {path: v for path, (v, _) in imported.values.items()}
    assert values["model.num_query_groups"] == 2
    assert values["model.activation"] == "swiglu" and values["model.add_bias_linear"] is False
    assert values["model.norm"] == "rmsnorm" and values["model.position_embedding_type"] == "rotary"
    assert values["model.rope_scaling"] is True and values["model.rotary_base"] == 500000
    assert values["model.tie_word_embeddings"] is False


def test_megatron_moe_command_line():
    """Megatron-Core's MoE arguments (its Mixtral recipe's): experts, routing, losses and ep carried;
    kernel and dispatcher switches listed as the same math."""
    imported = import_configs(
        ImportSources(
            megatron_args="pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --swiglu "
            "--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
            "--moe-router-pre-softmax --expert-model-parallel-size 8 --moe-grouped-gemm "
            "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
            "--position-embedding-type rope --no-position-embedding"
        )
    )
    values = {path: v for path, (v, _) in imported.values.items()}
    assert values["model.num_experts"] == 8 and values["model.moe_router_topk"] == 2
    assert values["model.moe_aux_loss_coeff"] == 0.01 and values["model.moe_z_loss_coeff"] == 0.001
    assert values["model.moe_norm_topk_prob"] is False  # softmax before top-k: scores kept as they are
    assert values["parallel.ep"] == 8
    ignored = " ".join(str(i) for i in imported.ignored)
    assert "--moe-grouped-gemm" in ignored and "--moe-token-dispatcher-type" in ignored
    assert "--no-position-embedding" in ignored  # nothing to turn off under rotary positions


@pytest.mark.parametrize(("topk", "score"), [(1, "sigmoid"), (2, "softmax")])
def test_megatron_sinkhorn_router_scores_as_megatron_does(topk, score):
    """Megatron's sinkhorn router weights by sigmoid scores at top-1 and softmax scores above, never
    renormalised, whatever --moe-router-pre-softmax says."""
    imported = import_configs(
        ImportSources(
            megatron_args="pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
            f"--num-experts 8 --moe-router-topk {topk} --moe-router-load-balancing-type sinkhorn"
        )
    )
    values = {path: v for path, (v, _) in imported.values.items()}
    assert values["model.moe_router_load_balancing"] == "sinkhorn"
    assert (values["model.moe_router_score"], values["model.moe_norm_topk_prob"]) == (score, False)


def test_import_reads_a_hugging_face_llama_config(tmp_path, capsys):
    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, '
        '"num_hidden_layers": 2, "num_key_value_heads": 2, "max_position_embeddings": 512, '
        '"rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 1024, '
        '"hidden_act": "silu", "attention_bias": false, "mlp_bias": false}',
        encoding="utf-8",
    )
    out = tmp_path / "c.yaml"
    code, cap = _import(tmp_path, capsys, "--hf", str(hf / "config.json"), "-o", str(out))
    assert code == 0, cap.err
    m = load_config(str(out)).model
    assert (m.type, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (
        "gpt",
        2,
        256,
        8,
        2,
    )
    assert (m.activation, m.add_bias_linear, m.norm, m.tie_word_embeddings) == (
        "swiglu",
        False,
        "rmsnorm",
        False,
    )
    assert m.ffn_hidden_size == 688 and m.position_embedding_type == "rotary"
