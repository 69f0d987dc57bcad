"""AR mode (next-token decoding, the baseline): the prefill call yields the first token, then one clean 1-token
call per token. The token at generated index j is drawn from fold_in(key, j): what verify mode checks its drafts
against."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from ...attention import clean_meta
from ...models.transformer import forward, lm_head
from .. import sampling
from ..prefill import last_prompt_hidden, prefill, prompt_meta
from ..state import DecodeEnv, LoopState, Row, gather, tally
from .base import Mode, finalize_at, last_token_positions


class ARState(NamedTuple):
    """AR mode's part of the loop state."""

    generated: Row  # [B] tokens generated so far (the next one's generated index)


def init_state(env: DecodeEnv, B: int, memory) -> ARState:
    return ARState(jnp.zeros((B,), jnp.int32))


def update(state: LoopState, env: DecodeEnv, logits_B1V, cache) -> LoopState:
    """Draw each running row's next token, write it, stop rows at an EOS or their cap."""
    active = ~state.done
    spec = env.spec
    g = state.mode_state.generated
    tok = sampling.sample(logits_B1V, env.keys, g[:, None], env.temp, top_k=spec.top_k, top_p=spec.top_p,
                          suppress=env.cfg.mask_token_id)[:, 0]
    rows = jnp.arange(state.seq.shape[0])
    seq = state.seq.at[rows, jnp.where(active, env.lengths + g, state.seq.shape[1])].set(tok, mode="drop")
    n = g + active.astype(jnp.int32)
    eos_hit = active & jnp.isin(tok, env.eos)
    stop = eos_hit | (active & (n >= env.max_new))
    return state._replace(seq=env.constrain(seq), cache=cache, mode_state=ARState(n), done=state.done | stop,
                          eos=state.eos | eos_hit, n_generated=jnp.where(stop, n, state.n_generated),
                          nfe=state.nfe + active.astype(jnp.int32), iters=state.iters + 1,
                          accepted=tally(state.accepted, active.astype(jnp.int32), active))


def first(state: LoopState, env: DecodeEnv, prompt_ids) -> LoopState:
    """NFE 1: the prompt (its last piece; earlier pieces prefilled first) -> the first token."""
    P = prompt_ids.shape[1]
    state, start, h_last = prefill(state, env, prompt_ids)
    h, cache = forward(env.params, env.cfg, prompt_ids[:, start:], prompt_meta(env.lengths, start, P - start),
                       state.cache, return_hidden=True)
    last = last_prompt_hidden(h, env.lengths, start, P, h_last)
    return update(state, env, lm_head(env.params, env.cfg, last), env.constrain(cache))


def step(state: LoopState, env: DecodeEnv) -> LoopState:
    """One clean 1-token call on each row's last token -> its next token."""
    pos = (env.lengths + state.mode_state.generated - 1)[:, None]
    meta = clean_meta((~state.done)[:, None].astype(jnp.int32), pos)
    logits, cache = forward(env.params, env.cfg, gather(state.seq, pos), meta, state.cache)
    return update(state, env, logits, env.constrain(cache))


def finalize(state: LoopState, env: DecodeEnv):
    """Only the last output token lacks its K/V (each other is written by the next call)."""
    return env.constrain(finalize_at(state, env, last_token_positions(state, env)))


AR = Mode("ar", init_state=init_state, first=first, step=step, finalize=finalize, prefills_last_token=False)
