"""Clear errors for bad configs/checkpoints, the NNX face, and the jitted functional path."""
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sbd_jax
from sbd_jax.config import ConfigError, from_dict, load_config
from sbd_jax.io import CheckpointError
from sbd_jax.models import causal_meta
from sbd_jax.models.nnx_model import SBDTransformer

CFG = sbd_jax.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mask_token_id=63)


@pytest.fixture
def saved(tmp_path):
    params = sbd_jax.init_params(CFG, jax.random.key(0))
    return sbd_jax.save_pretrained(CFG, params, tmp_path / "m")


def test_unknown_model_config_key():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['hiden_size'\]"):
        from_dict(sbd_jax.ModelConfig, {"hiden_size": 3})


def test_unknown_key_in_yaml_and_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("vocab_size: 10\nhidden_size: 8\nnum_attention_heads: 2\nnum_key_value_heads: 2\n")
    assert load_config(sbd_jax.ModelConfig, p, ["num_hidden_layers=3"]).num_hidden_layers == 3
    with pytest.raises(ConfigError, match="num_layerz"):
        load_config(sbd_jax.ModelConfig, p, ["num_layerz=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(sbd_jax.ModelConfig, tmp_path / "nope.yaml")


def test_unknown_hf_config_key(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["sliding_attention_magic"] = 7
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sliding_attention_magic"):
        sbd_jax.from_pretrained(saved)
    assert sbd_jax.from_pretrained(saved, allow_unknown_keys=True)[0].vocab_size == 64


def test_unsupported_model_type(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'mistral'.*not supported"):
        sbd_jax.from_pretrained(saved)


def test_unsupported_rope_type(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="yarn"):
        sbd_jax.from_pretrained(saved)


def test_missing_dir_and_files(saved, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        sbd_jax.from_pretrained(tmp_path / "meta-llama/Llama-3.1-8B")
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        sbd_jax.from_pretrained(saved)


def test_missing_and_truncated_shard(tmp_path):
    params = sbd_jax.init_params(CFG, jax.random.key(0))
    d = sbd_jax.save_pretrained(CFG, params, tmp_path / "m", max_shard_bytes=10_000)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 2
    backup = tmp_path / "backup"
    shutil.copy(shards[1], backup)
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        sbd_jax.from_pretrained(d)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1].name}.*missing"):
        sbd_jax.from_pretrained(d)
    shutil.copy(backup, shards[1])
    assert sbd_jax.from_pretrained(d)[0] == CFG


def test_wrong_weight_shape_and_vocab(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["vocab_size"] = 65
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model.embed_tokens.weight' has shape \(64, 32\), expected \(65, 32\)"):
        sbd_jax.from_pretrained(saved)


def test_bad_model_config_values():
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        sbd_jax.ModelConfig(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ConfigError, match="mask_token_id"):
        sbd_jax.ModelConfig(vocab_size=10, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                            mask_token_id=10)
    with pytest.raises(ConfigError, match=r"scan_unroll must be in \[1, num_hidden_layers=4\], got 5"):
        sbd_jax.ModelConfig(num_hidden_layers=4, scan_unroll=5)
    with pytest.raises(ConfigError, match=r"remat must be one of \('none', 'full', 'save_dots'\), got 'dots'"):
        sbd_jax.ModelConfig(remat="dots")
    with pytest.raises(ConfigError, match=r"attention_impl must be one of .*got 'flash'"):
        sbd_jax.ModelConfig(attention_impl="flash")
    with pytest.raises(ValueError, match="tokens must be"):
        sbd_jax.forward(sbd_jax.init_params(CFG, jax.random.key(0)), CFG, jnp.ones((3,), jnp.int32), None)


def _hf_config_edit(**changes):
    from sbd_jax.models.hf_config import config_to_hf
    d = config_to_hf(CFG)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


# config.json (an untrusted download) -> the error naming the file, the key and the value
@pytest.mark.parametrize("changes, match", [
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be a finite number > 0, got 0\.0"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be a finite number > 0, got -1e-06"),
    ({"rope_theta": float("nan")}, r"rope_theta must be a finite number > 0, got nan"),
    ({"rope_theta": "1e4"}, r"rope_theta is '1e4' \(str\), expected a number"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings must be an integer >= 1, got 0"),
    ({"head_dim": -8}, r"head_dim must be an integer >= 1, got -8"),
    ({"rope_scaling": {**LLAMA3, "factor": float("inf")}}, r"rope_scaling\.factor must be a finite number > 0"),
    ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "factor"}}, r"rope_scaling\.factor is missing"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, r"high_freq_factor \(1\.0\) must be greater than"),
    ({"rope_scaling": "llama3"}, r"rope_scaling must be a mapping, got 'llama3'"),
], ids=["eps_zero", "eps_negative", "theta_nan", "theta_string", "max_positions_zero", "head_dim_negative",
        "rope_factor_inf", "rope_factor_missing", "rope_high_equals_low", "rope_scaling_string"])
def test_bad_config_json_numbers_name_file_and_key(tmp_path, changes, match):
    from sbd_jax.io.hf import load_hf_config
    (tmp_path / "config.json").write_text(json.dumps(_hf_config_edit(**changes)))
    with pytest.raises((ConfigError, CheckpointError), match="config.json.*" + match):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b"\xff\xfe{}", "not UTF-8"),
    ("[1, 2]", "must hold a JSON object, not list"),
], ids=["deep_nesting", "bad_utf8", "not_an_object"])
def test_unreadable_config_json_is_named(tmp_path, text, match):
    from sbd_jax.io.hf import load_hf_config
    f = tmp_path / "config.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match="config.json.*" + match):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/passwd", "sub/../../x.safetensors", 7],
                         ids=["parent", "absolute", "dotdot_inside", "not_a_string"])
