"""LoRA over the parameter table: which weights take an adapter, the adapter's own table (`adapter_specs`), its
init, `attach` (the tree the forward runs: each target weight a `LoRAWeight`, the added mask token's row a
`RowPatch`) and `merge` (W + alpha/r * A @ B, for export and decoding).

Why not qwix (the LoRA/quantization library google/tunix uses): qwix adds LoRA by intercepting the
`dot_general`/`einsum` calls made inside Flax (linen/NNX) module methods and creating `<param>_lora_a/_b` variables
on the module that owns the weight. Our model is not a tree of Flax modules: `forward` is a pure function over a
dict, the layers run under a `lax.scan` over stacked weights, so inside the scan the einsum's weight is a slice that
no Flax module owns, and qwix would find no parameter to adapt (it would also take a Flax/qwix dependency into the
model, a second parameter layout beside `PARAM_SPECS`, and its own sharding guesses). An adapter here is one more
table beside `PARAM_SPECS` (~100 lines): A and B are stacked on the layer axis like their weight, sharded by the
same logical axes (A by the weight's input axes, B by its output axes, the rank replicated), the optimizer and orbax
see a plain dict, and the PEFT export is a renaming of the same table.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from ..config import ConfigError
from .config import ModelConfig
from .layers import project
from .params import PARAM_SPECS, ParamSpec, Weight, axis_sizes


@functools.partial(jax.tree_util.register_dataclass, data_fields=("w", "a", "b", "gate"),
                   meta_fields=("scale", "copy_only"))
@dataclasses.dataclass(frozen=True)
class LoRAWeight(Weight):
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

    def product(self, spec: str, x):
        """The base's product plus the low-rank path (for a copy-only weight on the gated tokens only)."""
        spec_a, spec_b = _lora_specs(spec)
        base = project(spec, x, self.w)
        delta = jnp.einsum(spec_b, jnp.einsum(spec_a, x, self.a), self.b) * self.scale
        if not self.copy_only:
            return base + delta
        if self.gate is None:
            raise ValueError("a copy-only LoRA weight multiplied outside a forward that sets its gate (`gated`)")
        gate = self.gate.reshape(self.gate.shape + (1,) * (base.ndim - self.gate.ndim))
        return jnp.where(gate, base + delta, base)  # clean tokens: the base's product, bit for bit


@functools.partial(jax.tree_util.register_dataclass, data_fields=("w", "value"),
                   meta_fields=("index", "axis", "input_only"))
@dataclasses.dataclass(frozen=True)
class RowPatch(Weight):
    """A frozen vocabulary matrix `w` (embedding [V, D]: axis 0; untied lm_head [D, V]: axis 1) whose entry `index`
    along `axis` reads `value` [D] instead: the added mask token's trainable row. `input_only`: only the embedding
    lookup reads it; a tied head keeps the base's row (a copy-only adapter leaves every logit of the base)."""

    w: Any
    value: Any
    index: int
    axis: int
    input_only: bool = False

    def embed(self, tokens_BT):
        return jnp.where((tokens_BT == self.index)[..., None], self.value, self.w[tokens_BT])

    def logits(self, spec: str, h_BTD, dtype):
        """The base's logits; the patched entry's is its own row's (not an `input_only` patch's)."""
        logits = jnp.einsum(spec, h_BTD, self.w, preferred_element_type=dtype)
        if self.input_only:
            return logits
        own = jnp.einsum("btd,d->bt", h_BTD, self.value, preferred_element_type=dtype)
        return logits.at[..., self.index].set(own)


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


# short target name -> the weight it adapts (PARAM_SPECS names, without "layers/")
LORA_TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
_SPECS = {s.name.removeprefix("layers/"): s for s in PARAM_SPECS}


