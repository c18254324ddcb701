"""Every config GPT-NeoX ships (its configs/, read from NeoX's snapshot at a pinned commit: tests/upstream.py)
imports as the
GPT NeoX builds from it, at the file's tp/pp and precision, or is refused naming the setting.

Parameter counts are checked against the numbers the source projects publish (Pythia, GPT-NeoX-20B,
Llama 2: their Hugging Face checkpoints' parameter counts) and, for every file, against a count written
here from NeoX's modules (megatron/model/transformer.py, word_embeddings.py), not from
config/model_shapes.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from scalable_transformer.cli import main
from scalable_transformer.config import neox_args
from scalable_transformer.config.foreign_configs import ImportSources, import_configs, render_yaml
from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import total_params
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from upstream import GPT_NEOX, upstream_tree


@pytest.fixture(scope="module")
def neox(tmp_path_factory) -> Path:
    """GPT-NeoX's configs/ as it ships at the pinned commit (skipped where no snapshot is at hand)."""
    return upstream_tree(*GPT_NEOX, "configs", tmp_path_factory.mktemp("neox"))


LLAMA_VOCAB = 32000  # Llama 1/2's tokenizer.model (meta-llama/Llama-2-7b-hf config.json vocab_size)
CODELLAMA_7B_VOCAB = 32016  # codellama/CodeLlama-7b-hf config.json: Llama 2's and 16 infilling tokens

# How NeoX's README runs each model config: `deepy.py train.py MODEL.yml SETUP.yml` (local_setup.yml
# names GPT-2's vocabulary; docker/pythia-paths.yml the 20B tokenizer Pythia used; llama/README.md
# pairs llama/*.yml with llama/train_config.yml). model file -> (files after it, --vocab-size)
IMPORTED: dict[str, tuple[tuple[str, ...], int | None]] = {
    **{f: (("local_setup.yml",), None) for f in (
        "125M.yml", "125M-json.yml", "1-3B.yml", "1-3B-transformer-engine.yml", "13B.yml", "175B.yml",
        "19M.yml", "2-7B.yml", "350M.yml", "49M.yml", "6-7B.yml", "760M.yml", "800M.yml", "bf16_125M.yml",
        "slurm_125M.yml", "autotuning_configs/tune_1-3B.json", "125M-dmoe.yml")},
    **{f"pythia/{f}": (("docker/pythia-paths.yml",), None) for f in (
        "70M.yml", "160M.yml", "410M.yml", "1B.yml", "1-4B.yml", "2-8B.yml", "6-9B.yml", "12B.yml")},
    "pythia/14M.yml": ((), None),
    "pythia/31M.yml": ((), None),
    "20B.yml": ((), None),
    "finetuning_configs/6-9B.yml": ((), 50277),  # Pythia-6.9B: the 20B tokenizer (no vocab_file given)
    **{f"llama/{f}": (("llama/train_config.yml",), LLAMA_VOCAB) for f in ("7B.yml", "13B.yml", "30B.yml",
                                                                          "65B.yml")},
    # llama2/ leaves use_bias_in_mlp at NeoX's default (true) with attention biases off: built as NeoX
    # builds it (model.add_mlp_bias), 835,584 parameters above Llama 2 7B (test_llama2_with_llamas_mlp...)
    **{f"llama2/{f}": (("llama/train_config.yml",), LLAMA_VOCAB) for f in ("7B.yml", "13B.yml", "70B.yml",
                                                                           "codellama_34B.yml")},
    "llama2/codellama_7B.yml": (("llama/train_config.yml",), CODELLAMA_7B_VOCAB),
}  # fmt: skip