def test_shard_outside_the_model_directory_is_refused(tmp_path, shard):
    d = sbd_jax.save_pretrained(CFG, sbd_jax.init_params(CFG, jax.random.key(0)), tmp_path / "m",
                                max_shard_bytes=10_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"weight_map\['model.norm.weight'\] = .* is not a file name inside"):
        sbd_jax.from_pretrained(d)


def test_nnx_module_split_merge_jit_matches_functional():
    model = SBDTransformer(CFG, rngs=nnx.Rngs(0))
    toks = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    meta = causal_meta(jnp.array([5, 3]), 5)
    eager, _ = model(toks, meta)
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, meta)[0])(state, toks)
    functional, _ = jax.jit(sbd_jax.forward, static_argnums=1)(model.params(), CFG, toks, meta)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6)
    np.testing.assert_allclose(np.asarray(functional), np.asarray(eager), atol=1e-6)


def test_bf16_compute_with_f32_master_weights():
    cfg_bf = sbd_jax.ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    params = sbd_jax.init_params(CFG, jax.random.key(1), std=0.1)
    toks = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    meta = causal_meta(jnp.array([6, 6]), 6)
    hi, _ = sbd_jax.forward(params, CFG, toks, meta)
    lo, _ = sbd_jax.forward(params, cfg_bf, toks, meta)
    assert params["embed"].dtype == jnp.float32 and lo.dtype == jnp.float32
    assert np.abs(np.asarray(hi) - np.asarray(lo)).max() < 5e-2 * max(1.0, np.abs(np.asarray(hi)).max())


def test_copy_len_config_errors_name_the_problem():
    from sbd_jax.training.config import TrainConfig
    yaml = Path(__file__).resolve().parents[1] / "configs" / "tiny_sbd.yaml"
    assert load_config(TrainConfig, yaml, ["data.copy_len=80", "sbd.block_align=response"]).data.copy_len == 80
    with pytest.raises(ConfigError, match="data.copy_len .* needs sbd.block_align='response'"):
        load_config(TrainConfig, yaml, ["data.copy_len=80"])
    with pytest.raises(ConfigError, match=r"data.copy_len must be in \[1, seq_len=128\]"):
        load_config(TrainConfig, yaml, ["data.copy_len=129", "sbd.block_align=response"])
    with pytest.raises(ConfigError, match=r"data.copy_len \(8\) is shorter than sbd.k_max \(16\)"):
        load_config(TrainConfig, yaml, ["data.copy_len=8", "sbd.block_align=response"])
    # the NTP baseline ignores the copy stream: the budget only shapes its rows
    assert load_config(TrainConfig, yaml, ["data.copy_len=8", "sbd.ntp_only=true"]).data.copy_len == 8


def test_a_setting_added_since_a_run_was_saved_is_a_change_only_off_its_default():
    """A run saved before a setting existed (absent from its record) resumes when that setting is at its declared
    default, and is refused, naming the key, when it is not; a key the record holds is compared as always."""
    from sbd_jax.config import changed_settings, to_dict
    from sbd_jax.training.config import TrainConfig
    yaml = Path(__file__).resolve().parents[1] / "configs" / "tiny_sbd.yaml"
    cfg = load_config(TrainConfig, yaml)
    saved = json.loads(json.dumps(to_dict(cfg), default=str))
    del saved["sbd"]["soft_targets"], saved["sbd"]["position_decay"]
    assert changed_settings(saved, cfg) == []
    decayed = load_config(TrainConfig, yaml, ["sbd.position_decay=0.9"])
    assert changed_settings(saved, decayed) == ["sbd.position_decay: None there, 0.9 now"]
    saved["sbd"]["k_max"] = 8
    assert changed_settings(saved, cfg) == ["sbd.k_max: 8 there, 16 now"]
