"""The kernels lower through Pallas' Triton backend (Pallas -> Triton IR) for an abstract H100,
on this CPU-only machine. This checks the Triton lowering's rules (power-of-two tensors, 2-D dots,
supported primitives, scalar table loads) at Llama-3.1-8B attention shapes; it does NOT compile
PTX, run, or time anything - that needs a GPU."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from sbd_jax.attention import block_starts, clean_meta, concat_meta, copy_meta
from sbd_jax.attention.pallas import (
    DEFAULT_BLOCKS,
    pallas_attention,
    pallas_attention_parts,
)

H100 = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_h100(fn, *args):
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=H100)
    with warnings.catch_warnings(), use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton backend is deprecated"
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def llama8b_qkv(B, Tq, Tk):
    q = jax.ShapeDtypeStruct((B, Tq, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, Tk, 8, 128), jnp.bfloat16)
    return q, kv


def test_training_kernels_lower_to_triton():
    L = 200  # 2L = 400: not a multiple of the 64 tile
    pos = np.broadcast_to(np.arange(L), (2, L))
    seg = np.ones((2, L), np.int32)
    meta = concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, 16)))
    q, kv = llama8b_qkv(2, 2 * L, 2 * L)

    def loss(q, k, v, meta):
        o = pallas_attention(q, k, v, meta, meta, kernel="train", backend="triton")
        return jnp.sum(o.astype(jnp.float32))

    text = lower_for_h100(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, meta)
    assert text.count(TRITON_CALL) == 3  # forward, dq, dk/dv
    for name in ("sbd_flash_fwd", "sbd_flash_dq", "sbd_flash_dkv"):
        assert name in text


@pytest.mark.parametrize("B,k,S", [(1, 16, 4096), (8, 32, 8192)])
def test_decode_kernel_lowers_to_triton(B, k, S):
    T = 2 * k  # finished block (clean) + next block (copy)
    lengths = np.full((B,), S // 2)
    pos = lengths[:, None] + np.arange(T)[None]
    q_meta = concat_meta(clean_meta(np.ones((B, k)), pos[:, :k]),
                         copy_meta(np.ones((B, k)), pos[:, k:], pos[:, k:k + 1].repeat(k, 1)))
    slot = np.broadcast_to(np.arange(S), (B, S))
    kv_meta = concat_meta(clean_meta((slot < lengths[:, None] + k).astype(np.int32), slot),
                          q_meta._replace(segment=np.where(q_meta.stream == 0, 0, 1)))
    q, kv = llama8b_qkv(B, T, S + T)
    fn = lambda q, k, v, qm, km: pallas_attention(q, k, v, qm, km, backend="triton")
    text = lower_for_h100(fn, q, kv, kv, q_meta, kv_meta)
    assert text.count(TRITON_CALL) == 1 and "sbd_flash_decode" in text


def test_decode_over_cache_and_window_parts_lowers_to_triton():
    B, k, S = 4, 16, 8192
    T = 2 * k
    pos = np.full((B, 1), S // 2) + np.arange(T)[None]
    q_meta = concat_meta(clean_meta(np.ones((B, k)), pos[:, :k]),
                         copy_meta(np.ones((B, k)), pos[:, k:], pos[:, k:k + 1].repeat(k, 1)))
    slot = np.broadcast_to(np.arange(S), (B, S))
    cache_meta = clean_meta((slot < S // 2 + k).astype(np.int32), slot)
    win_meta = q_meta._replace(segment=np.where(q_meta.stream == 0, 0, 1))
    q, cache = llama8b_qkv(B, T, S)
    _, win = llama8b_qkv(B, T, T)
    fn = lambda q, ck, cv, wk, wv, cm, wm, qm: pallas_attention_parts(
        q, [(ck, cv, cm), (wk, wv, wm)], qm, backend="triton")
    text = lower_for_h100(fn, q, cache, cache, win, win, cache_meta, win_meta, q_meta)
    assert text.count(TRITON_CALL) == 2  # one launch per part
    assert f"tensor<{B}x{S + T}x8x128xbf16>" not in text  # the cache is never copied/concatenated


def test_triton_defaults_are_triton_legal():
    blocks = DEFAULT_BLOCKS["triton"]
    for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "decode_block_k"):
        v = getattr(blocks, f)
        assert v >= 16 and v & (v - 1) == 0
