"""HF-layout interop: read `config.json` + (sharded, indexed) safetensors (writing: hf_save.py, re-exported here).
Never a hub download: `from_pretrained` takes a local directory only."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path, PurePosixPath

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors import SafetensorError, safe_open

from ..config import ConfigError
from ..models.config import ModelConfig
from ..jsonlines import read_object
from ..models.hf_config import KNOWN_KEYS, config_from_hf
from ..models.quant import QUANTIZED, Quantization, quantize_jit
from ..models.params import ParamSpec, param_specs
from .hf_layout import CheckpointError, hf_names, hf_shape
from .hf_quant import QUANT_KEY, quantization_in, read_layer
from .hf_save import atomic_write, host_value, save_generation_files, save_pretrained

__all__ = ["CheckpointError", "atomic_write", "check_number_types", "from_pretrained", "hf_names", "host_value",
           "load_hf_config", "save_generation_files", "save_pretrained"]


def load_hf_config(model_dir: str | os.PathLike, *, allow_unknown_keys: bool = False, **overrides) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist (hub names are not "
                              "downloaded: pass a local directory)")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is missing")
    d = read_object(path, CheckpointError)
    check_number_types(d, path)
    quantization_in(d, path)  # (checked here; from_pretrained reads it with `stored_quantization`)
    d = {k: v for k, v in d.items() if k != QUANT_KEY}
    mt = d.get("model_type")
    if mt not in KNOWN_KEYS:
        raise ConfigError(f"model_type {mt!r} in {str(path)!r} is not supported (supported: {sorted(KNOWN_KEYS)})")
    try:
        return config_from_hf(d, allow_unknown_keys=allow_unknown_keys, **overrides)
    except ConfigError as e:
        raise ConfigError(f"{str(path)!r}: {e}") from None


def stored_quantization(model_dir: str | os.PathLike) -> Quantization | None:
    """The scheme a quantized checkpoint's config.json records (None: full precision; after load_hf_config)."""
    path = Path(model_dir) / "config.json"
    return quantization_in(json.loads(path.read_text()), path)


def check_number_types(d: dict, path: Path) -> None:
    """A ModelConfig number given as a string, bool or list in config.json is an error naming the key and value."""
    for f in dataclasses.fields(ModelConfig):
        kind = str(f.type).replace(" | None", "")
        v = d.get(f.name)
        if kind not in ("int", "float") or v is None:
            continue
        ok = isinstance(v, int) if kind == "int" else isinstance(v, (int, float))
        if not ok or isinstance(v, bool):
            raise CheckpointError(f"{str(path)!r}: {f.name} is {v!r} ({type(v).__name__}), expected "
                                  f"{'an integer' if kind == 'int' else 'a number'}")


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file, from model.safetensors.index.json or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = {name: model_dir / f for name, f in _weight_map(index).items()}
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


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file name; every shard a plain relative name inside the model directory
    (an index from an untrusted download must not make us read `../elsewhere` or an absolute path)."""
    weight_map = read_object(index, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{str(index)!r}: weight_map must be an object of tensor name -> shard file, got "
                              f"{type(weight_map).__name__}")
    for name, f in weight_map.items():
        parts = PurePosixPath(f).parts if isinstance(f, str) else ()
        if not parts or PurePosixPath(f).is_absolute() or ".." in parts or "\\" in f or "\0" in f:
            raise CheckpointError(f"{str(index)!r}: weight_map[{name!r}] = {f!r} is not a file name inside the model "
                                  "directory (absolute paths and '..' are refused)")
    return weight_map


def _hf_slices(s: ParamSpec, shape: tuple[int, ...], box: list[tuple[int, int]]):
    """How to read the block `box` ([start, stop) per dim) of one layer of `s` (shape `shape`) from its HF
    tensor: -> (the HF slice, the shape of what it gives in our dim order, the cut of it that is the block).
    An HF dim joins several of ours (`heads*head_dim`): it is read over whole rows of its leading one."""
    hf_index, our_shape, cut, at = [], [], [], 0
    for group in s.axes.split():
        (a, b), rest = box[at], shape[at + 1:at + len(group.split("*"))]
        hf_index.append(slice(a * math.prod(rest), b * math.prod(rest)))
        our_shape += [b - a, *rest]
        cut += [slice(None), *(slice(*box[i]) for i in range(at + 1, at + 1 + len(rest)))]
        at += 1 + len(rest)
    return tuple(hf_index[::-1] if s.hf_t else hf_index), our_shape, tuple(cut)


_FLOATS = ("F32", "BF16", "F16", "F64")


def _read(files: dict[str, Path], model_dir: Path, name: str, index: tuple[slice, ...], expected_shape) -> np.ndarray:
    """The slice `index` of HF tensor `name`, whose shape is checked against the config's. The file is memory-mapped
    for this read only, so its pages leave the process's memory with it."""
    if name not in files:
        raise CheckpointError(f"weight {name!r} is missing from the checkpoint in {str(model_dir)!r}")
    f = files[name]
    try:
        with safe_open(str(f), framework="numpy") as handle:
            t = handle.get_slice(name)
            shape, dtype = tuple(t.get_shape()), t.get_dtype()
            out = t[index] if shape == tuple(expected_shape) and dtype in _FLOATS else None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {name!r} from {str(f)!r} (truncated or corrupt?): {e}") from None
    if dtype not in _FLOATS:  # e.g. a quantized checkpoint's values read as weights: garbage, never loaded
        raise CheckpointError(f"weight {name!r} in {str(f)!r} is stored as {dtype}, not a float type: a quantized "
                              f"checkpoint whose config.json lacks {QUANT_KEY}? (sbd_jax records its scheme there)")
    if out is None:
        raise CheckpointError(f"weight {name!r} has shape {shape}, expected {tuple(expected_shape)} for this "
                              f"config (vocab/hidden/head sizes disagree with config.json?)")
    return out


