"""HF-layout interop: read/write `config.json` + (sharded, indexed) safetensors. Never a hub download:
`from_pretrained` takes a local directory only."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from ..config import ConfigError, ModelConfig
from ..models import llama, qwen3
from ..models.transformer import param_shapes

_ARCH = {"llama": llama, "qwen3": qwen3}


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
    if mt not in _ARCH:
        raise ConfigError(f"model_type {mt!r} in {str(path)!r} is not supported (supported: {sorted(_ARCH)})")
    return _ARCH[mt].config_from_hf(d, allow_unknown_keys=allow_unknown_keys, **overrides)


def _hf_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    names = {
        "attn_norm": p + "input_layernorm.weight", "mlp_norm": p + "post_attention_layernorm.weight",
        "wq": p + "self_attn.q_proj.weight", "wk": p + "self_attn.k_proj.weight",
        "wv": p + "self_attn.v_proj.weight", "wo": p + "self_attn.o_proj.weight",
        "w_gate": p + "mlp.gate_proj.weight", "w_up": p + "mlp.up_proj.weight",
        "w_down": p + "mlp.down_proj.weight",
    }
    if cfg.attention_bias:
        names.update(bq=p + "self_attn.q_proj.bias", bk=p + "self_attn.k_proj.bias",
                     bv=p + "self_attn.v_proj.bias", bo=p + "self_attn.o_proj.bias")
    if cfg.qk_norm:
        names.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
    return names


def _to_ours(name: str, w, shape):
    """HF tensor (torch Linear layout [out, in]) -> our per-layer layout `shape` (without L)."""
    if name in ("wq", "wk", "wv"):  # [H*Dh, D] -> [D, H, Dh]
        return w.T.reshape(shape)
    if name == "wo":  # [D, H*Dh] -> [H, Dh, D]
        return w.T.reshape(shape)
    if name in ("w_gate", "w_up", "w_down"):
        return w.T
    if name in ("bq", "bk", "bv"):
        return w.reshape(shape)
    return w


def _to_hf(name: str, w):
    if name in ("wq", "wk", "wv"):  # [D, H, Dh] -> [H*Dh, D]
        return w.reshape(w.shape[0], -1).T
    if name == "wo":  # [H, Dh, D] -> [D, H*Dh]
        return w.reshape(-1, w.shape[-1]).T
    if name in ("w_gate", "w_up", "w_down"):
        return w.T
    if name in ("bq", "bk", "bv"):
        return w.reshape(-1)
    return w


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file, from model.safetensors.index.json or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: model_dir / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"safetensors shard {str(f)!r} listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}")
    return {name: single for name in _list_tensors(single)}


def _list_tensors(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="flax") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors file {str(path)!r} (truncated or corrupt?): {e}") from None


def from_pretrained(model_dir: str | os.PathLike, *, param_dtype: str | None = None, dtype: str | None = None,
                    allow_unknown_keys: bool = False, **config_overrides) -> tuple[ModelConfig, dict]:
    """Load a local HF-layout Llama-3.x/Qwen3 checkpoint -> (ModelConfig, params pytree).

    `param_dtype`/`dtype` default to the checkpoint's storage dtype / float32 compute."""
    model_dir = Path(model_dir)
    overrides = dict(config_overrides)
    if param_dtype:
        overrides["param_dtype"] = param_dtype
    if dtype:
        overrides["dtype"] = dtype
    cfg = load_hf_config(model_dir, allow_unknown_keys=allow_unknown_keys, **overrides)
    files = _weight_files(model_dir)
    shapes = param_shapes(cfg)
    pdt = jnp.dtype(cfg.param_dtype)
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
        return jnp.asarray(t).astype(pdt)

    V, D = cfg.vocab_size, cfg.hidden_size
    params: dict = {"embed": get("model.embed_tokens.weight", (V, D)),
                    "final_norm": get("model.norm.weight", (D,))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", (V, D)).T
    layers = {}
    for name, full_shape in shapes["layers"].items():
        per_layer = full_shape[1:]
        stack = []
        for i in range(cfg.num_hidden_layers):
            hf_name = _hf_names(cfg, i)[name]
            hf_shape = _to_hf(name, np.zeros(per_layer, np.int8)).shape
            stack.append(_to_ours(name, get(hf_name, hf_shape), per_layer))
        layers[name] = jnp.stack(stack)
    params["layers"] = layers
    return cfg, params


def hf_state_dict(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params -> HF tensor names and layouts (host arrays)."""
    params = jax.device_get(params)
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    for name, stacked in params["layers"].items():
        for i in range(cfg.num_hidden_layers):
            out[_hf_names(cfg, i)[name]] = _to_hf(name, np.asarray(stacked[i]))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


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
    size = 0
    for name, t in tensors.items():
        nbytes = t.size * t.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        _atomic(out_dir / "model.safetensors", lambda p: save_file(shards[0], p, metadata=meta))
        stale = out_dir / "model.safetensors.index.json"
        if stale.exists():
            stale.unlink()
    else:
        weight_map = {}
        n = len(shards)
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            _atomic(out_dir / fname, lambda p, s=shard: save_file(s, p, metadata=meta))
            weight_map.update({k: fname for k in shard})
        index = {"metadata": {"total_size": int(sum(t.size * t.dtype.itemsize for t in tensors.values()))},
                 "weight_map": weight_map}
        _atomic(out_dir / "model.safetensors.index.json", lambda p: Path(p).write_text(json.dumps(index, indent=2)))
    hf_cfg = _ARCH[cfg.model_type].config_to_hf(cfg)
    hf_cfg["torch_dtype"] = str(dtype.name)
    _atomic(out_dir / "config.json", lambda p: Path(p).write_text(json.dumps(hf_cfg, indent=2) + "\n"))
    return out_dir


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
