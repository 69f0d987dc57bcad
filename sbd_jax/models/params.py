"""The parameter tree of the Llama-3.x / Qwen3 decoder: a plain nested dict described by one table, `PARAM_SPECS`
(per-layer weights under "layers", stacked on a leading axis), its shapes, its random init and the decoding layout
(`unstack_layers`). A leaf is an array or a `Weight`, a weight that reads itself."""
from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Callable

import jax
import jax.numpy as jnp

from .config import ModelConfig


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Size of each logical axis (the names sbd_jax.sharding maps onto mesh axes)."""
    return {"vocab": cfg.vocab_size, "embed": cfg.hidden_size, "norm": cfg.hidden_size,
            "mlp": cfg.intermediate_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "layers": cfg.num_hidden_layers}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight. `name`: its key in the tree ("layers/<key>": one per layer, stacked on a leading "layers" axis).
    `axes`: the dims of one layer's weight by logical axis, which also sets their sizes (`axis_sizes`). `init`:
    "normal" (the std given to `init_params`; only these get weight decay), "ones" or "zeros", as HF initialises.
    `hf`: the HF tensor name (after `model.layers.{i}.` when per layer); HF stores the dims joined by `*` as one,
    and a torch Linear weight (`hf_t`) transposed, [out, in]. `when`: the configs that have it (None: all)."""

    name: str
    axes: str
    init: str
    hf: str
    hf_t: bool = False
    when: Callable[[ModelConfig], bool] | None = None

    @property
    def stacked(self) -> bool:
        return self.name.startswith("layers/")

    @property
    def logical_axes(self) -> tuple[str, ...]:
        return ("layers",) * self.stacked + tuple(self.axes.replace("*", " ").split())

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        return tuple(axis_sizes(cfg)[a] for a in self.logical_axes)


_BIAS, _QK_NORM = attrgetter("attention_bias"), attrgetter("qk_norm")
PARAM_SPECS = (
    ParamSpec("embed", "vocab embed", "normal", "model.embed_tokens.weight"),
    ParamSpec("final_norm", "norm", "ones", "model.norm.weight"),
    ParamSpec("lm_head", "embed vocab", "normal", "lm_head.weight", hf_t=True,
              when=lambda cfg: not cfg.tie_word_embeddings),
    ParamSpec("layers/attn_norm", "norm", "ones", "input_layernorm.weight"),
    ParamSpec("layers/mlp_norm", "norm", "ones", "post_attention_layernorm.weight"),
    ParamSpec("layers/wq", "embed heads*head_dim", "normal", "self_attn.q_proj.weight", hf_t=True),
    ParamSpec("layers/wk", "embed kv_heads*head_dim", "normal", "self_attn.k_proj.weight", hf_t=True),
    ParamSpec("layers/wv", "embed kv_heads*head_dim", "normal", "self_attn.v_proj.weight", hf_t=True),
    ParamSpec("layers/wo", "heads*head_dim embed", "normal", "self_attn.o_proj.weight", hf_t=True),
    ParamSpec("layers/bq", "heads*head_dim", "zeros", "self_attn.q_proj.bias", when=_BIAS),
    ParamSpec("layers/bk", "kv_heads*head_dim", "zeros", "self_attn.k_proj.bias", when=_BIAS),
    ParamSpec("layers/bv", "kv_heads*head_dim", "zeros", "self_attn.v_proj.bias", when=_BIAS),
    ParamSpec("layers/bo", "norm", "zeros", "self_attn.o_proj.bias", when=_BIAS),
    ParamSpec("layers/q_norm", "head_dim", "ones", "self_attn.q_norm.weight", when=_QK_NORM),
    ParamSpec("layers/k_norm", "head_dim", "ones", "self_attn.k_norm.weight", when=_QK_NORM),
    ParamSpec("layers/w_gate", "embed mlp", "normal", "mlp.gate_proj.weight", hf_t=True),
    ParamSpec("layers/w_up", "embed mlp", "normal", "mlp.up_proj.weight", hf_t=True),
    ParamSpec("layers/w_down", "mlp embed", "normal", "mlp.down_proj.weight", hf_t=True),
)


def param_specs(cfg: ModelConfig) -> dict:
    """The ParamSpecs of `cfg`'s weights, laid out as its parameter tree (they are its leaves)."""
    tree: dict = {"layers": {}}
    for s in PARAM_SPECS:
        if s.when is None or s.when(cfg):
            (tree["layers"] if s.stacked else tree)[s.name.removeprefix("layers/")] = s
    return tree


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every parameter for `cfg` (tuples are leaves): the layout of init, checkpoints and HF I/O."""
    return jax.tree.map(lambda s: s.shape(cfg), param_specs(cfg))


def init_params(cfg: ModelConfig, key, *, std: float = 0.02) -> dict:
    """Random init of every parameter by its spec's `init`."""
    specs, treedef = jax.tree.flatten(param_specs(cfg))
    dtype = jnp.dtype(cfg.param_dtype)

    def init(s: ParamSpec, k):
        if s.init == "normal":
            return (std * jax.random.normal(k, s.shape(cfg), jnp.float32)).astype(dtype)
        return (jnp.ones if s.init == "ones" else jnp.zeros)(s.shape(cfg), dtype)
    return jax.tree.unflatten(treedef, [init(s, k) for s, k in zip(specs, jax.random.split(key, len(specs)))])


def unstack_layers(params: dict, *, delete: bool = False) -> dict:
    """The decoding layout: `params["layers"]` as a tuple of per-layer dicts, each weight in its own buffer
    (sharded as the stacked one was, minus the layer axis). `forward` accepts both layouts. A scan over stacked
    weights slices them per layer, and XLA:GPU copies each slice before its matmul (BENCHMARKS.md: the copies
    took half of an 8B decode step); decoders convert once. `delete`: free each stacked leaf once split (peak
    memory: the weights plus one leaf). Already unstacked params are returned as they are."""
    if isinstance(params["layers"], (tuple, list)):
        return params
    L = jax.tree.leaves(params["layers"])[0].shape[0]

    def split(x):
        sh = getattr(x, "sharding", None)
        out = (jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:]))
               if isinstance(sh, jax.sharding.NamedSharding) else sh)
        parts = jax.jit(lambda a: tuple(a[i] for i in range(L)), out_shardings=(out,) * L if out else None)(x)
        if delete and isinstance(x, jax.Array):
            x.delete()
        return parts
    leaves, treedef = jax.tree.flatten(params["layers"])
    parts = [split(x) for x in leaves]
    layers = tuple(jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(L))
    return {**params, "layers": layers}


class Weight:
    """A parameter leaf that is not a plain array and reads itself in the forward's ops (layers.py): a quantized
    projection (quant.py), a LoRA weight or the added mask token's row (lora.py), a weight watched by GPTQ
    (gptq.py). Each type gives the reads it supports; they are pytrees, so the layer scan, remat, sharding and dtype
    casts treat their arrays like any weight."""

    def product(self, spec: str, x):
        """`jnp.einsum(spec, x, W)` for the weight W this stands for (spec: activations first, weight second)."""
        raise TypeError(f"{type(self).__name__} is not a projection weight")

    def embed(self, tokens_BT):
        """The embedding lookup [B, T, D]."""
        raise TypeError(f"{type(self).__name__} is not an embedding")

    def logits(self, spec: str, h_BTD, dtype):
        """The LM head's logits [B, T, V] in `dtype`."""
        raise TypeError(f"{type(self).__name__} is not an LM head")
