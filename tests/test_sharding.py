"""Mesh construction errors, the multi-process start conditions and what the parameter table gives."""
import dataclasses

import jax
import numpy as np
import pytest

import sbd_jax.sharding as sh
from sbd_jax.config import ConfigError
from sbd_jax.models.config import ModelConfig
from sbd_jax.models import init_params, param_shapes
from sbd_jax.models.params import param_specs
from sbd_jax.training.optim import decay_mask


def test_mesh_errors_and_fill():
    n = len(jax.devices())
    assert dict(sh.make_mesh(sh.MeshConfig()).shape) == {"data": n, "fsdp": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="needs 3 devices"):
        sh.make_mesh(sh.MeshConfig(data=3, fsdp=1, tensor=1), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        sh.make_mesh(sh.MeshConfig(data=-1, fsdp=-1))


def test_distributed_start_conditions(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for var in ("SBD_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not sh.maybe_initialize_distributed() and not calls
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not sh.maybe_initialize_distributed()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert sh.maybe_initialize_distributed() and calls[-1] == {}
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert sh.maybe_initialize_distributed()
    assert calls[-1] == {"coordinator_address": "host0:1234", "num_processes": 2, "process_id": 1}
    monkeypatch.setenv("SBD_DISTRIBUTED", "0")
    assert not sh.maybe_initialize_distributed()


def test_param_table_gives_shapes_axes_init_and_decay_mask():
    """Every weight of a config with biases and qk-norm: its shape and axes agree; norms are ones and biases zeros,
    and neither is decayed (the rule the decay mask derives from the table's init column)."""
    cfg = ModelConfig(model_type="qwen3", qk_norm=True, attention_bias=True, vocab_size=40, hidden_size=16,
                      intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    params = init_params(cfg, jax.random.key(0))

    def flat(tree):
        leaves = jax.tree.flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
        return {path[-1].key: leaf for path, leaf in leaves}
    weights, shapes, specs, mask = flat(params), flat(param_shapes(cfg)), flat(param_specs(cfg)), flat(decay_mask(params))
    assert weights.keys() == shapes.keys() == specs.keys() == mask.keys() and len(weights) == 18
    for name, w in weights.items():
        assert w.shape == shapes[name] and len(specs[name].logical_axes) == w.ndim
        norm, bias = name.endswith("norm"), name in ("bq", "bk", "bv", "bo")
        assert mask[name] == (not (norm or bias))
        if norm or bias:
            np.testing.assert_array_equal(w, 1.0 if norm else 0.0)
    assert specs["wq"].logical_axes == ("layers", "embed", "heads", "head_dim") and shapes["wo"] == (2, 4, 4, 16)
    tied = dataclasses.replace(cfg, tie_word_embeddings=True, attention_bias=False, qk_norm=False)
    assert sorted(param_shapes(tied)) == ["embed", "final_norm", "layers"] and len(param_shapes(tied)["layers"]) == 9
