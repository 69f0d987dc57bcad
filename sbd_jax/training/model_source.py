"""Where a run's weights come from (`ModelSource`): a local HF directory or a random init, sharded on the mesh, with
the vocabulary grown by one row for the mask token when asked (`model.add_mask_token`); for a LoRA run, the frozen
base in its own dtype and its fingerprint (`prepare_base`)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from ..config import ConfigError
from ..models.config import ModelConfig
from ..io.hf import from_pretrained, load_hf_config, stored_quantization
from ..models.fingerprint import base_fingerprint
from ..models.params import init_params
from ..sharding import param_shardings, shard_params
from .config import ModelSource


def add_mask_row(cfg: ModelConfig, params: dict | None, init: str = "mean", seed: int = 0
                 ) -> tuple[ModelConfig, dict | None]:
    """Grow the vocabulary by one row for the `<m>` token (id = old vocab size). The new embedding row and lm_head
    column (ModelSource.mask_init): "mean" of the existing ones, "zero", or "random" (normal, the existing entries'
    standard deviation: what a fresh token's row looks like)."""
    V = cfg.vocab_size
    cfg = dataclasses.replace(cfg, vocab_size=V + 1, mask_token_id=V)
    if params is None:
        return cfg, None
    params = dict(params)
    key = jax.random.PRNGKey(seed)
    for name, axis in (("embed", 0), ("lm_head", 1)):
        if name in params:
            w = params[name]
            params[name] = jnp.concatenate([w, _new_row(w, axis, init, jax.random.fold_in(key, axis))], axis=axis)
    return cfg, params


def _new_row(w, axis: int, init: str, key):
    if init == "mean":
        return jnp.mean(w, axis=axis, keepdims=True)
    shape = w.shape[:axis] + (1,) + w.shape[axis + 1:]
    if init == "zero":
        return jnp.zeros(shape, w.dtype)
    return (jax.random.normal(key, shape, jnp.float32) * jnp.std(w.astype(jnp.float32))).astype(w.dtype)


def prepare_model(src: ModelSource, seed: int, mesh, *, load_weights: bool = True):
    """ModelSource -> (ModelConfig, params sharded on `mesh`, or None without `load_weights`)."""
    overrides = {k: getattr(src, k) for k in ("param_dtype", "dtype", "attention_impl", "mask_token_id",
                                              "scan_unroll", "remat") if getattr(src, k) is not None}
    params = None
    if src.init_from:
        stored = stored_quantization(src.init_from) if Path(src.init_from, "config.json").is_file() else None
        if stored is not None:
            raise ConfigError(f"model.init_from={src.init_from!r} holds {stored.name}-quantized weights (a decoding "
                              "checkpoint): fine-tune from the full-precision model")
        if load_weights:
            cfg, params = from_pretrained(src.init_from, mesh=mesh, **overrides)  # each process reads its shards
        else:
            cfg = load_hf_config(src.init_from, **overrides)
    else:
        try:
            cfg = dataclasses.replace(src.config, **overrides)
        except ConfigError as e:
            raise ConfigError(f"model: {e}") from None
        if load_weights and not src.add_mask_token:
            params = _init_fn(cfg, src.init_std, mesh)(jax.random.PRNGKey(seed))
        elif load_weights:
            params = init_params(cfg, jax.random.PRNGKey(seed), std=src.init_std)
    if src.add_mask_token:
        cfg, params = add_mask_row(cfg, params, src.mask_init, seed)
    if src.add_mask_token and params is not None:
        params = shard_params(params, cfg, mesh)
    return cfg, params


@functools.lru_cache(maxsize=4)
def _init_fn(cfg: ModelConfig, std: float, mesh):
    return jax.jit(lambda k: init_params(cfg, k, std=std), out_shardings=param_shardings(cfg, mesh))


def prepare_base(src: ModelSource, seed: int, mesh, base_dtype: str | None) -> tuple[ModelConfig, dict, str]:
    """The frozen base of a LoRA run -> (ModelConfig with the master dtype for the adapter, base params held in
    `base_dtype` (default: the master dtype) sharded on `mesh`, the fingerprint of the base as loaded, taken before
    a mask row is added: the checkpoint's, whatever row the run grows)."""
    held = dataclasses.replace(src, add_mask_token=False, param_dtype=base_dtype or src.param_dtype)
    cfg, params = prepare_model(held, seed, mesh)
    fingerprint = base_fingerprint(params)
    if src.add_mask_token:
        cfg, params = add_mask_row(cfg, params, src.mask_init, seed)
        params = shard_params(params, cfg, mesh)
    master = src.param_dtype or ("float32" if src.init_from else src.config.param_dtype)
    return dataclasses.replace(cfg, param_dtype=master), params, fingerprint
