"""HF-layout interop: read/write `config.json` + (sharded, indexed) safetensors. Never a hub download:
`from_pretrained` takes a local directory only."""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from ..config import ConfigError, ModelConfig
from ..models.hf_config import KNOWN_KEYS, config_from_hf, config_to_hf
from ..models.transformer import ParamSpec, axis_sizes, param_specs


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked (missing/truncated file, bad shape...)."""


def load_hf_config(model_dir: str | os.PathLike, *, allow_unknown_keys: bool = False, **overrides) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist (hub names are not "
                              "downloaded: pass a local directory)")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is missing")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from None
    mt = d.get("model_type")
    if mt not in KNOWN_KEYS:
        raise ConfigError(f"model_type {mt!r} in {str(path)!r} is not supported (supported: {sorted(KNOWN_KEYS)})")
    return config_from_hf(d, allow_unknown_keys=allow_unknown_keys, **overrides)


def _hf_names(s: ParamSpec, cfg: ModelConfig) -> list[str]:
    return [f"model.layers.{i}.{s.hf}" for i in range(cfg.num_hidden_layers)] if s.stacked else [s.hf]


def _hf_shape(s: ParamSpec, cfg: ModelConfig) -> tuple[int, ...]:
    """HF's shape for one layer of `s`: dims joined by `*` are one, a Linear weight is [out, in]."""
    sizes = axis_sizes(cfg)
    groups = tuple(math.prod(sizes[a] for a in g.split("*")) for g in s.axes.split())
    return groups[::-1] if s.hf_t else groups


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file, from model.safetensors.index.json or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = {name: model_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"safetensors shard {str(f)!r} listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}")
    try:
        with safe_open(str(single), framework="flax") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors file {str(single)!r} (truncated or corrupt?): {e}") from None


def from_pretrained(model_dir: str | os.PathLike, *, param_dtype: str | None = None, dtype: str | None = None,
                    allow_unknown_keys: bool = False, **config_overrides) -> tuple[ModelConfig, dict]:
    """Load a local HF-layout Llama-3.x/Qwen3 checkpoint -> (ModelConfig, params pytree). `param_dtype`
    (storage) and `dtype` (compute) default to float32, whatever the checkpoint stores."""
    model_dir = Path(model_dir)
    dtypes = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
    cfg = load_hf_config(model_dir, allow_unknown_keys=allow_unknown_keys, **{**config_overrides, **dtypes})
    files = _weight_files(model_dir)
    handles: dict[Path, object] = {}

    def get(name: str, expected_shape) -> np.ndarray:
        if name not in files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint in {str(model_dir)!r}")
        f = files[name]
        try:
            if f not in handles:
                handles[f] = safe_open(str(f), framework="flax")
            t = handles[f].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {name!r} from {str(f)!r} (truncated or corrupt?): {e}") from None
        if tuple(t.shape) != tuple(expected_shape):
            raise CheckpointError(f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(expected_shape)} "
                                  f"for this config (vocab/hidden/head sizes disagree with config.json?)")
        return jnp.asarray(t).astype(cfg.param_dtype)

    def load(s: ParamSpec):
        ws = [get(name, _hf_shape(s, cfg)) for name in _hf_names(s, cfg)]  # a Linear weight transposed back
        ws = [(w.T if s.hf_t else w).reshape(s.shape(cfg)[s.stacked:]) for w in ws]
        return jnp.stack(ws) if s.stacked else ws[0]
    return cfg, jax.tree.map(load, param_specs(cfg))


def hf_state_dict(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params -> HF tensor names and layouts (host arrays)."""
    params, out = jax.device_get(params), {}
    for s in jax.tree.leaves(param_specs(cfg)):
        w = np.asarray(functools.reduce(lambda tree, key: tree[key], s.name.split("/"), params))
        shape = _hf_shape(s, cfg)
        for name, layer_w in zip(_hf_names(s, cfg), w if s.stacked else [w]):
            out[name] = np.ascontiguousarray(layer_w.reshape(shape[::-1]).T if s.hf_t else layer_w.reshape(shape))
    return out


def save_pretrained(cfg: ModelConfig, params: dict, out_dir: str | os.PathLike, *,
                    max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> Path:
    """Write config.json (with mask_token_id) + safetensors (sharded with an index past
    `max_shard_bytes`) so that `transformers` loads the directory. Files are written to a temporary
    name and renamed, so a killed save never leaves a half-written shard under its final name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    tensors = {k: jnp.asarray(v).astype(dtype) for k, v in hf_state_dict(cfg, params).items()}
    shards: list[dict] = [{}]
    for name, t in tensors.items():
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = t
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for fname, shard in zip(files, shards):
        _atomic(out_dir / fname, lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}))
    index_path = out_dir / "model.safetensors.index.json"
    if n == 1:
        index_path.unlink(missing_ok=True)  # a stale index would shadow the single file
    else:
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                 "weight_map": {k: fname for fname, shard in zip(files, shards) for k in shard}}
        _atomic(index_path, lambda p: Path(p).write_text(json.dumps(index, indent=2)))
    hf_cfg = {**config_to_hf(cfg), "torch_dtype": dtype.name}
    _atomic(out_dir / "config.json", lambda p: Path(p).write_text(json.dumps(hf_cfg, indent=2) + "\n"))
    return out_dir


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