@dataclasses.dataclass(frozen=True)
class AdapterLayout:
    """What an adapter holds: rank r, alpha (scale alpha / r), the target weights (LORA_TARGETS keys) and the added
    mask token whose embedding row (and untied lm_head column) trains (None: no token was added).

    `copy_only`: the adapter applies to copy-stream (mask) tokens only, and the mask row only as an input: clean
    tokens run the base model bit for bit, so AR decoding and lossless (verify) output are the base's own, and the
    clean half of a training example needs no backward pass. Such an adapter cannot be merged into the weights."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(LORA_TARGETS)
    mask_row: int | None = None
    copy_only: bool = False

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ConfigError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"LoRA alpha must be > 0, got {self.alpha}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets must be distinct names among {list(LORA_TARGETS)}, got "
                              f"{list(self.targets)}" + (f" (unknown: {bad})" if bad else ""))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One adapter array: its tree path, logical axes (what sbd_jax.sharding maps to the mesh) and shape; `init`
    "uniform" (A: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), PEFT's default), "zeros" (B: the adapter starts as a no-op)
    or "row" (a copy of the base's mask-token row). `weight`: the ParamSpec it adapts."""

    name: str
    logical_axes: tuple[str, ...]
    dims: tuple[int, ...]
    init: str
    weight: ParamSpec

    def shape(self, cfg: ModelConfig | None = None) -> tuple[int, ...]:
        return self.dims


def target_spec(target: str) -> ParamSpec:
    """The ParamSpec a target ("q", ..., "down") adapts."""
    return _SPECS[LORA_TARGETS[target]]


