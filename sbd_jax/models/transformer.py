"""The Llama-3.x / Qwen3 decoder as pure functions of an explicit parameter pytree.

Parameters (a plain nested dict; layers stacked on a leading axis L and run with `lax.scan`):
  embed            [V, D]
  layers/attn_norm [L, D]       layers/mlp_norm [L, D]
  layers/wq        [L, D, H, Dh] layers/wk, wv [L, D, K, Dh]   layers/wo [L, H, Dh, D]
  layers/bq [L,H,Dh] bk,bv [L,K,Dh] bo [L,D]          (only with attention_bias)
  layers/q_norm, k_norm [L, Dh]                        (only Qwen3, qk_norm)
  layers/w_gate, w_up [L, D, F] layers/w_down [L, F, D]
  final_norm       [D]
  lm_head          [D, V]       (absent when tie_word_embeddings)

`forward` is the single entry point used by training, decoding, the demo and the tests.
Attention follows `cfg.attention_impl`; with "pallas" under an active mesh (`jax.set_mesh`, or
`sbd_jax.sharding.mesh_context` as the training step and the decoder set it) the kernels run per
shard inside `jax.shard_map` (sbd_jax/attention/sharded.py).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..attention import TokenMeta, attention, attention_parts, clean_meta, concat_meta
from ..attention.mask import CLEAN
from ..config import ModelConfig
from .layers import apply_rope, rms_norm, rope_inv_freq, swiglu

# logical axis names per parameter (used by sbd_jax.sharding to lay parameters out on a mesh)
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "layers": {
        "attn_norm": ("layers", "norm"),
        "mlp_norm": ("layers", "norm"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "bq": ("layers", "heads", "head_dim"),
        "bk": ("layers", "kv_heads", "head_dim"),
        "bv": ("layers", "kv_heads", "head_dim"),
        "bo": ("layers", "norm"),
        "q_norm": ("layers", "head_dim"),
        "k_norm": ("layers", "head_dim"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    },
}


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every parameter for `cfg` (the layout contract for init, checkpoints and HF I/O)."""
    L, D, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, Dh, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim, cfg.vocab_size
    layers = {
        "attn_norm": (L, D), "mlp_norm": (L, D),
        "wq": (L, D, H, Dh), "wk": (L, D, K, Dh), "wv": (L, D, K, Dh), "wo": (L, H, Dh, D),
        "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
    }
    if cfg.attention_bias:
        layers.update(bq=(L, H, Dh), bk=(L, K, Dh), bv=(L, K, Dh), bo=(L, D))
    if cfg.qk_norm:
        layers.update(q_norm=(L, Dh), k_norm=(L, Dh))
    shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def param_axes(cfg: ModelConfig) -> dict:
    """Logical axes with the same tree structure as `param_shapes(cfg)` (tuples are leaves)."""
    return {k: ({kk: PARAM_AXES["layers"][kk] for kk in v} if k == "layers" else PARAM_AXES[k])
            for k, v in param_shapes(cfg).items()}


def init_params(cfg: ModelConfig, key, *, std: float = 0.02) -> dict:
    """Random init as HF does (normal(0, std) matrices, ones for norms, zeros for biases)."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    dtype = jnp.dtype(cfg.param_dtype)
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name in ("bq", "bk", "bv", "bo"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


class KVCache(NamedTuple):
    """Static-shape KV cache. Slot s of row b holds the (clean, causal) K/V of position s of that
    row's sequence; `lengths[b]` = number of committed slots. k, v: [L, B, S, K, Dh]."""

    k: jnp.ndarray
    v: jnp.ndarray
    lengths: jnp.ndarray

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.resolved_head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def cache_meta(cache: KVCache) -> TokenMeta:
    """Metadata of the cache slots as keys: clean tokens of segment 1 at position = slot."""
    return causal_meta(cache.lengths, cache.max_len)


