"""`calibrate`: verify mode's call costs (costs.py) timed on this device. It compiles and runs programs, so it is
an explicit step whose result the caller keeps and states as `DecodeSpec(wide_cost=...)`; `generate` never runs
it."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from ....models.config import ModelConfig
from ...spec import DecodeError, DecodeSpec
from ...state import make_env, new_state, prompt_seq
from .. import ar
from . import step as verify
from .state import DraftMemory, VerifyState

ROUNDS, CALLS = 5, 32


def calibrate(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> tuple[float, ...]:
    """Each draft width's loop-step time over the AR step's on this device, fastest of ROUNDS (`loop_seconds`;
    greedy, every row mid-way through a cache of `cache_len` slots, `batch` rows): state the result as the spec's
    `wide_cost`. A width's step is verify mode's own loop step (the policy's choice, the switch between call
    kinds, the call) with costs that make the policy choose it. Compiles and runs programs: not inside a trace."""
    seconds = step_seconds(params, cfg, spec, batch, cache_len)
    return tuple(round(t / seconds[0], 3) for t in seconds[1:])


def step_seconds(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> list[float]:
    """Seconds of the AR loop step, then of verify's loop step at each draft width (`calibrate`'s timings)."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
        raise DecodeError("calibrate times programs on the device: call it outside jax.jit and state its result "
                          "as DecodeSpec(wide_cost=...)")
    spec = dataclasses.replace(spec, wide_cost=None)
    P = max(cache_len - spec.max_new_tokens, 1)
    lengths = jnp.full((batch,), max(P // 2, 1), jnp.int32)
    env = make_env(params, cfg, spec, lengths, jnp.full((batch,), 1 << 30, jnp.int32),  # rows never end:
                   jnp.zeros((batch,)), jnp.zeros((batch,)), jax.random.split(jax.random.key(0), batch), None)
    env = dataclasses.replace(env, eos=jnp.full((1,), -1, jnp.int32))  # no cap, no stop id (a finished row
    # would make the policy fall back to AR calls inside the timed loop)
    state = verify.admit(new_state(env, prompt_seq(jnp.zeros((batch, P), jnp.int32), lengths, spec, env), P,
                                   VerifyState.new(batch, DraftMemory.empty(spec.block_size - 1))), env)
    n = len(spec.draft_widths)

    def step_ar(s, w):
        return ar.step(s, dataclasses.replace(env, params=w))

    def wide(i):  # the loop's step, its policy made to choose width i by stated costs
        forced = dataclasses.replace(spec, wide_cost=tuple(1e-3 if j == i else 1e9 for j in range(n)))
        return lambda s, w: verify.step(s, dataclasses.replace(env, params=w, spec=forced))

    return loop_seconds([step_ar] + [wide(i) for i in range(n)], state, params)


def loop_seconds(runs, state, weights) -> list[float]:
    """Seconds per step of `runs[i](state, weights)` run CALLS times in one compiled loop: the fastest of ROUNDS
    rounds, the runs interleaved (a busy spell of a shared machine then hits them alike)."""
    progs = [jax.jit(lambda s, w, r=r: jax.lax.fori_loop(0, CALLS, lambda _, x: r(x, w), s)).lower(state, weights)
             .compile() for r in runs]
    for prog in progs:
        jax.block_until_ready(prog(state, weights))
    best = [float("inf")] * len(progs)
    for _ in range(ROUNDS):
        for n, prog in enumerate(progs):
            t = time.perf_counter()
            jax.block_until_ready(prog(state, weights))
            best[n] = min(best[n], (time.perf_counter() - t) / CALLS)
    return best
