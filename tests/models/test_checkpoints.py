"""Loading weights: safetensors checkpoints (single, sharded, bfloat16), laziness, and the
errors for missing or mis-shaped weights, mismatched configs and broken index files.

Checkpoints are written by `save_pretrained` from small random models built locally.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from einpage.errors import EinpageError  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.models.checkpoint import INDEX_FILE, SafetensorsSource  # noqa: E402
from einpage.models.errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    ConfigMismatchError,
    UnsupportedConfigError,
    WeightError,
)

torch.set_num_threads(1)


def small_llama(tie: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def small_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model saved whole and in small shards: {name: (model, directory)}."""
    root = tmp_path_factory.mktemp("checkpoints")
    saved = {}
    for name, model in (("llama", small_llama()), ("gpt2", small_gpt2())):
        model.save_pretrained(root / name)
        model.save_pretrained(root / f"{name}-sharded", max_shard_size="20KB")
        saved[name] = (model, root / name)
        saved[f"{name}-sharded"] = (model, root / f"{name}-sharded")
    return saved


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


MODULES = {"llama": (llama, llama.LlamaConfig), "gpt2": (gpt2, gpt2.GPT2Config)}


@pytest.mark.parametrize("name", ["llama", "llama-sharded", "gpt2", "gpt2-sharded"])
def test_safetensors_checkpoints_load_the_same_weights_as_the_state_dict(checkpoints, name):
    module, config_cls = MODULES[name.split("-")[0]]
    model, path = checkpoints[name]
    if name.endswith("sharded"):
        assert (path / INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 2
    cfg = config_cls.from_hf(model.config)
    want = module.weights_from_state_dict(cfg, model.state_dict())
    assert same_weights(module.weights_from_safetensors(cfg, path), want)
    half = module.weights_from_safetensors(cfg, path, "float16")
    assert all(v.dtype == np.float16 and v.flags.c_contiguous for v in half.values())


def test_a_single_safetensors_file_loads(checkpoints):
    model, path = checkpoints["gpt2"]
    cfg = gpt2.GPT2Config.from_hf(model.config)
    loaded = gpt2.weights_from_safetensors(cfg, path / "model.safetensors")
    assert same_weights(loaded, gpt2.weights_from_state_dict(cfg, model.state_dict()))


def test_bfloat16_checkpoints_are_widened_exactly(tmp_path):
    model = small_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg = llama.LlamaConfig.from_hf(model.config)
    loaded = llama.weights_from_safetensors(cfg, tmp_path)
    want = llama.weights_from_state_dict(cfg, model.state_dict())  # bf16 tensors -> float32
    assert same_weights(loaded, want)
    assert loaded["embed"].dtype == np.float32


@pytest.mark.parametrize("name", ["llama-sharded", "gpt2"])
def test_loading_reads_only_the_tensors_the_program_uses(checkpoints, name, monkeypatch):
    module, config_cls = MODULES[name.split("-")[0]]
    model, path = checkpoints[name]
    cfg = config_cls.from_hf(model.config)
    reads = []
    original = SafetensorsSource.read

    def spy(self, key, part=None):
        reads.append((key, part))
        return original(self, key, part)

    monkeypatch.setattr(SafetensorsSource, "read", spy)
    module.weights_from_safetensors(cfg, path)
    specs = module.weight_specs(cfg)
    assert sorted(reads, key=str) == sorted(((s.key, s.part) for s in specs), key=str)


def test_gpt2_reads_the_fused_qkv_in_thirds(checkpoints):
    model, _ = checkpoints["gpt2"]
    cfg = gpt2.GPT2Config.from_hf(model.config)
    weights = gpt2.weights_from_state_dict(cfg, model.state_dict())
    c_attn = model.transformer.h[0].attn.c_attn
    fused = c_attn.weight.detach().numpy()  # [in, 3 * out]
    d, h, e = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    for third, part in enumerate("qkv"):
        want = fused[:, third * d : (third + 1) * d].T.reshape(h, e, d)
        assert np.array_equal(weights[f"layers.0.attn.w{part}"], want)
        bias = c_attn.bias.detach().numpy()[third * d : (third + 1) * d].reshape(h, e)
        assert np.array_equal(weights[f"layers.0.attn.b{part}"], bias)


# -- missing and mis-shaped weights ----------------------------------------------------


def test_a_missing_weight_is_named():
    model = small_llama()
    cfg = llama.LlamaConfig.from_hf(model.config)
    state = dict(model.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightError) as info:
        llama.weights_from_state_dict(cfg, state)
    err = info.value
    assert (err.name, err.key, err.got) == (
        "layers.1.mlp.w_up",
        "model.layers.1.mlp.up_proj.weight",
        None,
    )
    assert "layers.1.mlp.w_up" in str(err) and "model.layers.1.mlp.up_proj.weight" in str(err)
    assert isinstance(err, EinpageError)


def test_an_untied_config_needs_the_lm_head():
    model = small_llama()
    cfg = llama.LlamaConfig.from_hf(model.config)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(WeightError, match="'lm_head.weight'"):
        llama.weights_from_state_dict(cfg, state)


def test_a_mis_shaped_weight_names_both_shapes():
    model = small_llama()
    cfg = llama.LlamaConfig.from_hf(model.config)
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    with pytest.raises(WeightError) as info:
        llama.weights_from_state_dict(cfg, state)
    err = info.value
    assert (err.name, err.expected, err.got) == ("layers.0.attn.wk", (16, 32), (32, 32))
    assert "(32, 32)" in str(err) and "(16, 32)" in str(err)


def test_a_mis_shaped_gpt2_fused_qkv_names_both_shapes():
    model = small_gpt2()
    cfg = gpt2.GPT2Config.from_hf(model.config)
    state = dict(model.state_dict())
    state["transformer.h.1.attn.c_attn.weight"] = torch.zeros(32, 64)
    with pytest.raises(WeightError, match=r"\(32, 64\).*\(32, 96\)"):
        gpt2.weights_from_state_dict(cfg, state)


def test_non_float_weights_are_rejected():
    model = small_llama()
    cfg = llama.LlamaConfig.from_hf(model.config)
    state = dict(model.state_dict())
    state["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
    with pytest.raises(WeightError, match="int64"):
        llama.weights_from_state_dict(cfg, state)


# -- config that does not describe the checkpoint ---------------------------------------


@pytest.mark.parametrize("layers, words", [(1, "num_layers=1"), (3, "num_layers=3")])
def test_wrong_layer_count(layers, words):
    model = small_llama()
    cfg = llama.LlamaConfig(32, layers, 4, 2, 48, vocab_size=64)
    with pytest.raises(ConfigMismatchError) as info:
        llama.weights_from_state_dict(cfg, model.state_dict())
    assert words in str(info.value) and "2 layers" in str(info.value)
    gpt = small_gpt2()
    gcfg = gpt2.GPT2Config(32, layers, 4, vocab_size=64, max_positions=16)
    with pytest.raises(ConfigMismatchError, match=words):
        gpt2.weights_from_state_dict(gcfg, gpt.state_dict())


def test_wrong_hidden_size_or_vocabulary():
    model = small_llama()
    cfg = llama.LlamaConfig(64, 2, 4, 2, 48, vocab_size=64)
    with pytest.raises(ConfigMismatchError, match=r"hidden_size=64.*\(64, 32\)"):
        llama.weights_from_state_dict(cfg, model.state_dict())
    gcfg = gpt2.GPT2Config(32, 2, 4, vocab_size=64, max_positions=8)
    with pytest.raises(ConfigMismatchError, match="max_positions"):
        gpt2.weights_from_state_dict(gcfg, small_gpt2().state_dict())


def test_tied_config_with_an_untied_checkpoint():
    model = small_llama(tie=False)
    cfg = llama.LlamaConfig(32, 2, 4, 2, 48, vocab_size=64, tie_embeddings=True)
    with pytest.raises(ConfigMismatchError, match="tie"):
        llama.weights_from_state_dict(cfg, model.state_dict())
    gpt = small_gpt2()
    state = dict(gpt.state_dict())
    state["lm_head.weight"] = torch.zeros(64, 32)
    with pytest.raises(UnsupportedConfigError, match="tied"):
        gpt2.weights_from_state_dict(gpt2.GPT2Config.from_hf(gpt.config), state)


def test_config_json_beside_the_weights_must_match(checkpoints):
    """Same shapes, different heads: only config.json can tell."""
    _, path = checkpoints["llama"]
    cfg = llama.LlamaConfig(32, 2, 8, 4, 48, vocab_size=64)  # 8 heads of 4, not 4 of 8
    with pytest.raises(ConfigMismatchError) as info:
        llama.weights_from_safetensors(cfg, path)
    assert "num_heads=8 (checkpoint: 4)" in str(info.value)
    _, path = checkpoints["gpt2"]
    with pytest.raises(ConfigMismatchError, match="layer_norm_eps"):
        gpt2.weights_from_safetensors(
            gpt2.GPT2Config(32, 2, 4, vocab_size=64, max_positions=16, layer_norm_eps=1e-6), path
        )


@pytest.mark.parametrize("name", ["llama", "gpt2-sharded"])
def test_configs_come_from_the_checkpoint_directory(checkpoints, name):
    module, config_cls = MODULES[name.split("-")[0]]
    model, path = checkpoints[name]
    cfg = config_cls.from_checkpoint(path)
    assert cfg == config_cls.from_hf(model.config) and cfg.name == path.name
    weights = module.weights_from_safetensors(cfg, path)
    assert same_weights(weights, module.weights_from_state_dict(cfg, model.state_dict()))
    inside = next(path.glob("*.safetensors"))
    assert config_cls.from_checkpoint(inside, name="mine").name == "mine"


def test_a_checkpoint_without_config_json_asks_for_a_config(checkpoints, tmp_path):
    _, path = checkpoints["llama"]
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no config.json in .*LlamaConfig.from_hf"):
        llama.LlamaConfig.from_checkpoint(tmp_path)
    cfg = llama.LlamaConfig.from_hf(checkpoints["llama"][0].config)
    assert llama.weights_from_safetensors(cfg, tmp_path).keys() == set(llama.weight_shapes(cfg))


def test_a_llama_3_checkpoint_reads_its_rope_scaling(checkpoints, tmp_path):
    _, path = checkpoints["llama"]
    config = json.loads((path / "config.json").read_text())
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    older = {k: v for k, v in config.items() if k != "rope_parameters"}
    for edited in (  # as transformers 4 writes it, and with both keys
        {**older, "rope_theta": 5e5, "rope_scaling": llama3},
        {**config, "rope_scaling": llama3},
    ):
        (tmp_path / "config.json").write_text(json.dumps(edited))
        cfg = llama.LlamaConfig.from_checkpoint(tmp_path)
        assert cfg.rope_scaling == llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    incomplete = {k: v for k, v in llama3.items() if k != "high_freq_factor"}
    (tmp_path / "config.json").write_text(json.dumps({**older, "rope_scaling": incomplete}))
    with pytest.raises(ConfigError, match="llama3.*high_freq_factor"):
        llama.LlamaConfig.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**older, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    with pytest.raises(UnsupportedConfigError, match="RoPE scaling.*yarn"):
        llama.LlamaConfig.from_checkpoint(tmp_path)


def test_a_checkpoint_of_another_model_is_named():
    gpt = small_gpt2()
    cfg = llama.LlamaConfig(32, 2, 4, 2, 48, vocab_size=64)
    with pytest.raises(WeightError, match="no embedding table"):
        llama.weights_from_state_dict(cfg, gpt.state_dict())


# -- broken checkpoints on disk ----------------------------------------------------------


@pytest.fixture
def sharded_copy(checkpoints, tmp_path):
    """A writable copy of the sharded LLaMA checkpoint and its config."""
    model, path = checkpoints["llama-sharded"]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    return copy, llama.LlamaConfig.from_hf(model.config)


def first_shard(directory) -> str:
    return sorted(p.name for p in directory.glob("*.safetensors"))[0]


@pytest.mark.parametrize(
    "index, words",
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"weight_map": 3}', "'weight_map' must be an object"),
        ('{"weight_map": {}}', "'weight_map' is empty"),
        ('{"metadata": 1, "weight_map": {"a": "b.safetensors"}}', "'metadata' must be an object"),
        ('{"weight_map": {"model.norm.weight": 5}}', "must be a file name"),
        ('{"weight_map": {"model.norm.weight": "../x.safetensors"}}', "paths are not allowed"),
        ('{"weight_map": {"model.norm.weight": "/etc/passwd"}}', "paths are not allowed"),
        ('{"weight_map": {"model.norm.weight": "config.json"}}', "not the name of a .safetensors"),
        ('{"weight_map": {"model.norm.weight": "nope.safetensors"}}', "does not exist"),
    ],
)
def test_a_bad_index_json_is_rejected(sharded_copy, index, words):
    path, cfg = sharded_copy
    (path / INDEX_FILE).write_text(index)
    with pytest.raises(CheckpointError) as info:
        llama.weights_from_safetensors(cfg, path)
    assert words in str(info.value) and INDEX_FILE in str(info.value)