def _layer(cfg: ModelConfig, inv_freq, h_BTD, lp, meta: TokenMeta, cache_kv, write_slot_BT,
           kv_meta: tuple[TokenMeta, TokenMeta, TokenMeta] | None, clean_prefix: int | None = None):
    dt = jnp.dtype(cfg.dtype)
    p = jax.tree.map(lambda a: a.astype(dt), lp)
    x = rms_norm(h_BTD, p["attn_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", x, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", x, p["wv"])
    if cfg.attention_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, meta.position, inv_freq)
    k = apply_rope(k, meta.position, inv_freq)
    if cache_kv is None:
        new_cache_kv = None
        if clean_prefix:
            # [x ; x_hat] layout: the clean half only ever attends itself (L x L); the copy half attends all
            P = clean_prefix
            head = meta.take((slice(None), slice(None, P)))
            tail = meta.take((slice(None), slice(P, None)))
            o = jnp.concatenate([
                attention(q[:, :P], k[:, :P], v[:, :P], head, head, impl=cfg.attention_impl),
                attention(q[:, P:], k, v, tail, meta, impl=cfg.attention_impl)], axis=1)
        else:
            o = attention(q, k, v, meta, meta, impl=cfg.attention_impl)
    else:
        # the whole stacked cache [L, B, S, K, Dh] is carried through the layer scan and updated in
        # place at layer `li` (as scan xs/ys it was rebuilt, i.e. copied whole, at every call)
        ks, vs, li = cache_kv
        B = ks.shape[1]
        rows = jnp.arange(B)[:, None]
        ks = ks.at[li, rows, write_slot_BT].set(k.astype(ks.dtype), mode="drop")
        vs = vs.at[li, rows, write_slot_BT].set(v.astype(vs.dtype), mode="drop")
        new_cache_kv = (ks, vs)
        ck = jax.lax.dynamic_index_in_dim(ks, li, 0, keepdims=False)
        cv = jax.lax.dynamic_index_in_dim(vs, li, 0, keepdims=False)
        # keys = committed cache (clean) + this window's copy tokens (its clean tokens are in the cache)
        cache_kv_meta, window_kv_meta, full_meta = kv_meta
        # "pallas" reads the cache in place (no concatenated copy per layer; per shard under a
        # mesh, see sbd_jax/attention/sharded.py); "xla" concatenates
        o = attention_parts(q, [(ck.astype(dt), cv.astype(dt), cache_kv_meta), (k, v, window_kv_meta)], meta,
                            impl=cfg.attention_impl, kv_meta=full_meta)
    h_BTD = h_BTD + jnp.einsum("bthk,hkd->btd", o, p["wo"]) + (p["bo"] if cfg.attention_bias else 0)
    x = rms_norm(h_BTD, p["mlp_norm"], cfg.rms_norm_eps)
    h_BTD = h_BTD + swiglu(x, p["w_gate"], p["w_up"], p["w_down"])
    return h_BTD, new_cache_kv


def forward(params: dict, cfg: ModelConfig, tokens_BT, meta: TokenMeta, cache: KVCache | None = None,
            *, return_hidden: bool = False, clean_prefix: int | None = None):
    """Run the model on tokens with SBD metadata.

    Without a cache: attention among the given tokens under the SBD mask (training, the doubled
    `[x ; x_hat]` sequence, brute-force references, plain causal use with stream=0).

    With a cache (decoding; one sequence per row, segment 1 for real tokens, 0 for padding): every
    clean, non-padding token writes its K/V at slot = its position; queries then attend the cache
    (slots < the new length) and this call's copy tokens. Returns `(logits [B,T,V] float32, cache)`
    (`cache` is None when none was given). With `return_hidden`, the final-norm hidden states
    [B,T,D] are returned instead of logits.

    `clean_prefix=P` (no-cache only, static) promises that queries among the first P tokens of every row
    never attend keys beyond them - true for the training layout `[x ; x_hat]` with P = L (clean tokens
    never see the copy) and for any packed causal row. Attention then computes the P x P clean block and
    the (T-P) x T rest instead of the T x T square: 25% less attention work on the doubled sequence.
    """
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if tokens_BT.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens_BT.shape}")
    if clean_prefix is not None and (cache is not None or not 0 < clean_prefix < tokens_BT.shape[1]):
        raise ValueError(f"clean_prefix={clean_prefix} needs no cache and 0 < clean_prefix < T={tokens_BT.shape[1]}")
    dt = jnp.dtype(cfg.dtype)
    inv_freq = rope_inv_freq(cfg)
    h = params["embed"].astype(dt)[tokens_BT]

    if cache is None:
        def body(h, lp):
            h, _ = _layer(cfg, inv_freq, h, lp, meta, None, None, None, clean_prefix)
            return h, None
        h, _ = jax.lax.scan(body, h, params["layers"], unroll=cfg.scan_unroll)
        new_cache = None
    else:
        S = cache.max_len
        writes = (meta.stream == CLEAN) & (meta.segment > 0)
        write_slot = jnp.where(writes, meta.position, S)  # out of range -> dropped
        new_len = jnp.maximum(cache.lengths, jnp.max(jnp.where(writes, meta.position + 1, 0), axis=1))
        committed = cache._replace(lengths=new_len)
        window_keys = meta._replace(segment=jnp.where(meta.stream == CLEAN, 0, meta.segment))
        cmeta = cache_meta(committed)
        kv_meta = (cmeta, window_keys, concat_meta(cmeta, window_keys))  # built once, not per layer

        def body(carry, xs):
            h, ks, vs = carry
            lp, li = xs
            h, (ks, vs) = _layer(cfg, inv_freq, h, lp, meta, (ks, vs, li), write_slot, kv_meta)
            return (h, ks, vs), None
        layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
        (h, ks, vs), _ = jax.lax.scan(body, (h, cache.k, cache.v), (params["layers"], layer_ids))
        new_cache = KVCache(ks, vs, new_len)

    h = rms_norm(h, params["final_norm"].astype(dt), cfg.rms_norm_eps)
    if return_hidden:
        return h, new_cache
    return lm_head(params, cfg, h), new_cache


def lm_head(params: dict, cfg: ModelConfig, h_BTD):
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_word_embeddings:
        w_VD = params["embed"].astype(dt)
        return jnp.einsum("btd,vd->btv", h_BTD, w_VD, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", h_BTD, params["lm_head"].astype(dt), preferred_element_type=jnp.float32)


def causal_meta(lengths_B, T: int) -> TokenMeta:
    """Metadata for plain causal use: row b holds one sequence of length lengths_B[b], right-padded."""
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (jnp.shape(lengths_B)[0], T))
    seg = (pos < jnp.asarray(lengths_B)[:, None]).astype(jnp.int32)
    return clean_meta(seg, pos)
