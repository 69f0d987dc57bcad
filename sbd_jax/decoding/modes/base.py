"""What a decoding mode is to the loop and to continuous batching (`Mode`), and the cache finalize they share."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from ...attention import clean_meta
from ...models.transformer import KVCache, forward
from ..spec import DecodeError
from ..state import DecodeEnv, LoopState, gather


@dataclasses.dataclass(frozen=True)
class Mode:
    """A decoding mode: its own state, its first call (prompt -> first tokens), its loop step and its cache finalize.

    init_state(env, B, memory) -> NamedTuple   the mode's part of the loop state (`LoopState.mode_state`) before
                                               the first call, its per-row fields annotated `Row` (continuous
                                               batching resets those); `memory`: what an earlier run learned
                                               (`memory(state)` of that run; None: nothing)
    first(state, env, prompt_ids) -> state     NFE 1: the prompt's last piece with the first decoding window
    step(state, env) -> state                  one iteration of the decode loop (one model call)
    finalize(state, env) -> KVCache            one uncounted call writing the K/V the loop left uncommitted
    admit(state, env) -> state                 a row whose prompt was prefilled by continuous batching, made
                                               ready for `step` to make its first call
    prefills_last_token                        continuous batching prefills the whole prompt (SBD) or all but its
                                               last token, which the first step runs (AR, verify)
    A mode that learns across runs (verify's drafting policy) also gives:
    report(state) -> pytree                    what a run reports of its state (`GenerateOutput.mode_stats`)
    memory(state) -> pytree                    what a later run may start from
    start_from(memory, spec) -> pytree         a caller's `memory` checked and made the pytree `init_state` takes
                                               (None: from nothing; the same structure either way, one program)
    retire(state, slots) -> state              the finished rows in `slots` leave (before new prompts take them)
    """

    name: str
    init_state: Callable
    first: Callable
    step: Callable
    finalize: Callable
    admit: Callable = lambda state, env: state
    prefills_last_token: bool = False
    report: Callable = lambda state: None
    memory: Callable = lambda state: None
    retire: Callable = lambda state, slots: state
    start_from: Callable = lambda memory, spec: no_memory(memory)


def no_memory(memory):
    """A mode without memory takes none."""
    if memory is not None:
        raise DecodeError("draft_memory is what verify mode's drafting policy learned: give it to a verify=True run")


def finalize_at(state: LoopState, env: DecodeEnv, pos) -> KVCache:
    """One extra clean call (not counted in NFE) over the output positions `pos` [B, n] whose K/V the loop
    left uncommitted (positions past a row's output are padding)."""
    seg = (pos < (env.lengths + state.n_generated)[:, None]).astype(jnp.int32)
    _, cache = forward(env.params, env.cfg, gather(state.seq, pos), clean_meta(seg, pos), state.cache,
                       return_hidden=True)
    return cache


def last_token_positions(state: LoopState, env: DecodeEnv):
    """[B, 1]: each row's last output token (AR and verify mode commit every other token by the next call)."""
    return (env.lengths + state.n_generated - 1)[:, None]
