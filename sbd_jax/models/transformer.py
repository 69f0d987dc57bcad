"""The Llama-3.x / Qwen3 decoder as pure functions of an explicit parameter pytree (its table, `PARAM_SPECS`:
params.py); per-layer weights sit under "layers", stacked on a leading axis and run with `lax.scan`. `forward` is
the single entry point of training, decoding, the demo and the tests. Attention follows `cfg.attention_impl`;
"pallas" under an active mesh (`jax.set_mesh`, or `sbd_jax.sharding.mesh_context` as the training step and the
decoder set it) runs the kernels per shard in `jax.shard_map` (sbd_jax/attention/sharded.py)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..attention import TokenMeta, attention, attention_parts, clean_meta, concat_meta
from ..attention.mask import CLEAN, COPY
from .config import ModelConfig
from .layers import apply_rope, embed_rows, head_logits, project, rms_norm, rope_inv_freq, swiglu
from .lora import base_of, gated, has_copy_only
from .quant import cast_floats


class KVCache(NamedTuple):
    """Static-shape KV cache. Slot s of row b holds the (clean, causal) K/V of position s of that
    row's sequence; `lengths[b]` = number of committed slots. k, v: [L, B, S, K, Dh]. An int8 cache
    (`init_cache(..., "int8")`) also holds k_scale, v_scale [L, B, S, K]: a slot's K (V) of a head is its int8
    values times that scale (symmetric, per position and head; `quantize_kv`)."""

    k: jnp.ndarray
    v: jnp.ndarray
    lengths: jnp.ndarray
    k_scale: jnp.ndarray | None = None
    v_scale: jnp.ndarray | None = None

    def arrays(self) -> tuple:
        """The per-slot arrays (k, v[, k_scale, v_scale]): all [L, B, S, ...]."""
        return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.k_scale is not None else ())

    def with_arrays(self, arrays, lengths=None) -> KVCache:
        return KVCache(*arrays[:2], self.lengths if lengths is None else lengths, *arrays[2:])


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """A zero cache in `dtype` (default the compute dtype; "int8" adds per-slot, per-head scales in it)."""
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    lengths = jnp.zeros((batch,), jnp.int32)
    if dtype == jnp.int8:
        scale = jnp.zeros(shape[:-1], cfg.dtype)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths, scale, scale)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)


def quantize_kv(x_BTKD, scale_dtype):
    """-> (int8 values, scales [B, T, K] in `scale_dtype`): per position and head, its largest |value| maps to 127
    (the scale rounded to its storage type first, so values and the stored scale agree)."""
    x = x_BTKD.astype(jnp.float32)
    s = (jnp.max(jnp.abs(x), axis=-1) / 127.0).astype(scale_dtype)
    s32 = jnp.where(s > 0, s.astype(jnp.float32), 1.0)
    return jnp.clip(jnp.round(x / s32[..., None]), -127, 127).astype(jnp.int8), s


def _write_kv(arrays: tuple, li, rows, slot_BT, k, v) -> tuple:
    """The cache arrays with layer `li`'s K/V of this call written at `slot_BT` (out of range: dropped)."""
    put = lambda a, x: a.at[li, rows, slot_BT].set(x.astype(a.dtype), mode="drop")  # noqa: E731
    if len(arrays) == 2:
        return put(arrays[0], k), put(arrays[1], v)
    (qk, sk), (qv, sv) = quantize_kv(k, arrays[2].dtype), quantize_kv(v, arrays[3].dtype)
    return put(arrays[0], qk), put(arrays[1], qv), put(arrays[2], sk), put(arrays[3], sv)


def _read_kv(arrays: tuple, li, dt):
    """Layer `li`'s cached K, V [B, S, K, Dh] in `dt` (an int8 cache's values times their scales)."""
    layer = [jax.lax.dynamic_index_in_dim(a, li, 0, keepdims=False) for a in arrays]
    if len(layer) == 2:
        return layer[0].astype(dt), layer[1].astype(dt)
    k, v, sk, sv = layer
    return k.astype(dt) * sk[..., None].astype(dt), v.astype(dt) * sv[..., None].astype(dt)


