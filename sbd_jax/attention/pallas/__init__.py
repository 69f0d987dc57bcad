"""Fused SBD attention kernels in Pallas: flash attention for training and flash-decoding.

`pallas_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)` has the signature and semantics of
`reference_attention` (the oracle): GQA, f32 softmax, rows that see nothing return 0. It picks a
kernel from the shapes (`choose_kernel`) and a kernel family from the backend (options.py), and is
differentiable (custom VJP: flash backward kernels for dq and dk/dv, whichever forward ran).
`pallas_attention_parts(q, [(cache_k, cache_v, cache_meta), (win_k, win_v, win_meta)], q_meta)`
is the same attention over K/V given in parts, so decoding reads its cache in place.

Two kernel families share the tile lists (`tiling`) and in-kernel helpers (`kernel_common`):
Triton-style (`flash_train`, `decode`: GPU through the Triton lowering, CPU in interpret mode) and
Mosaic-TPU (`tpu_train`, `tpu_decode`, with `tpu_common`).

Verified: both families against the reference in interpret mode on CPU (tests/test_pallas_attention.py,
tests/test_pallas_model.py: outputs and gradients, f32 and bf16, GQA/MQA, packed segments, ragged
caches, the whole model), also per shard on 8 CPU devices (tests/test_pallas_sharded.py); their
lowering to Triton IR for an abstract H100 and to Mosaic for TPU (tests/test_pallas_lowering.py);
the Triton-style kernels on an H100 (BENCHMARKS.md "Pallas kernels on an H100"). Not verified:
the TPU kernels' compilation by libtpu, runtime and speed (untuned tiles), real multi-device meshes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..mask import TokenMeta
from ..reference import concat_parts
from . import decode, flash_train, tpu_decode, tpu_train
from .options import DEFAULT_BLOCKS, BlockSizes, PallasOptions, PallasOptionsError, force_backend


class PallasAttentionError(ValueError):
    """Inputs the kernels cannot take (shapes, dtypes, metadata)."""


def choose_kernel(Tq: int, Tk: int, opts: PallasOptions) -> str:
    """The kernel to run (the rule for kernel="auto": `PallasOptions`)."""
    if opts.kernel != "auto":
        return opts.kernel
    return "decode" if (Tk > Tq and Tq <= opts.decode_max_q) else "train"


def _family(opts: PallasOptions):
    """(training kernels, decode kernels) of the backend's family."""
    return (tpu_train, tpu_decode) if opts.backend == "tpu" else (flash_train, decode)


def _forward(q, parts, q_meta, opts):
    """The decode kernel reads the parts in place; the training kernel takes them concatenated."""
    train, dec = _family(opts)
    if choose_kernel(q.shape[1], sum(p[0].shape[1] for p in parts), opts) == "decode":
        return dec.decode_forward_parts(q, parts, q_meta, opts)
    k, v, kv_meta = concat_parts(parts)
    return train.train_forward(q, k, v, q_meta, kv_meta, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sbd_attention(q, parts, q_meta, opts):
    return _forward(q, parts, q_meta, opts)[0]


def _sbd_attention_fwd(q, parts, q_meta, opts):
    o, lse = _forward(q, parts, q_meta, opts)
    return o, (q, parts, q_meta, o, lse)


def _sbd_attention_bwd(opts, res, do):
    """The flash backward kernels, whichever forward ran (over the concatenated parts)."""
    q, parts, q_meta, o, lse = res
    k, v, kv_meta = concat_parts(parts)
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    dq, dk, dv = _family(opts)[0].train_backward(q, k, v, q_meta, kv_meta, lse, delta, do, opts)
    bounds = [int(x) for x in np.cumsum([p[0].shape[1] for p in parts])[:-1]]
    split = (lambda x: jnp.split(x, bounds, axis=1)) if bounds else (lambda x: [x])
    return dq, tuple((a, b, None) for a, b in zip(split(dk), split(dv))), None


_sbd_attention.defvjp(_sbd_attention_fwd, _sbd_attention_bwd)


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


def _as_meta(m) -> TokenMeta:
    return TokenMeta(*(jnp.asarray(f, jnp.int32) for f in m))


def pallas_attention(q_BTHD, k_BSKD, v_BSKD, q_meta: TokenMeta, kv_meta: TokenMeta, **options):
    """SBD attention with Pallas kernels; drop-in for `reference_attention`: q_BTHD [B, T, H, D],
    k/v_BSKD [B, S, K, D] (H a multiple of K), metadata [B, T] / [B, S]. Keywords (`kernel`,
    `backend`, `blocks`, `scale`, `interpret`, or a whole `options`): `pallas_attention_parts`."""
    return pallas_attention_parts(q_BTHD, [(k_BSKD, v_BSKD, kv_meta)], q_meta, **options)


def pallas_attention_parts(q_BTHD, kv_parts, q_meta: TokenMeta, *, kernel: str = "auto",
                           backend: str | None = None, blocks: BlockSizes | None = None,
                           scale: float | None = None, interpret: bool | None = None,
                           options: PallasOptions | None = None):
    """`pallas_attention` over keys/values given as parts of one sequence, WITHOUT concatenating
    them: kv_parts = [(k_BSKD, v_BSKD, kv_meta), ...] means k = concat(k_i), kv_meta =
    concat(meta_i) along time. The decode kernel runs once per part (decoding reads its cache in
    place) and the partial softmaxes are merged; the training kernel takes the parts concatenated.
    The keywords are the fields of `PallasOptions` (kernel "auto" | "train" | "decode"; backend
    None | "interpret" | "triton" | "tpu"; blocks None: per-backend defaults); or pass a whole
    `options` (then the other keywords must be left at their defaults).
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
    opts = options.resolved(q_BTHD.shape[-1])
    kv_parts = tuple((k, v, _as_meta(m)) for k, v, m in kv_parts)
    return _sbd_attention(q_BTHD, kv_parts, _as_meta(q_meta), opts)


__all__ = ["DEFAULT_BLOCKS", "BlockSizes", "PallasAttentionError", "PallasOptions", "PallasOptionsError",
           "choose_kernel", "force_backend", "pallas_attention", "pallas_attention_parts"]
