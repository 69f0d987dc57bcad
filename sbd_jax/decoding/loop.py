"""The decode loop: one `lax.while_loop` over a mode's step, nothing returned to the host per step; used by
`generate` (decoder.py) and by the continuous engine (continuous.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .state import DecodeEnv, LoopState


def run_loop(state: LoopState, env: DecodeEnv, step, stop_at_finish=None) -> LoopState:
    """`step(state, env)` until every row is done or, with `stop_at_finish` (a traced bool), as soon as a row
    that was running on entry finishes (continuous batching: its slot can then take the next prompt)."""
    if stop_at_finish is None:
        def cond(s):
            return ~jnp.all(s.done)
    else:
        running = ~state.done

        def cond(s):
            return ~jnp.all(s.done) & ~(stop_at_finish & jnp.any(s.done & running))
    return jax.lax.while_loop(cond, functools.partial(step, env=env), state)
