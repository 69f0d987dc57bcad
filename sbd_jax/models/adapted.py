"""Weights with an adapter attached, and the three ops of the forward that read weights (`project`, `embed_rows`,
`head_logits`). A plain array is read as before; a quantized projection (sbd_jax/models/quant.py) through qwix; a
`LoRAWeight` adds its low-rank path and a `RowPatch` swaps one vocabulary row, both without building the merged
weight (sbd_jax/models/lora.py attaches them to the parameter tree). All are pytrees, so the layer scan, remat and
dtype casts treat their arrays like any weight."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from qwix import QArray


@functools.partial(jax.tree_util.register_dataclass, data_fields=("w", "a", "b", "gate"),
                   meta_fields=("scale", "copy_only"))
@dataclasses.dataclass(frozen=True)
class LoRAWeight:
    """A frozen weight `w` (its einsum's in dims, then out dims) plus A [in dims..., r] and B [r, out dims...]:
    x @ W_eff = x @ w + scale * (x @ A) @ B, with W_eff = w + scale * A @ B never formed.

    `copy_only`: the low-rank path applies to copy-stream (mask) tokens only, so clean tokens run the base model
    exactly; the forward sets `gate` (bool [B, T], True on copy tokens) per call (`gated`)."""

    w: Any
    a: Any
    b: Any
    scale: float
    copy_only: bool = False
    gate: Any = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=("w", "value"),
                   meta_fields=("index", "axis", "input_only"))
@dataclasses.dataclass(frozen=True)
class RowPatch:
    """A frozen vocabulary matrix `w` (embedding [V, D]: axis 0; untied lm_head [D, V]: axis 1) whose entry `index`
    along `axis` reads `value` [D] instead: the added mask token's trainable row. `input_only`: only the embedding
    lookup reads it; a tied head keeps the base's row (a copy-only adapter leaves every logit of the base)."""

    w: Any
    value: Any
    index: int
    axis: int
    input_only: bool = False


@functools.partial(jax.tree_util.register_dataclass, data_fields=("q", "scale", "low"), meta_fields=("axis",))
@dataclasses.dataclass(frozen=True)
class Int4Groups:
    """A weight in 4 bits (sbd_jax/models/quant.py's "int4"): unsigned values `q` (uint4, 0..15; the weight's shape)
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


@functools.lru_cache(maxsize=64)
def _lora_specs(spec: str) -> tuple[str, str]:
    """"btd,dhk->bthk" -> ("btd,dr->btr", "btr,rhk->bthk"): the weight's letters shared with x go through A."""
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    r = next(c for c in "rzyxwuv" if c not in spec)
    ins = "".join(c for c in rhs if c in lhs)
    outs = "".join(c for c in rhs if c not in lhs)
    keep = "".join(c for c in lhs if c not in ins)
    return f"{lhs},{ins}{r}->{keep}{r}", f"{keep}{r},{r}{outs}->{out}"


@functools.partial(jax.tree_util.register_dataclass, data_fields=("w",), meta_fields=("on_input",))
@dataclasses.dataclass(frozen=True)
class Observed:
    """A weight whose input activations are handed to `on_input` (on the host, `jax.debug.callback`) whenever it is
    multiplied: how GPTQ calibration (sbd_jax/models/gptq.py) sees a layer's inputs, in a jitted forward."""

    w: Any
    on_input: Any

    def astype(self, dtype) -> Observed:
        return dataclasses.replace(self, w=self.w.astype(dtype))


def project(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` (spec: activations first, weight second); an int8 / fp8 weight (a qwix QArray) is
    multiplied by qwix in its quantized form, an `Int4Groups` dequantized into the product, and a `LoRAWeight`'s
    low-rank path is added to its base's product."""
    if isinstance(w, Observed):
        jax.debug.callback(w.on_input, x)
        w = w.w
    if isinstance(w, LoRAWeight):
        spec_a, spec_b = _lora_specs(spec)
        base = project(spec, x, w.w)
        delta = jnp.einsum(spec_b, jnp.einsum(spec_a, x, w.a), w.b) * w.scale
        if not w.copy_only:
            return base + delta
        if w.gate is None:
            raise ValueError("a copy-only LoRA weight multiplied outside a forward that sets its gate (`gated`)")
        gate = w.gate.reshape(w.gate.shape + (1,) * (base.ndim - w.gate.ndim))
        return jnp.where(gate, base + delta, base)  # clean tokens: the base's product, bit for bit
    if isinstance(w, QArray | Int4Groups):
        # tied to the activations, a weight's dequantization runs when its layer does: without, XLA may schedule
        # every layer's (or hoist it out of the decode loop), a full-precision copy of the model beside it
        x, w = jax.lax.optimization_barrier((x, w))
    if isinstance(w, QArray):
        return qwix.einsum(spec, x, w, preferred_element_type=x.dtype)
    if isinstance(w, Int4Groups):
        return jnp.einsum(spec, x, w.dequantize(x.dtype))
    return jnp.einsum(spec, x, w)


def embed_rows(w, tokens_BT):
    """Embedding lookup [B, T, D]; a `RowPatch`'s token reads its own row."""
    if not isinstance(w, RowPatch):
        return w[tokens_BT]
    return jnp.where((tokens_BT == w.index)[..., None], w.value, w.w[tokens_BT])


def head_logits(spec: str, h_BTD, w, dtype):
    """Logits [B, T, V] in `dtype` (spec "btd,vd->btv" for a tied head, "btd,dv->btv" for lm_head); a `RowPatch`'s
    entry is the logit of its own row (not an `input_only` one's)."""
    if isinstance(w, RowPatch) and w.input_only:
        w = w.w
    if not isinstance(w, RowPatch):
        return jnp.einsum(spec, h_BTD, w, preferred_element_type=dtype)
    logits = jnp.einsum(spec, h_BTD, w.w, preferred_element_type=dtype)
    own = jnp.einsum("btd,d->bt", h_BTD, w.value, preferred_element_type=dtype)
    return logits.at[..., w.index].set(own)


def has_copy_only(tree) -> bool:
    """Whether `tree` holds a copy-only LoRA weight (the forward then gates it per token)."""
    return any(isinstance(x, LoRAWeight) and x.copy_only
               for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LoRAWeight)))


def gated(tree, copy_BT):
    """`tree` with every copy-only LoRA weight's gate set to `copy_BT` (bool [B, T]: the call's copy tokens)."""
    return jax.tree.map(lambda x: dataclasses.replace(x, gate=copy_BT) if isinstance(x, LoRAWeight) and x.copy_only
                        else x, tree, is_leaf=lambda x: isinstance(x, LoRAWeight))


def base_of(tree):
    """`tree` without its LoRA paths: each LoRAWeight's frozen weight."""
    return jax.tree.map(lambda x: x.w if isinstance(x, LoRAWeight) else x, tree,
                        is_leaf=lambda x: isinstance(x, LoRAWeight))


def cast_floats(tree, dtype):
    """Every weight in `tree` in `dtype`; a quantized one (QArray, Int4Groups) keeps its values and casts its scales,
    so its product comes out in `dtype`."""
    return jax.tree.map(lambda a: a.astype(dtype), tree, is_leaf=lambda x: isinstance(x, QArray | Int4Groups))