def io_axes(spec: ParamSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A linear weight's input and output logical axes ("embed heads*head_dim" -> (embed,), (heads, head_dim))."""
    first, second = spec.axes.split()
    return tuple(first.split("*")), tuple(second.split("*"))


def adapter_specs(cfg: ModelConfig, layout: AdapterLayout) -> dict:
    """The adapter's table as its tree: {"layers": {weight: {"a", "b"}}, "mask_embed", "mask_head" (untied)}."""
    sizes = axis_sizes(cfg)
    layers = {}
    for t in layout.targets:
        w = target_spec(t)
        ins, outs = io_axes(w)
        a_axes, b_axes = ("layers", *ins, "lora_rank"), ("layers", "lora_rank", *outs)
        dims = lambda axes: tuple(layout.rank if a == "lora_rank" else sizes[a] for a in axes)  # noqa: E731
        n_in, n_out = (math.prod(sizes[a] for a in axes) for axes in (ins, outs))
        if layout.rank > min(n_in, n_out):  # A @ B's rank is at most min(in, out): more only adds parameters
            raise ConfigError(f"LoRA rank {layout.rank} is above what {t} ({n_in} in, {n_out} out) can use: at most "
                              f"{min(n_in, n_out)} (lora.rank)")
        layers[w.name.removeprefix("layers/")] = {
            "a": AdapterSpec(f"{w.name}/a", a_axes, dims(a_axes), "uniform", w),
            "b": AdapterSpec(f"{w.name}/b", b_axes, dims(b_axes), "zeros", w)}
    tree: dict = {"layers": layers}
    if layout.mask_row is not None:
        if not 0 <= layout.mask_row < cfg.vocab_size:
            raise ConfigError(f"the adapter's mask token row {layout.mask_row} is outside the vocabulary "
                              f"[0, {cfg.vocab_size})")
        tree["mask_embed"] = AdapterSpec("mask_embed", ("embed",), (cfg.hidden_size,), "row", _SPECS["embed"])
        if not cfg.tie_word_embeddings and not layout.copy_only:
            tree["mask_head"] = AdapterSpec("mask_head", ("embed",), (cfg.hidden_size,), "row", _SPECS["lm_head"])
    return tree


def init_adapter(cfg: ModelConfig, layout: AdapterLayout, key, base: dict) -> dict:
    """A uniform, B zeros (so attach(base, init) == base), mask rows copied from `base` (already holding the added
    row); in cfg.param_dtype."""
    specs, treedef = jax.tree.flatten(adapter_specs(cfg, layout))
    dtype = jnp.dtype(cfg.param_dtype)

    def init(s: AdapterSpec, k):
        if s.init == "uniform":
            bound = 1.0 / math.sqrt(math.prod(s.dims[1:-1]))
            return jax.random.uniform(k, s.dims, jnp.float32, -bound, bound).astype(dtype)
        if s.init == "zeros":
            return jnp.zeros(s.dims, dtype)
        return _mask_entry(base, s.name, layout.mask_row).astype(dtype)
    return jax.tree.unflatten(treedef, [init(s, k) for s, k in zip(specs, jax.random.split(key, len(specs)))])


def _mask_entry(base: dict, name: str, row: int):
    return base["embed"][row] if name == "mask_embed" else base["lm_head"][:, row]


def attach(base: dict, adapter: dict, layout: AdapterLayout) -> dict:
    """The tree `forward` runs: the base with each target weight a LoRAWeight and the mask token's embedding row
    (and untied lm_head column) a RowPatch. Nothing is merged: the forward adds (x @ A) @ B * scale per weight."""
    layers = dict(base["layers"])
    for name, ab in adapter["layers"].items():
        layers[name] = LoRAWeight(layers[name], ab["a"], ab["b"], layout.scale, layout.copy_only)
    out = {**base, "layers": layers}
    if "mask_embed" in adapter:
        out["embed"] = RowPatch(base["embed"], adapter["mask_embed"], layout.mask_row, 0, layout.copy_only)
    if "mask_head" in adapter:
        out["lm_head"] = RowPatch(base["lm_head"], adapter["mask_head"], layout.mask_row, 1)
    return out


@functools.partial(jax.jit, static_argnums=3)
def merged_weight(w, a, b, scale: float):
    """W + scale * A @ B for one stacked weight [L, in..., out...], a layer at a time (float32 inside, returned in
    w's dtype): the temporaries are one layer's, not the whole stack's."""
    def one(args):
        wl, al, bl = args
        r = al.shape[-1]
        delta = al.reshape(-1, r).astype(jnp.float32) @ bl.reshape(r, -1).astype(jnp.float32)
        return (wl.astype(jnp.float32) + scale * delta.reshape(wl.shape)).astype(wl.dtype)
    return jax.lax.map(one, (w, a, b))


def put_row(w, value, index: int, axis: int):
    """`w` with entry `index` along `axis` (0: embedding rows, 1: lm_head columns) set to `value`; appended when
    `index` is the vocabulary size (a token the adapter's run added to its base)."""
    value = jnp.asarray(value, w.dtype)
    if index == w.shape[axis]:
        return jnp.concatenate([w, jnp.expand_dims(value, axis)], axis=axis)
    return w.at[index].set(value) if axis == 0 else w.at[:, index].set(value)


def merge(base: dict, adapter: dict, layout: AdapterLayout, *, delete: bool = False) -> dict:
    """Plain parameters with the adapter folded in: W_eff per target weight, the mask row (and untied lm_head
    column) written. `delete`: free each base weight once its merged copy exists (peak: the weights plus one)."""
    if layout.copy_only:
        raise ConfigError("a copy-only LoRA adapter applies to copy-stream tokens only, so no merged weights "
                          "express it: attach it instead (`attach_copy_only`)")
    layers = dict(base["layers"])
    for name, ab in adapter["layers"].items():
        old = layers[name]
        layers[name] = merged_weight(old, ab["a"], ab["b"], layout.scale)
        if delete and isinstance(old, jax.Array):
            old.delete()
    out = {**base, "layers": layers}
    for key, target, axis in (("mask_embed", "embed", 0), ("mask_head", "lm_head", 1)):
        if key in adapter:
            out[target] = put_row(base[target], adapter[key], layout.mask_row, axis)
    return out


def attach_copy_only(base: dict, adapter: dict, layout: AdapterLayout) -> dict:
    """The tree decoding runs for a copy-only adapter: the base (its vocabulary grown by the mask row when the
    adapter added it, that row being the adapter's) with each target weight a gated LoRAWeight."""
    out = dict(base)
    if "mask_embed" in adapter:
        out["embed"] = put_row(base["embed"], adapter["mask_embed"], layout.mask_row, 0)
        if "lm_head" in base:
            out["lm_head"] = put_row(base["lm_head"], jnp.zeros_like(adapter["mask_embed"]), layout.mask_row, 1)
    return attach(out, {"layers": adapter["layers"]}, layout)
