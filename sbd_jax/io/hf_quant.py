"""Quantized projections (sbd_jax/models/quant.py) in an HF-layout checkpoint: what `save_pretrained` writes for them
and what `from_pretrained` reads back, one layer's weight at a time and never in full precision.

Per layer and projection, beside its HF name `model.layers.{i}.self_attn.q_proj.weight`:
  * `...weight`: the values in HF's [out, in] layout: int8 ("I8"), float8_e4m3fn ("F8_E4M3"), or int4 as two values
    per byte ("U8", [out, in / 2], the even input in the low nibble);
  * `...weight_scale`: [out, n], n scales per output channel: float32, one for int8 / fp8; float16, in / group_size
    for int4;
  * `...weight_low` (int4 only): float16 [out, in / group_size], each group's low end (w ~ q * scale + low).
config.json records the scheme: `"quantization_config": {"quant_method": "sbd_jax", "scheme": ..., "group_size": ...}`.
The files are read through their safetensors header here (safetensors' numpy reader has no float8 type).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from ..config import ConfigError
from ..models.config import ModelConfig
from ..models.quant import Int4Groups, QArray, Quantization, weight_axes
from ..models.params import ParamSpec
from .hf_layout import CheckpointError, hf_shape

QUANT_KEY = "quantization_config"
_DTYPES = {"I8": np.dtype(np.int8), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "U8": np.dtype(np.uint8),
           "F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}
_VALUES = {"int8": "I8", "fp8": "F8_E4M3", "int4": "U8"}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "F8_E4M3": 1, "U8": 1}  # what save_pretrained writes


def config_entry(q: Quantization) -> dict:
    return {QUANT_KEY: {"quant_method": "sbd_jax", **q.to_json()}}


def quantization_in(d: dict, path) -> Quantization | None:
    """The scheme a config.json (dict `d`, read from `path`) records, after checking it is sbd_jax's."""
    entry = d.get(QUANT_KEY)
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("quant_method") != "sbd_jax":
        method = entry.get("quant_method") if isinstance(entry, dict) else entry
        raise CheckpointError(f"{str(path)!r}: {QUANT_KEY} has quant_method {method!r}; sbd_jax reads its own "
                              "quantized checkpoints (quant_method 'sbd_jax') and full-precision ones")
    try:
        return Quantization.of({k: v for k, v in entry.items() if k != "quant_method"})
    except ConfigError as e:
        raise CheckpointError(f"{str(path)!r}: {QUANT_KEY}: {e}") from None


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file to write: HF name, shape, safetensors dtype, and what produces it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def _parts(spec: ParamSpec, cfg: ModelConfig, q: Quantization) -> dict[str, tuple[tuple[int, ...], str]]:
    """suffix -> (HF shape, safetensors dtype) of one layer's quantized projection."""
    out, n_in = hf_shape(spec, cfg)
    scales = n_in // q.group_size if q.scheme == "int4" else 1
    parts = {"": ((out, n_in // 2) if q.scheme == "int4" else (out, n_in), _VALUES[q.scheme]),
             "_scale": ((out, scales), "F16" if q.scheme == "int4" else "F32")}
    if q.scheme == "int4":
        parts["_low"] = ((out, scales), "F16")
    return parts


def tensors(name: str, spec: ParamSpec, cfg: ModelConfig, q: Quantization, layer_weight: Callable) -> list[Tensor]:
    """The tensors of one layer's quantized projection `spec` (HF name `name`); `layer_weight()` gives the layer's
    QArray / Int4Groups with host arrays (called once per tensor)."""
    parts = _parts(spec, cfg, q)

    def produce(suffix: str, shape) -> Callable[[], np.ndarray]:
        def run():
            w = layer_weight()
            if suffix == "":
                v = np.asarray(w.q if isinstance(w, Int4Groups) else w.qvalue)
                v = v.reshape(-1, shape[0]).T  # [out, in]
                return _pack4(v) if q.scheme == "int4" else np.ascontiguousarray(v)
            x = np.asarray(w.scale if suffix == "_scale" else w.low, _DTYPES[parts[suffix][1]])
            return np.ascontiguousarray(x.reshape(-1, shape[0]).T)
        return run
    return [Tensor(name + suffix, shape, dtype, produce(suffix, shape))
            for suffix, (shape, dtype) in parts.items()]


def _pack4(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.uint8)
    return np.ascontiguousarray(v[:, 0::2] | (v[:, 1::2] << 4))


def _unpack4(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    out[..., 0::2], out[..., 1::2] = b & 15, b >> 4
    return out


def read_tensor(path: Path, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Tensor `name` of safetensors file `path`, checked to have `shape` and `dtype` (errors name file and key)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = path.stat().st_size
            if not 0 < n <= size - 8:
                raise CheckpointError(f"{str(path)!r} is not a safetensors file (header size {n}, file {size} bytes)")
            header = json.loads(f.read(n))
            entry = header.get(name)
            if not isinstance(entry, dict):
                raise CheckpointError(f"{str(path)!r} has no tensor {name!r} (a quantized checkpoint needs it)")
            if entry.get("dtype") != dtype or tuple(entry.get("shape", ())) != tuple(shape):
                raise CheckpointError(f"{str(path)!r}: {name!r} is {entry.get('dtype')} {entry.get('shape')}, "
                                      f"expected {dtype} {list(shape)} for this config and quantization")
            start, end = entry["data_offsets"]
            want = math.prod(shape) * _DTYPES[dtype].itemsize
            if end - start != want or 8 + n + end > size:
                raise CheckpointError(f"{str(path)!r}: {name!r} holds {end - start} bytes at {start}, expected "
                                      f"{want} within the file's {size} (truncated or corrupt?)")
            f.seek(8 + n + start)
            return np.frombuffer(f.read(want), _DTYPES[dtype]).reshape(shape)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"cannot read {name!r} from {str(path)!r} (truncated or corrupt?): {e}") from None


def read_layer(files: dict[str, Path], name: str, spec: ParamSpec, cfg: ModelConfig, q: Quantization,
               layer_shape: tuple[int, ...], sharding):
    """One layer's quantized projection (HF name `name`) from the checkpoint, in our layout, on `sharding` (the
    weight's layer sharding; scales are sharded where their dims are the weight's)."""
    got = {}
    for suffix, (shape, dtype) in _parts(spec, cfg, q).items():
        key = name + suffix
        if key not in files:
            raise CheckpointError(f"{key!r} is missing from the quantized checkpoint ({q.name}: a projection needs "
                                  f"{', '.join(repr(name + s) for s in _parts(spec, cfg, q))})")
        got[suffix] = read_tensor(files[key], key, shape, dtype)
    ins, _ = weight_axes(spec.name.removeprefix("layers/"), len(layer_shape))
    values = got[""]
    if q.scheme == "int4":
        values = _unpack4(values).astype(ml_dtypes.uint4)
    values = values.T.reshape(layer_shape)
    def scale_dim(a: int, n: int) -> int:  # int8 / fp8: one scale per output channel; int4: per group too
        if a not in ins:
            return n
        return 1 if q.scheme != "int4" else n // q.group_size if a == ins[-1] else n
    scale_shape = tuple(scale_dim(a, n) for a, n in enumerate(layer_shape))
    parts = {k: got[k].T.reshape(scale_shape) for k in got if k}
    if not all(np.isfinite(p).all() and (k != "_scale" or (p > 0).all()) for k, p in parts.items()):
        raise CheckpointError(f"{name!r}: its scales (or low ends) hold non-finite or non-positive values")
    put = lambda x: _place(x, sharding, layer_shape)  # noqa: E731
    if q.scheme == "int4":
        return Int4Groups(put(values), put(parts["_scale"]), put(parts["_low"]), ins[-1] - len(layer_shape))
    return QArray(put(values), put(parts["_scale"]), None, q.qtype)


def _place(x: np.ndarray, sharding, weight_shape) -> jax.Array:
    """`x` on the devices of `sharding`, split along the dims it shares with the weight (a scale's reduced dims
    are replicated)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(s if n == m else None for s, n, m in zip(tuple(sharding.spec) + (None,) * x.ndim, x.shape,
                                                                weight_shape))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
