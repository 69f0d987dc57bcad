"""LoRA adapters in HF PEFT's layout, both ways. `save_adapter` writes adapter_config.json (peft_type LORA, r,
lora_alpha, target_modules, base_model_name_or_path; an added mask token as trainable_token_indices),
adapter_model.safetensors (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]; a token's row as `...embed_tokens.token_adapter.trainable_tokens_delta` [1, D]) and
sbd_adapter.json (the base's fingerprint, the mask token id). `load_adapter` reads such a directory (ours, or a
plain PEFT LoRA of a Llama/Qwen3) against a model config and refuses what does not fit, naming it; `apply_adapter`
merges it into a loaded base once the base's fingerprint matches."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ..config import ConfigError
from ..models.config import ModelConfig
from ..jsonlines import read_object
from ..models.fingerprint import base_fingerprint
from ..models.lora import LORA_TARGETS, AdapterLayout, adapter_specs, attach_copy_only, merge, target_spec
from .hf import CheckpointError, atomic_write, host_value

ADAPTER_CONFIG, ADAPTER_WEIGHTS, SBD_INFO = "adapter_config.json", "adapter_model.safetensors", "sbd_adapter.json"
# adapter_config.json values that set the adapter's math, recorded in sbd_adapter.json as trained
TRAINED_AS = ("r", "lora_alpha", "target_modules", "trainable_token_indices")
_PREFIX = "base_model.model."
_TOKENS = {"mask_embed": "model.embed_tokens", "mask_head": "lm_head"}  # the PEFT module of each trainable row
# PEFT options this loader does not implement, with the value that means "not used"
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "lora_bias": False, "bias": "none", "fan_in_fan_out": False,
                "modules_to_save": None, "layers_to_transform": None, "layer_replication": None, "exclude_modules": None,
                "target_parameters": None, "alpha_pattern": None, "rank_pattern": None}


def _module(target: str) -> str:
    return target_spec(target).hf.removesuffix(".weight")  # "q" -> "self_attn.q_proj"


PEFT_MODULES = {t: _module(t).split(".")[-1] for t in LORA_TARGETS}  # "q" -> "q_proj"


def _entries(cfg: ModelConfig, layout: AdapterLayout):
    """(PEFT tensor name, adapter tree path, layer or None) of every tensor of the adapter."""
    specs = adapter_specs(cfg, layout)
    for t in layout.targets:
        w = LORA_TARGETS[t]
        for i in range(cfg.num_hidden_layers):
            stem = f"{_PREFIX}model.layers.{i}.{_module(t)}"
            yield f"{stem}.lora_A.weight", ("layers", w, "a"), i
            yield f"{stem}.lora_B.weight", ("layers", w, "b"), i
    for key in ("mask_embed", "mask_head"):
        if key in specs:
            yield f"{_PREFIX}{_TOKENS[key]}.token_adapter.trainable_tokens_delta", (key,), None


def _to_hf(x: np.ndarray, part: str) -> np.ndarray:
    """Ours -> PEFT: A [in..., r] -> [r, in]; B [r, out...] -> [out, r]; a row [D] -> [1, D]."""
    if part == "a":
        return x.reshape(-1, x.shape[-1]).T
    return x.reshape(x.shape[0], -1).T if part == "b" else x[None]


def _from_hf(x: np.ndarray, part: str, shape: tuple[int, ...]) -> np.ndarray:
    return (x.T if part in ("a", "b") else x[0]).reshape(shape)


def save_adapter(out_dir: str | os.PathLike, cfg: ModelConfig, layout: AdapterLayout, adapter: dict, *,
                 fingerprint: str, base_name: str | None = None, dtype: str | None = None) -> Path:
    """Write the adapter in PEFT's layout (+ sbd_adapter.json). Every process must call it (the arrays are gathered);
    process 0 writes. `dtype`: of the tensors (default cfg.param_dtype)."""
    out_dir = Path(out_dir)
    dt = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    host = jax.tree.map(host_value, adapter)
    tensors = {}
    for name, path, layer in _entries(cfg, layout):
        x = host
        for key in path:
            x = x[key]
        tensors[name] = np.ascontiguousarray(_to_hf(x if layer is None else x[layer], path[-1])).astype(dt)
    if jax.process_index() != 0:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / ADAPTER_WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    added = layout.mask_row is not None
    tokens = None if not added else {"embed_tokens": [layout.mask_row]} | (
        {} if cfg.tie_word_embeddings else {"lm_head": [layout.mask_row]})
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": layout.rank, "lora_alpha": layout.alpha,
            "target_modules": [PEFT_MODULES[t] for t in layout.targets], "base_model_name_or_path": base_name,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "inference_mode": True, "modules_to_save": None, "trainable_token_indices": tokens}
    info = {"format": 1, "base_fingerprint": fingerprint, "base_model": base_name,
            "base_vocab_size": cfg.vocab_size - added, "mask_token_id": cfg.mask_token_id,
            "trained_as": {k: conf[k] for k in TRAINED_AS}, "copy_only": layout.copy_only}
    for fname, d in ((ADAPTER_CONFIG, conf), (SBD_INFO, info)):
        atomic_write(out_dir / fname, lambda p, d=d: Path(p).write_text(json.dumps(d, indent=2) + "\n"))
    return out_dir


@dataclasses.dataclass(frozen=True)
class LoadedAdapter:
    layout: AdapterLayout
    tensors: dict  # the adapter tree in our layout (numpy), as `adapter_specs` of the (grown) model lays it out
    fingerprint: str | None  # of the base it was trained on (None: a PEFT adapter made elsewhere)
    info: dict  # sbd_adapter.json ({} when absent)
    path: Path


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{str(path)!r} is missing: not a PEFT adapter directory")
        return {}
    return read_object(path, CheckpointError)


def _layout(conf: dict, where: Path) -> AdapterLayout:
    """The AdapterLayout an adapter_config.json describes; options this loader does not implement are refused."""
    if conf.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type is {conf.get('peft_type')!r}, only 'LORA' adapters are supported")
    for key, off in _UNSUPPORTED.items():
        if conf.get(key, off) not in (off, None, {}, [], False):
            raise CheckpointError(f"{where}: {key}={conf[key]!r} is not supported (only plain LoRA on "
                                  f"{sorted(PEFT_MODULES.values())})")
    modules = conf.get("target_modules")
    names = {v: k for k, v in PEFT_MODULES.items()}
    if not isinstance(modules, list) or any(m not in names for m in modules):
        raise CheckpointError(f"{where}: target_modules {modules!r} must be a list of {sorted(names)}")
    rows = conf.get("trainable_token_indices")
    ids = sorted({i for v in (rows.values() if isinstance(rows, dict) else [rows or []]) for i in v})
    if len(ids) > 1:
        raise CheckpointError(f"{where}: trainable_token_indices {rows!r}: only one trainable token (the mask token) "
                              "is supported")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise CheckpointError(f"{where}: r is {r!r}; the LoRA rank must be an integer >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < float("inf"):
        raise CheckpointError(f"{where}: lora_alpha is {alpha!r}; it must be a finite number > 0")
    try:
        return AdapterLayout(r, float(alpha),
                             tuple(t for t in LORA_TARGETS if PEFT_MODULES[t] in modules), ids[0] if ids else None)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _check_trained_as(conf: dict, info: dict, path: Path) -> None:
    """The adapter_config.json values that set the adapter's math are those it was trained with (sbd_adapter.json
    records them): an edited lora_alpha rescales every update and would load without a word."""
    trained = info.get("trained_as")
    if not isinstance(trained, dict):  # an adapter made elsewhere, or before the record existed
        return
    for key in TRAINED_AS:
        if key in trained and conf.get(key) != trained[key]:
            raise CheckpointError(f"{str(path / ADAPTER_CONFIG)!r}: {key} is {conf.get(key)!r}, but the adapter was "
                                  f"trained with {trained[key]!r} ({SBD_INFO}): restore it, or retrain")


def _leaf(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _read_tensors(files: Path, cfg: ModelConfig, layout: AdapterLayout) -> dict:
    """The adapter tree (numpy) of `layout` for a model of config `cfg`, from a PEFT safetensors file."""
    specs = adapter_specs(cfg, layout)
    tensors, seen = jax.tree.map(lambda s: np.zeros(s.dims, np.float32), specs), set()
    try:
        with safe_open(str(files), framework="numpy") as f:
            names = set(f.keys())
            for name, path, layer in _entries(cfg, layout):
                dims = _leaf(specs, path).dims[layer is not None:]
                hf_shape = _to_hf(np.zeros(dims, np.int8), path[-1]).shape
                if name not in names:
                    raise CheckpointError(f"adapter tensor {name!r} is missing from {str(files)!r}")
                x = f.get_tensor(name)
                if x.shape != hf_shape:
                    raise CheckpointError(f"adapter tensor {name!r} has shape {list(x.shape)}, this model (hidden "
                                          f"{cfg.hidden_size}, {cfg.num_hidden_layers} layers) needs {list(hf_shape)}")
                _leaf(tensors, path)[layer if layer is not None else ...] = _from_hf(x, path[-1], dims)
                seen.add(name)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {str(files)!r}: {e}") from None
    if extra := sorted(names - seen):
        raise CheckpointError(f"{str(files)!r} holds tensors this model has no place for (e.g. {extra[:3]}): an "
                              "adapter of another architecture or depth")
    return tensors


def load_adapter(adapter_dir: str | os.PathLike, cfg: ModelConfig) -> LoadedAdapter:
    """Read a PEFT LoRA directory for a model of config `cfg` (the base's). Refused, naming what differs: another
    vocabulary than the base it was made for, a tensor missing or of another shape than this model needs, a tensor
    this model has no place for."""
    path = Path(adapter_dir)
    if not path.is_dir():
        raise CheckpointError(f"adapter directory {str(path)!r} does not exist")
    conf = _read_json(path / ADAPTER_CONFIG, True)
    layout = _layout(conf, path / ADAPTER_CONFIG)
    info = _read_json(path / SBD_INFO, False)
    if not isinstance(info.get("copy_only", False), bool):
        raise CheckpointError(f"{str(path / SBD_INFO)!r}: copy_only must be true or false, got {info['copy_only']!r}")
    layout = dataclasses.replace(layout, copy_only=info.get("copy_only", False))
    _check_trained_as(conf, info, path)
    if info.get("base_vocab_size", cfg.vocab_size) != cfg.vocab_size:
        raise CheckpointError(f"adapter {str(path)!r} was made for a base with vocab_size {info['base_vocab_size']}, "
                              f"this model has {cfg.vocab_size}")
    grown = cfg if layout.mask_row != cfg.vocab_size else dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1)
    try:
        tensors = _read_tensors(path / ADAPTER_WEIGHTS, grown, layout)
    except ConfigError as e:  # e.g. a trainable token beyond the vocabulary
        raise CheckpointError(f"adapter {str(path)!r}: {e}") from None
    return LoadedAdapter(layout, tensors, info.get("base_fingerprint"), info, path)


def apply_adapter(cfg: ModelConfig, params: dict, adapter_dir: str | os.PathLike, *,
                  model_dir: str | os.PathLike | None = None) -> tuple[ModelConfig, dict]:
    """Merge the adapter in `adapter_dir` into `params` (the base, stacked layout; its target weights are consumed)
    -> (config with the adapter's vocabulary and mask token id, merged params); a copy-only adapter (sbd_adapter.json
    "copy_only") is attached unmerged instead (`attach_copy_only`: clean tokens run the base). Refuses a base whose
    fingerprint is not the one the adapter was trained on, naming both. Every process must call it."""
    loaded = load_adapter(adapter_dir, cfg)
    if loaded.fingerprint is not None and (fp := base_fingerprint(params)) != loaded.fingerprint:
        made = loaded.info.get("base_model") or "a base not named"
        raise CheckpointError(f"adapter {str(loaded.path)!r} was trained on base weights {loaded.fingerprint} ({made}); "
                              f"the model{f' in {str(model_dir)!r}' if model_dir else ''} has {fp}: load the adapter "
                              "onto the base it was made for")
    if loaded.layout.copy_only:
        tensors = jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(cfg.param_dtype)), loaded.tensors)
        merged = attach_copy_only(params, tensors, loaded.layout)
    else:
        merged = merge(params, loaded.tensors, loaded.layout, delete=True)
    mask = loaded.info.get("mask_token_id", cfg.mask_token_id)
    return dataclasses.replace(cfg, vocab_size=merged["embed"].shape[0], mask_token_id=mask), merged
