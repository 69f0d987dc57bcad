"""Cross-lowering on this CPU-only machine, at Llama-3.1-8B attention shapes (bf16, 32 query
heads, 8 KV heads, head_dim 128):

* Triton (backend "triton"): Pallas -> Triton IR for an abstract H100. Checks the Triton
  lowering's rules (power-of-two tensors, 2-D dots, supported primitives, scalar table loads).
  Does NOT compile PTX, run, or time anything - that needs a GPU.
* Mosaic TPU (backend "tpu"): `lower(lowering_platforms=("tpu",))` runs Pallas' TPU lowering
  (jaxpr -> Mosaic MLIR: tpu/vector/arith dialects) and serialises the kernels into
  `tpu_custom_call`s; the tests decode those bodies back to MLIR text (parsing verifies the ops)
  and check the block rules Pallas enforces (last two block dims multiples of (8, 128) or full),
  the scalar-prefetched SMEM tile lists, the grid and its dimension semantics, and that the KV
  cache is read in place. NOT checked: Mosaic's layout passes, compilation by libtpu (they run
  only on a TPU host), VMEM limits, runtime results, speed.
"""
import base64
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from sbd_jax.attention import clean_meta, concat_meta
from layouts import decode_meta, training_meta
from sbd_jax.attention.pallas import DEFAULT_BLOCKS, PallasOptions, pallas_attention, pallas_attention_parts