# Files NeoX ships that the import refuses, with the setting the message names.
REFUSED: dict[str, str] = {
    **{f"mamba/{f}": "'attention_config' names 'mamba'" for f in (
        "mamba-130M.yml", "mamba-370M.yml", "mamba-790M.yml", "mamba-1.4B.yml", "mamba-2.8B.yml")},
    "rwkv/170M.yml": "'attention_config' names 'rwkv'",
    "gmlp_small.yml": "'attention_config' names 'gmlp'",
    "sparse.yml": "'attention_config' names 'local'",
    "bnb_125M.yml": "'use_bnb_optimizer' = True",
    # intermediate_size 14336 with mlp_multiple_of 1: NeoX's gated MLP is 9558 wide into a 4778 input
    "mistral/7B.yml": "its first projection is 9558 wide and its second reads 4778",
    # keys NeoXArgs does not have: NeoX refuses these files itself
    "llemma/7B.yml": "'decay_lr_to' is not a GPT-NeoX argument",
    "llemma/34B.yml": "'attention_type' is not a GPT-NeoX argument",
    "autotuning_configs/tune.json": "'autotuning_config' is not a GPT-NeoX argument",
    "autotuning_configs/small_tune.json": "'save_interval' is not a GPT-NeoX argument",
    "autotuning_configs/tune_6-7B.json": "'zero_optimization.stage' = [0, 1, 2, 3]",  # autotuning's list
}  # fmt: skip

# Files that hold no model (setup, paths, generation, profiling): merged with a model file, alone refused.
OVERLAYS = (
    "local_setup.yml", "local_setup_comet.yml", "local_setup_wandb.yml", "docker/pythia-paths.yml",
    "llama/train_config.yml", "cpu_mock_config.yml", "eleutherai_cluster.yml", "prof.yml", "slurm_local.yml",
    "slurm_local.json", "text_generation.yml",
)  # fmt: skip

# Published parameter counts: the Hugging Face checkpoints of these models (model.num_parameters()).
PUBLISHED = {
    "pythia/160M.yml": 162_322_944,  # EleutherAI/pythia-160m
    "pythia/12B.yml": 11_846_072_320,  # EleutherAI/pythia-12b
    "20B.yml": 20_554_567_680,  # EleutherAI/gpt-neox-20b
}


def _raw(files: list[Path]) -> dict:
    """The files merged plainly (PyYAML's FullLoader, as NeoX loads them), for the expectations."""
    merged: dict = {}
    for path in files:
        for key, value in yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.FullLoader).items():
            merged[key.replace("-", "_")] = value
    return merged