def _qkv(cfg: ModelConfig, inv_freq, h_BTD, p, meta: TokenMeta):
    """A layer's queries, keys and values (RoPE applied) for hidden states `h_BTD`."""
    x = rms_norm(h_BTD, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = (project("btd,dhk->bthk", x, p[w]) for w in ("wq", "wk", "wv"))
    if cfg.attention_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return (*(apply_rope(t, meta.position, inv_freq) for t in (q, k)), v)


def _finish(cfg: ModelConfig, h_BTD, o, p):
    """The attention output projected and added, then the MLP block."""
    h_BTD = h_BTD + project("bthk,hkd->btd", o, p["wo"]) + (p["bo"] if cfg.attention_bias else 0)
    with jax.named_scope("mlp"):
        x = rms_norm(h_BTD, p["mlp_norm"], cfg.rms_norm_eps)
        return h_BTD + swiglu(x, p["w_gate"], p["w_up"], p["w_down"])


def _frozen_clean_layer(cfg: ModelConfig, inv_freq, h_BTD, p, meta: TokenMeta, P: int):
    """[x ; x_hat] under a copy-only adapter: the clean half (first P tokens) is the base model's own computation,
    which no trainable weight reaches, so it runs without the adapter and outside the gradient (no backward pass);
    the copy half runs with the adapter and attends the clean half's K/V and its own."""
    head, tail = (meta.take((slice(None), s)) for s in (slice(None, P), slice(P, None)))
    pb, px = base_of(p), gated(p, tail.stream == COPY)
    hc, hx = jax.lax.stop_gradient(h_BTD[:, :P]), h_BTD[:, P:]
    with jax.named_scope("attention"):
        qc, kc, vc = jax.lax.stop_gradient(_qkv(cfg, inv_freq, hc, pb, head))
        qx, kx, vx = _qkv(cfg, inv_freq, hx, px, tail)
        oc = attention(qc, kc, vc, head, head, impl=cfg.attention_impl)
        ox = attention(qx, jnp.concatenate([kc, kx], 1), jnp.concatenate([vc, vx], 1), tail, meta,
                       impl=cfg.attention_impl)
    hc = jax.lax.stop_gradient(_finish(cfg, hc, oc, pb))
    return jnp.concatenate([hc, _finish(cfg, hx, ox, px)], axis=1)


_REMAT = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@jax.named_scope("layer")
def _layer(cfg: ModelConfig, inv_freq, h_BTD, lp, meta: TokenMeta, cache_kv, write_slot_BT,
           kv_meta: tuple[TokenMeta, TokenMeta, TokenMeta] | None, clean_prefix: int | None = None):
    dt = jnp.dtype(cfg.dtype)
    p = cast_floats(lp, dt)
    copy_only = has_copy_only(p)
    if copy_only and cache_kv is None and clean_prefix:
        return _frozen_clean_layer(cfg, inv_freq, h_BTD, p, meta, clean_prefix), None
    if copy_only:
        p = gated(p, meta.stream == COPY)
    with jax.named_scope("attention"):
        q, k, v = _qkv(cfg, inv_freq, h_BTD, p, meta)
        if cache_kv is None:
            new_cache_kv = None
            if clean_prefix:
                # [x ; x_hat] layout: the clean half only ever attends itself (P x P); the copy half attends all
                P = clean_prefix
                head, tail = (meta.take((slice(None), s)) for s in (slice(None, P), slice(P, None)))
                o = jnp.concatenate([
                    attention(q[:, :P], k[:, :P], v[:, :P], head, head, impl=cfg.attention_impl),
                    attention(q[:, P:], k, v, tail, meta, impl=cfg.attention_impl)], axis=1)
            else:
                o = attention(q, k, v, meta, meta, impl=cfg.attention_impl)
        else:
            # the whole stacked cache [L, B, S, K, Dh] is carried through the layer scan and written in place
            # at layer `li` (scanned as xs/ys it would be copied whole at every call)
            arrays, li = cache_kv
            new_cache_kv = _write_kv(arrays, li, jnp.arange(arrays[0].shape[1])[:, None], write_slot_BT, k, v)
            ck, cv = _read_kv(new_cache_kv, li, dt)
            # keys = committed cache (clean) + this window's copy tokens (its clean tokens are in the cache);
            # "pallas" reads the cache in place (per shard under a mesh), "xla" concatenates
            cache_kv_meta, window_kv_meta, full_meta = kv_meta
            o = attention_parts(q, [(ck, cv, cache_kv_meta), (k, v, window_kv_meta)], meta, impl=cfg.attention_impl,
                                kv_meta=full_meta)
    return _finish(cfg, h_BTD, o, p), new_cache_kv


def forward(params: dict, cfg: ModelConfig, tokens_BT, meta: TokenMeta, cache: KVCache | None = None,
            *, return_hidden: bool = False, clean_prefix: int | None = None):
    """Run the model on tokens with SBD metadata -> `(logits [B,T,V] float32, cache)` (`cache` is None when
    none was given); with `return_hidden`, the final-norm hidden states [B,T,D] instead of logits.

    Without a cache: attention among the given tokens under the SBD mask (training's doubled `[x ; x_hat]`
    sequence, brute-force references, plain causal use with stream=0). With a cache (decoding; one sequence
    per row, segment 1 for real tokens, 0 for padding): every clean, non-padding token writes its K/V at
    slot = its position; queries then attend the cache (slots < the new length) and this call's copy tokens.

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
    h = embed_rows(jax.tree.map(lambda a: a.astype(dt), params["embed"]), tokens_BT)

    if cache is None:
        def body(h, xs):
            return _layer(cfg, inv_freq, h, xs[0], meta, None, None, None, clean_prefix)[0], None
        if cfg.remat != "none":  # the backward pass recomputes each layer from its input (and the saved dots)
            body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
        h = _over_layers(body, h, params["layers"], cfg)
        new_cache = None
    else:
        writes = (meta.stream == CLEAN) & (meta.segment > 0)
        S = cache.k.shape[2]  # cache slots; a write to slot S is out of range, so dropped
        write_slot = jnp.where(writes, meta.position, S)
        new_len = jnp.maximum(cache.lengths, jnp.max(jnp.where(writes, meta.position + 1, 0), axis=1))
        window_keys = meta._replace(segment=jnp.where(meta.stream == CLEAN, 0, meta.segment))
        cmeta = causal_meta(new_len, S)  # the cache slots as keys: clean, position = slot
        kv_meta = (cmeta, window_keys, concat_meta(cmeta, window_keys))  # built once, not per layer

        def body(carry, xs):
            (h, arrays), (lp, li) = carry, xs
            return _layer(cfg, inv_freq, h, lp, meta, (arrays, li), write_slot, kv_meta), None
        h, arrays = _over_layers(body, (h, cache.arrays()), params["layers"], cfg)
        new_cache = cache.with_arrays(arrays, new_len)

    h = rms_norm(h, params["final_norm"].astype(dt), cfg.rms_norm_eps)
    return (h if return_hidden else lm_head(params, cfg, h)), new_cache


def _over_layers(body, carry, layers, cfg: ModelConfig):
    """`body(carry, (layer params, layer index))` over the layers: a `lax.scan` over stacked weights, a Python loop
    over `unstack_layers`' per-layer ones (no per-step slicing of the weights)."""
    if isinstance(layers, (tuple, list)):
        for li, lp in enumerate(layers):
            carry, _ = body(carry, (lp, li))
        return carry
    ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
    return jax.lax.scan(body, carry, (layers, ids), unroll=cfg.scan_unroll)[0]


@jax.named_scope("lm_head")
def lm_head(params: dict, cfg: ModelConfig, h_BTD):
    """Logits [B, T, V] in float32 (the tied head reuses the embedding)."""
    w, spec = (params["embed"], "btd,vd->btv") if cfg.tie_word_embeddings else (params["lm_head"], "btd,dv->btv")
    return head_logits(spec, h_BTD, jax.tree.map(lambda a: a.astype(cfg.dtype), w), jnp.float32)


def causal_meta(lengths_B, T: int) -> TokenMeta:
    """Metadata for plain causal use: row b holds one sequence of length lengths_B[b], right-padded."""
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (jnp.shape(lengths_B)[0], T))
    seg = (pos < jnp.asarray(lengths_B)[:, None]).astype(jnp.int32)
    return clean_meta(seg, pos)
