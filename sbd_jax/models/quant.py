"""Weight-only quantization of the projections for decoding, with google's qwix (`qwix.quantize` -> `qwix.QArray`,
read by `qwix.einsum`: `quantized_product`, which layers.project calls).

Schemes (`Quantization.scheme`):
  * "int8": symmetric int8, one scale per output channel (and layer);
  * "fp8": float8_e4m3fn values (what Hopper multiplies natively), one scale per output channel;
  * "int4": 4-bit values with a float scale and low end per group of `group_size` consecutive inputs of each output
    channel (`Int4Groups`, llama.cpp's Q4_1 form; by hand, not qwix: its int4 zero point is an integer,
    and symmetric int4 loses far more on small models: BENCHMARKS.md "Quantization").
The seven projections (q, k, v, o, gate, up, down) are quantized; embeddings, the LM head and norms stay as they
are. Both forms are pytrees (values, scales [, low ends]), so the layer scan, `unstack_layers` and sharding treat
their arrays like any weight; `cast_floats` casts only their scales.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from ..config import ConfigError
from .config import ModelConfig
from .params import PARAM_SPECS, Weight

QArray = qwix.QArray


@functools.partial(jax.tree_util.register_dataclass, data_fields=("q", "scale", "low"), meta_fields=("axis",))
@dataclasses.dataclass(frozen=True)
class Int4Groups(Weight):
    """A weight in 4 bits (the "int4" scheme): unsigned values `q` (uint4, 0..15; the weight's shape)
    and, per group of consecutive inputs along `axis` (negative, from the end, so that a stacked weight's layers
    slice alike), a float `scale` and `low` end: w ~ q * scale + low, llama.cpp's Q4_1 form. Its low end is a
    float: qwix's int4 QArray rounds its zero point to an integer, a shift of up to half a step for a whole group
    (+24% perplexity on SmolLM2-135M in groups of 32, BENCHMARKS.md "Quantization")."""

    q: Any
    scale: Any
    low: Any
    axis: int

    def astype(self, dtype) -> Int4Groups:
        return dataclasses.replace(self, scale=self.scale.astype(dtype), low=self.low.astype(dtype))

    def dequantize(self, dtype) -> jax.Array:
        """The weight in `dtype`: each group's values scaled and shifted."""
        a = self.q.ndim + self.axis
        G, shape = self.scale.shape[a], self.q.shape
        split = shape[:a] + (G, shape[a] // G) + shape[a + 1:]
        q = self.q.reshape(split).astype(dtype)
        w = q * jnp.expand_dims(self.scale, a + 1).astype(dtype) + jnp.expand_dims(self.low, a + 1).astype(dtype)
        return w.reshape(shape)

    def product(self, spec: str, x):
        return quantized_product(spec, x, self)


def quantized_product(spec: str, x, w):
    """`einsum(spec, x, w)` of a quantized weight: a QArray multiplied by qwix in its quantized form, `Int4Groups`
    dequantized into the product."""
    # tied to the activations, a weight's dequantization runs when its layer does: without, XLA may schedule
    # every layer's (or hoist it out of the decode loop), a full-precision copy of the model beside it
    x, w = jax.lax.optimization_barrier((x, w))
    if isinstance(w, QArray):
        return qwix.einsum(spec, x, w, preferred_element_type=x.dtype)
    return jnp.einsum(spec, x, w.dequantize(x.dtype))


def cast_floats(tree, dtype):
    """Every weight in `tree` in `dtype`; a quantized one (QArray, Int4Groups) keeps its values and casts its scales,
    so its product comes out in `dtype`."""
    return jax.tree.map(lambda a: a.astype(dtype), tree, is_leaf=lambda x: isinstance(x, QArray | Int4Groups))

QUANTIZED_TYPES = (QArray, Int4Groups)
SCHEMES = ("int8", "fp8", "int4")
QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the per-layer weights that are quantized
SCALE_DTYPE = jnp.float16  # int4's per-group scale and low end
DEFAULT_INT4_GROUP = 32  # divides every hidden / head / MLP size of the supported families (llama.cpp's Q4 too)
_QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint4}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How the projections are quantized: `scheme` of SCHEMES; `group_size` (int4 only) input elements per scale."""

    scheme: str
    group_size: int | None = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ConfigError(f"quantize={self.scheme!r} is not a known scheme (choose from {', '.join(SCHEMES)})")
        if self.scheme == "int4":
            g = self.group_size if self.group_size is not None else DEFAULT_INT4_GROUP
            if isinstance(g, bool) or not isinstance(g, int) or g < 2:
                raise ConfigError(f"quantize group_size={self.group_size!r} must be an integer >= 2")
            object.__setattr__(self, "group_size", g)
        elif self.group_size is not None:
            raise ConfigError(f"quantize group_size={self.group_size!r} is for int4 only ({self.scheme} has one "
                              "scale per output channel)")

    @classmethod
    def of(cls, value) -> Quantization | None:
        """None, a Quantization, a scheme name ("int8", "fp8", "int4", "int4-g64": groups of 64) or its JSON dict."""
        if value is None or isinstance(value, Quantization):
            return value
        if isinstance(value, str):
            scheme, _, group = value.partition("-g")
            if group and not group.isdigit():
                raise ConfigError(f"quantize={value!r}: write the int4 group size as int4-g<N>, e.g. int4-g64")
            return cls(scheme, int(group) if group else None)
        if isinstance(value, dict):
            unknown = set(value) - {"scheme", "group_size"}
            if unknown or "scheme" not in value:
                raise ConfigError(f"quantization {value!r} needs 'scheme' (and for int4 'group_size') and nothing "
                                  f"else{f'; unknown: {sorted(unknown)}' if unknown else ''}")
            return cls(value["scheme"], value.get("group_size"))
        raise ConfigError(f"quantize={value!r} must be a scheme name ({', '.join(SCHEMES)}) or None")

    @property
    def qtype(self):
        return _QTYPES[self.scheme]

    @property
    def name(self) -> str:
        return self.scheme if self.scheme != "int4" else f"int4-g{self.group_size}"

    def to_json(self) -> dict:
        return {"scheme": self.scheme, "group_size": self.group_size}


def weight_axes(name: str, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input axes, the other axes) of projection `name` as an array of `ndim` dims (a leading layer axis when
    stacked): its first spec group is what the einsum contracts (`transformer.PARAM_SPECS`)."""
    spec = next(s for s in PARAM_SPECS if s.name == f"layers/{name}")
    n_in = len(spec.axes.split()[0].split("*"))
    lead = ndim - len(spec.logical_axes) + 1  # 1 when stacked, 0 for one layer
    ins = tuple(range(lead, lead + n_in))
    return ins, tuple(a for a in range(ndim) if a not in ins)


def _tiles(w, name: str, q: Quantization, where: str) -> dict | None:
    """qwix's tiled axes for projection `name`'s weight `w` (int4: groups along its last input axis), after checking
    that `w` can be quantized: errors name the weight."""
    if isinstance(w, QUANTIZED_TYPES):
        raise ConfigError(f"{where or name} is already quantized ({type(w).__name__}); quantize a full-precision "
                          "model")
    if not hasattr(w, "shape") or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ConfigError(f"{where or name} is {getattr(w, 'dtype', type(w).__name__)}: only floating-point "
                          "weight arrays can be quantized")
    if q.scheme != "int4":
        return None
    axis = weight_axes(name, w.ndim)[0][-1]
    n = w.shape[axis]
    if n % q.group_size:
        fits = next(g for g in (128, 64, 32, 16, 8, 4, 2) if n % g == 0 and g < q.group_size)
        raise ConfigError(f"int4 group size {q.group_size} does not divide {where or name}'s input dim of {n} "
                          f"(shape {tuple(w.shape)}): pick one that does, e.g. quantize='int4-g{fits}'")
    return {axis: q.group_size}


def quantize_weight(w, name: str, q: Quantization, *, where: str = ""):
    """Projection `name`'s weight (one layer or stacked) quantized: int8 / fp8 a qwix QArray with a scale per output
    channel (and layer); int4 an `Int4Groups` in groups along its last input axis (refused, naming the weight, where
    the group does not divide that axis)."""
    tiles = _tiles(w, name, q, where)
    if q.scheme == "int4":
        return _int4_groups(w, *tiles.items())
    return qwix.quantize(w, q.qtype, channelwise_axes=weight_axes(name, w.ndim)[1], scale_dtype=jnp.float32)


def _int4_groups(w, tile) -> Int4Groups:
    """Per group of `g` inputs along `axis`: low = its minimum, scale = its range / 15 (both stored in float16, as
    llama.cpp's Q4_1 does: 4 bytes per group), q = the nearest step from the stored ones."""
    axis, g = tile
    shape = w.shape
    split = shape[:axis] + (shape[axis] // g, g) + shape[axis + 1:]
    x = w.reshape(split).astype(jnp.float32)
    low, high = jnp.min(x, axis=axis + 1, keepdims=True), jnp.max(x, axis=axis + 1, keepdims=True)
    scale = ((high - low) / 15.0).astype(SCALE_DTYPE)
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    low = low.astype(SCALE_DTYPE)
    q = jnp.round((x - low.astype(jnp.float32)) / scale.astype(jnp.float32))
    q = jnp.clip(q, 0, 15).astype(jnp.uint4).reshape(shape)
    return Int4Groups(q, jnp.squeeze(scale, axis + 1), jnp.squeeze(low, axis + 1), axis - w.ndim)


# one compiled program per weight shape, scheme and name, kept across calls (loading and quantize_params share it)
quantize_jit = jax.jit(quantize_weight, static_argnames=("name", "q", "where"))


def quantize_params(params: dict, cfg: ModelConfig, q: Quantization | str, *, delete: bool = False) -> dict:
    """`params` with the projections of every layer quantized (stacked or `unstack_layers`' per-layer layout);
    `delete`: free each full-precision weight once quantized (the device then holds the quantized weights plus one
    full-precision weight at most). Values rounded to nearest; calibrated by GPTQ: sbd_jax/models/gptq.py."""
    q = Quantization.of(q)

    def one(layer: dict, where: str) -> dict:
        out = dict(layer)
        for name in QUANTIZED:
            w = layer[name]
            _tiles(w, name, q, f"{where}{name}")  # errors before tracing
            out[name] = quantize_jit(w, name=name, q=q, where="")
            if delete and isinstance(w, jax.Array):
                w.delete()
        return out
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return {**params, "layers": tuple(one(lp, f"layers[{i}].") for i, lp in enumerate(layers))}
    return {**params, "layers": one(layers, "layers.")}


def quantization_of(params: dict) -> Quantization | None:
    """The scheme `params` were quantized with (None: full precision)."""
    layers = params["layers"]
    w = (layers[0] if isinstance(layers, (tuple, list)) else layers)["wq"]
    w = getattr(w, "w", w)  # a LoRA adapter's base
    if isinstance(w, Int4Groups):
        return Quantization("int4", w.q.shape[w.axis] // w.scale.shape[w.axis])
    if isinstance(w, QArray):
        return Quantization(next(s for s, t in _QTYPES.items() if jnp.dtype(t) == jnp.dtype(w.qtype)))
    return None
