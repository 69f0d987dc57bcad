"""What a model call of each width costs on this device, for verify mode's drafting policy (policy.py): the
2w-wide calls (w clean + w copy tokens per row, w a draft width) against the 1-wide AR call, at the batch's row count and cache
length. Measured once per process and shape with zero weights of the model's shapes (timing needs no real
weights, so it also runs while a user's `jax.jit` traces `generate`); a spec's `wide_cost` skips it."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from ..attention import clean_meta
from ..config import ModelConfig
from ..models.transformer import forward, init_cache
from .spec import DecodeSpec

REPEATS = 5
_MEASURED: dict = {}


def needs_cost(spec: DecodeSpec) -> bool:
    return spec.mode == "sbd" and spec.verify and spec.draft_policy == "adaptive"


def call_costs(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> tuple[float, ...]:
    """What a 2w-wide call costs in 1-wide calls for each draft width w of `spec.draft_widths` (`batch` rows, a
    cache of `cache_len` slots): from the spec's `wide_cost` (the 2k-wide call's; narrower ones in proportion to
    their width) if set, 1.0 where no policy reads them, else measured (once per process and shape)."""
    if spec.wide_cost is not None or not needs_cost(spec):
        return spec.stated_call_costs()
    widths = spec.draft_widths
    layout = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params))
    key = (cfg, widths, batch, cache_len, jax.default_backend(), layout)
    if key not in _MEASURED:
        _MEASURED[key] = measure(params, cfg, widths, batch, cache_len)
    return _MEASURED[key]


def measure(params, cfg: ModelConfig, widths, batch: int, cache_len: int) -> tuple[float, ...]:
    """Median time of a 2w-wide clean call over a 1-wide one, for each w (zero weights of `params`' shapes)."""
    with jax.ensure_compile_time_eval():
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params)
        cache = init_cache(cfg, batch, cache_len)
        one = call_seconds(zeros, cfg, cache, 1)
        return tuple(call_seconds(zeros, cfg, cache, 2 * w) / one for w in widths)


def call_seconds(params, cfg: ModelConfig, cache, width: int) -> float:
    """Median seconds of one compiled `width`-wide call at the middle of the cache."""
    batch, start = cache.lengths.shape[0], max(cache.k.shape[2] // 2 - width, 0)
    pos = jnp.broadcast_to(start + jnp.arange(width, dtype=jnp.int32)[None], (batch, width))
    tokens = jnp.zeros((batch, width), jnp.int32)
    call = jax.jit(lambda p, t, c: forward(p, cfg, t, clean_meta(jnp.ones_like(t), pos), c)[0]).lower(
        params, tokens, cache).compile()
    jax.block_until_ready(call(params, tokens, cache))
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        jax.block_until_ready(call(params, tokens, cache))
        times.append(time.perf_counter() - t)
    return statistics.median(times)
