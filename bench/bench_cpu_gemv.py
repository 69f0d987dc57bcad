"""Benchmark: one [1, 4096] x [4096, 4096] product per stored weight type on XLA:CPU, the step quantized decoding at
batch 1 is made of (why int8 weights do not speed up decoding on this CPU: BENCHMARKS.md "Quantization").

    .venv/bin/python bench/bench_cpu_gemv.py
    XLA_FLAGS=--xla_cpu_experimental_onednn_custom_call=true .venv/bin/python bench/bench_cpu_gemv.py
"""
import time

import jax
import jax.numpy as jnp

D = N = 4096
x = jnp.ones((1, D), jnp.float32)
wf = jax.random.normal(jax.random.key(0), (D, N), jnp.float32)
wq = jnp.clip(jnp.round(wf * 40), -127, 127).astype(jnp.int8)
s = jnp.ones((N,), jnp.float32) / 40
CASES = {
    "float32 dot": (lambda x, w: x @ w, wf),
    "bfloat16 dot": (lambda x, w: (x.astype(jnp.bfloat16) @ w).astype(jnp.float32), wf.astype(jnp.bfloat16)),
    "int8: dot of the converted weight, scaled": (lambda x, w: (x @ w.astype(jnp.float32)) * s, wq),
    "int8: multiply-and-reduce, scaled": (lambda x, w: jnp.sum(x[0][:, None] * w.astype(jnp.float32), axis=0) * s, wq),
    "int8: dot_general of mixed types, scaled": (
        lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * s, wq),
}
for name, (f, w) in CASES.items():
    f = jax.jit(f)
    f(x, w).block_until_ready()
    t, n = time.perf_counter(), 50
    for _ in range(n):
        r = f(x, w)
    r.block_until_ready()
    dt = (time.perf_counter() - t) / n
    print(f"{name:44s} {dt * 1e3:7.2f} ms  {w.size * w.dtype.itemsize / dt / 1e9:6.1f} GB/s of stored weight")