_stack = jax.jit(lambda *parts: jax.tree.map(lambda *xs: jnp.stack(xs), *parts))


def _layer_sharding(sharding):
    """A stacked weight's sharding for one of its layers."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    return jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[1:]))


def _load_quantized(shape, sharding, block, name: str, q: Quantization, where: str):
    """Stacked projection `name` quantized as it loads: each layer's weight is read (`block` of the stacked shape),
    quantized and freed before the next, so one layer's full precision is on the device at a time."""
    layer = _layer_sharding(sharding)
    parts = []
    for i in range(shape[0]):
        w = jax.make_array_from_callback(shape[1:], layer, lambda index, i=i: block((slice(i, i + 1), *index))[0])
        parts.append(quantize_jit(w, name=name, q=q, where=where))
        w.delete()
    return _stack(*parts)


def from_pretrained(model_dir: str | os.PathLike, *, param_dtype: str | None = None, dtype: str | None = None,
                    mesh=None, rules=None, allow_unknown_keys: bool = False, gguf_file: str | None = None,
                    quantize=None, **config_overrides) -> tuple[ModelConfig, dict]:
    """Load a local HF-layout Llama-3.x/Qwen3 checkpoint -> (ModelConfig, params pytree). `param_dtype`
    (storage) and `dtype` (compute) default to float32, whatever the checkpoint stores. With `mesh`, every
    weight is built in its shards (`sbd_jax.sharding.param_shardings(cfg, mesh, rules)`): each process reads
    from the safetensors only the slices its own devices hold, one device's slice of one layer at a time;
    without, the weights land on the default device. With `gguf_file` (a name in `model_dir`, or a path), as in
    transformers: that llama.cpp file is converted once into the model cache (`sbd_jax.io.gguf.cached_convert`,
    float32) and the conversion is loaded. `quantize` (sbd_jax/models/quant.py): the projections quantized as they
    load, one layer's weight at a time (`_load_quantized`)."""
    from ..sharding import param_shardings  # (sharding imports the model; a module-level import would cycle)

    if gguf_file is not None:
        from .gguf import cached_convert
        model_dir = cached_convert(Path(model_dir) / gguf_file)
    model_dir, quantization = Path(model_dir), Quantization.of(quantize)
    dtypes = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
    cfg = load_hf_config(model_dir, allow_unknown_keys=allow_unknown_keys, **{**config_overrides, **dtypes})
    files, stored = _weight_files(model_dir), stored_quantization(model_dir)
    if stored is not None and quantization is not None:
        raise ConfigError(f"{str(model_dir)!r} is already quantized ({stored.name}): load it without quantize= "
                          f"(asked for {quantization.name})")

    def load(s: ParamSpec, sharding):
        shape = s.shape(cfg)
        names, hf_dims = hf_names(s, cfg), hf_shape(s, cfg)

        def block(index: tuple[slice, ...]) -> np.ndarray:
            box = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
            layers, box = (range(*box[0]), box[1:]) if s.stacked else ([0], box)
            hf_index, our_shape, cut = _hf_slices(s, shape[s.stacked:], box)
            ws = [_read(files, model_dir, names[i], hf_index, hf_dims) for i in layers]
            ws = [(w.T if s.hf_t else w).reshape(our_shape)[cut].astype(cfg.param_dtype) for w in ws]
            return np.stack(ws) if s.stacked else ws[0]
        name = s.name.removeprefix("layers/")
        if stored is not None and name in QUANTIZED:
            return _stack(*(read_layer(files, hf, s, cfg, stored, shape[1:], _layer_sharding(sharding))
                            for hf in hf_names(s, cfg)))
        if quantization is None or name not in QUANTIZED:
            return jax.make_array_from_callback(shape, sharding, block)
        return _load_quantized(shape, sharding, block, name, quantization, f"{model_dir}: {name}")

    specs = param_specs(cfg)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return cfg, jax.tree.map(lambda sp: load(sp, one), specs)
    return cfg, jax.tree.map(load, specs, param_shardings(cfg, mesh, rules))