H100 = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_h100(fn, *args):
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=H100)
    with warnings.catch_warnings(), use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton backend is deprecated"
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lower_for_tpu(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


LOWER = {"triton": lower_for_h100, "tpu": lower_for_tpu}


def llama8b_qkv(B, Tq, Tk):
    q = jax.ShapeDtypeStruct((B, Tq, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, Tk, 8, 128), jnp.bfloat16)
    return q, kv


def lower_training(backend):
    """Forward and backward of the training kernels on 2 rows of 2L = 400 tokens (not a multiple of
    the 64 Triton tile nor of the 256 / 512 TPU tiles)."""
    L = 200
    meta = training_meta([[L], [L]], L, 16)
    q, kv = llama8b_qkv(2, 2 * L, 2 * L)

    def loss(q, k, v, meta):
        o = pallas_attention(q, k, v, meta, meta, kernel="train", backend=backend)
        return jnp.sum(o.astype(jnp.float32))

    return LOWER[backend](jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, meta)


PARTS_B, PARTS_S, PARTS_T = 4, 8192, 32  # batch, cache slots, window (2k, k = 16)


def lower_decode_parts(backend):
    """`pallas_attention_parts` over (cache, window): a half-full cache, the window's 2k queries."""
    B, S, T = PARTS_B, PARTS_S, PARTS_T
    q_meta, cache_meta, win_meta = decode_meta(np.full((B,), S // 2), S, T // 2)
    q, cache = llama8b_qkv(B, T, S)
    _, win = llama8b_qkv(B, T, T)
    fn = lambda q, ck, cv, wk, wv, cm, wm, qm: pallas_attention_parts(
        q, [(ck, cv, cm), (wk, wv, wm)], qm, backend=backend)
    return LOWER[backend](fn, q, cache, cache, win, win, cache_meta, win_meta, q_meta)


def test_training_kernels_lower_to_triton():
    text = lower_training("triton")
    assert text.count(TRITON_CALL) == 3  # forward, dq, dk/dv
    for name in ("sbd_flash_fwd", "sbd_flash_dq", "sbd_flash_dkv"):
        assert name in text


@pytest.mark.parametrize("B,k,S", [(1, 16, 4096), (8, 32, 8192)])
def test_decode_kernel_lowers_to_triton(B, k, S):
    T = 2 * k  # finished block (clean) + next block (copy)
    q_meta, cache_meta, win_meta = decode_meta(np.full((B,), S // 2), S, k)
    q, kv = llama8b_qkv(B, T, S + T)
    fn = lambda q, k, v, qm, km: pallas_attention(q, k, v, qm, km, backend="triton")
    text = lower_for_h100(fn, q, kv, kv, q_meta, concat_meta(cache_meta, win_meta))
    assert text.count(TRITON_CALL) == 1 and "sbd_flash_decode" in text


def test_decode_over_cache_and_window_parts_lowers_to_triton():
    B, S, T = PARTS_B, PARTS_S, PARTS_T
    text = lower_decode_parts("triton")
    assert text.count(TRITON_CALL) == 2  # one launch per part
    assert f"tensor<{B}x{S + T}x8x128xbf16>" not in text  # the cache is never copied/concatenated


def test_triton_defaults_are_triton_legal():
    blocks = DEFAULT_BLOCKS["triton"]
    for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "decode_block_k"):
        v = getattr(blocks, f)
        assert v >= 16 and v & (v - 1) == 0


# ----------------------------------------------------------------------------------------------
# Mosaic TPU


def mosaic_kernels(text):
    """{kernel_name: Mosaic MLIR text} of every tpu_custom_call in a lowered module (the bodies
    are parsed - and so verified - by the MLIR bindings with the TPU dialect registered)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir, passmanager

    calls = re.findall(r'tpu_custom_call\(.*?backend_config = "(\{.*?\}\})", kernel_name = "(\w+)"',
                       text)
    out = {}
    ctx = jax_mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True  # the serialised "stable_mosaic" wrapper
        for cfg, name in calls:
            body = json.loads(cfg.replace("\\22", '"'))["custom_call_config"]["body"]
            module = ir.Module.parse(base64.b64decode(body))
            passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
                module.operation)
            out.setdefault(name, []).append(str(module))
    return out, len(calls)


def kernel_head(mlir):
    """The kernel function's signature and attributes (grid, semantics, windows)."""
    start = mlir.index("func.func")
    return mlir[start:mlir.index("{\n", start)]


def check_mosaic_kernel(mlir, semantics):
    head = kernel_head(mlir)
    got = re.findall(r"dimension_semantics<(\w+)>", head)
    assert got == semantics, got
    assert "scalar_prefetch = 1" in head and "#tpu.memory_space<smem>" in head
    windows = [tuple(map(int, w.split(", ")))
               for w in re.findall(r"window_bounds = array<i64: ([\d, ]+)>", head)]
    assert windows
    for w in windows:  # every block: lanes a multiple of 128, sublanes of 8 (or a single row)
        assert w[-1] % 128 == 0 and (w[-2] % 8 == 0 or w[-2] == 1), w
    return windows


def test_training_kernels_lower_to_mosaic_tpu():
    kernels, n = mosaic_kernels(lower_training("tpu"))
    assert n == 3 and set(kernels) == {"sbd_tpu_flash_fwd", "sbd_tpu_flash_dq", "sbd_tpu_flash_dkv"}
    par, arb = "parallel", "arbitrary"
    fwd = check_mosaic_kernel(kernels["sbd_tpu_flash_fwd"][0], [par, par, par, arb])
    check_mosaic_kernel(kernels["sbd_tpu_flash_dq"][0], [par, par, par, arb])
    check_mosaic_kernel(kernels["sbd_tpu_flash_dkv"][0], [par, par, par, arb, arb])
    assert (1, 256, 128) in fwd  # q tile of the in-place [B, T, H * D] view (no transpose)
    assert "tpu.matmul" in kernels["sbd_tpu_flash_fwd"][0]


def test_decode_over_cache_and_window_parts_lowers_to_mosaic_tpu():
    B, S, T = PARTS_B, PARTS_S, PARTS_T
    text = lower_decode_parts("tpu")
    kernels, n = mosaic_kernels(text)
    assert n == 2 and list(kernels) == ["sbd_tpu_flash_decode"]  # one launch per part
    par, arb = "parallel", "arbitrary"
    cache_windows = check_mosaic_kernel(kernels["sbd_tpu_flash_decode"][0], [par] * 4 + [arb])
    assert (1, 512, 128) in cache_windows  # a 512-key tile of one KV head, read in place
    assert f"tensor<{B}x{S}x1024xbf16>" in text  # the cache enters as the free [B, S, K*D] view
    assert f"tensor<{B}x{S + T}x8x128xbf16>" not in text  # never concatenated with the window
    assert f"tensor<{B}x8x{S}x128xbf16>" not in text  # nor transposed to [B, K, S, D]


def test_head_dim_64_lowers_to_mosaic_tpu():
    """head_dim % 128 != 0 takes the transposed [B, N, T, D] layout (D = full block dim)."""
    meta = clean_meta(np.ones((1, 300), np.int32), np.arange(300)[None])
    q = jax.ShapeDtypeStruct((1, 300, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(pallas_attention(q, k, v, meta, meta, backend="tpu").astype(jnp.float32))

    kernels, n = mosaic_kernels(lower_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv))
    assert n == 3
    head = kernel_head(kernels["sbd_tpu_flash_fwd"][0])
    assert "window_bounds = array<i64: 1, 1, 256, 64>" in head


def test_tpu_defaults_are_mosaic_legal():
    PallasOptions(backend="tpu").resolved()  # checks the block rules
