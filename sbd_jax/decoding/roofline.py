"""What a decode run achieved against the device: weight bytes read per model call x calls per second over the
measured copy bandwidth (gpt-fast's "bandwidth achieved"), and the peak device memory. Decoding at small batch
reads every weight once per call, so this is the number that says how far a step is from its floor."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def copy_bandwidth(gib: float = 1.0, reps: int = 10) -> float:
    """Bytes per second (read + written) of a large array copy on the default device."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0000001)  # every byte read and written; not elided
    for _ in range(3):
        jax.block_until_ready(f(x))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(ts)


def bytes_per_device(tree) -> int:
    """Bytes of `tree` held by one device (its shard of each leaf; the whole leaf when replicated)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shards = getattr(x, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else x.nbytes
    return total


def peak_memory() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPU, TPU; not CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def bandwidth_report(params, calls: int, seconds: float, copy_bw: float | None = None) -> dict:
    """Achieved weight bandwidth of `calls` batched model calls in `seconds` (per device), with the copy
    bandwidth it is compared with (measured now unless given) and the peak device memory."""
    weights = bytes_per_device(params)
    achieved = weights * calls / seconds
    copy_bw = copy_bandwidth() if copy_bw is None else copy_bw
    return {"weight_bytes_per_device": weights, "calls_per_s": calls / seconds, "achieved_bytes_per_s": achieved,
            "copy_bytes_per_s": copy_bw, "share_of_copy": achieved / copy_bw, "peak_memory_bytes": peak_memory()}


def format_bandwidth(r: dict) -> str:
    line = (f"achieved bandwidth: {r['achieved_bytes_per_s'] / 1e9:.0f} GB/s per device (weights "
            f"{r['weight_bytes_per_device'] / 1e9:.2f} GB x {r['calls_per_s']:.1f} model calls/s) = "
            f"{100 * r['share_of_copy']:.0f}% of the measured copy bandwidth {r['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    if r.get("peak_memory_bytes"):
        line += f"; peak device memory {r['peak_memory_bytes'] / 2**30:.1f} GiB"
    return line