def _neox_params(raw: dict, vocab: int) -> int:
    """Parameters of the model NeoX builds from `raw` (one tp rank's modules times tp; replicated parts
    once), from NeoX's modules: VocabParallelEmbedding, the learned position table, per layer
    ParallelSelfAttention (query_key_value, dense) and ParallelMLP (linear1, linear2) with their
    biases, two norms, the final norm and the untied final_linear."""
    h, layers = raw["hidden_size"], raw["num_layers"]
    heads = raw["num_attention_heads"]
    kv = raw.get("num_kv_heads") or heads
    tp = max(1, raw.get("model_parallel_size", 1))
    multiple = raw.get("make_vocab_size_divisible_by", 128) * tp
    v = -(-vocab // multiple) * multiple
    attn_bias = raw.get("use_bias_in_attn_linear", True)
    mlp_bias = raw.get("use_bias_in_mlp", True)
    gated = raw.get("activation", "gelu") in ("swiglu", "geglu")
    width = raw.get("intermediate_size") or 4 * h
    width_in = width
    if gated:
        width, width_in = int(width * 2 / 3), int(width * 2 / 3) // 2
    m = raw.get("mlp_multiple_of", 1)
    width, width_in = 2 * m * -(-width // (2 * m)), m * -(-width_in // m)
    norm = h if raw.get("norm", "layernorm") == "rmsnorm" else 2 * h
    qkv_out = h + 2 * kv * (h // heads)
    attention = (h * qkv_out + attn_bias * qkv_out) + (h * h + attn_bias * h) + 2 * norm
    dense = (h * width + mlp_bias * width) + (width_in * h + mlp_bias * h)
    experts, interval = raw.get("moe_num_experts", 1), raw.get("moe_expert_interval", 1)
    # ParallelDroplessMoE: SinkhornRouter / TopKTokenChoiceRouter's Linear(h, E, bias=False) and
    # ParallelGroupedMLP's w1, w2 (E x ff rows of h each, ff = intermediate_size or 4 h rounded up to 256)
    ff = raw.get("intermediate_size") or 256 * -(-4 * h // 256)
    moe = h * experts + experts * 2 * ff * h
    mlps = [moe if experts > 1 and i % interval == 0 else dense for i in range(layers)]
    total = v * h + layers * attention + sum(mlps) + norm
    if raw.get("pos_emb", "learned") == "learned":
        total += raw["max_position_embeddings"] * h
    if raw.get("no_weight_tying", False):
        total += v * h
    return total


def _precision(raw: dict) -> str:
    """The precision NeoX trains the files in (calculate_derived), fp16.type 'bfloat16' read as bf16."""
    fp16, bf16 = raw.get("fp16") or {}, raw.get("bf16") or {}
    if raw.get("precision"):
        return {"bfloat16": "bf16"}.get(raw["precision"], raw["precision"])
    if fp16.get("enabled"):
        return "bf16" if fp16.get("type") == "bfloat16" else "fp16"
    return "bf16" if bf16.get("enabled") else "fp32"


def _import(files: list[Path], vocab: int | None):
    imported = import_configs(ImportSources(neox=tuple(files), neox_vocab_size=vocab))
    return imported, {path: value for path, (value, _) in imported.values.items()}


def test_every_fixture_is_accounted_for(neox):
    """A file NeoX adds upstream must land in one of the lists (imported, refused, setup overlay)."""
    shipped = {str(p.relative_to(neox)) for p in neox.rglob("*") if p.suffix in (".yml", ".yaml", ".json")}
    listed = set(IMPORTED) | set(REFUSED) | set(OVERLAYS)
    assert shipped == listed
    assert not set(IMPORTED) & set(REFUSED)


@pytest.mark.parametrize("model", sorted(IMPORTED))
def test_neox_config_imports_as_the_gpt_neox_builds(neox, model, tmp_path):
    extra, vocab = IMPORTED[model]
    files = [neox / model, *(neox / f for f in extra)]
    raw = _raw(files)
    imported, values = _import(files, vocab)
    assert values["model.type"] == "gpt"
    tp, pp = max(1, raw.get("model_parallel_size", 1)), max(1, raw.get("pipe_parallel_size", 0))
    assert (values["parallel.tp"], values["parallel.pp"]) == (tp, pp)
    assert values["train.precision"] == _precision(raw)
    out = tmp_path / "imported.yaml"
    out.write_text(render_yaml(imported), encoding="utf-8")
    cfg = resolve(load_config(str(out)), world_size=tp * pp)
    expected_vocab = vocab or neox_args.KNOWN_VOCABULARIES[Path(raw["vocab_file"]).name][0]
    assert total_params(cfg.model) == _neox_params(raw, expected_vocab)
    if model in PUBLISHED:
        assert total_params(cfg.model) == PUBLISHED[model]
    assert cfg.model.parallel_residual == bool(raw.get("gpt_j_residual", False))
    assert cfg.model.rotary_percent == (raw.get("rotary_pct", 1.0) if raw.get("pos_emb") == "rotary" else 1.0)
    assert cfg.model.num_experts == (
        raw.get("moe_num_experts", 1) if raw.get("moe_num_experts", 1) > 1 else 0
    )


@pytest.mark.parametrize("model", sorted(REFUSED))
def test_neox_config_is_refused_naming_the_setting(neox, model):
    with pytest.raises(ConfigError, match=re.escape(REFUSED[model])) as error:
        _import([neox / model], LLAMA_VOCAB)
    assert model in str(error.value)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_setup_file_alone_is_not_a_model(neox, overlay):
    with pytest.raises(ConfigError, match="NeoX requires the model's shape"):
        _import([neox / overlay], None)


@pytest.mark.parametrize(
    ("model", "published"),
    [
        ("llama2/7B.yml", 6_738_415_616),  # meta-llama/Llama-2-7b-hf
        ("llama2/13B.yml", 13_015_864_320),  # meta-llama/Llama-2-13b-hf, at the file's tp 2
        ("llama2/70B.yml", 68_976_648_192),  # meta-llama/Llama-2-70b-hf
    ],
)
def test_llama2_with_llamas_mlp_is_llama2(neox, model, published, tmp_path):
    """NeoX's llama2/ configs leave use_bias_in_mlp at its default (true; configs/llama/ set it false
    since NeoX #1276), which NeoX builds and the import keeps (model.add_mlp_bias); with the one line
    that gives Llama's bias-free MLP, they are Llama 2 exactly,
    its ffn 11008 / 13824 / 28672 from NeoX's gated rounding of intermediate_size."""
    fix = tmp_path / "llama_mlp.yml"
    fix.write_text("use_bias_in_mlp: false\n", encoding="utf-8")
    imported, _ = _import([neox / model, fix], LLAMA_VOCAB)
    out = tmp_path / "imported.yaml"
    out.write_text(render_yaml(imported), encoding="utf-8")
    cfg = resolve(load_config(str(out)), world_size=_raw([neox / model])["model_parallel_size"])
    assert total_params(cfg.model) == published
    assert cfg.model.ffn_hidden_size == {"7B": 11008, "13B": 13824, "70B": 28672}[model[7:-4]]
    assert cfg.model.num_query_groups == {"7B": 32, "13B": 40, "70B": 8}[model[7:-4]]  # 70B: GQA, 8 groups
    # as the file ships (NeoX's default MLP biases): the same model plus the MLP's two biases per layer
    imported, _ = _import([neox / model], LLAMA_VOCAB)
    out.write_text(render_yaml(imported), encoding="utf-8")
    shipped = resolve(load_config(str(out)), world_size=_raw([neox / model])["model_parallel_size"]).model
    assert (shipped.add_bias_linear, shipped.add_mlp_bias) == (False, True)
    assert total_params(shipped) - published == shipped.num_layers * (
        2 * shipped.ffn_hidden_size + shipped.hidden_size
    )


def test_the_20b_config_names_its_vocabulary_and_layout_in_the_written_file(neox, tmp_path, capsys):
    out = tmp_path / "neox20b.yaml"
    assert main(["config", "import", "--neox", str(neox / "20B.yml"), "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "vocab_size: 50277" in text and "make_vocab_size_divisible_by: 256" in text
    assert "fp16.fp16" in text  # NeoX's own key, listed as ignored with its reason
    cfg = resolve(load_config(str(out)), world_size=64)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (2, 4, 8)
    # the file's ZeRO-1 over a tp2 x pp4 model is built as ZeRO-2 (named in the file's notes)
    assert cfg.parallel.zero_stage == 2 and "ZeRO-1" in text
    assert cfg.model.padded_vocab_size == 50432  # EleutherAI/gpt-neox-20b config.json vocab_size


def test_a_key_in_two_files_is_refused_as_neox_refuses_it(neox, tmp_path):
    again = tmp_path / "again.yml"
    again.write_text("num_layers: 4\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="'num_layers' is also given in"):
        _import([neox / "20B.yml", again], None)


def test_an_unknown_tokenizer_asks_for_the_vocabulary(neox):
    with pytest.raises(ConfigError, match="--vocab-size N"):
        _import([neox / "pythia/160M.yml"], None)


def test_every_argument_of_neoxs_reference_is_classified(neox):
    names = re.findall(r"^- \*\*(\w+)\*\*", (neox / "neox_arguments.md").read_text(encoding="utf-8"), re.M)
    assert len(names) > 250  # the page was parsed
    assert sorted(set(names) - set(neox_args.NEOX_ARGS)) == []
    assert {rule.kind for rule in neox_args.NEOX_ARGS.values()} == {"carried", "ignored", "refused"}


@pytest.mark.parametrize("model", ["pythia/1B.yml", "20B.yml", "1-3B-transformer-engine.yml"])
def test_every_key_of_an_imported_file_is_accounted_for(neox, model):
    """No silent loss: each key the files give is carried, listed as ignored with its reason, or a
    refused argument at a value that asks for nothing (NeoX's default)."""
    extra, vocab = IMPORTED[model]
    files = [neox / model, *(neox / f for f in extra)]
    imported, _ = _import(files, vocab)
    listed = {w.key.split(".")[0] for w in imported.ignored}
    for key, value in _raw(files).items():
        rule = neox_args.NEOX_ARGS[key]
        if rule.kind == "ignored" and value is not None:
            assert key in listed, key
        if rule.kind == "refused":
            assert value in rule.accept, key
    if model == "pythia/1B.yml":  # fp16.type bfloat16: bf16, its loss-scale keys listed as scaling nothing
        assert {"fp16.type", "fp16.loss_scale_window"} <= {w.key for w in imported.ignored}


def test_the_dmoe_config_is_neoxs_dropless_sinkhorn_moe(neox, tmp_path):
    """configs/125M-dmoe.yml: 8 experts in every layer (moe_expert_interval 1), NeoX's defaults top-1 and
    the sinkhorn router (megatron/neox_arguments/neox_args.py NeoXArgsMoE): Sinkhorn-balanced choice,
    sigmoid scores for top-1, no load-balancing loss, ungated gelu experts of 4 h = 3072."""
    imported, values = _import([neox / "125M-dmoe.yml", neox / "local_setup.yml"], None)
    out = tmp_path / "dmoe.yaml"
    out.write_text(render_yaml(imported), encoding="utf-8")
    m = resolve(load_config(str(out)), world_size=1).model
    assert (m.num_experts, m.moe_router_topk, m.moe_layer_freq, m.moe_ffn_hidden_size) == (8, 1, 1, 3072)
    assert (m.moe_router_load_balancing, m.moe_router_score, m.moe_norm_topk_prob) == (
        "sinkhorn",
        "sigmoid",
        False,
    )
    assert m.moe_aux_loss_coeff == 0 and m.activation == "gelu"
    # every other layer, top-2 by the topk router: softmax scores, plain top-k
    extra = tmp_path / "moe.yml"
    extra.write_text("moe_expert_interval: 2\nmoe_top_k: 2\nmoe_router_type: topk\n", encoding="utf-8")
    _, values = _import([neox / "125M-dmoe.yml", extra], LLAMA_VOCAB)
    assert (values["model.moe_layer_freq"], values["model.moe_router_topk"]) == (2, 2)
    assert (values["model.moe_router_load_balancing"], values["model.moe_router_score"]) == (
        "none",
        "softmax",
    )


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        ("moe_jitter_eps: 0.01\n", "'moe_jitter_eps' = 0.01: multiplies the router's input by uniform noise"),
        ("activation: swiglu\n", "'activation' = 'swiglu' with moe_num_experts = 8"),
    ],
)
def test_dmoe_settings_not_built_are_refused_by_name(neox, tmp_path, lines, says):
    base = _raw([neox / "125M-dmoe.yml"])
    base.pop("activation", None)
    extra = tmp_path / "extra.yml"
    extra.write_text(lines, encoding="utf-8")
    model = tmp_path / "model.yml"
    model.write_text(yaml.safe_dump(base), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(says)):
        _import([model, extra], LLAMA_VOCAB)
