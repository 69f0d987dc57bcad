"""Fused SBD attention kernels in Pallas (training flash attention + flash-decoding).

`pallas_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)` has the signature and semantics of
`reference_attention` (the oracle): GQA, f32 softmax, rows that see nothing return 0. It picks a
kernel from the shapes (see `PallasOptions.kernel`), is differentiable (custom VJP: flash
backward kernels for dq and dk/dv, whichever forward kernel ran) and picks the Pallas backend
from `jax.default_backend()` (CPU -> interpret mode).

`pallas_attention_parts(q, [(cache_k, cache_v, cache_meta), (win_k, win_v, win_meta)], q_meta)`
is the same attention over K/V given in parts, so decoding can read the cache in place.

Two kernel families, chosen by backend (options.py): Triton-style kernels ("triton" on GPU,
"interpret" on CPU) and Mosaic-TPU kernels ("tpu"; `interpret=True` or
`force_backend("tpu", interpret=True)` runs them in TPU interpret mode on CPU).

STATUS:
  Verified: interpret mode on CPU against `reference_attention`, for both families
  (tests/test_pallas_attention.py, tests/test_pallas_model.py, tests/test_pallas_tpu.py:
  outputs and gradients, f32 and bf16, GQA/MQA, packed segments, ragged caches, whole model);
  Pallas -> Triton IR lowering for an abstract H100 and Pallas -> Mosaic lowering for TPU, on
  CPU (tests/test_pallas_lowering.py); the Triton-style kernels compiled and run on an H100
  (test_pallas_attention.py + test_pallas_model.py pass there; speed in BENCHMARKS.md).
  Not verified: Mosaic layout passes / libtpu compilation and TPU runtime and speed.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..mask import TokenMeta, concat_meta
from . import tpu_decode, tpu_train
from .decode import decode_forward, decode_forward_parts
from .flash_train import train_backward, train_forward
from .options import (
    DEFAULT_BLOCKS,
    BlockSizes,
    PallasOptions,
    PallasOptionsError,
    check_head_dim,
    check_tpu_blocks,
    check_triton_blocks,
    force_backend,
)


class PallasAttentionError(ValueError):
    """Inputs the kernels cannot take (shapes, dtypes, metadata)."""


def choose_kernel(Tq: int, Tk: int, opts: PallasOptions) -> str:
    """"decode" when there are more keys than queries (a KV cache in front of the window) and
    the window is small; otherwise "train". Overridden by opts.kernel != "auto"."""
    if opts.kernel != "auto":
        return opts.kernel
    return "decode" if (Tk > Tq and Tq <= opts.decode_max_q) else "train"


class _Kernels(NamedTuple):
    train_forward: Callable
    train_backward: Callable
    decode_forward: Callable
    decode_forward_parts: Callable


_TRITON_STYLE = _Kernels(train_forward, train_backward, decode_forward, decode_forward_parts)
_TPU = _Kernels(tpu_train.train_forward, tpu_train.train_backward, tpu_decode.decode_forward,
                tpu_decode.decode_forward_parts)


def _kernels(opts: PallasOptions) -> _Kernels:
    """Mosaic-TPU kernels for backend "tpu" (compiled, or TPU interpret mode); the Triton-style
    kernels for "triton" and "interpret"."""
    return _TPU if opts.backend == "tpu" else _TRITON_STYLE


def _forward(q, k, v, q_meta, kv_meta, opts):
    kind = choose_kernel(q.shape[1], k.shape[1], opts)
    ks = _kernels(opts)
    fn = ks.decode_forward if kind == "decode" else ks.train_forward
    return fn(q, k, v, q_meta, kv_meta, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sbd_attention(q, k, v, q_meta, kv_meta, opts):
    return _forward(q, k, v, q_meta, kv_meta, opts)[0]


def _sbd_attention_fwd(q, k, v, q_meta, kv_meta, opts):
    o, lse = _forward(q, k, v, q_meta, kv_meta, opts)
    return o, (q, k, v, q_meta, kv_meta, o, lse)


def _sbd_attention_bwd(opts, res, do):
    q, k, v, q_meta, kv_meta, o, lse = res
    dq, dk, dv = _kernels(opts).train_backward(q, k, v, q_meta, kv_meta, o, lse, do, opts)
    return dq, dk, dv, None, None


_sbd_attention.defvjp(_sbd_attention_fwd, _sbd_attention_bwd)


def _concat_parts(parts):
    k = jnp.concatenate([p[0] for p in parts], axis=1)
    v = jnp.concatenate([p[1] for p in parts], axis=1)
    meta = concat_meta(*(p[2] for p in parts), axis=1)
    return k, v, meta


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sbd_attention_parts(q, parts, q_meta, opts):
    return _kernels(opts).decode_forward_parts(q, parts, q_meta, opts)[0]


def _sbd_attention_parts_fwd(q, parts, q_meta, opts):
    o, lse = _kernels(opts).decode_forward_parts(q, parts, q_meta, opts)
    return o, (q, parts, q_meta, o, lse)


def _sbd_attention_parts_bwd(opts, res, do):
    # not a decoding need; correct but concatenates (the backward kernels take one K/V)
    q, parts, q_meta, o, lse = res
    k, v, kv_meta = _concat_parts(parts)
    dq, dk, dv = _kernels(opts).train_backward(q, k, v, q_meta, kv_meta, o, lse, do, opts)
    bounds = [int(x) for x in np.cumsum([p[0].shape[1] for p in parts])[:-1]]
    dks, dvs = jnp.split(dk, bounds, axis=1), jnp.split(dv, bounds, axis=1)
    return dq, tuple((a, b, None) for a, b in zip(dks, dvs)), None


_sbd_attention_parts.defvjp(_sbd_attention_parts_fwd, _sbd_attention_parts_bwd)


def _validate(q, k, v, q_meta, kv_meta):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise PallasAttentionError(f"{name} must be 4-D [batch, time, heads, head_dim], "
                                       f"got shape {getattr(x, 'shape', None)}")
    B, Tq, H, D = q.shape
    if k.shape != v.shape:
        raise PallasAttentionError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if k.shape[0] != B or k.shape[3] != D:
        raise PallasAttentionError(f"k/v shape {k.shape} does not match q {q.shape} "
                                   "(batch and head_dim must agree)")
    K = k.shape[2]
    if H % K:
        raise PallasAttentionError(f"query heads {H} must be a multiple of kv heads {K}")
    if not (q.dtype == k.dtype == v.dtype):
        raise PallasAttentionError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise PallasAttentionError(f"q, k, v must be floating point, got {q.dtype}")
    for name, meta, T in (("q_meta", q_meta, Tq), ("kv_meta", kv_meta, k.shape[1])):
        if not isinstance(meta, TokenMeta):
            raise PallasAttentionError(f"{name} must be a TokenMeta, got {type(meta).__name__}")
        for field, f in zip(TokenMeta._fields, meta):
            if tuple(jnp.shape(f)) != (B, T):
                raise PallasAttentionError(f"{name}.{field} has shape {tuple(jnp.shape(f))}, "
                                           f"expected {(B, T)}")
            if not jnp.issubdtype(jnp.result_type(f), jnp.integer):
                raise PallasAttentionError(f"{name}.{field} must be integer, got {jnp.result_type(f)}")


def pallas_attention(q_BTHD, k_BSKD, v_BSKD, q_meta: TokenMeta, kv_meta: TokenMeta, *,
                     kernel: str = "auto", backend: str | None = None,
                     blocks: BlockSizes | None = None, scale: float | None = None,
                     interpret: bool | None = None, options: PallasOptions | None = None):
    """SBD attention with Pallas kernels; drop-in for `reference_attention`.

    q_BTHD [B, T, H, D]; k/v_BSKD [B, S, K, D] (H a multiple of K); metadata [B, T] / [B, S].
    `kernel`: "auto" | "train" | "decode"; `backend`: None (from jax.default_backend()) |
    "interpret" | "triton" | "tpu"; `blocks`: tile sizes (None: per-backend defaults);
    `interpret`: with backend "tpu", run the Mosaic-TPU kernels in TPU interpret mode (CPU);
    or pass a whole `options` (then the other keywords must be left at their defaults).
    """
    if options is None:
        options = PallasOptions(kernel=kernel, backend=backend, blocks=blocks, scale=scale,
                                interpret=interpret)
    elif (kernel, backend, blocks, scale, interpret) != ("auto", None, None, None, None):
        raise PallasOptionsError("pass either `options` or the individual keywords, not both")
    _validate(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)
    opts = options.resolved()
    D = q_BTHD.shape[-1]
    if opts.scale is None:
        opts = dataclasses.replace(opts, scale=float(D) ** -0.5)
    check_head_dim(opts.backend, D)
    check_triton_blocks(opts.backend, opts.blocks)
    check_tpu_blocks(opts)
    q_meta = TokenMeta(*(jnp.asarray(f, jnp.int32) for f in q_meta))
    kv_meta = TokenMeta(*(jnp.asarray(f, jnp.int32) for f in kv_meta))
    return _sbd_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta, opts)


def pallas_attention_parts(q_BTHD, kv_parts, q_meta: TokenMeta, *, kernel: str = "auto",
                           backend: str | None = None, blocks: BlockSizes | None = None,
                           scale: float | None = None, interpret: bool | None = None,
                           options: PallasOptions | None = None):
    """`pallas_attention` over keys/values given as parts of one sequence, WITHOUT concatenating
    them: kv_parts = [(k_BSKD, v_BSKD, kv_meta), ...] means k = concat(k_i), kv_meta =
    concat(meta_i) along time. Meant for decoding: [(cache_k, cache_v, cache_meta),
    (window_k, window_v, window_key_meta)] reads the cache in place instead of copying it into
    a concatenated array every layer. The decode kernel runs once per part and the partial
    softmaxes are merged. If the shapes call for the training kernel (long prefill), the parts
    are concatenated and `pallas_attention` is used.
    """
    if options is None:
        options = PallasOptions(kernel=kernel, backend=backend, blocks=blocks, scale=scale,
                                interpret=interpret)
    elif (kernel, backend, blocks, scale, interpret) != ("auto", None, None, None, None):
        raise PallasOptionsError("pass either `options` or the individual keywords, not both")
    kv_parts = tuple(tuple(p) for p in kv_parts)
    if not kv_parts or any(len(p) != 3 for p in kv_parts):
        raise PallasAttentionError("kv_parts must be a non-empty sequence of (k, v, kv_meta)")
    for k, v, m in kv_parts:
        _validate(q_BTHD, k, v, q_meta, m)
    if len({p[0].shape[2] for p in kv_parts}) != 1:
        raise PallasAttentionError("all kv_parts must have the same number of kv heads")
    Tk = sum(p[0].shape[1] for p in kv_parts)
    opts = options.resolved()
    if choose_kernel(q_BTHD.shape[1], Tk, opts) == "train":
        k, v, m = _concat_parts(kv_parts)
        return pallas_attention(q_BTHD, k, v, q_meta, m, options=options)
    D = q_BTHD.shape[-1]
    if opts.scale is None:
        opts = dataclasses.replace(opts, scale=float(D) ** -0.5)
    check_head_dim(opts.backend, D)
    check_triton_blocks(opts.backend, opts.blocks)
    check_tpu_blocks(opts)
    as_meta = lambda m: TokenMeta(*(jnp.asarray(f, jnp.int32) for f in m))
    kv_parts = tuple((k, v, as_meta(m)) for k, v, m in kv_parts)
    return _sbd_attention_parts(q_BTHD, kv_parts, as_meta(q_meta), opts)


__all__ = [
    "DEFAULT_BLOCKS",
    "BlockSizes",
    "PallasAttentionError",
    "PallasOptions",
    "PallasOptionsError",
    "choose_kernel",
    "decode_forward",
    "force_backend",
    "pallas_attention",
    "pallas_attention_parts",
    "train_backward",
    "train_forward",
]