def test_an_index_that_points_at_the_wrong_shard(sharded_copy):
    path, cfg = sharded_copy
    index = json.loads((path / INDEX_FILE).read_text())
    wrong = next(
        f
        for f in sorted(set(index["weight_map"].values()))
        if f != index["weight_map"]["model.norm.weight"]
    )
    index["weight_map"]["model.norm.weight"] = wrong
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps 'model.norm.weight' to '{wrong}'"):
        llama.weights_from_safetensors(cfg, path)


def test_an_index_missing_a_weight(sharded_copy):
    path, cfg = sharded_copy
    index = json.loads((path / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.0.self_attn.v_proj.weight"]
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(WeightError, match="layers.0.attn.wv"):
        llama.weights_from_safetensors(cfg, path)


def test_a_corrupt_shard(sharded_copy):
    path, cfg = sharded_copy
    (path / first_shard(path)).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(CheckpointError, match="cannot open safetensors file"):
        llama.weights_from_safetensors(cfg, path)


def test_directories_without_weights(tmp_path):
    cfg = llama.PRESETS["tiny"]
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        llama.weights_from_safetensors(cfg, tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        llama.weights_from_safetensors(cfg, tmp_path / "missing")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        llama.weights_from_safetensors(cfg, tmp_path)


def test_a_state_dict_must_be_a_mapping():
    with pytest.raises(CheckpointError, match="mapping"):
        llama.weights_from_state_dict(llama.PRESETS["tiny"], [1, 2, 3])
