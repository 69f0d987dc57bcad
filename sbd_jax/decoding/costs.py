"""What each call of verify mode costs on this device, for its drafting policy (policy.py): the loop step of a
2w-wide call (w clean + w copy tokens per row, w a draft width: the model call, AR's tokens, the check and the
drafting) against the step of a 1-wide AR call, at the batch's row count and cache length. Measured once per
process and shape on zero weights of the model's shapes (timing needs no real weights, so it also runs while a
user's `jax.jit` traces `generate`); a spec's `wide_cost` skips it."""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import jax.numpy as jnp

from ..config import ModelConfig
from .modes import ar, verify
from .spec import DecodeSpec
from .state import make_env, new_state, prompt_seq

ROUNDS, CALLS = 5, 32
MEASURED: dict = {}  # (shapes) -> costs, one measurement per process and shape


def needs_cost(spec: DecodeSpec) -> bool:
    return spec.mode == "sbd" and spec.verify and spec.draft_policy == "adaptive"


def call_costs(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> tuple[float, ...]:
    """What a 2w-wide call costs in 1-wide calls for each draft width w of `spec.draft_widths` (`batch` rows, a
    cache of `cache_len` slots): from the spec's `wide_cost` (the 2k-wide call's; narrower ones in proportion to
    their width) if set, 1.0 where no policy reads them, else measured (once per process, shape and power of two
    of the cache length)."""
    if spec.wide_cost is not None or not needs_cost(spec):
        return spec.stated_call_costs()
    cache_len = 1 << (cache_len - 1).bit_length()  # one measurement per power of two: costs vary slowly with it
    layout = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params))
    key = (cfg, spec.draft_widths, spec.max_new_tokens, batch, cache_len, jax.default_backend(), layout)
    if key not in MEASURED:
        MEASURED[key] = measure(params, cfg, spec, batch, cache_len)
    return MEASURED[key]


def measure(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> tuple[float, ...]:
    """Each width's loop-step time over the AR step's, fastest of ROUNDS (`loop_seconds`; greedy, every row mid-way
    through its cache). A width's step is verify mode's own loop step (the policy's choice, the switch between call
    kinds, the call) with costs that make the policy choose it. The weights are an argument of the timed programs
    (not constants baked into them): `params` themselves, or zeros of their shapes while a user's jit traces them."""
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
    with jax.ensure_compile_time_eval():
        weights = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params) if traced else params
        P = max(cache_len - spec.max_new_tokens, 1)
        lengths = jnp.full((batch,), max(P // 2, 1), jnp.int32)
        env = make_env(weights, cfg, spec, lengths, jnp.full((batch,), 1 << 30, jnp.int32),  # rows never end:
                       jnp.zeros((batch,)), jnp.zeros((batch,)), jax.random.split(jax.random.key(0), batch), None)
        env = dataclasses.replace(env, eos=jnp.full((1,), -1, jnp.int32))  # no cap, no stop id (a finished row
        # would make the policy fall back to AR calls inside the timed loop)
        state = verify.admit(new_state(env, prompt_seq(jnp.zeros((batch, P), jnp.int32), lengths, spec, env), P), env)
        widths = jnp.arange(len(spec.draft_widths))

    def step_ar(s, i, w):
        return ar.step(s, dataclasses.replace(env, params=w))

    def wide(s, i, w):  # the loop's step, its policy made to choose width i
        return verify.step(s, dataclasses.replace(env, params=w, call_costs=jnp.where(widths == i, 1e-3, 1e9)))

    # compiled outside compile-time evaluation: a Pallas kernel (GPU/TPU) cannot be traced under it
    seconds = loop_seconds([step_ar] + [wide] * len(spec.draft_widths), state, weights)
    return tuple(t / seconds[0] for t in seconds[1:])


def loop_seconds(runs, state, weights) -> list[float]:
    """Seconds per step of `runs[i](state, i - 1, weights)` run CALLS times in one compiled loop: the fastest of
    ROUNDS rounds, the runs interleaved (a busy spell of a shared machine then hits them alike)."""
    compiled = {}  # one program per distinct run; numpy arguments: concrete also while a user's jit traces
    for r in runs:
        if r not in compiled:
            loop = lambda s, i, w, r=r: jax.lax.fori_loop(0, CALLS, lambda _, x: r(x, i, w), s)
            compiled[r] = jax.jit(loop).lower(state, np.int32(0), weights).compile()
    progs = [compiled[r] for r in runs]
    for n, prog in enumerate(progs):
        jax.block_until_ready(prog(state, np.int32(max(n - 1, 0)), weights))
    best = [float("inf")] * len(progs)
    for _ in range(ROUNDS):
        for n, prog in enumerate(progs):
            t = time.perf_counter()
            jax.block_until_ready(prog(state, np.int32(max(n - 1, 0)), weights))
            best[n] = min(best[n], (time.perf_counter() - t) / CALLS)
    return best
