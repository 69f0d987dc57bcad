"""What each call of verify mode costs, in 1-wide AR calls, for its drafting policy (policy.py): a width-w loop
step (w clean + w * w copy tokens per row, w a draft width: `wide_tokens`) next to a 1-wide one, at the batch's
rows and cache.

Three sources, in this order:
  * stated: the spec's `wide_cost` (a number: the widest call's cost, narrower ones in proportion to their queries;
    or one cost per draft width, e.g. what bench/calibrate.py measured);
  * estimated (the default): a cost model from the call's arithmetic - weights and KV cache read once per call,
    FLOPs per token, a fixed cost per call and layer - and a `Machine` per backend (`MACHINES`). Pure Python
    on shapes: no device work, also while a user's `jax.jit` traces `generate`;
  * measured: bench/calibrate.py times the loop steps on a device (it compiles and runs programs: a measurement
    whose result the caller keeps and states as `wide_cost`; the library never times anything).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ....models.config import ModelConfig
from ...spec import DecodeSpec


@dataclasses.dataclass(frozen=True)
class Machine:
    """A backend's constants for the cost model: fixed seconds per call, per layer and per row and layer (dispatch,
    launches, per-row bookkeeping), verify's extra seconds in a wide step (its check and drafting: fixed and per
    row), matmul FLOP/s per parameter byte width, memory bytes/s, and whether memory traffic and arithmetic overlap
    (a step then takes the slower of the two, else their sum)."""

    call_s: float
    layer_s: float
    wide_s: float
    flops: dict  # parameter itemsize (2: bf16/fp16, 4: f32) -> sustained matmul FLOP/s
    bandwidth: float
    overlap: bool = True
    row_layer_s: float = 0.0
    wide_row_s: float = 0.0


# cpu: fitted to bench/calibrate.py's timings of the current loop steps (w + w * w queries per row) on a 2-core x86 CPU, 5
# model shapes up to SmolLM2-135M's x 2-3 batch sizes (bench/bench_costs.py --fit, BENCHMARKS "Verify mode's call
# costs": a fit, not a datasheet - the fixed and per-row terms stand in for XLA:CPU's per-op overhead); gpu:
# bench_decode's bare forwards on one H100 (8B bf16: weights at 2.5 TB/s, 410 TFLOP/s at 512 tokens per call); tpu:
# stated from the v5e sheet, not measured
MACHINES = {
    "cpu": Machine(call_s=0.0, layer_s=0.0, wide_s=3.0e-4, flops={2: 6.9e10, 4: 1.39e11}, bandwidth=1.9e10,
                   overlap=False, row_layer_s=4.2e-6, wide_row_s=0.0),
    "gpu": Machine(call_s=30e-6, layer_s=20e-6, wide_s=100e-6, flops={2: 4.1e14, 4: 1.0e14}, bandwidth=2.5e12),
    "tpu": Machine(call_s=30e-6, layer_s=10e-6, wide_s=100e-6, flops={2: 1.6e14, 4: 4e13}, bandwidth=7e11),
}


def call_costs(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int,
               backend: str | None = None) -> tuple[float, ...]:
    """Per draft width of `spec.draft_widths`, a width-w call's cost in 1-wide calls: the spec's stated
    `wide_cost`, else the estimate."""
    if spec.wide_cost is not None:
        return spec.stated_call_costs()
    return estimate(params, cfg, spec, batch, cache_len, backend)


def estimate(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int,
             backend: str | None = None, machine: Machine | None = None) -> tuple[float, ...]:
    """The cost model's per-width costs (`params` are read for their shapes and dtypes only: concrete, traced or
    `jax.ShapeDtypeStruct`s), with `machine`'s constants or the backend's (an unknown backend is costed as a GPU)."""
    m = machine or MACHINES.get(backend or jax.default_backend(), MACHINES["gpu"])
    seconds = step_model(params, cfg, batch, cache_len, m, kv_int8=spec.kv_cache_dtype == "int8")
    one = seconds(1)
    return tuple(seconds(wide_tokens(w)) / one for w in spec.draft_widths)


def wide_tokens(w: int) -> int:
    """Queries per row of a width-w verify call: w clean (the commit window) + w copy blocks of w (one per outcome
    of its check, step.py `outcome_window`)."""
    return w + w * w


def step_model(params, cfg: ModelConfig, batch: int, cache_len: int, m: Machine, kv_int8: bool = False):
    """-> seconds(tokens): the modelled seconds of a loop step running `tokens` queries per row: fixed and per-row
    costs, then reading the weights, the KV cache (rows mid-way through it) and the logits, and the matmul
    arithmetic (the slower of the two where they overlap, else both). `kv_int8`: an int8 cache (values + scales)."""
    leaves = jax.tree.leaves(params)
    n_params = sum(int(np.prod(x.shape)) for x in leaves)
    weight_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
    itemsize = 2 if weight_bytes < 3 * n_params else 4
    context = cache_len / 2
    L = cfg.num_hidden_layers
    per_head = (cfg.head_dim + jnp.dtype(cfg.dtype).itemsize if kv_int8  # int8 values + one scale
                else cfg.head_dim * jnp.dtype(cfg.dtype).itemsize)
    kv_bytes = batch * context * L * 2 * cfg.num_key_value_heads * per_head
    attn_flops = 4 * L * cfg.num_attention_heads * cfg.head_dim * context  # per query: scores and values

    def seconds(tokens: int) -> float:
        n = batch * tokens
        memory = (weight_bytes + kv_bytes + n * cfg.vocab_size * 8) / m.bandwidth  # logits written and read
        compute = n * (2 * n_params + attn_flops) / m.flops[itemsize]
        body = max(memory, compute) if m.overlap else memory + compute
        wide = m.wide_s + m.wide_row_s * batch if tokens > 1 else 0.0
        return m.call_s + (m.layer_s + m.row_layer_s * batch) * L + wide + body
    return seconds
